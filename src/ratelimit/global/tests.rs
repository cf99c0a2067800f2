//! Global rules without Envoy: the protocol bytes, pools, shared records,
//! and the coordinator (lease, demand, calls, grants, breaker) over the
//! in-memory store, with the limiter spending what was granted.

use super::codec::{self, Health, HealthState, Lease, Want};
use super::pool::{Pool, PoolSpec};
use super::proto::{self, Code};
use super::{Call, Coordinator, Leading, Mode, Report, RuleId};
use crate::ratelimit::stage;
use crate::ratelimit::{LimitVerdict, Limiter};
use crate::request::fake::FakeRequest;
use crate::rng::SplitMix;
use crate::store::memory::MemoryStore;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

pub(super) const MS: u64 = 1_000_000;
pub(super) const T0: u64 = 1_700_000_000_000; // ms

fn config(extra: &str) -> String {
    format!(
        r#"{{"domain":"d","rate_limits":[{{"name":"g","key":[{{"header":"x-key"}}],
        "algorithm":"sliding_window","window":{{"limit":100,"period":"1h"}},"max_keys":64,
        "global":{{"cluster":"rls","domain":"fleet","instances":2{extra}}}}}]}}"#
    )
}

pub(super) struct Vm {
    pub(super) limiter: Limiter,
    pub(super) coord: Coordinator,
    rng: SplitMix,
}

pub(super) fn vm(json: &str, me: u64, store: &MemoryStore) -> Vm {
    vm_as(json, me, store, Leading::Allowed)
}

/// A VM whose global rules may lead or not (see [`Leading`]).
pub(super) fn vm_as(json: &str, me: u64, store: &MemoryStore, leading: Leading) -> Vm {
    let cfg = parse(json.as_bytes()).expect("valid");
    let limiter = Limiter::new(&cfg.rules, &cfg.common, (1, 2)).expect("limiter");
    limiter.create_tables(store).expect("tables");
    let coord = stage::test_coordinator(&cfg.common, &limiter, me, leading).expect("global rules");
    Vm {
        limiter,
        coord,
        rng: SplitMix(me),
    }
}

fn req(key: &str) -> FakeRequest {
    FakeRequest::new("GET", "/").with_header("x-key", key.as_bytes())
}

impl Vm {
    /// A request: decided by the limiter, its demand noted.
    pub(super) fn request(&mut self, store: &MemoryStore, now_ms: u64, key: &str) -> LimitVerdict {
        self.request_fp(store, now_ms, key).0
    }

    /// A request as the stage makes it (starved or not, its cost), and
    /// its key's hash.
    pub(super) fn request_fp(
        &mut self,
        store: &MemoryStore,
        now_ms: u64,
        key: &str,
    ) -> (LimitVerdict, u64) {
        let r = req(key);
        let eval = self.limiter.evaluate(store, now_ms * MS, &r);
        let mut fp = 0;
        for &(_, f) in &eval.global_keys {
            fp = f;
            let report = eval.reports.first();
            let starved = report.is_some_and(|r| r.wait_ns == super::STARVED_WAIT_NS);
            let cost = report.map_or(1, |r| r.cost);
            self.coord.note(RuleId(0), f, starved, cost, || {
                vec![key.as_bytes().to_vec()]
            });
        }
        (eval.verdict, fp)
    }

    pub(super) fn tick(&mut self, store: &MemoryStore, now_ms: u64) -> Report {
        let r = self.coord.tick(store, now_ms, &mut self.rng);
        for &(g, mode) in &r.modes {
            if let Some(rule) = self.coord.rule(g) {
                self.limiter.use_backstop(rule.rule, mode == Mode::Backstop);
            }
        }
        r
    }

    pub(super) fn answer(
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
            if let Some(rule) = self.coord.rule(g) {
                self.limiter.use_backstop(rule.rule, mode == Mode::Backstop);
            }
        }
        r
    }
}

/// An RLS response: overall code, and one status with the limit (100 per
/// hour), the remaining count and the time to the reset.
fn response(code: u64, remaining: u64, reset_s: u64) -> Vec<u8> {
    response_of(code, 100, remaining, reset_s)
}

