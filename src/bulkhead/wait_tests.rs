//! Waiting for a place, through the whole pipeline on two simulated
//! workers sharing a store: first come first served per key, places handed
//! over on release, found on the tick when another worker frees them, no
//! wait past `max_wait` or the deadline, a bounded line, nothing left by a
//! client gone while waiting, later stages run only once a waiter has its
//! places, and bad settings named by field.

use crate::pipeline::telemetry::Recorder;
use crate::pipeline::{Effect, Env, Outcome, Pipeline, StreamId, Verdict};
use crate::request::fake::FakeRequest;
use crate::store::memory::MemoryStore;
use crate::time::Instant;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const T0: u64 = 1_700_000_000_000_000_000;
const MS: u64 = 1_000_000;

/// One place per tenant, a 100 ms wait, lines of 2; a rate limit after it
/// (3 requests of tenant `r`, none refilled soon), deadlines read.
const CFG: &str = r#"{"concurrency_limits":[{"name":"one","key":[{"header":"x-t"}],"max":1,
    "max_keys":1000,"max_wait":"100ms","queue":2}],
  "rate_limits":[{"name":"r","match":{"path_prefix":"/rl"},
    "bucket":{"rate":1,"period":"1h","burst":3}}],
  "deadlines":{}}"#;

/// Workers (pipelines) over one store, at a manual time.
struct World {
    store: MemoryStore,
    now: u64,
    workers: Vec<(Pipeline, Recorder)>,
}

impl World {
    fn new(json: &str, n: usize) -> Self {
        let config = parse(json.as_bytes()).expect("valid");
        let mut w = World {
            store: MemoryStore::default(),
            now: T0,
            workers: Vec::new(),
        };
        for i in 0..n {
            let p =
                crate::wiring::pipeline(&config, (1, 2), i as u32, Instant::from_ns(T0), i as u64)
                    .expect("builds");
            let rec = Recorder::of(&p.metrics);
            w.workers.push((p, rec));
            w.call(i, |p, env| {
                (p.start(env).expect("starts"), Outcome::default())
            });
        }
        w
    }

