//! Tests of the limiter's transaction over a store with Envoy's CAS
//! semantics, including simulated writers on other workers.

use super::codec::Slot;
use super::{LimitVerdict, Limiter, RuleResult};
use crate::request::fake::FakeRequest;
use crate::rng::SplitMix;
use crate::store::memory::MemoryStore;
use crate::store::Store;
use crate::wiring::parse;
use std::cell::Cell;
use std::rc::Rc;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const S: u64 = 1_000_000_000;
const NOW: u64 = 1_700_000_000 * S;

fn limiter(json: &str) -> Limiter {
    let config = parse(json.as_bytes()).expect("valid config");
    Limiter::new(&config.rules, &config.common, (1, 2)).expect("no table id collision")
}

fn ready(json: &str) -> (Limiter, MemoryStore) {
    let l = limiter(json);
    let store = MemoryStore::default();
    l.create_tables(&store).expect("tables");
    // Count only what the test does from here on.
    store.sets.set(0);
    store.gets.set(0);
    (l, store)
}

fn req(key: &str) -> FakeRequest {
    FakeRequest::new("GET", "/api/x").with_header("x-key", key.as_bytes())
}

const ONE_RULE: &str = r#"{"rate_limits":[{"name":"r","key":[{"header":"x-key"}],
    "bucket":{"rate":1,"period":"1h","burst":5},"max_keys":100}]}"#;

#[test]
fn admits_exactly_burst_then_refuses_with_the_exact_wait() {
    let (l, store) = ready(ONE_RULE);
    let verdicts: Vec<_> = (0..7)
        .map(|_| l.evaluate(&store, NOW, &req("a")).verdict)
        .collect();
    assert!(verdicts[..5].iter().all(|v| *v == LimitVerdict::Allow));
    assert_eq!(
        verdicts[5],
        LimitVerdict::Deny {
            rule: 0,
            wait_ns: 3600 * S
        }
    );
    let later = l.evaluate(&store, NOW + 3600 * S, &req("a"));
    assert_eq!(later.verdict, LimitVerdict::Allow);
}

#[test]
fn slot_keys_are_the_table_prefix_and_the_slot_in_decimal() {
    let l =
        limiter(r#"{"rate_limits":[{"name":"a","bucket":{"rate":1,"period":"1s","burst":1}}]}"#);
    let prefix = l.slot_key(0, 0).trim_end_matches('0').to_string();
    assert!(prefix.starts_with("sl") && prefix.ends_with('/') && prefix.len() == 11);
    for slot in [0, 7, 9, 10, 99, 100, 12_345, 1_000_000_000, u32::MAX] {
        assert_eq!(l.slot_key(0, slot), format!("{prefix}{slot}"));
    }
}

#[test]
fn keys_are_isolated() {
    let (l, store) = ready(ONE_RULE);
    for _ in 0..5 {
        l.evaluate(&store, NOW, &req("a"));
    }
    assert_ne!(
        l.evaluate(&store, NOW, &req("a")).verdict,
        LimitVerdict::Allow
    );
    assert_eq!(
        l.evaluate(&store, NOW, &req("b")).verdict,
        LimitVerdict::Allow
    );
}

#[test]
fn tables_are_created_once_and_hold_exactly_max_keys_entries() {
    let (l, store) = ready(ONE_RULE);
    // The slots and the table's "complete" marker.
    assert_eq!(store.map.borrow().len(), 101);
    assert_eq!(l.create_tables(&store), Ok(0));
    for i in 0..5000 {
        l.evaluate(&store, NOW + i, &req(&i.to_string()));
    }
    assert_eq!(store.map.borrow().len(), 101);
}

#[test]
fn a_complete_table_costs_one_read_to_configure_again() {
    let (l, store) = ready(ONE_RULE);
    store.gets.set(0);
    assert_eq!(l.create_tables(&store), Ok(0));
    assert_eq!(store.gets.get(), 1);
    // A lost slot with a marker that no longer fits (corrupt) is found again.
    let marker = store
        .map
        .borrow()
        .keys()
        .find(|k| k.ends_with("complete"))
        .cloned();
    let marker = marker.expect("a marker");
    store.raw_set(&marker, b"junk");
    store.map.borrow_mut().remove(&l.slot_key(0, 7));
    assert_eq!(l.create_tables(&store), Ok(1));
    store.gets.set(0);
    assert_eq!(l.create_tables(&store), Ok(0));
    assert_eq!(store.gets.get(), 1);
}

const LAYERED: &str = r#"{"rate_limits":[
    {"name":"global","bucket":{"rate":1,"period":"1h","burst":10}},
    {"name":"tenant","key":[{"header":"x-key"}],"bucket":{"rate":1,"period":"1h","burst":2}}]}"#;