/// An RLS response with a limit of `limit` per hour.
pub(super) fn response_of(code: u64, limit: u64, remaining: u64, reset_s: u64) -> Vec<u8> {
    let mut lim = vec![0x08];
    push_varint(&mut lim, limit);
    lim.extend([0x10, 3]);
    let mut status = vec![0x08, code as u8, 0x12, lim.len() as u8];
    status.extend(lim);
    status.extend([0x18]);
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

fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads the hits_addend of an encoded request.
pub(super) fn hits_of(call: &Call) -> u64 {
    let m = &call.message;
    let i = m.len() - 1;
    let mut j = i;
    while j > 0 && m[j - 1] & 0x80 != 0 {
        j -= 1;
    }
    assert_eq!(m[j - 1], 0x18, "hits_addend is the last field");
    let mut v = 0;
    for (k, b) in m[j..].iter().enumerate() {
        v |= u64::from(b & 0x7f) << (7 * k);
    }
    v
}

#[test]
fn requests_encode_domain_descriptor_and_hits() {
    let m = proto::request("fleet", &[("remote_address", b"10.0.0.1")], 300);
    let mut want = vec![0x0a, 5];
    want.extend(b"fleet");
    let entry = [&[0x0a, 14][..], b"remote_address", &[0x12, 8], b"10.0.0.1"].concat();
    want.extend([0x12, entry.len() as u8 + 2, 0x0a, entry.len() as u8]);
    want.extend(entry);
    want.extend([0x18, 0xac, 0x02]);
    assert_eq!(m, want);
    // Values that are not UTF-8 are made UTF-8.
    let m = proto::request("d", &[("k", &[0xff, b'a'])], 1);
    assert!(String::from_utf8_lossy(&m).contains("\u{fffd}a"));
}

#[test]
fn responses_decode_and_skip_unknown_fields_and_refuse_garbage() {
    let mut body = response(1, 42, 30);
    // Unknown fields of every wire type around it.
    body.extend([0x28, 0x05, 0x31, 1, 2, 3, 4, 5, 6, 7, 8, 0x3d, 1, 2, 3, 4]);
    let r = proto::response(&body).expect("decodes");
    assert_eq!(r.overall, Code::Ok);
    assert_eq!(r.status.remaining, Some(42));
    assert_eq!(r.status.reset_ms, Some(30_000));
    assert_eq!(r.status.limit, Some((100, 3_600_000)));
    assert_eq!(proto::response(&[]).map(|r| r.overall), Ok(Code::Unknown));
    for bad in [&[0x12, 0x09, 0x08][..], &[0xff; 11][..], &[0x0b][..]] {
        assert!(proto::response(bad).is_err(), "{bad:?}");
    }
    let mut rng = SplitMix(3);
    for _ in 0..2_000 {
        let n = rng.below(40) as usize;
        let junk: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
        let _ = proto::response(&junk); // never panics
    }
}

#[test]
fn pools_round_trip_spend_expire_and_merge_grants_of_one_window() {
    let p = Pool {
        tokens: 7,
        until_ms: T0 + 5_000,
        blocked: true,
    };
    assert_eq!(Pool::decode(p.encode()), p);
    let spec = PoolSpec {
        quota: 100,
        window_ns: 3_600_000 * MS,
        retry_ns: super::STARVED_WAIT_NS,
    };
    let open = Pool {
        blocked: false,
        ..p
    };
    match spec.decide(open.encode(), T0 * MS, 3) {
        crate::ratelimit::bucket::BucketAnswer::Allow {
            new_tat, remaining, ..
        } => {
            assert_eq!(remaining, 4);
            assert_eq!(Pool::decode(new_tat).tokens, 4);
        }
        o => panic!("{o:?}"),
    }
    // Past its window, a pool is empty; refused for a second.
    let o = spec.decide(open.encode(), (T0 + 5_000) * MS, 1);
    assert!(!o.allowed());
    // Blocked and empty: refused until the reset.
    let empty_blocked = Pool { tokens: 0, ..p };
    match spec.decide(empty_blocked.encode(), T0 * MS, 1) {
        crate::ratelimit::bucket::BucketAnswer::Deny { wait_ns, .. } => {
            assert_eq!(wait_ns, 5_000 * MS)
        }
        o => panic!("{o:?}"),
    }
    // Grants of the same window add up; a later window's replace them.
    let (g, dropped) = Pool::grant(Some(open), 10, T0 + 5_200, T0);
    assert_eq!((g.tokens, g.until_ms, dropped), (17, T0 + 5_000, 0));
    let (g, dropped) = Pool::grant(Some(open), 10, T0 + 3_605_000, T0);
    assert_eq!((g.tokens, dropped), (10, 7));
}

#[test]
fn shared_records_round_trip_and_corruption_is_detected() {
    let l = Lease {
        owner: 9,
        until_ms: T0,
        config: 7,
    };
    assert_eq!(Lease::decode(&l.encode()), Ok(l));
    assert_eq!(codec::decode_newest(&codec::encode_newest(5)), Ok(5));
    let mut n = codec::encode_newest(5);
    n[3] ^= 1;
    assert!(codec::decode_newest(&n).is_err());
    let h = Health {
        state: HealthState::HalfOpen,
        failures: 4,
        until_ms: T0,
    };
    assert_eq!(Health::decode(&h.encode()), Ok(h));
    let wants = [
        Want {
            rule: 0,
            fingerprint: 77,
            count: 3,
            values: vec![b"a".to_vec(), vec![]],
        },
        Want {
            rule: 1,
            fingerprint: 78,
            count: 1,
            values: vec![vec![b'x'; 5_000]],
        },
    ];
    let (bytes, left_out) = codec::encode_wants(wants.iter());
    assert!(left_out.is_empty());
    let back = codec::decode_wants(&bytes).expect("decodes");
    assert_eq!(back[0], wants[0]);
    assert_eq!(
        back[1].values[0].len(),
        codec::MAX_VALUE_LEN,
        "long values are cut"
    );
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x40;
        assert!(codec::decode_wants(&b).is_err());
    }
    assert!(Lease::decode(&[1, 2, 3]).is_err() && Health::decode(&[]).is_err());
}