    fn call<R>(
        &mut self,
        w: usize,
        f: impl FnOnce(&mut Pipeline, &mut Env<'_>) -> (R, Outcome),
    ) -> (R, Outcome) {
        let now = self.now;
        let clock = move || Instant::from_ns(now);
        let (p, sums) = &mut self.workers[w];
        let mut env = Env {
            store: &self.store,
            clock: &clock,
            sink: sums,
        };
        f(p, &mut env)
    }

    fn request(&mut self, w: usize, st: StreamId, req: &FakeRequest) -> (Verdict, Outcome) {
        self.call(w, |p, env| p.request(env, st, req))
    }

    fn end(&mut self, w: usize, st: StreamId) -> Outcome {
        self.call(w, |p, env| ((), p.end(env, st))).1
    }

    fn tick(&mut self, w: usize) -> Outcome {
        self.call(w, |p, env| ((), p.tick(env))).1
    }

    fn sum(&self, name: &str) -> i64 {
        self.workers
            .iter()
            .map(|(_, s)| s.sums.get(name).copied().unwrap_or(0))
            .sum()
    }

    /// Requests in flight in the shared slots.
    fn in_flight(&self) -> u32 {
        let map = self.store.map.borrow();
        map.iter()
            .filter(|(k, _)| k.starts_with("bh"))
            .filter_map(|(_, (v, _))| super::codec::decode(v).ok())
            .sum()
    }
}

fn metric(name: &str, result: Option<&str>) -> String {
    match result {
        Some(r) => format!("domain=.=default;.;limit=.=one;.;result=.={r};.;{name}"),
        None => format!("domain=.=default;.;limit=.=one;.;{name}"),
    }
}

fn tenant(t: &str) -> FakeRequest {
    FakeRequest::new("GET", "/x").with_header("x-t", t.as_bytes())
}

fn streams(n: u32) -> Vec<StreamId> {
    (0..n).map(StreamId).collect()
}

/// The streams an outcome resumes, and those it answers.
fn fates(out: &Outcome) -> (Vec<u32>, Vec<(u32, u32)>) {
    let mut on = Vec::new();
    let mut answered = Vec::new();
    for e in &out.effects {
        match e {
            Effect::Resume { stream, .. } => on.push(stream.0),
            Effect::Reply { stream, rejection } => answered.push((stream.0, rejection.status)),
            Effect::Again { stream } => panic!("a bulkhead never decides again ({stream})"),
        }
    }
    (on, answered)
}

#[test]
fn waiters_of_a_key_go_in_arrival_order_as_places_are_handed_over() {
    let mut w = World::new(CFG, 1);
    let s = streams(4);
    let r = tenant("a");
    assert_eq!(w.request(0, s[0], &r).0, Verdict::Continue);
    assert_eq!(w.request(0, s[1], &r).0, Verdict::Pause);
    assert_eq!(w.request(0, s[2], &r).0, Verdict::Pause);
    // The line of two is full: refused at once.
    let (v, _) = w.request(0, s[3], &r);
    assert!(
        matches!(v, Verdict::Reply(ref x) if x.status == 429),
        "{v:?}"
    );
    // Another tenant does not wait behind them.
    let other = StreamId(9);
    assert_eq!(w.request(0, other, &tenant("b")).0, Verdict::Continue);
    w.end(0, other);
    assert_eq!(w.sum(&metric("sluice_bulkhead_queued", None)), 2);
    let out = w.end(0, s[0]);
    assert_eq!(fates(&out), (vec![1], vec![]));
    // Handed over: the shared count never dropped.
    assert_eq!(w.in_flight(), 1);
    let out = w.end(0, s[1]);
    assert_eq!(fates(&out), (vec![2], vec![]));
    let out = w.end(0, s[2]);
    assert_eq!(fates(&out), (vec![], vec![]));
    assert_eq!(w.in_flight(), 0);
    assert_eq!(w.sum(&metric("sluice_bulkhead_queued", None)), 0);
    assert_eq!(w.sum(&metric("sluice_bulkhead_in_flight", None)), 0);
    let counted = |r| w.sum(&metric("sluice_bulkhead_requests_total", Some(r)));
    assert_eq!(
        (
            counted("admitted"),
            counted("queued_admitted"),
            counted("limited")
        ),
        (2, 2, 1)
    );
}

#[test]
fn a_place_freed_on_another_worker_is_found_on_the_fast_tick() {
    let mut w = World::new(CFG, 2);
    let s = streams(2);
    let r = tenant("a");
    assert_eq!(w.request(0, s[0], &r).0, Verdict::Continue);
    let (v, out) = w.request(1, s[1], &r);
    assert_eq!(v, Verdict::Pause);
    assert_eq!(out.tick, Some(crate::pipeline::FAST_TICK));
    w.now += 5 * MS;
    assert_eq!(fates(&w.tick(1)), (vec![], vec![]));
    w.end(0, s[0]);
    assert_eq!(w.in_flight(), 0);
    // An arrival on the waiter's worker before the tick waits behind it.
    let late = StreamId(2);
    assert_eq!(w.request(1, late, &r).0, Verdict::Pause);
    let out = w.tick(1);
    assert_eq!(fates(&out), (vec![1], vec![]));
    assert_eq!(w.in_flight(), 1);
    let out = w.end(1, s[1]);
    assert_eq!(fates(&out), (vec![2], vec![]));
    // Nobody waits any more: back to the slow tick.
    assert_eq!(out.tick, Some(crate::pipeline::SLOW_TICK));
    w.end(1, late);
    assert_eq!(w.in_flight(), 0);
}

#[test]
fn nobody_waits_past_max_wait_or_past_their_deadline() {
    let mut w = World::new(CFG, 1);
    let s = streams(3);
    assert_eq!(w.request(0, s[0], &tenant("a")).0, Verdict::Continue);
    assert_eq!(w.request(0, s[1], &tenant("a")).0, Verdict::Pause);
    let short = tenant("a").with_header("grpc-timeout", b"30m");
    assert_eq!(w.request(0, s[2], &short).0, Verdict::Pause);
    w.now += 29 * MS;
    assert_eq!(fates(&w.tick(0)), (vec![], vec![]));
    w.now += MS;
    // The deadline first: answered as a missed deadline.
    assert_eq!(fates(&w.tick(0)), (vec![], vec![(2, 504)]));
    w.now += 69 * MS;
    assert_eq!(fates(&w.tick(0)), (vec![], vec![]));
    w.now += MS;
    let out = w.tick(0);
    assert_eq!(fates(&out), (vec![], vec![(1, 429)]));
    let Some(Effect::Reply { rejection, .. }) = out.effects.first() else {
        panic!("a reply")
    };
    assert!(rejection
        .headers
        .iter()
        .any(|h| h.0 == "x-sluice-bulkhead" && h.1 == "full"));
    // They leave; the one in flight still holds its place.
    w.end(0, s[1]);
    w.end(0, s[2]);
    assert_eq!(w.in_flight(), 1);
    assert_eq!(
        w.sum(&metric("sluice_bulkhead_requests_total", Some("timed_out"))),
        2
    );
    assert_eq!(w.sum("domain=.=default;.;sluice_deadline_refused_total"), 1);
    assert_eq!(w.sum(&metric("sluice_bulkhead_queued", None)), 0);
    w.end(0, s[0]);
    assert_eq!(w.in_flight(), 0);
}

#[test]
fn a_waiter_goes_upstream_with_its_deadline_reduced_by_the_wait() {
    let mut w = World::new(CFG, 1);
    let s = streams(2);
    assert_eq!(w.request(0, s[0], &tenant("a")).0, Verdict::Continue);
    let r = tenant("a").with_header("grpc-timeout", b"2S");
    assert_eq!(w.request(0, s[1], &r).0, Verdict::Pause);
    w.now += 40 * MS;
    let out = w.end(0, s[0]);
    assert_eq!(out.effects, vec![Effect::Resume { stream: s[1] }]);
    // It goes on upstream with the header reduced by its wait.
    let (v, out) = w.call(0, |p, env| p.resume(env, s[1], &r));
    assert_eq!(v, Verdict::Continue);
    assert_eq!(
        out.request_headers,
        vec![("grpc-timeout".to_string(), "1960m".to_string())]
    );
}

#[test]
fn a_client_gone_while_waiting_leaves_nothing_behind() {
    let mut w = World::new(CFG, 1);
    let s = streams(3);
    let r = tenant("a");
    assert_eq!(w.request(0, s[0], &r).0, Verdict::Continue);
    assert_eq!(w.request(0, s[1], &r).0, Verdict::Pause);
    assert_eq!(w.request(0, s[2], &r).0, Verdict::Pause);
    // The first waiter leaves: the second is next.
    assert_eq!(fates(&w.end(0, s[1])), (vec![], vec![]));
    assert_eq!(w.in_flight(), 1);
    assert_eq!(fates(&w.end(0, s[0])), (vec![2], vec![]));
    // The second leaves after it got the place (before its stream went on).
    assert_eq!(fates(&w.end(0, s[2])), (vec![], vec![]));
    assert_eq!(w.in_flight(), 0);
    assert_eq!(w.sum(&metric("sluice_bulkhead_queued", None)), 0);
    assert_eq!(w.sum(&metric("sluice_bulkhead_in_flight", None)), 0);
    // The whole limit is there again.
    let again = StreamId(5);
    assert_eq!(w.request(0, again, &r).0, Verdict::Continue);
}

#[test]
fn a_waiter_spends_nothing_later_until_it_goes_on_and_a_later_refusal_frees_its_place_at_once() {
    let mut w = World::new(CFG, 1);
    let s = streams(6);
    let r = FakeRequest::new("GET", "/rl").with_header("x-t", b"r");
    assert_eq!(w.request(0, s[0], &r).0, Verdict::Continue);
    // Two wait; neither has spent a token yet.
    assert_eq!(w.request(0, s[1], &r).0, Verdict::Pause);
    assert_eq!(w.request(0, s[2], &r).0, Verdict::Pause);
    let tokens = |w: &World| {
        w.sum("domain=.=default;.;rule=.=r;.;result=.=allowed;.;sluice_rl_requests_total")
    };
    assert_eq!(tokens(&w), 1);
    // The place goes to stream 1: the rate limit now sees it.
    let out = w.end(0, s[0]);
    assert_eq!(out.effects.len(), 1);
    let Some(Effect::Resume {
        stream: StreamId(1),
        ..
    }) = out.effects.first()
    else {
        panic!("goes on: {:?}", out.effects)
    };
    let (v, _) = w.call(0, |p, env| p.resume(env, s[1], &r));
    assert_eq!(v, Verdict::Continue);
    assert_eq!(tokens(&w), 2);
    let out = w.end(0, s[1]);
    let (v, _) = w.call(0, |p, env| p.resume(env, s[2], &r));
    assert_eq!((fates(&out).0, v), (vec![2], Verdict::Continue));
    // The bucket (3) is empty now: the next waiter is refused by the rate
    // limit when it goes on, and its place goes back at once.
    assert_eq!(w.request(0, s[3], &r).0, Verdict::Pause);
    assert_eq!(fates(&w.end(0, s[2])), (vec![3], vec![]));
    let (v, out) = w.call(0, |p, env| p.resume(env, s[3], &r));
    assert!(
        matches!(v, Verdict::Reply(ref x) if x.status == 429),
        "{v:?}"
    );
    assert!(out.effects.is_empty());
    assert_eq!(w.in_flight(), 0);
    assert_eq!(w.end(0, s[3]), Outcome::default());
    assert_eq!(w.in_flight(), 0);
    assert_eq!(w.sum(&metric("sluice_bulkhead_in_flight", None)), 0);
}

#[test]
fn limits_without_max_wait_refuse_at_once_as_before() {
    let json = CFG.replace(r#","max_wait":"100ms","queue":2"#, "");
    let mut w = World::new(&json, 1);
    let s = streams(2);
    assert_eq!(w.request(0, s[0], &tenant("a")).0, Verdict::Continue);
    let (v, out) = w.request(0, s[1], &tenant("a"));
    assert!(
        matches!(v, Verdict::Reply(ref x) if x.status == 429),
        "{v:?}"
    );
    assert_eq!(out.tick, None);
}

#[test]
fn bad_wait_settings_are_refused_naming_the_field() {
    let limit =
        |extra: &str| format!(r#"{{"concurrency_limits":[{{"name":"l","max":2{extra}}}]}}"#);
    for (extra, field) in [
        (r#","max_wait":"-1s""#, "concurrency_limits[0].max_wait"),
        (r#","max_wait":"1x""#, "concurrency_limits[0].max_wait"),
        (r#","max_wait":"0ms""#, "concurrency_limits[0].max_wait"),
        (r#","max_wait":"2h""#, "concurrency_limits[0].max_wait"),
        (r#","max_wait":5"#, "concurrency_limits[0].max_wait"),
        (
            r#","max_wait":"1s","queue":0"#,
            "concurrency_limits[0].queue",
        ),
        (
            r#","max_wait":"1s","queue":-3"#,
            "concurrency_limits[0].queue",
        ),
        (
            r#","max_wait":"1s","queue":100001"#,
            "concurrency_limits[0].queue",
        ),
        (r#","queue":5"#, "concurrency_limits[0].queue"),
    ] {
        let json = limit(extra);
        let e = parse(json.as_bytes()).expect_err(&json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
    let ok = parse(limit(r#","max_wait":"250ms""#).as_bytes()).expect("valid");
    let wait = ok.concurrency_limits[0].wait.expect("waits");
    assert_eq!((wait.max_wait_ms, wait.queue), (250, 8));
}
