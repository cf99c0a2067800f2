//! Scenarios over time: a leader, a worker and a service that counts as
//! envoyproxy/ratelimit does (refused hits too, hour windows), ticking
//! every 100 ms; each once showed a fault found in review.
use super::codec::{self, Want};
use super::pool::Pool;
use super::tests::{hits_of, response_of as response, vm, Vm, T0};
use super::{Call, Mode, RuleId};
use crate::ratelimit::LimitVerdict;
use crate::store::memory::MemoryStore;
use std::collections::HashMap;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// envoyproxy/ratelimit-like: counts refused hits too; fixed 1h window.
struct Service {
    limit: u64,
    count: HashMap<String, u64>,
}
impl Service {
    fn answer(&mut self, call: &Call, keys: &[&str], now_ms: u64) -> Vec<u8> {
        let key = keys
            .iter()
            .find(|k| call.message.windows(k.len()).any(|w| w == k.as_bytes()))
            .expect("key in descriptor");
        let hits = hits_of(call);
        let c = self.count.entry(key.to_string()).or_default();
        *c += hits;
        let reset = 3_600 - (now_ms / 1000) % 3_600;
        if *c <= self.limit {
            response(1, self.limit, self.limit - *c, reset)
        } else {
            response(2, self.limit, 0, reset)
        }
    }
}

fn cfg(extra_rule: &str, extra_global: &str, limit: u64, max_keys: u32) -> String {
    format!(
        r#"{{"domain":"d","rate_limits":[{{"name":"g","key":[{{"header":"x-key"}}],
        "algorithm":"sliding_window","window":{{"limit":{limit},"period":"1h"}},"max_keys":{max_keys}{extra_rule},
        "global":{{"cluster":"rls","domain":"fleet"{extra_global}}}}}]}}"#
    )
}

/// Runs `secs` seconds: every 100 ms each key sends `per_tick` requests
/// through a worker VM, both VMs tick, the leader's calls are answered by
/// the service 5 ms later. Returns admitted per key.
fn run(json: &str, keys: &[(&str, u32)], secs: u64, limit: u64) -> (Vec<u64>, Service, u64, u64) {
    let store = MemoryStore::default();
    let mut leader = vm(json, 1, &store);
    let mut worker = vm(json, 2, &store);
    let mut svc = Service {
        limit,
        count: HashMap::new(),
    };
    let names: Vec<&str> = keys.iter().map(|k| k.0).collect();
    let mut admitted = vec![0u64; keys.len()];
    let (mut granted, mut dropped) = (0, 0);
    let mut now = T0 - T0 % 3_600_000 + 1_000; // early in an hour window
    leader.tick(&store, now - 200);
    for _ in 0..secs * 10 {
        for (i, &(k, n)) in keys.iter().enumerate() {
            for _ in 0..n {
                if worker.request_fp(&store, now, k).0 == LimitVerdict::Allow {
                    admitted[i] += 1;
                }
            }
        }
        worker.tick(&store, now + 1);
        let r = leader.tick(&store, now + 2);
        for c in &r.calls {
            let body = svc.answer(c, &names, now + 5);
            let a = leader.answer(&store, now + 7, c, Some(body));
            granted += a.granted.iter().map(|g| g.1).sum::<u64>();
            dropped += a.dropped.iter().map(|g| g.1).sum::<u64>();
        }
        now += 100;
    }
    (admitted, svc, granted, dropped)
}

#[test]
fn a_cost_above_the_share_cap_is_still_fetched() {
    // limit 100 over 20 instances: the share cap is 100/20/2 = 2; a batch
    // is never below cost.max (here 3), so requests of cost 3 get through.
    let json = cfg(
        r#","cost":{"default":3,"max":3}"#,
        r#","instances":20"#,
        100,
        64,
    );
    let (admitted, svc, granted, _) = run(&json, &[("tenant-a", 5)], 20, 100);
    assert!(
        admitted[0] >= 20,
        "cost 3: admitted {admitted:?} granted {granted} count {:?}",
        svc.count
    );
    assert!(admitted[0] * 3 <= 100);
}