#[test]
fn one_vm_leads_and_another_takes_over_when_its_lease_lapses() {
    let store = MemoryStore::default();
    let json = config("");
    let mut a = vm(&json, 1, &store);
    let mut b = vm(&json, 2, &store);
    assert_eq!(a.tick(&store, T0).leader, Some(true));
    assert_eq!(b.tick(&store, T0 + 10).leader, None);
    assert!(a.coord.is_leader() && !b.coord.is_leader());
    // a stops ticking (its worker restarted): b takes over after the lease.
    assert_eq!(b.tick(&store, T0 + super::LEASE_MS - 100).leader, None);
    assert_eq!(b.tick(&store, T0 + super::LEASE_MS + 1).leader, Some(true));
    assert_eq!(a.tick(&store, T0 + super::LEASE_MS + 2).leader, Some(false));
    // Between slow ticks (a fast tick), nothing but the demand report.
    assert_eq!(b.tick(&store, T0 + super::LEASE_MS + 3), Report::default());
    // A leader that resigns lets another lead at once.
    b.coord.resign(&store, T0 + super::LEASE_MS + 100);
    assert_eq!(
        a.tick(&store, T0 + super::LEASE_MS + 200).leader,
        Some(true)
    );
}

#[test]
fn a_follower_never_leads_yet_reports_demand_wakes_the_leader_and_follows_the_breaker() {
    let store = MemoryStore::default();
    let json = config(r#","breaker":{"failures":1,"cooldown":"1s"}"#);
    let mut f = vm_as(&json, 1, &store, Leading::Never);
    // The lease is free, for ever: a follower never takes it, nor listens.
    for t in [T0, T0 + 100, T0 + 5 * super::LEASE_MS] {
        let r = f.tick(&store, t);
        assert!(
            r.leader.is_none() && !r.listen && r.calls.is_empty(),
            "{r:?}"
        );
    }
    assert!(!f.coord.is_leader());
    // A starved key: its demand is reported at once, and the leader woken.
    let t = T0 + 5 * super::LEASE_MS;
    assert_ne!(f.request(&store, t + 10, "k"), LimitVerdict::Allow);
    assert!(f.tick(&store, t + 11).wake);
    // A VM that may lead takes the lease and calls for the follower's key.
    let mut l = vm(&json, 2, &store);
    let mut r = l.tick(&store, t + 20);
    assert_eq!(r.leader, Some(true));
    assert_eq!(r.calls.len(), 1, "{r:?}");
    // The call fails: the breaker opens, and the follower uses its backstop.
    let call = r.calls.remove(0);
    l.answer(&store, t + 30, &call, None);
    let r = f.tick(&store, t + 200);
    assert_eq!(r.modes, vec![(RuleId(0), Mode::Backstop)]);
}

#[test]
fn a_follower_built_late_does_not_hold_a_newer_configuration_back() {
    let store = MemoryStore::default();
    let old = config("");
    let new = format!("{old} ");
    let mut a = vm(&old, 1, &store);
    a.coord.announce(&store);
    assert_eq!(a.tick(&store, T0).leader, Some(true));
    let mut n = vm(&new, 2, &store);
    n.coord.announce(&store);
    // A follower of the old configuration starts after the new one did
    // (its worker's first stream of it came late): it says nothing, so
    // the new configuration takes the lease at once.
    let late = vm_as(&old, 3, &store, Leading::Never);
    late.coord.announce(&store);
    assert_eq!(n.tick(&store, T0 + 10).leader, Some(true));
    assert_eq!(a.tick(&store, T0 + 100).leader, Some(false));
}

#[test]
fn a_leader_rebuilt_after_a_crash_leads_but_does_not_hold_a_newer_configuration_back() {
    let store = MemoryStore::default();
    let old = config("");
    let new = format!("{old} ");
    let mut n = vm(&new, 2, &store);
    n.coord.announce(&store);
    // The old configuration's leading pipeline is built again (a panic
    // took it) after the new one started: it says nothing, so the new
    // configuration takes the lease at once.
    let mut again = vm_as(&old, 1, &store, Leading::Rebuilt);
    again.coord.announce(&store);
    assert_eq!(n.tick(&store, T0).leader, Some(true));
    assert_ne!(again.tick(&store, T0 + 10).leader, Some(true));
    // Alone, a rebuilt pipeline leads.
    let store = MemoryStore::default();
    let mut alone = vm_as(&old, 3, &store, Leading::Rebuilt);
    alone.coord.announce(&store);
    assert_eq!(alone.tick(&store, T0).leader, Some(true));
}

#[test]
fn a_replaced_configuration_gives_the_lease_to_the_new_one_and_leaves_it_free_for_it() {
    let store = MemoryStore::default();
    let old = config("");
    // Another text is another configuration (ECDS pushed a new one).
    let new = format!("{old} ");
    let mut a = vm(&old, 1, &store);
    let mut b = vm(&old, 2, &store);
    a.coord.announce(&store);
    b.coord.announce(&store);
    assert_eq!(a.tick(&store, T0).leader, Some(true));
    // The new configuration starts: its VM takes the lease at once, though
    // the old leader's has most of a second to run.
    let mut n = vm(&new, 3, &store);
    n.coord.announce(&store);
    assert_eq!(b.tick(&store, T0 + 5).leader, None);
    assert_eq!(n.tick(&store, T0 + 10).leader, Some(true));
    // Until its next tick the old leader still thinks it leads: woken for
    // a new key's demand, it reads the lease again and leaves the demand
    // to the new leader (its calls would die with it).
    assert_ne!(b.request(&store, T0 + 20, "new"), LimitVerdict::Allow);
    assert!(b.tick(&store, T0 + 21).wake);
    let mut r = Report::default();
    a.coord.hurry(&store, T0 + 22, &mut r);
    assert!(r.calls.is_empty(), "{r:?}");
    n.coord.hurry(&store, T0 + 23, &mut r);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    assert_eq!(a.tick(&store, T0 + 100).leader, Some(false));
    assert_eq!(a.tick(&store, T0 + 200).leader, None, "not taken back");
    // The new leader goes away (its worker's configuration is dropped):
    // the old configuration's VMs, alive only for their last requests,
    // leave the free lease to the new configuration's other VMs.
    n.coord.resign(&store, T0 + 250);
    assert_eq!(a.tick(&store, T0 + 300).leader, None);
    assert_eq!(b.tick(&store, T0 + 300).leader, None);
    let mut m = vm(&new, 4, &store);
    assert_eq!(m.tick(&store, T0 + 310).leader, Some(true));
    // No VM of the new configuration is left: an old one takes the lease
    // once it has been free for a whole lease, and keeps it.
    let lapsed = T0 + 310 + super::LEASE_MS;
    assert_eq!(a.tick(&store, lapsed + 1).leader, None);
    assert_eq!(a.tick(&store, lapsed + super::LEASE_MS).leader, Some(true));
    assert_eq!(b.tick(&store, lapsed + super::LEASE_MS + 10).leader, None);
    assert_eq!(a.tick(&store, lapsed + super::LEASE_MS + 100).leader, None);
    assert!(a.coord.is_leader());
}

#[test]
fn demand_becomes_a_call_and_the_grant_is_spent_exactly() {
    let store = MemoryStore::default();
    let json = config("");
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    leader.tick(&store, T0);
    // No tokens yet: refused for a second (the pool is being filled).
    assert_eq!(
        worker.request(&store, T0 + 1, "k"),
        LimitVerdict::Deny {
            rule: 0,
            wait_ns: super::STARVED_WAIT_NS
        }
    );
    for _ in 0..4 {
        worker.request(&store, T0 + 2, "k");
    }
    worker.tick(&store, T0 + 50);
    let r = leader.tick(&store, T0 + 100);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    let call = &r.calls[0];
    assert_eq!(
        (call.cluster.as_str(), call.method),
        ("rls", "ShouldRateLimit")
    );
    // 5 requests in 100 ms: 50/s, a second ahead, capped at half of this
    // Envoy's share of the limit (100 / 2 / 2).
    assert_eq!(hits_of(call), 25);
    assert!(call.message.windows(5).any(|w| w == b"fleet"));
    // Only one call at a time per key.
    worker.request(&store, T0 + 101, "k");
    worker.tick(&store, T0 + 150);
    assert!(leader.tick(&store, T0 + 200).calls.is_empty());
    let r = leader.answer(&store, T0 + 210, call, Some(response(1, 75, 3_000)));
    assert_eq!(r.granted, vec![(RuleId(0), 25)]);
    let admitted = (0..40)
        .filter(|_| worker.request(&store, T0 + 220, "k") == LimitVerdict::Allow)
        .count();
    assert_eq!(admitted, 25, "exactly what was granted");
    // Another key has nothing.
    assert_ne!(
        worker.request(&store, T0 + 220, "other"),
        LimitVerdict::Allow
    );
}

/// `response_of` as proto3 writes it when nothing is left: no
/// `limit_remaining` field (a zero is never written).
fn response_with_none_left(code: u64, limit: u64, reset_s: u64) -> Vec<u8> {
    let full = response_of(code, limit, 0, reset_s);
    let (head, status) = full.split_at(4);
    let at = status
        .windows(2)
        .position(|w| w == [0x18, 0])
        .expect("limit_remaining 0");
    let status = [&status[..at], &status[at + 2..]].concat();
    let mut out = vec![head[0], head[1], head[2], status.len() as u8];
    out.extend(status);
    out
}

#[test]
fn a_status_with_a_limit_and_no_remaining_count_has_none_left() {
    let r = proto::response(&response_with_none_left(1, 100, 30)).expect("decodes");
    assert_eq!(r.status.limit, Some((100, 3_600_000)));
    assert_eq!(r.status.remaining, Some(0));
    // Without a limit either, the remaining count is unknown.
    let bare = [0x08, 1, 0x12, 2, 0x08, 1];
    assert_eq!(proto::response(&bare).map(|r| r.status.remaining), Ok(None));
}

#[test]
fn after_an_answer_that_leaves_nothing_the_next_call_asks_for_the_dearest_request_only() {
    let store = MemoryStore::default();
    let json = config("");
    let mut l = vm(&json, 1, &store);
    l.tick(&store, T0);
    l.request(&store, T0 + 1, "k");
    let call = l.tick(&store, T0 + 100).calls.remove(0);
    assert_eq!(hits_of(&call), 10);
    let r = l.answer(
        &store,
        T0 + 110,
        &call,
        Some(response_with_none_left(1, 100, 3_000)),
    );
    assert_eq!(r.granted, vec![(RuleId(0), 10)]);
    for _ in 0..11 {
        l.request(&store, T0 + 120, "k");
    }
    let call = l.tick(&store, T0 + 200).calls.remove(0);
    assert_eq!(hits_of(&call), 1, "0 left: one request's cost, not a batch");
}

#[test]
fn over_limit_blocks_the_key_until_the_reset_after_a_single_hit_refusal() {
    let store = MemoryStore::default();
    let json = config("");
    let mut l = vm(&json, 1, &store);
    l.tick(&store, T0);
    l.request(&store, T0 + 1, "k");
    let call = l.tick(&store, T0 + 100).calls.remove(0);
    // One request in 100 ms: 10 a second, a second ahead.
    assert_eq!(hits_of(&call), 10);
    l.answer(&store, T0 + 110, &call, Some(response(2, 0, 20)));
    l.request(&store, T0 + 115, "k");
    let call = l.tick(&store, T0 + 200).calls.remove(0);
    assert_eq!(hits_of(&call), 1, "a refused batch is followed by one hit");
    l.answer(&store, T0 + 210, &call, Some(response(2, 0, 20)));
    match l.request(&store, T0 + 220, "k") {
        LimitVerdict::Deny { wait_ns, .. } => {
            assert!(wait_ns > 19_000 * MS && wait_ns <= 20_000 * MS)
        }
        v => panic!("{v:?}"),
    }
    // No call for it until the reset.
    l.request(&store, T0 + 230, "k");
    assert!(l.tick(&store, T0 + 300).calls.is_empty());
    l.request(&store, T0 + 20_300, "k");
    assert_eq!(l.tick(&store, T0 + 20_400).calls.len(), 1);
}

#[test]
fn failures_open_the_breaker_every_vm_uses_the_backstop_and_a_probe_closes_it() {
    let store = MemoryStore::default();
    let json = config(r#","breaker":{"failures":2,"cooldown":"1s"}"#);
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    leader.tick(&store, T0);
    let mut now = T0;
    for _ in 0..2 {
        worker.request(&store, now + 1, "k");
        worker.tick(&store, now + 2);
        now += 100;
        let call = leader.tick(&store, now).calls.remove(0);
        leader.answer(&store, now + 5, &call, None);
    }
    let r = worker.tick(&store, now + 10);
    assert_eq!(r.modes, vec![(RuleId(0), Mode::Backstop)]);
    // The backstop: 100 per hour x 1/2 = 50 for this Envoy.
    let admitted = (0..80)
        .filter(|_| worker.request(&store, now + 20, "k") == LimitVerdict::Allow)
        .count();
    assert_eq!(admitted, 50);
    // No calls while open; after the cool-down (+ up to 20%), one probe.
    assert!(leader.tick(&store, now + 100).calls.is_empty());
    let probe = leader.tick(&store, now + 1_300).calls;
    assert_eq!(probe.len(), 1);
    assert!(
        leader.tick(&store, now + 1_400).calls.is_empty(),
        "one probe"
    );
    leader.answer(&store, now + 1_450, &probe[0], Some(response(1, 10, 100)));
    assert_eq!(
        worker.tick(&store, now + 1_500).modes,
        vec![(RuleId(0), Mode::Service)]
    );
}

#[test]
fn failure_mode_deny_spends_what_is_held_then_refuses() {
    let store = MemoryStore::default();
    let json = config(r#","failure_mode_deny":true,"breaker":{"failures":1}"#);
    let mut l = vm(&json, 1, &store);
    l.tick(&store, T0);
    l.request(&store, T0 + 1, "k");
    let call = l.tick(&store, T0 + 100).calls.remove(0);
    assert_eq!(hits_of(&call), 10);
    l.answer(&store, T0 + 110, &call, Some(response(1, 50, 100)));
    // Spend down to the refill mark, so that the next tick calls again.
    for _ in 0..5 {
        assert_eq!(l.request(&store, T0 + 150, "k"), LimitVerdict::Allow);
    }
    let call = l.tick(&store, T0 + 200).calls.remove(0);
    l.answer(&store, T0 + 210, &call, None);
    assert_eq!(
        l.tick(&store, T0 + 300).modes,
        vec![(RuleId(0), Mode::Deny)]
    );
    // The five tokens still held are spent; then nothing more.
    let admitted = (0..10)
        .filter(|_| l.request(&store, T0 + 310, "k") == LimitVerdict::Allow)
        .count();
    assert_eq!(admitted, 5);
}

#[test]
fn property_two_workers_never_admit_more_than_was_granted() {
    let mut rng = SplitMix(17);
    let mut total = 0;
    for round in 0..40 {
        let store = MemoryStore::default();
        let json = config(r#","max_batch":7"#);
        let mut vms: Vec<Vm> = (0..3).map(|i| vm(&json, 10 + i, &store)).collect();
        let mut now = T0;
        let mut admitted = 0u64;
        let mut granted = 0u64;
        let mut outstanding: Vec<(usize, Call)> = Vec::new();
        for _ in 0..400 {
            now += rng.below(30);
            let i = rng.below(3) as usize;
            match rng.below(10) {
                0..=5 => {
                    let key = ["a", "b"][rng.below(2) as usize];
                    // Admissions from a pool (a backstop's are not paid).
                    let pool = vms[i].coord.mode(RuleId(0)) != Mode::Backstop;
                    if vms[i].request(&store, now, key) == LimitVerdict::Allow && pool {
                        admitted += 1;
                    }
                }
                6 | 7 => {
                    let r = vms[i].tick(&store, now);
                    outstanding.extend(r.calls.into_iter().map(|c| (i, c)));
                }
                _ if !outstanding.is_empty() => {
                    let (owner, call) =
                        outstanding.remove(rng.below(outstanding.len() as u64) as usize);
                    let body = match rng.below(4) {
                        0 => None,
                        1 => Some(response(2, 0, 60)),
                        _ => Some(response(1, 50, 60)),
                    };
                    let r = vms[owner].answer(&store, now, &call, body);
                    granted += r.granted.iter().map(|g| g.1).sum::<u64>();
                }
                _ => {}
            }
        }
        assert!(admitted <= granted, "round {round}: {admitted} > {granted}");
        total += admitted;
    }
    assert!(total > 200, "the rounds admitted from pools: {total}");
}

#[test]
fn bad_global_sections_are_refused_with_the_field_named() {
    let cases = [
        (
            r#"{"domain":"fleet","instances":2}"#,
            "rate_limits[0].global.cluster",
        ),
        (
            r#"{"cluster":"rls","protocol":"grpc","instances":2}"#,
            "rate_limits[0].global.protocol",
        ),
        (
            r#"{"cluster":"rls","instances":0}"#,
            "rate_limits[0].global.instances",
        ),
        (r#"{"cluster":"rls"}"#, "rate_limits[0].global.instances"),
        (
            r#"{"cluster":"rls","share":1.5}"#,
            "rate_limits[0].global.share",
        ),
        (
            r#"{"cluster":"rls","instances":2,"share":0.5}"#,
            "rate_limits[0].global.share",
        ),
        (
            r#"{"cluster":"rls","instances":2,"descriptor_keys":["a","b"]}"#,
            "rate_limits[0].global.descriptor_keys",
        ),
        (
            r#"{"cluster":"rls","instances":2,"timeout":"0s"}"#,
            "rate_limits[0].global.timeout",
        ),
        (
            r#"{"cluster":"rls","instances":2,"max_batch":0}"#,
            "rate_limits[0].global.max_batch",
        ),
        (
            r#"{"cluster":"rls","instances":2,"breaker":{"failures":0}}"#,
            "rate_limits[0].global.breaker.failures",
        ),
        (
            r#"{"cluster":"rls","instances":2,"bogus":1}"#,
            "rate_limits[0].global",
        ),
    ];
    for (global, field) in cases {
        let json = format!(
            r#"{{"rate_limits":[{{"name":"g","key":[{{"header":"x-key"}}],
            "bucket":{{"rate":10,"period":"1s"}},"global":{global}}}]}}"#
        );
        let e = parse(json.as_bytes())
            .err()
            .unwrap_or_else(|| panic!("{global} accepted"));
        assert!(e.field.starts_with(field), "{global}: {e}");
    }
    let shaped = r#"{"rate_limits":[{"name":"g","key":[{"header":"x-key"}],
        "bucket":{"rate":10,"period":"1s"},"on_limit":"delay","max_delay":"1s",
        "global":{"cluster":"rls","instances":2}}]}"#;
    let e = parse(shaped.as_bytes()).expect_err("refused");
    assert_eq!(e.field, "rate_limits[0].on_limit");
    // The backstop is the limit times the share, at least one.
    let ok = r#"{"rate_limits":[{"name":"g","key":[{"header":"x-key"}],
        "bucket":{"rate":10,"period":"1s","burst":3},"global":{"cluster":"outbound|8081||rls.default.svc.cluster.local","instances":4}}]}"#;
    let cfg = parse(ok.as_bytes()).expect("valid");
    let g = cfg.rules[0].global.as_deref().expect("global");
    assert_eq!(
        g.backstop,
        crate::ratelimit::algorithm::Algorithm::Bucket(crate::ratelimit::config::BucketSpec {
            rate: 2,
            period_ns: 1_000_000_000,
            burst: 1
        })
    );
    assert_eq!(g.service.descriptor_keys, vec!["x-key".to_string()]);
}