#[test]
fn a_request_refused_by_one_rule_spends_nothing_in_the_others() {
    let (l, store) = ready(LAYERED);
    for _ in 0..2 {
        assert_eq!(
            l.evaluate(&store, NOW, &req("a")).verdict,
            LimitVerdict::Allow
        );
    }
    for _ in 0..20 {
        let e = l.evaluate(&store, NOW, &req("a"));
        assert_eq!(
            e.verdict,
            LimitVerdict::Deny {
                rule: 1,
                wait_ns: 3600 * S
            }
        );
    }
    // Global has spent only the 2 admitted requests: 8 more callers pass.
    for i in 0..8 {
        assert_eq!(
            l.evaluate(&store, NOW, &req(&format!("other{i}"))).verdict,
            LimitVerdict::Allow,
            "{i}"
        );
    }
    let e = l.evaluate(&store, NOW, &req("z"));
    assert_eq!(
        e.verdict,
        LimitVerdict::Deny {
            rule: 0,
            wait_ns: 3600 * S
        }
    );
}

/// Runs `l` on tenant `a` while `interfere` writes the store just before
/// the first write to a tenant slot; returns how many fresh tenants pass after.
fn conflict_then_count(interfere: impl Fn(&MemoryStore, &Limiter) + 'static) -> usize {
    let (l, store) = ready(LAYERED);
    assert_eq!(
        l.evaluate(&store, NOW, &req("a")).verdict,
        LimitVerdict::Allow
    );
    let l2 = l.clone();
    let tenant_prefix = l.rules[1].prefix.clone();
    let armed = Cell::new(true);
    *store.before_set.borrow_mut() = Some(Box::new(move |s: &MemoryStore, key: &str| {
        if key.starts_with(&tenant_prefix) && armed.replace(false) {
            interfere(s, &l2);
        }
    }));
    let e = l.evaluate(&store, NOW, &req("a"));
    assert_eq!(
        e.verdict,
        LimitVerdict::Deny {
            rule: 1,
            wait_ns: 3600 * S
        }
    );
    *store.before_set.borrow_mut() = None;
    (0..20)
        .filter(|i| l.evaluate(&store, NOW, &req(&format!("n{i}"))).verdict == LimitVerdict::Allow)
        .count()
}

#[test]
fn a_conflict_that_turns_a_later_rule_into_a_refusal_refunds_an_untouched_earlier_rule() {
    // Another worker drains tenant a's slots (and touches nothing else) while
    // our request commits: tenant now refuses, and global's charge is undone.
    let passed = conflict_then_count(|s, l| {
        let p = crate::keys::place(
            &l.rules[1].spec.key,
            l.rules[1].spec.on_missing_key,
            l.seed,
            l.table_len(1),
            &req("a"),
        )
        .expect("placed");
        for &slot in p.slots() {
            let drained = l.rules[1].spec.algorithm.exhausted(NOW);
            s.raw_set(
                &l.slot_key(1, slot),
                &Slot {
                    fingerprint: 7,
                    tat: drained,
                }
                .encode(),
            );
        }
    });
    assert_eq!(passed, 9, "global spent only the first request's token");
}

#[test]
fn a_refund_is_skipped_when_the_slot_moved_so_it_never_over_admits() {
    // Another worker spends tenant a's last token and a global token in
    // between: global's slot moved, so our charge stays (one token lost,
    // never one too many).
    let passed = conflict_then_count(|s, l| {
        assert_eq!(l.evaluate(s, NOW, &req("a")).verdict, LimitVerdict::Allow);
    });
    assert_eq!(passed, 7);
}

#[test]
fn shadow_rules_report_but_never_refuse_and_are_not_charged_when_over() {
    let (l, store) = ready(
        r#"{"rate_limits":[{"name":"s","shadow":true,"bucket":{"rate":1,"period":"1h","burst":1}}]}"#,
    );
    let first = l.evaluate(&store, NOW, &req("a"));
    assert_eq!(first.reports[0].result, RuleResult::Allowed);
    for _ in 0..3 {
        let e = l.evaluate(&store, NOW, &req("a"));
        assert_eq!(e.verdict, LimitVerdict::Allow);
        assert_eq!(e.reports[0].result, RuleResult::ShadowLimited);
        assert_eq!(e.reports[0].wait_ns, 3600 * S);
    }
}

