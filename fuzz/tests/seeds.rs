//! Writes the committed seeds of the binary targets (`seeds/`), from the
//! filter's own encoders and a run of its pipeline:
//! `cargo test --test seeds -- --ignored`. The configuration seeds are
//! the examples', the docs' and the tests' configurations.

use sluice_fuzz::harness::{Host, MemStore};
use sluice_fuzz::headers::EVERYTHING;
use sluice_fuzz::records::CODECS;
use sluice_fuzz::store::{drive, kind_of, DECODERS};
use std::path::Path;

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    std::fs::create_dir_all(&dir).expect("seeds dir");
    std::fs::write(dir.join(name), bytes).expect("a seed");
}

/// An arrival op of `headers`: path index, then (name index, value).
fn arrive(path: u8, headers: &[(u8, &[u8])]) -> Vec<u8> {
    let mut v = vec![0, path, headers.len() as u8];
    for (n, value) in headers {
        v.push(*n);
        v.push(value.len() as u8);
        v.extend_from_slice(value);
    }
    v
}

fn headers_seeds() {
    let cases: [&[(u8, &[u8])]; 8] = [
        &[(0, b"100m"), (4, b"k1"), (3, b"3")],
        &[(1, b"250"), (5, b"w"), (3, b"2")],
        &[(0, b"5S"), (6, b"tenant"), (9, b"2")],
        &[(8, b"critical"), (4, b"k2"), (11, b"application/grpc")],
        &[(8, b"sheddable"), (7, b"dep"), (10, b"1")],
        &[(2, b"30"), (15, b"[::1]:80"), (3, b"99999999999999999999")],
        &[(0, b"1H,5m"), (1, b"0"), (12, b"/a/%2e%2e/q")],
        &[(13, b"POST"), (14, b"h:1"), (8, b"DEFAULT")],
    ];
    for (i, c) in cases.iter().enumerate() {
        let mut v = Vec::new();
        for path in 0..6u8 {
            v.extend(arrive(path, c));
            v.extend([2, 10, 3, 4, 1]);
        }
        v.extend([5, 0, 2, 200, 3]);
        write("headers", &format!("ops-{i}"), &v);
    }
}

fn records_and_store_seeds() {
    let config = sluice::wiring::parse(EVERYTHING.as_bytes()).expect("loads");
    let store = MemStore::default();
    let mut host = Host::new(&config, &store, 1);
    drive(&mut host, 3);
    let map = store.map.borrow();
    let mut seen = std::collections::BTreeMap::new();
    for (key, (value, _)) in map.iter() {
        let Some(kind) = kind_of(value) else {
            panic!("{key}: a record no decoder reads: {value:?}");
        };
        let name = DECODERS[kind].0;
        let n = seen.entry(name).or_insert(0);
        *n += 1;
        if let Some(sel) = CODECS.iter().position(|c| *c == name) {
            if *n <= 3 {
                let mut v = vec![sel as u8];
                v.extend_from_slice(value);
                write("records", &format!("{name}-{n}"), &v);
            }
        }
    }
    println!("records by kind: {seen:?}");
    for (i, v) in [[0u8; 16], [0xff; 16], *b"0123456789abcdef"]
        .iter()
        .enumerate()
    {
        let mut pool = vec![5];
        pool.extend_from_slice(v);
        write("records", &format!("pool-{i}"), &pool);
        let mut rule = vec![11];
        rule.extend_from_slice(v);
        rule.extend_from_slice(&1_700_000_000_000_000_000u64.to_le_bytes());
        rule.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]);
        write("records", &format!("rule-{i}"), &rule);
    }
    let keys = map.len() as u8;
    for k in 0..keys {
        write(
            "store",
            &format!("key-{k}"),
            &[k, 3, k % 4, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        );
    }
}

fn rls_seeds() {
    use sluice_fuzz::rls::encode;
    let now = [
        encode(1, 1, 100, 2, 42, (30, 0)),
        encode(2, 2, 100, 2, 0, (59, 500_000_000)),
        encode(1, 1, 5, 1, 5, (0, 999_999_999)),
        encode(0, 0, 0, 0, 0, (0, 0)),
        encode(2, 2, 1, 4, 0, (u64::MAX, 1)),
    ];
    for (i, b) in now.iter().enumerate() {
        let mut raw = vec![0];
        raw.extend_from_slice(b);
        write("rls", &format!("response-{i}"), &raw);
    }
    let mut fields = vec![1];
    for v in [1u64, 1, 100, 2, 42, 30, 0] {
        fields.extend_from_slice(&v.to_le_bytes());
    }
    write("rls", "fields-0", &fields);
    write("rls", "empty", &[0]);
}

#[test]
#[ignore = "writes the seeds"]
fn write_seeds() {
    headers_seeds();
    records_and_store_seeds();
    rls_seeds();
}