#[test]
fn a_starved_key_asks_for_a_fast_tick_that_only_reports_its_demand() {
    let store = MemoryStore::default();
    let json = config("");
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    leader.tick(&store, T0);
    worker.tick(&store, T0 + 1);
    assert!(!worker.coord.wants_fast_tick());
    worker
        .coord
        .note(RuleId(0), 42, true, 1, || vec![b"k".to_vec()]);
    assert!(worker.coord.wants_fast_tick());
    // Fast ticks report at most every 10 ms (each rewrites the record).
    assert_eq!(worker.tick(&store, T0 + 5), Report::default());
    assert!(worker.coord.wants_fast_tick());
    // The report of a starved key wakes the leader.
    let woke = Report {
        wake: true,
        ..Report::default()
    };
    assert_eq!(worker.tick(&store, T0 + 11), woke);
    assert!(!worker.coord.wants_fast_tick());
    let r = leader.tick(&store, T0 + 100);
    assert_eq!(r.calls.len(), 1, "the leader asks for the starved key");
}

#[test]
fn a_woken_leader_calls_at_once_for_new_keys_only() {
    let store = MemoryStore::default();
    let json = config("");
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    leader.tick(&store, T0);
    worker.tick(&store, T0 + 1);
    // Three requests of a new key, refused for want of tokens.
    for _ in 0..3 {
        assert_ne!(worker.request(&store, T0 + 20, "new"), LimitVerdict::Allow);
    }
    assert!(worker.tick(&store, T0 + 21).wake);
    // Woken (on its own thread, between its ticks): the call goes now,
    // sized from the demand so far over one tick (3 in 100 ms: 30 a
    // second, a second's lead), not left to the tick 100 ms later.
    let mut r = Report::default();
    leader.coord.hurry(&store, T0 + 22, &mut r);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    assert_eq!(
        hits_of(&r.calls[0]),
        25,
        "30 capped at half the share of 100"
    );
    // The answer fills the pool: the key's requests pass.
    let call = r.calls.remove(0);
    leader.answer(&store, T0 + 25, &call, Some(response(1, 75, 3_000)));
    assert_eq!(worker.request(&store, T0 + 26, "new"), LimitVerdict::Allow);
    // A second wake-up calls for nothing: the key was called for (its
    // refills are the tick's), and so was every other.
    let mut again = Report::default();
    leader.coord.hurry(&store, T0 + 30, &mut again);
    assert!(again.calls.is_empty(), "{again:?}");
    // A VM that is not the leader calls for nothing when woken.
    assert_ne!(
        worker.request(&store, T0 + 40, "other"),
        LimitVerdict::Allow
    );
    worker.tick(&store, T0 + 41);
    let mut not = Report::default();
    worker.coord.hurry(&store, T0 + 42, &mut not);
    assert!(not.calls.is_empty(), "{not:?}");
    // The leader's own starved key is called for on its own fast report,
    // with no wake-up.
    assert_ne!(leader.request(&store, T0 + 50, "mine"), LimitVerdict::Allow);
    let own = leader.tick(&store, T0 + 51);
    assert!(!own.wake, "{own:?}");
    assert!(
        own.calls
            .iter()
            .any(|c| c.message.windows(4).any(|w| w == b"mine")),
        "{own:?}"
    );
}