#[test]
fn property_exact_under_simulated_concurrent_workers() {
    // Frozen time, burst B, many requests from "workers" whose writes
    // interleave at random: exactly B are admitted, never B + 1.
    exact_under_interleaving(false, false, false);
    // The same with every worker skipping reads where its memory allows
    // (long stretches run on one worker): reads were skipped.
    assert!(exact_under_interleaving(true, false, false) * 40 > 100 * crate::test_seeds(40));
    // Sliding windows, on the same transaction.
    exact_under_interleaving(false, true, false);
    assert!(exact_under_interleaving(true, true, false) * 40 > 100 * crate::test_seeds(40));
    // One keyless rule: decided alone (`Limiter::lone`), as exact.
    for (remembering, window) in [(false, false), (true, false), (false, true), (true, true)] {
        exact_under_interleaving(remembering, window, true);
    }
}

/// Returns the reads our worker skipped; `alone`: the rule is the
/// configuration's only one, without a key.
fn exact_under_interleaving(remembering: bool, window: bool, alone: bool) -> u64 {
    use crate::store::Remembering;
    let mut skipped = 0;
    for seed in 0..crate::test_seeds(40) {
        let burst = 1 + seed * 7 % 60;
        let algorithm = if window {
            format!(r#""algorithm":"sliding_window","window":{{"limit":{burst},"period":"1h"}}"#)
        } else {
            format!(r#""bucket":{{"rate":1,"period":"1h","burst":{burst}}}"#)
        };
        let json = if alone {
            format!(r#"{{"max_cas_retries":1000,"rate_limits":[{{"name":"r",{algorithm}}}]}}"#)
        } else {
            format!(
                r#"{{"max_cas_retries":1000,"rate_limits":[{{"name":"r","key":["client_address"],{algorithm}}},
                {{"name":"g","bucket":{{"rate":1,"period":"1h","burst":100000}}}}]}}"#
            )
        };
        let (l, store) = ready(&json);
        assert_eq!(l.lone, alone);
        let host = Rc::new(store);
        let memory = Rc::new(Remembering::new(host.clone()));
        let ours: Rc<dyn Store> = if remembering {
            memory.clone()
        } else {
            host.clone()
        };
        let theirs: Box<dyn Store> = if remembering {
            Box::new(Remembering::new(Rc::downgrade(&host)))
        } else {
            Box::new(Rc::downgrade(&host))
        };
        let one_in = if remembering { 8 } else { 3 };
        let admitted = Rc::new(Cell::new(0u64));
        let rng = Rc::new(std::cell::RefCell::new(SplitMix(seed)));
        let (l2, a2, r2) = (l.clone(), admitted.clone(), rng.clone());
        let depth = Rc::new(Cell::new(0));
        let d2 = depth.clone();
        *host.before_set.borrow_mut() = Some(Box::new(move |_: &MemoryStore, _key: &str| {
            if d2.get() < 3 && r2.borrow_mut().below(one_in) == 0 {
                d2.set(d2.get() + 1);
                if l2
                    .evaluate(&*theirs, NOW, &FakeRequest::new("GET", "/"))
                    .verdict
                    == LimitVerdict::Allow
                {
                    a2.set(a2.get() + 1);
                }
                d2.set(d2.get() - 1);
            }
        }));
        for _ in 0..burst * 3 {
            if l.evaluate(&*ours, NOW, &FakeRequest::new("GET", "/"))
                .verdict
                == LimitVerdict::Allow
            {
                admitted.set(admitted.get() + 1);
            }
        }
        assert_eq!(admitted.get(), burst, "seed {seed}");
        skipped += memory.take_counts().0;
    }
    skipped
}