#[test]
fn demand_is_counted_in_tokens_not_requests() {
    // One request per second of cost 20, limit 1000/h over 2 instances.
    let json = cfg(r#","cost":{"default":20}"#, r#","instances":2"#, 1000, 64);
    let store = MemoryStore::default();
    let mut leader = vm(&json, 1, &store);
    let mut svc = Service {
        limit: 1000,
        count: HashMap::new(),
    };
    let mut now = T0 - T0 % 3_600_000 + 1_000;
    let (mut admitted, mut sent) = (0, 0);
    for t in 0..600u64 {
        if t % 10 == 0 {
            sent += 1;
            if leader.request_fp(&store, now, "tenant-a").0 == LimitVerdict::Allow {
                admitted += 1;
            }
        }
        let r = leader.tick(&store, now + 2);
        for c in &r.calls {
            let body = svc.answer(c, &["tenant-a"], now + 5);
            leader.answer(&store, now + 7, c, Some(body));
        }
        now += 100;
    }
    // 60 requests of cost 20 against a limit of 1000: at most 50 fit.
    assert!(
        (40..=50).contains(&admitted),
        "cost 20 at 1/s: {admitted} of {sent}; {:?}",
        svc.count
    );
}

/// A leader and a worker: key "busy" holds a full pool (the service was
/// fine), then key "quiet" asked and its call failed: the breaker (one
/// failure, 1 s) is open.
fn stocked_key_and_an_open_breaker() -> (MemoryStore, Vm, Vm, u64) {
    let json = cfg(
        "",
        r#","instances":2,"breaker":{"failures":1,"cooldown":"1s"}"#,
        1000,
        64,
    );
    let store = MemoryStore::default();
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    let mut now = T0 - T0 % 3_600_000 + 1_000;
    leader.tick(&store, now);
    // "busy" gets a full pool (service fine); then "quiet" asks and its
    // call fails (service down): breaker opens.
    for _ in 0..5 {
        worker.request(&store, now + 1, "busy");
    }
    worker.tick(&store, now + 2);
    now += 100;
    let c = leader.tick(&store, now).calls.remove(0);
    leader.answer(&store, now + 5, &c, Some(response(1, 1000, 900, 3_000)));
    worker.request(&store, now + 10, "quiet");
    worker.tick(&store, now + 11);
    now += 100;
    let r = leader.tick(&store, now);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    leader.answer(&store, now + 5, &r.calls[0], None);
    (store, leader, worker, now)
}

/// After `stocked_key_and_an_open_breaker`, the service is back: 60 s of
/// steady demand on "busy" (and on "quiet" too, if `quiet_asks`). The
/// breaker must half-open once, probe, and close.
fn recovers(quiet_asks: bool) {
    let (store, mut leader, mut worker, mut now) = stocked_key_and_an_open_breaker();
    let mut calls = 0;
    let mut probes_opened = 0;
    for _ in 0..600 {
        for _ in 0..5 {
            worker.request(&store, now + 1, "busy");
        }
        if quiet_asks {
            worker.request(&store, now + 1, "quiet");
        }
        worker.tick(&store, now + 2);
        let r = leader.tick(&store, now + 3);
        probes_opened += r
            .transitions
            .iter()
            .filter(|t| t.1 == super::codec::HealthState::HalfOpen)
            .count();
        for c in &r.calls {
            calls += 1;
            leader.answer(&store, now + 5, c, Some(response(1, 1000, 800, 3_000)));
        }
        now += 100;
    }
    assert!(
        calls > 0 && probes_opened == 1,
        "half-open {probes_opened} times, {calls} calls"
    );
    assert_eq!(
        worker.coord.mode(RuleId(0)),
        Mode::Service,
        "back on the service"
    );
}

#[test]
fn the_probe_is_not_wasted_on_a_key_that_needs_no_tokens() {
    recovers(true);
}

#[test]
fn a_probe_is_sent_even_when_only_stocked_keys_ask() {
    recovers(false);
}

#[test]
fn two_keys_sharing_a_first_slot_each_keep_a_pool() {
    // Find two keys in the same slot of a 16-slot table.
    let json = cfg("", r#","instances":2"#, 300, 16);
    let store = MemoryStore::default();
    let mut probe = vm(&json, 9, &store);
    let mut by_slot: HashMap<u64, String> = HashMap::new();
    let mut pair = None;
    for i in 0..100 {
        let k = format!("tenant-{i:03}");
        let (_, fp) = probe.request_fp(&store, T0, &k);
        if let Some(other) = by_slot.get(&(fp % 16)) {
            pair = Some((other.clone(), k));
            break;
        }
        by_slot.insert(fp % 16, k);
    }
    let (a, b) = pair.expect("a pair");
    // Same demand, once alone and once sharing a slot.
    let (alone, svc_alone, _, _) = run(&json, &[(&a, 2)], 60, 300);
    let (both, svc, granted, dropped) = run(&json, &[(&a, 2), (&b, 2)], 60, 300);
    let _ = (svc_alone, svc, granted);
    assert!(alone[0] >= 280, "{alone:?}");
    assert!(
        both.iter().all(|n| (280..=300).contains(n)),
        "sharing a first slot: {both:?}, dropped {dropped}"
    );
}

/// Demand for 10,000 keys never seen before (round `round`'s), once each.
fn note_distinct_keys(vm: &mut Vm, round: u64, starved: bool) {
    for i in 0..10_000u64 {
        let fp = round * 10_000 + i + 1_000_000;
        vm.coord.note(RuleId(0), fp, starved, 1, || {
            vec![format!("x{fp}").into_bytes()]
        });
    }
}

#[test]
fn a_full_key_table_makes_room_for_new_keys() {
    let json = cfg("", r#","instances":2"#, 1_000_000, 64);
    let store = MemoryStore::default();
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    let mut now = T0;
    leader.tick(&store, now);
    // An attacker: 50,000 distinct keys, each once.
    for round in 0..5u64 {
        note_distinct_keys(&mut worker, round, true);
        worker.tick(&store, now + 1);
        now += 100;
        let r = leader.tick(&store, now);
        for c in &r.calls {
            leader.answer(
                &store,
                now + 1,
                c,
                Some(response(1, 1_000_000, 999_000, 3_000)),
            );
        }
    }
    assert!(leader.coord.keys.len() <= super::MAX_KEYS);
    // A legitimate tenant now: refused as starved for as long as the
    // attacker keeps its keys alive (one request each per 30 s).
    let mut legit_calls = 0;
    let mut admitted = 0;
    for t in 0..100 {
        if worker.request_fp(&store, now, "legit").0 == LimitVerdict::Allow {
            admitted += 1;
        }
        worker.tick(&store, now + 1);
        let r = leader.tick(&store, now + 2);
        for c in &r.calls {
            if c.message.windows(5).any(|w| w == b"legit") {
                legit_calls += 1;
            }
            leader.answer(
                &store,
                now + 3,
                c,
                Some(response(1, 1_000_000, 999_000, 3_000)),
            );
        }
        let _ = t;
        now += 100;
    }
    // The attacker's pools fill the 64-slot table; the new key takes a
    // slot once their owners have had no demand for 5 s (FRESH_MS), and is
    // served from then on.
    assert!(
        legit_calls > 0 && admitted >= 40,
        "legit: {legit_calls} calls, {admitted} admitted of 100"
    );
}

/// A key a full table evicts, its pool still live, is counted as dropped
/// at its window's end as an idle one is.
#[test]
fn an_evicted_keys_unspent_tokens_are_counted_at_its_windows_end() {
    let json = cfg("", r#","instances":2"#, 1_000_000, 64);
    let store = MemoryStore::default();
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    let mut now = T0;
    leader.tick(&store, now);
    // One key granted a batch good for 20 s, one token spent.
    worker.request(&store, now, "a");
    worker.tick(&store, now + 1);
    now += 100;
    let call = leader.tick(&store, now).calls.remove(0);
    let granted = hits_of(&call);
    leader.answer(
        &store,
        now + 1,
        &call,
        Some(response(1, 1_000_000, 999_000, 20)),
    );
    assert_eq!(worker.request(&store, now + 2, "a"), LimitVerdict::Allow);
    // Then 60,000 other keys, each once: the table evicts the oldest.
    for round in 0..6u64 {
        note_distinct_keys(&mut worker, round, false);
        worker.tick(&store, now + 1);
        now += 100;
        assert!(leader.tick(&store, now).dropped.is_empty());
    }
    // Its window over, before it would be forgotten as idle (30 s).
    assert!(leader.coord.keys.len() <= super::MAX_KEYS);
    let r = leader.tick(&store, T0 + 25_000);
    assert!(
        r.dropped.contains(&(RuleId(0), granted - 1)),
        "{:?}",
        r.dropped
    );
}

#[test]
fn demand_left_out_of_a_full_record_waits_for_the_next_report() {
    let json = cfg("", r#","instances":2"#, 1000, 64);
    let store = MemoryStore::default();
    let mut w = vm(&json, 2, &store);
    for i in 0..300u64 {
        w.coord
            .note(RuleId(0), i + 1, false, 1, || vec![vec![b'v'; 1_000]]);
    }
    w.coord.report_demand(&store);
    let wants: Vec<Want> = store
        .map
        .borrow()
        .iter()
        .filter(|(k, _)| k.ends_with("/want"))
        .flat_map(|(_, (b, _))| codec::decode_wants(b).unwrap())
        .collect();
    assert!(wants.len() < 300, "the record is full");
    assert_eq!(wants.len() + w.coord.local.len(), 300, "nothing lost");
}

#[test]
fn a_block_never_extends_kept_tokens_past_their_window() {
    let old = Pool {
        tokens: 5,
        until_ms: T0,
        blocked: false,
    };
    let (p, _) = Pool::block(Some(old), T0 + 900, T0 - 100);
    assert_eq!(p.live(T0 - 50), 5);
    assert_eq!(p.live(T0 + 500), 0, "{p:?}");
}