#[test]
fn tokens_left_unspent_at_the_window_end_are_counted_as_dropped() {
    let store = MemoryStore::default();
    let mut l = vm(&config(""), 1, &store);
    l.tick(&store, T0);
    l.request(&store, T0 + 1, "k");
    let call = l.tick(&store, T0 + 100).calls.remove(0);
    assert_eq!(hits_of(&call), 10);
    // Good for 2 more seconds.
    l.answer(&store, T0 + 110, &call, Some(response(1, 90, 2)));
    for _ in 0..3 {
        assert_eq!(l.request(&store, T0 + 120, "k"), LimitVerdict::Allow);
    }
    // The window ends with 7 unspent: the next grant counts them dropped,
    // and they are not spendable any more.
    assert_ne!(l.request(&store, T0 + 2_200, "k"), LimitVerdict::Allow);
    let call = l.tick(&store, T0 + 2_300).calls.remove(0);
    let r = l.answer(&store, T0 + 2_310, &call, Some(response(1, 80, 60)));
    assert_eq!(r.dropped, vec![(RuleId(0), 7)]);
}

/// A key whose demand stops long before its window ends is forgotten 30 s
/// on, its pool still live: what it left unspent is counted as dropped at
/// the window's end, once (not again when the key comes back).
#[test]
fn tokens_of_a_key_forgotten_before_its_window_ends_are_counted_at_its_end() {
    let store = MemoryStore::default();
    let mut l = vm(&config(""), 1, &store);
    l.tick(&store, T0);
    l.request(&store, T0 + 1, "k");
    let call = l.tick(&store, T0 + 100).calls.remove(0);
    // Good for a minute.
    l.answer(&store, T0 + 110, &call, Some(response(1, 90, 60)));
    for _ in 0..3 {
        assert_eq!(l.request(&store, T0 + 120, "k"), LimitVerdict::Allow);
    }
    // Calls its demand made go on being answered in the same window.
    let (mut dropped, mut granted) = (Vec::new(), 10);
    let mut now = T0 + 200;
    while now < T0 + 90_000 {
        let r = l.tick(&store, now);
        dropped.extend(r.dropped.into_iter().map(|d| (now, d)));
        for call in r.calls {
            granted += hits_of(&call);
            let left_s = (T0 + 60_110).saturating_sub(now + 10) / 1000;
            l.answer(&store, now + 10, &call, Some(response(1, 80, left_s)));
        }
        now += 100;
    }
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    let (at, d) = dropped[0];
    assert_eq!(d, (RuleId(0), granted - 3));
    assert!(
        (T0 + 59_000..T0 + 61_500).contains(&at),
        "counted {} ms after the start",
        at - T0
    );
    // The key comes back: its next grant counts nothing more.
    assert_ne!(l.request(&store, now, "k"), LimitVerdict::Allow);
    let call = l.tick(&store, now + 100).calls.remove(0);
    let r = l.answer(&store, now + 110, &call, Some(response(1, 80, 60)));
    assert_eq!(r.dropped, vec![]);
}