#[test]
fn property_a_hot_key_never_exceeds_its_limit_among_many_cold_keys() {
    let (l, store) = ready(
        r#"{"rate_limits":[{"name":"r","key":[{"header":"x-key"}],
        "bucket":{"rate":10,"period":"1s","burst":20},"max_keys":50}]}"#,
    );
    let mut rng = SplitMix(9);
    let mut now = NOW;
    let mut hot_admitted = 0u64;
    let mut hot_refused = 0u64;
    for i in 0..20_000u64 {
        now += rng.below(2 * S / 1000); // 1,000 requests/s on average
        let key = if i % 10 == 0 {
            "hot".to_string()
        } else {
            format!("cold{i}")
        };
        let allowed = l.evaluate(&store, now, &req(&key)).verdict == LimitVerdict::Allow;
        if key == "hot" {
            if allowed {
                hot_admitted += 1
            } else {
                hot_refused += 1
            }
            let bound = 20 + (now - NOW) as u128 * 10 / S as u128;
            assert!(
                hot_admitted as u128 <= bound,
                "hot key escaped: {hot_admitted} > {bound}"
            );
        }
    }
    assert!(hot_refused > 0 && hot_admitted > 0);
    // The 50 slots and the table's "complete" marker: nothing more.
    assert_eq!(store.map.borrow().len(), 51);
}

#[test]
fn corrupt_slots_are_rebuilt_by_the_failure_policy() {
    for (deny, expect) in [
        (false, LimitVerdict::Allow),
        (
            true,
            LimitVerdict::Deny {
                rule: 0,
                wait_ns: 3600 * S,
            },
        ),
    ] {
        let json = format!(
            r#"{{"failure_mode_deny":{deny},"rate_limits":[{{"name":"r","bucket":{{"rate":1,"period":"1h","burst":1}}}}]}}"#
        );
        let (l, store) = ready(&json);
        store.raw_set(&l.slot_key(0, 0), b"garbage");
        let e = l.evaluate(&store, NOW, &req("a"));
        assert_eq!(e.verdict, expect);
        assert!(e.reports[0].corrupt);
        // The slot is readable again afterwards (fail-open rewrote it).
        if !deny {
            assert!(!l.evaluate(&store, NOW, &req("a")).reports[0].corrupt);
        }
    }
}

#[test]
fn an_unavailable_store_follows_the_failure_policy() {
    for deny in [false, true] {
        let json = format!(
            r#"{{"failure_mode_deny":{deny},"rate_limits":[{{"name":"r","bucket":{{"rate":1,"period":"1h","burst":1}}}}]}}"#
        );
        let (l, store) = ready(&json);
        store.fail_all.set(true);
        let e = l.evaluate(&store, NOW, &req("a"));
        assert_eq!(e.reports[0].result, RuleResult::StoreFailure);
        assert_eq!(e.verdict == LimitVerdict::Allow, !deny);
    }
}

#[test]
fn endless_conflicts_stop_after_the_retry_bound() {
    let (l, store) = ready(
        r#"{"max_cas_retries":3,"rate_limits":[{"name":"r","bucket":{"rate":1,"period":"1h","burst":100}}]}"#,
    );
    *store.before_set.borrow_mut() = Some(Box::new(|s: &MemoryStore, key: &str| {
        let v = s
            .map
            .borrow()
            .get(key)
            .map(|(b, _)| b.clone())
            .unwrap_or_default();
        s.raw_set(key, &v); // same bytes, new CAS token: a conflict every time
    }));
    let e = l.evaluate(&store, NOW, &req("a"));
    assert_eq!(e.verdict, LimitVerdict::Allow);
    assert_eq!(e.reports[0].result, RuleResult::StoreFailure);
    assert_eq!(e.reports[0].cas_retries, 3);
    // (The table's one slot was created before: `ready` resets the count.)
    assert!(store.sets.get() <= 4);
}

#[test]
fn cost_comes_from_the_header_clamped_and_defaults_on_bad_values() {
    let (l, store) = ready(
        r#"{"rate_limits":[{"name":"r","cost":{"header":"x-cost","max":5},
        "bucket":{"rate":1,"period":"1h","burst":100}}]}"#,
    );
    let cases: [(&[u8], u64); 9] = [
        (b"3", 3),
        (b"50", 5),
        (b"0", 1),
        (b"-2", 1),
        (b"abc", 1),
        (b"\xff\xfe", 1),
        (b"99999999999999999999999", 1),
        // 20 digits past u64: a positive integer, clamped like the others.
        (b"99999999999999999999", 5),
        (b"00000000000000000000", 1),
    ];
    for (value, cost) in cases {
        let r = FakeRequest::new("GET", "/").with_header("x-cost", value);
        assert_eq!(
            l.evaluate(&store, NOW, &r).reports[0].cost,
            cost,
            "{value:?}"
        );
    }
}

#[test]
fn missing_slots_are_created_on_use_when_tables_were_not() {
    let l = limiter(ONE_RULE);
    let store = MemoryStore::default();
    assert_eq!(
        l.evaluate(&store, NOW, &req("a")).verdict,
        LimitVerdict::Allow
    );
    assert!(!store.map.borrow().is_empty());
}

