//! Concurrency limits per key: exact across simulated workers, released
//! exactly once, isolated between keys, limited early (never late) under
//! collisions, and bad settings named by field.

use super::*;
use crate::request::fake::FakeRequest;
use crate::store::memory::{views, MemoryStore};
use crate::wiring::parse;
use std::rc::Rc;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const PER_TENANT: &str = r#"{"concurrency_limits":[{"name":"exports","key":[{"header":"x-tenant"}],
    "max":2,"max_keys":64}]}"#;

fn limits(json: &str) -> Bulkheads {
    let c = parse(json.as_bytes()).expect("valid");
    Bulkheads::new(&c.concurrency_limits, &c.common, (1, 2)).expect("no collision")
}

fn tenant(t: &str) -> FakeRequest {
    FakeRequest::new("GET", "/export").with_header("x-tenant", t.as_bytes())
}

#[test]
fn a_key_holds_at_most_max_and_a_release_makes_room_exactly_once() {
    let mut b = limits(PER_TENANT);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    let a1 = b.admit(&store, 0, &tenant("a")).0;
    let a2 = b.admit(&store, 0, &tenant("a")).0;
    assert!(matches!(a1, Admission::Holds { .. }) && a1 == a2);
    assert_eq!(b.admit(&store, 0, &tenant("a")).0, Admission::Full);
    // Another tenant is not slowed (unless it shares the slot: not these).
    assert!(matches!(
        b.admit(&store, 0, &tenant("b")).0,
        Admission::Holds { .. }
    ));
    let Admission::Holds { slot } = a1 else {
        unreachable!()
    };
    b.release(&store, 0, slot);
    assert_eq!(b.in_flight(&store, 0, slot), 1);
    assert!(matches!(
        b.admit(&store, 0, &tenant("a")).0,
        Admission::Holds { .. }
    ));
}

#[test]
fn property_never_more_than_max_in_flight_across_workers_and_all_come_back() {
    for remembering in [false, true] {
        for seed in 0..30u64 {
            let store = Rc::new(MemoryStore::default());
            let mut vms: Vec<Bulkheads> = (0..3).map(|_| limits(PER_TENANT)).collect();
            vms[0].create(&*store).expect("created");
            let stores = views(&store, 3, remembering);
            let mut rng = crate::rng::SplitMix(seed);
            // (worker, tenant, slot) of each request in flight.
            let mut flying: Vec<(usize, u64, u32)> = Vec::new();
            for _ in 0..400 {
                let w = rng.below(3) as usize;
                if rng.below(2) == 0 || flying.is_empty() {
                    let t = rng.below(5);
                    if let Admission::Holds { slot } =
                        vms[w].admit(&*stores[w], 0, &tenant(&t.to_string())).0
                    {
                        flying.push((w, t, slot));
                    }
                } else {
                    let (w, _, slot) = flying.swap_remove(rng.below(flying.len() as u64) as usize);
                    vms[w].release(&*stores[w], 0, slot);
                }
                for t in 0..5 {
                    let n = flying.iter().filter(|f| f.1 == t).count();
                    assert!(n <= 2, "seed {seed}: tenant {t} has {n} in flight");
                }
            }
            for (w, _, slot) in flying.drain(..) {
                vms[w].release(&*stores[w], 0, slot);
            }
            let map = store.map.borrow();
            let left: u32 = map
                .values()
                .filter_map(|(v, _)| codec::decode(v).ok())
                .sum();
            assert_eq!(left, 0, "seed {seed}: slots left held");
        }
    }
}

#[test]
fn a_failed_release_is_retried_so_the_limit_never_shrinks() {
    let mut b = limits(PER_TENANT);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    let Admission::Holds { slot } = b.admit(&store, 0, &tenant("a")).0 else {
        panic!("admitted")
    };
    store.fail_all.set(true);
    b.release(&store, 0, slot);
    store.fail_all.set(false);
    assert_eq!(b.in_flight(&store, 0, slot), 1);
    b.retry_failed(&store);
    assert_eq!(b.in_flight(&store, 0, slot), 0);
}

#[test]
fn a_release_that_finds_its_slot_corrupt_rewrites_it_and_counts_it() {
    let mut b = limits(PER_TENANT);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    let Admission::Holds { slot } = b.admit(&store, 0, &tenant("a")).0 else {
        panic!("admitted")
    };
    let key = b.slot_key(0, slot);
    store.raw_set(&key, b"garbage");
    assert_eq!(b.release(&store, 0, slot), 1, "counted as a store failure");
    assert_eq!(b.in_flight(&store, 0, slot), 0, "rewritten, readable");
    assert_eq!(
        b.release(&store, 0, slot),
        0,
        "a readable slot is not counted"
    );
}

#[test]
fn missing_keys_skip_the_limit_and_a_store_failure_fails_open() {
    let b = limits(PER_TENANT);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    assert_eq!(
        b.admit(&store, 0, &FakeRequest::new("GET", "/")).0,
        Admission::Free
    );
    store.fail_all.set(true);
    let (got, store_failures) = b.admit(&store, 0, &tenant("a"));
    assert_eq!(got, Admission::Free);
    assert_eq!(store_failures, 1);
}

#[test]
fn bad_limits_are_refused_naming_the_field() {
    for (json, field) in [
        (
            r#"{"concurrency_limits":[{"name":"l","max":0}]}"#,
            "concurrency_limits[0].max",
        ),
        (
            r#"{"concurrency_limits":[{"name":"l"}]}"#,
            "concurrency_limits[0]",
        ),
        (
            r#"{"concurrency_limits":[{"name":"l","max":1,"max_keys":0}]}"#,
            "concurrency_limits[0].max_keys",
        ),
        (
            r#"{"concurrency_limits":[{"name":"l","max":1,"max_keys":100001}]}"#,
            "concurrency_limits[0].max_keys",
        ),
        (
            r#"{"concurrency_limits":[{"name":"l","max":1,"key":[{"header":"a b"}]}]}"#,
            "concurrency_limits[0].key[0]",
        ),
        (
            r#"{"concurrency_limits":[{"name":"l","max":1,"status":200}]}"#,
            "concurrency_limits[0].status",
        ),
        (
            r#"{"concurrency_limits":[{"name":"l","max":1},{"name":"l","max":1}]}"#,
            "concurrency_limits[1].name",
        ),
    ] {
        let e = parse(json.as_bytes()).expect_err(json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}
