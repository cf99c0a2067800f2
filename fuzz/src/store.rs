//! Target `store`: shared data corrupted under the keys a configuration
//! uses, then read back by the mechanisms on their request path and ticks.

use crate::harness::{Host, Input, MemStore, Req};
use crate::headers::everything;
use sluice::ratelimit::codec::{table_marker, Slot};
use sluice::ratelimit::global::codec as global;

type Decode = fn(&[u8]) -> bool;

/// Every record's decoder, by name: whether `bytes` are one.
pub const DECODERS: [(&str, Decode); 11] = [
    ("slot", |b| Slot::decode(b).is_ok()),
    ("marker", |b| {
        let n = b
            .get(1..5)
            .and_then(|n| n.try_into().ok())
            .map(u32::from_le_bytes);
        n.is_some_and(|n| b == table_marker(n))
    }),
    ("lease", |b| global::Lease::decode(b).is_ok()),
    ("newest", |b| global::decode_newest(b).is_ok()),
    ("health", |b| global::Health::decode(b).is_ok()),
    ("wants", |b| global::decode_wants(b).is_ok()),
    ("breaker", |b| sluice::breaker::codec::decode(b).is_ok()),
    ("bulkhead", |b| sluice::bulkhead::codec::decode(b).is_ok()),
    ("retry", |b| sluice::retry::codec::decode(b).is_ok()),
    ("shed", |b| sluice::shed::codec::decode_shared(b).is_some()),
    ("adaptive", |b| {
        sluice::shed::adaptive::Auto::decode(b).is_ok()
    }),
];

/// The decoder that reads `bytes`, if any.
pub fn kind_of(bytes: &[u8]) -> Option<usize> {
    DECODERS.iter().position(|(_, d)| d(bytes))
}

/// Traffic that reaches every mechanism of [`crate::headers::EVERYTHING`] and writes its
/// records: keyed requests on every path, upstream errors, time, ticks.
pub fn drive(host: &mut Host<'_>, rounds: u64) {
    for round in 0..rounds {
        for (i, path) in ["/", "/p", "/q/x", "/a", "/l"].iter().enumerate() {
            let k = [b'a' + (round % 3) as u8];
            let mut req = Req::new("GET", path).with("x-k", &k).with("x-w", &k);
            if i == 0 {
                req = req.with("x-g", &k);
            }
            let req = req
                .with("x-dep", &k)
                .with("x-prio", b"critical")
                .with("x-envoy-attempt-count", if i == 2 { b"2" } else { b"1" });
            let (id, _) = host.arrive(req);
            host.advance_ms(2);
            host.tick();
            let status = if (round + i as u64).is_multiple_of(3) {
                200
            } else {
                503
            };
            host.finish(id, status, Vec::new());
        }
        let ok = crate::rls::encode(1, 1, 100, 2, 99, (30, 0));
        while host.answer_call(Some(&ok)) {}
        host.advance_ms(25);
        host.tick();
    }
}

/// Overwrites a key's value with a corruption read off the input:
/// another value, a truncation, a flipped bit, another version byte.
fn corrupt(store: &MemStore, input: &mut Input<'_>) {
    let keys: Vec<String> = store.map.borrow().keys().cloned().collect();
    if keys.is_empty() {
        return;
    }
    let key = &keys[input.byte() as usize % keys.len()];
    let mut map = store.map.borrow_mut();
    let Some((value, cas)) = map.get_mut(key) else {
        return;
    };
    let at = input.byte() as usize;
    match input.byte() % 4 {
        0 => *value = input.piece().to_vec(),
        1 => value.truncate(at % (value.len() + 1)),
        2 if !value.is_empty() => {
            let n = value.len();
            value[at % n] ^= 1 << (at % 8);
        }
        _ => {
            if let Some(v) = value.first_mut() {
                *v = input.byte();
            }
        }
    }
    *cas = cas.wrapping_add(1);
}

/// Corruptions read off the input, then traffic on the same worker and on
/// a new one: no panic, and every key a mechanism wrote again holds a
/// record of the kind it held before (rebuilt, not garbage kept).
pub fn store(data: &[u8]) {
    let config = everything();
    let store = MemStore::default();
    let mut host = Host::new(config, &store, 1);
    drive(&mut host, 3);
    let kinds: Vec<(String, Option<usize>)> = store
        .map
        .borrow()
        .iter()
        .map(|(k, (v, _))| (k.clone(), kind_of(v)))
        .collect();
    let mut input = Input(data);
    for _ in 0..8 {
        if input.is_empty() {
            break;
        }
        corrupt(&store, &mut input);
    }
    let corrupted = store.map.borrow().clone();
    let mut other = Host::new(config, &store, 2);
    drive(&mut host, 2);
    drive(&mut other, 2);
    host.wind_down();
    other.wind_down();
    let reported = |metric: &str| reported(&host, metric) + reported(&other, metric) > 0;
    let map = store.map.borrow();
    for (key, kind) in kinds {
        let (Some(kind), Some((now, _))) = (kind, map.get(&key)) else {
            continue;
        };
        let found = corrupted.get(&key).map(|(c, _)| c);
        if found == Some(now) {
            continue;
        }
        let (name, decodes) = DECODERS[kind];
        assert!(
            decodes(now),
            "{key}: a {name} record was written back as {now:?}"
        );
        // Rebuilt from a record it could not read: counted where the
        // mechanism has a metric for it.
        let metric = REPORTED.iter().find(|(k, _)| *k == name).map(|(_, m)| *m);
        if let (Some(metric), Some(found)) = (metric, found) {
            assert!(
                decodes(found) || reported(metric),
                "{key}: a corrupt {name} record was rebuilt, {metric} did not count it"
            );
        }
    }
}

/// The metric that counts a record of each kind found corrupt.
const REPORTED: [(&str, &str); 4] = [
    ("slot", "sluice_rl_corrupt_state_total"),
    ("breaker", "sluice_cb_store_failures_total"),
    ("bulkhead", "sluice_bulkhead_store_failures_total"),
    ("retry", "sluice_retry_store_failures_total"),
];

/// The sum of every series of `metric` a host's pipeline changed.
fn reported(host: &Host<'_>, metric: &str) -> i64 {
    let defs = &host.pipeline.metrics.defs;
    let series = host.sums.0.iter().filter(|(id, _)| {
        defs.get(**id as usize)
            .is_some_and(|d| d.name.contains(metric))
    });
    series.map(|(_, n)| *n).sum()
}