#[test]
fn unmatched_rules_and_skipped_keys_do_not_apply() {
    let (l, store) = ready(
        r#"{"rate_limits":[{"name":"r","match":{"path_prefix":"/admin"},
        "bucket":{"rate":1,"period":"1h","burst":1}},
        {"name":"k","key":[{"header":"x-tenant"}],"bucket":{"rate":1,"period":"1h","burst":1}}]}"#,
    );
    for _ in 0..3 {
        let e = l.evaluate(&store, NOW, &req("a"));
        assert_eq!(e.verdict, LimitVerdict::Allow);
        assert!(e.reports.is_empty());
    }
    let _ = store.get("x");
}

#[test]
fn a_refusal_is_never_decided_on_a_remembered_value() {
    // A worker remembers the bucket it emptied; another worker's refund
    // (here: a raw write) fills it again. The next request must see that.
    use crate::store::Remembering;
    let (l, store) =
        ready(r#"{"rate_limits":[{"name":"r","bucket":{"rate":1,"period":"1h","burst":8}}]}"#);
    let host = Rc::new(store);
    let vm = Remembering::new(host.clone());
    for _ in 0..8 {
        assert_eq!(l.evaluate(&vm, NOW, &req("a")).verdict, LimitVerdict::Allow);
    }
    assert_ne!(l.evaluate(&vm, NOW, &req("a")).verdict, LimitVerdict::Allow);
    assert!(vm.take_counts().0 > 0, "the bucket's reads were skipped");
    host.raw_set(
        &l.slot_key(0, 0),
        &Slot {
            fingerprint: 0,
            tat: 0,
        }
        .encode(),
    );
    assert_eq!(l.evaluate(&vm, NOW, &req("a")).verdict, LimitVerdict::Allow);
}

#[test]
fn property_a_hot_key_in_a_sliding_window_stays_within_its_bound_among_cold_keys() {
    // 50 slots, two per key: the hot key shares slots with cold keys, whose
    // charges only ever make it stricter (merged states only grow).
    let (l, store) = ready(
        r#"{"rate_limits":[{"name":"r","key":[{"header":"x-key"}],"algorithm":"sliding_window",
        "window":{"limit":20,"period":"1s"},"max_keys":50}]}"#,
    );
    let mut rng = SplitMix(4);
    let mut now = NOW;
    let mut log: Vec<u64> = Vec::new();
    let mut refused = 0;
    for i in 0..20_000u64 {
        now += rng.below(2 * S / 1000);
        let key = if i % 10 == 0 {
            "hot".to_string()
        } else {
            format!("cold{i}")
        };
        let allowed = l.evaluate(&store, now, &req(&key)).verdict == LimitVerdict::Allow;
        if key != "hot" {
            continue;
        }
        if !allowed {
            refused += 1;
            continue;
        }
        log.push(now);
        // The documented bound: limit + previous window's count * e / W.
        let start = now / S * S;
        let truth = log.iter().filter(|&&t| t + S > now).count() as u128;
        let previous = log.iter().filter(|&&t| t < start && t + S >= start).count() as u128;
        let e = u128::from(now - start);
        assert!(
            truth * u128::from(S) <= 20 * u128::from(S) + previous * e,
            "hot key escaped: {truth} in one window"
        );
    }
    assert!(refused > 0 && !log.is_empty());
}

const SHAPED: &str = r#"{"rate_limits":[{"name":"pace","bucket":{"rate":10,"period":"1s","burst":1},
    "on_limit":"delay","max_delay":"1s"}]}"#;

fn shaped(l: &Limiter, store: &MemoryStore, now: u64, cap: u64) -> super::Evaluation {
    l.evaluate_shaped(store, now, &req("a"), &|_| cap)
}