#[test]
fn a_half_open_probe_goes_to_a_key_that_needs_tokens() {
    let store = MemoryStore::default();
    let json = config(r#","breaker":{"failures":1,"cooldown":"1s"}"#);
    let mut l = vm(&json, 1, &store);
    l.tick(&store, T0);
    // Key a is well stocked: 25 tokens for 5 requests a tick.
    for _ in 0..5 {
        l.request(&store, T0 + 1, "a");
    }
    let call = l.tick(&store, T0 + 100).calls.remove(0);
    l.answer(&store, T0 + 110, &call, Some(response(1, 75, 3_000)));
    // Key b's first call fails: the breaker opens.
    l.request(&store, T0 + 120, "b");
    let calls = l.tick(&store, T0 + 200).calls;
    assert_eq!(calls.len(), 1);
    l.answer(&store, T0 + 210, &calls[0], None);
    // Demand on both, a's the higher; after the cool-down the one probe
    // goes to b (a has tokens enough: no call for it).
    let mut now = T0 + 300;
    while now < T0 + 1_600 {
        for _ in 0..2 {
            l.request(&store, now, "a");
        }
        l.request(&store, now, "b");
        let calls = l.tick(&store, now).calls;
        if !calls.is_empty() {
            assert_eq!(calls.len(), 1, "one probe");
            assert!(now >= T0 + 1_210, "not before the cool-down");
            // The descriptor entry's value is "b".
            assert!(calls[0].message.windows(3).any(|w| w == [0x12, 1, b'b']));
            return;
        }
        now += 100;
    }
    panic!("no probe");
}

#[test]
fn two_wake_ups_in_one_millisecond_each_bring_their_keys() {
    // From a review: a second wake-up in the same millisecond was dropped,
    // and with it the second worker's new key until the leader's tick.
    let store = MemoryStore::default();
    let json = config("");
    let mut leader = vm(&json, 1, &store);
    let mut one = vm(&json, 2, &store);
    let mut two = vm(&json, 3, &store);
    leader.tick(&store, T0);
    one.tick(&store, T0 + 1);
    two.tick(&store, T0 + 1);
    assert_ne!(one.request(&store, T0 + 20, "a"), LimitVerdict::Allow);
    assert!(one.tick(&store, T0 + 21).wake);
    let mut r = Report::default();
    leader.coord.hurry(&store, T0 + 22, &mut r);
    assert_ne!(two.request(&store, T0 + 22, "b"), LimitVerdict::Allow);
    assert!(two.tick(&store, T0 + 22).wake);
    leader.coord.hurry(&store, T0 + 22, &mut r);
    assert_eq!(r.calls.len(), 2, "{r:?}");
}

#[test]
fn the_leader_listens_again_on_every_slow_tick_and_only_the_leader() {
    // A registration another VM took over while the lease changed hands
    // (the last to register is woken) comes back within a tick.
    let store = MemoryStore::default();
    let json = config("");
    let mut leader = vm(&json, 1, &store);
    let mut worker = vm(&json, 2, &store);
    for t in [T0, T0 + 100, T0 + 200] {
        assert!(leader.tick(&store, t).listen, "{t}");
        assert!(!worker.tick(&store, t + 1).listen, "{t}");
    }
    // A fast tick (a report only) does not.
    worker.request(&store, T0 + 220, "k");
    assert_ne!(leader.request(&store, T0 + 220, "j"), LimitVerdict::Allow);
    assert!(!leader.tick(&store, T0 + 231).listen);
}
