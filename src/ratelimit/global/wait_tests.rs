//! `global.wait_for_tokens` through the whole pipeline, two VMs over one
//! store: a request of a key with no tokens yet waits for its first batch
//! (decided on again on every fast tick) instead of being refused, up to
//! the wait; a client gone while it waits leaves nothing behind.
use super::tests::response_of;
use crate::pipeline::telemetry::{MetricId, Sink};
use crate::pipeline::{Effect, Env, Outcome, Pipeline, Signal, StreamId, Verdict};
use crate::request::fake::FakeRequest;
use crate::store::memory::MemoryStore;
use crate::time::Instant;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const MS: u64 = 1_000_000;
const T0: u64 = 1_700_000_000_000 * MS;

struct Nothing;
impl Sink for Nothing {
    fn add(&mut self, _m: MetricId, _by: i64) {}
    fn add_now(&mut self, _m: MetricId, _by: i64) {}
    fn record(&mut self, _m: MetricId, _value: u64) {}
}

struct Vm {
    p: Pipeline,
}

impl Vm {
    fn new(json: &str, worker: u32, store: &MemoryStore) -> Self {
        let config = parse(json.as_bytes()).expect("valid");
        let mut p = crate::wiring::pipeline(
            &config,
            (1, 2),
            worker,
            Instant::from_ns(T0),
            u64::from(worker),
        )
        .expect("builds");
        p.start(&mut env(store, T0, &mut Nothing)).expect("starts");
        Vm { p }
    }
}

fn env<'a>(store: &'a MemoryStore, now: u64, sink: &'a mut Nothing) -> Env<'a> {
    let clock: &'a dyn Fn() -> Instant = Box::leak(Box::new(move || Instant::from_ns(now)));
    Env { store, clock, sink }
}

fn req(key: &str) -> FakeRequest {
    FakeRequest::new("GET", "/").with_header("x-key", key.as_bytes())
}

/// The queue a worker's outcome wakes (the leader's).
fn woken_on(out: &Outcome) -> String {
    out.signals
        .iter()
        .find_map(|x| match x {
            Signal::Wake(q) => Some(q.clone()),
            Signal::Listen(_) => None,
        })
        .unwrap_or_default()
}

fn agains(out: &Outcome) -> Vec<u32> {
    out.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Again { stream } => Some(stream.0),
            _ => None,
        })
        .collect()
}

const JSON: &str = r#"{"domain":"d","rate_limits":[{"name":"g","key":[{"header":"x-key"}],
    "algorithm":"sliding_window","window":{"limit":100,"period":"1h"},"max_keys":64,
    "global":{"cluster":"rls","domain":"fleet","instances":1,"wait_for_tokens":"50ms"}}]}"#;

#[test]
fn a_new_keys_request_waits_for_its_first_tokens_then_goes_on() {
    let store = MemoryStore::default();
    let mut leader = Vm::new(JSON, 1, &store);
    let mut worker = Vm::new(JSON, 2, &store);
    let s = &mut Nothing;
    let out = leader.p.tick(&mut env(&store, T0, s));
    // It took the lease: it listens for wake-ups.
    assert!(
        out.signals.iter().any(|x| matches!(x, Signal::Listen(_))),
        "{out:?}"
    );
    worker.p.tick(&mut env(&store, T0 + MS, s));
    // A new key: no tokens yet; the request waits (paused), it is not refused.
    let one = StreamId(1);
    let (v, _) = worker
        .p
        .request(&mut env(&store, T0 + 20 * MS, s), one, &req("k"));
    assert_eq!(v, Verdict::Pause);
    // The worker's fast tick reports the key, wakes the leader, and has
    // the request decided on again: still no tokens, still waiting.
    let out = worker.p.tick(&mut env(&store, T0 + 21 * MS, s));
    assert!(
        out.signals.iter().any(|x| matches!(x, Signal::Wake(_))),
        "{out:?}"
    );
    assert_eq!(agains(&out), vec![1]);
    let (v, _) = worker
        .p
        .again(&mut env(&store, T0 + 21 * MS, s), one, &req("k"));
    assert_eq!(v, Verdict::Pause);
    // Woken, the leader calls; the answer fills the pool.
    let out = leader
        .p
        .woken(&mut env(&store, T0 + 22 * MS, s), &woken_on(&out));
    assert_eq!(out.calls.len(), 1, "{out:?}");
    let body = response_of(1, 100, 90, 3_000);
    leader.p.call_done(
        &mut env(&store, T0 + 25 * MS, s),
        out.calls[0].id,
        Some(&body),
    );
    // On the next tick the request goes on.
    let out = worker.p.tick(&mut env(&store, T0 + 26 * MS, s));
    assert_eq!(agains(&out), vec![1]);
    let (v, _) = worker
        .p
        .again(&mut env(&store, T0 + 26 * MS, s), one, &req("k"));
    assert_eq!(v, Verdict::Continue);
    // Nothing waits any more: no request is decided on again.
    let out = worker.p.tick(&mut env(&store, T0 + 27 * MS, s));
    assert!(agains(&out).is_empty(), "{out:?}");
}