#[test]
fn shaping_reserves_distinct_turns_one_interval_apart_up_to_max_delay() {
    let (l, store) = ready(SHAPED);
    let delays: Vec<u64> = (0..11)
        .map(|_| {
            let e = shaped(&l, &store, NOW, u64::MAX);
            assert_eq!(e.verdict, LimitVerdict::Allow);
            e.delay_ns
        })
        .collect();
    let expected: Vec<u64> = (0..11).map(|i| i * S / 10).collect();
    assert_eq!(delays, expected);
    // The next turn is 1.1 s away, beyond max_delay: refused, and told to
    // come back when it would go at once (never early).
    let e = shaped(&l, &store, NOW, u64::MAX);
    assert_eq!(
        e.verdict,
        LimitVerdict::Deny {
            rule: 0,
            wait_ns: 11 * S / 10
        }
    );
    // 100 ms later a turn is within reach again, 1 s away.
    let e = shaped(&l, &store, NOW + S / 10, u64::MAX);
    assert_eq!((e.verdict, e.delay_ns), (LimitVerdict::Allow, S));
    assert_eq!(e.reports[0].result, RuleResult::Delayed);
    assert_eq!(e.reservations.len(), 1);
}

#[test]
fn shaping_within_a_cap_and_never_for_plain_evaluation() {
    let (l, store) = ready(SHAPED);
    assert_eq!(shaped(&l, &store, NOW, 0).delay_ns, 0);
    // No room to wait (a full worker, or no deadline left): refused.
    let e = shaped(&l, &store, NOW, 0);
    assert!(matches!(e.verdict, LimitVerdict::Deny { .. }));
    // A cap of 250 ms allows two more turns (100 and 200 ms), not three.
    assert_eq!(shaped(&l, &store, NOW, S / 4).delay_ns, S / 10);
    assert_eq!(shaped(&l, &store, NOW, S / 4).delay_ns, 2 * S / 10);
    assert!(matches!(
        shaped(&l, &store, NOW, S / 4).verdict,
        LimitVerdict::Deny { .. }
    ));
    assert!(matches!(
        l.evaluate(&store, NOW, &req("a")).verdict,
        LimitVerdict::Deny { .. }
    ));
}

#[test]
fn a_held_request_that_leaves_gives_back_only_the_last_turn() {
    let (l, store) = ready(SHAPED);
    let first = shaped(&l, &store, NOW, u64::MAX);
    assert_eq!(first.delay_ns, 0);
    let a = shaped(&l, &store, NOW, u64::MAX);
    let b = shaped(&l, &store, NOW, u64::MAX);
    assert_eq!((a.delay_ns, b.delay_ns), (S / 10, 2 * S / 10));
    // `a` leaves: a later turn (b's) was reserved since, so a's stays
    // taken (nobody goes early); the next request gets turn 3.
    l.give_back(&store, &a.reservations);
    let c = shaped(&l, &store, NOW, u64::MAX);
    assert_eq!(c.delay_ns, 3 * S / 10);
    // `c` leaves as the last reservation: its turn is free again.
    l.give_back(&store, &c.reservations);
    let d = shaped(&l, &store, NOW, u64::MAX);
    assert_eq!(d.delay_ns, 3 * S / 10);
    assert_eq!(shaped(&l, &store, NOW, u64::MAX).delay_ns, 4 * S / 10);
}

#[test]
fn property_shaped_turns_are_distinct_under_simulated_concurrent_workers() {
    for seed in 0..30u64 {
        let (l, store) = ready(SHAPED);
        let host = Rc::new(store);
        let theirs: Box<dyn Store> = Box::new(Rc::downgrade(&host));
        let turns = Rc::new(std::cell::RefCell::new(Vec::new()));
        let rng = Rc::new(std::cell::RefCell::new(SplitMix(seed)));
        let (l2, t2, r2) = (l.clone(), turns.clone(), rng.clone());
        let depth = Rc::new(Cell::new(0));
        let d2 = depth.clone();
        *host.before_set.borrow_mut() = Some(Box::new(move |_: &MemoryStore, _key: &str| {
            if d2.get() < 3 && r2.borrow_mut().below(3) == 0 {
                d2.set(d2.get() + 1);
                let e = l2.evaluate_shaped(&*theirs, NOW, &req("a"), &|_| u64::MAX);
                if e.verdict == LimitVerdict::Allow {
                    t2.borrow_mut().push(e.delay_ns);
                }
                d2.set(d2.get() - 1);
            }
        }));
        for _ in 0..30 {
            let e = l.evaluate_shaped(&*host, NOW, &req("a"), &|_| u64::MAX);
            if e.verdict == LimitVerdict::Allow {
                turns.borrow_mut().push(e.delay_ns);
            }
        }
        let mut t = turns.borrow().clone();
        t.sort_unstable();
        // Exactly the 11 turns within max_delay, each taken once.
        let expected: Vec<u64> = (0..11).map(|i| i * S / 10).collect();
        assert_eq!(t, expected, "seed {seed}");
    }
}
