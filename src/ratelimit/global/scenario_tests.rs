//! Scenarios over time: a leader, a worker and a service that counts as
//! envoyproxy/ratelimit does (refused hits too, hour windows), ticking
//! every 100 ms; each once showed a fault found in review.
use super::codec::{self, Want};
use super::pool::Pool;
use super::{Call, Coordinator, Mode, Report};
use crate::config::parse;
use crate::ratelimit::stage;
use crate::ratelimit::{Limiter, Verdict};
use crate::request::fake::FakeRequest;
use crate::rng::SplitMix;
use crate::store::memory::MemoryStore;
use std::collections::HashMap;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const MS: u64 = 1_000_000;
const T0: u64 = 1_700_000_000_000;

struct Vm {
    limiter: Limiter,
    coord: Coordinator,
    rng: SplitMix,
}

fn vm(json: &str, me: u64, store: &MemoryStore) -> Vm {
    let cfg = parse(json.as_bytes()).expect("valid");
    let limiter = Limiter::new(&cfg, (1, 2)).expect("limiter");
    limiter.create_tables(store).expect("tables");
    let coord = stage::test_coordinator(&cfg, &limiter, me).expect("global");
    Vm {
        limiter,
        coord,
        rng: SplitMix(me),
    }
}

impl Vm {
    fn request(&mut self, store: &MemoryStore, now_ms: u64, key: &str) -> (Verdict, u64) {
        let r = FakeRequest::new("GET", "/").with_header("x-key", key.as_bytes());
        let eval = self.limiter.evaluate(store, now_ms * MS, &r);
        let mut fp = 0;
        for &(_, f) in &eval.global_keys {
            fp = f;
            let starved = eval
                .reports
                .iter()
                .any(|x| x.wait_ns == super::STARVED_WAIT_NS);
            let cost = eval.reports.first().map_or(1, |r| r.cost);
            self.coord
                .note(0, f, starved, cost, || vec![key.as_bytes().to_vec()]);
        }
        (eval.verdict, fp)
    }
    fn tick(&mut self, store: &MemoryStore, now_ms: u64) -> Report {
        let r = self.coord.tick(store, now_ms, &mut self.rng);
        for &(g, mode) in &r.modes {
            self.limiter.use_backstop(g, mode == Mode::Backstop);
        }
        r
    }
    fn answer(
        &mut self,
        store: &MemoryStore,
        now_ms: u64,
        call: &Call,
        body: Option<Vec<u8>>,
    ) -> Report {
        let r = self
            .coord
            .done(store, now_ms, &mut self.rng, call.id, body.as_deref());
        for &(g, mode) in &r.modes {
            self.limiter.use_backstop(g, mode == Mode::Backstop);
        }
        r
    }
}

fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// limit per hour, remaining, reset seconds
fn response(code: u64, limit: u64, remaining: u64, reset_s: u64) -> Vec<u8> {
    let mut lim = vec![0x08];
    push_varint(&mut lim, limit);
    lim.extend([0x10, 3]);
    let mut status = vec![0x08, code as u8, 0x12, lim.len() as u8];
    status.extend(lim);
    status.push(0x18);
    push_varint(&mut status, remaining);
    let mut d = vec![0x08];
    push_varint(&mut d, reset_s);
    status.push(0x22);
    status.push(d.len() as u8);
    status.extend(d);
    let mut out = vec![0x08, code as u8, 0x12, status.len() as u8];
    out.extend(status);
    out
}

fn hits_of(call: &Call) -> u64 {
    let m = &call.message;
    let i = m.len() - 1;
    let mut j = i;
    while j > 0 && m[j - 1] & 0x80 != 0 {
        j -= 1;
    }
    let mut v = 0;
    for (k, b) in m[j..].iter().enumerate() {
        v |= u64::from(b & 0x7f) << (7 * k);
    }
    v
}

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
                if worker.request(&store, now, k).0 == Verdict::Allow {
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
            if leader.request(&store, now, "tenant-a").0 == Verdict::Allow {
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

#[test]
fn the_probe_is_not_wasted_on_a_key_that_needs_no_tokens() {
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
    // The service is back. Keep steady demand on both keys for 60 s.
    let mut calls = 0;
    let mut probes_opened = 0;
    for _ in 0..600 {
        for _ in 0..5 {
            worker.request(&store, now + 1, "busy");
        }
        worker.request(&store, now + 1, "quiet");
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
    assert_eq!(worker.coord.mode(0), Mode::Service, "back on the service");
}

#[test]
fn a_probe_is_sent_even_when_only_stocked_keys_ask() {
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
    // The service is back. Keep steady demand on both keys for 60 s.
    let mut calls = 0;
    let mut probes_opened = 0;
    for _ in 0..600 {
        for _ in 0..5 {
            worker.request(&store, now + 1, "busy");
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
    assert_eq!(worker.coord.mode(0), Mode::Service, "back on the service");
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
        let (_, fp) = probe.request(&store, T0, &k);
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
        for i in 0..10_000u64 {
            let fp = round * 10_000 + i + 1_000_000;
            worker
                .coord
                .note(0, fp, true, 1, || vec![format!("x{fp}").into_bytes()]);
        }
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
        if worker.request(&store, now, "legit").0 == Verdict::Allow {
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

#[test]
fn demand_left_out_of_a_full_record_waits_for_the_next_report() {
    let json = cfg("", r#","instances":2"#, 1000, 64);
    let store = MemoryStore::default();
    let mut w = vm(&json, 2, &store);
    for i in 0..300u64 {
        w.coord.note(0, i + 1, false, 1, || vec![vec![b'v'; 1_000]]);
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