#[test]
fn a_request_waits_no_longer_than_wait_for_tokens_and_a_gone_client_leaves_nothing() {
    let store = MemoryStore::default();
    let mut leader = Vm::new(JSON, 1, &store);
    let mut worker = Vm::new(JSON, 2, &store);
    let s = &mut Nothing;
    leader.p.tick(&mut env(&store, T0, s));
    worker.p.tick(&mut env(&store, T0 + MS, s));
    let two = StreamId(2);
    let three = StreamId(3);
    let at = T0 + 20 * MS;
    let (v, _) = worker.p.request(&mut env(&store, at, s), two, &req("k2"));
    assert_eq!(v, Verdict::Pause);
    let (v, _) = worker.p.request(&mut env(&store, at, s), three, &req("k3"));
    assert_eq!(v, Verdict::Pause);
    // Stream 3's client goes away: it is no longer decided on again.
    worker.p.end(&mut env(&store, at + MS, s), three);
    let out = worker.p.tick(&mut env(&store, at + 2 * MS, s));
    assert_eq!(agains(&out), vec![2]);
    // The service never answers: 49 ms on it still waits, at 50 ms it is
    // refused (429), as it would have been at once without the wait.
    let (v, _) = worker
        .p
        .again(&mut env(&store, at + 49 * MS, s), two, &req("k2"));
    assert_eq!(v, Verdict::Pause);
    let (v, _) = worker
        .p
        .again(&mut env(&store, at + 50 * MS, s), two, &req("k2"));
    assert!(
        matches!(v, Verdict::Reply(ref r) if r.status == 429),
        "{v:?}"
    );
    let out = worker.p.tick(&mut env(&store, at + 51 * MS, s));
    assert!(agains(&out).is_empty(), "{out:?}");
}

#[test]
fn without_wait_for_tokens_a_new_keys_request_is_refused_at_once() {
    let store = MemoryStore::default();
    let json = JSON.replace(r#","wait_for_tokens":"50ms""#, "");
    let mut worker = Vm::new(&json, 2, &store);
    let s = &mut Nothing;
    worker.p.tick(&mut env(&store, T0, s));
    let (v, _) = worker
        .p
        .request(&mut env(&store, T0 + 20 * MS, s), StreamId(1), &req("k"));
    assert!(
        matches!(v, Verdict::Reply(ref r) if r.status == 429),
        "{v:?}"
    );
}

#[test]
fn bad_wait_for_tokens_values_are_refused_naming_the_field() {
    for (json, field) in [
        (
            JSON.replace(r#""50ms""#, r#""2s""#),
            "rate_limits[0].global.wait_for_tokens",
        ),
        (
            JSON.replace(r#""50ms""#, r#""soon""#),
            "rate_limits[0].global.wait_for_tokens",
        ),
        (
            JSON.replace(
                r#""rate_limits":[{"#,
                r#""rate_limits":[{"name":"pace","bucket":{"rate":10,"period":"1s"},"on_limit":"delay","max_delay":"1s"},{"#,
            ),
            "rate_limits[1].global.wait_for_tokens",
        ),
    ] {
        let e = parse(json.as_bytes()).expect_err(&json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}

#[test]
fn a_request_admitted_after_waiting_goes_on_with_its_deadline_reduced() {
    let json = JSON.replace(
        r#"{"domain":"d","#,
        r#"{"domain":"d","deadlines":{"headers":["x-envoy-expected-rq-timeout-ms"]},"#,
    );
    let store = MemoryStore::default();
    let mut leader = Vm::new(&json, 1, &store);
    let mut worker = Vm::new(&json, 2, &store);
    let s = &mut Nothing;
    leader.p.tick(&mut env(&store, T0, s));
    worker.p.tick(&mut env(&store, T0 + MS, s));
    let r = req("k").with_header("x-envoy-expected-rq-timeout-ms", b"1000");
    let one = StreamId(1);
    let (v, _) = worker.p.request(&mut env(&store, T0 + 20 * MS, s), one, &r);
    assert_eq!(v, Verdict::Pause);
    let out = worker.p.tick(&mut env(&store, T0 + 21 * MS, s));
    let out = leader
        .p
        .woken(&mut env(&store, T0 + 22 * MS, s), &woken_on(&out));
    let body = response_of(1, 100, 90, 3_000);
    leader.p.call_done(
        &mut env(&store, T0 + 25 * MS, s),
        out.calls[0].id,
        Some(&body),
    );
    // Admitted 6 ms after it arrived: it goes on with its deadline set
    // to what is left, as a request resumed from a queue does.
    let (v, out) = worker.p.again(&mut env(&store, T0 + 26 * MS, s), one, &r);
    assert_eq!(v, Verdict::Continue);
    assert!(out.effects.is_empty(), "{:?}", out.effects);
    assert_eq!(
        out.request_headers,
        vec![("x-envoy-expected-rq-timeout-ms".into(), "994".into())]
    );
}
