//! Shedders in a chain, through the whole pipeline: a stream that waits at
//! one shedder passes the later ones when it leaves the queue, with its
//! deadline header reduced by its waits exactly once, and nothing leaks.

use super::telemetry::Recorder;
use super::*;
use crate::request::fake::FakeRequest;
use crate::store::memory::MemoryStore;
use crate::time::Instant;
use crate::wiring::parse;
use std::cell::Cell;
use std::rc::Rc;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const T0: u64 = 1_700_000_000_000_000_000;
const MS: u64 = 1_000_000;

pub struct H {
    pub p: Pipeline,
    rec: Recorder,
    store: MemoryStore,
    pub now: Rc<Cell<u64>>,
    pub streams: Vec<StreamId>,
    pub reqs: Vec<FakeRequest>,
    pub log: Vec<String>,
    pub phase: Vec<u8>,
}

impl H {
    pub fn new(json: &str) -> H {
        let config = parse(json.as_bytes()).expect("valid");
        let p =
            crate::wiring::pipeline(&config, (1, 2), 7, Instant::from_ns(T0), 1).expect("builds");
        let rec = Recorder::of(&p.metrics);
        let mut h = H {
            p,
            rec,
            store: MemoryStore::default(),
            now: Rc::new(Cell::new(T0)),
            streams: vec![],
            reqs: vec![],
            log: vec![],
            phase: vec![],
        };
        let now = h.now.clone();
        let clock = move || Instant::from_ns(now.get());
        let mut env = Env {
            store: &h.store,
            clock: &clock,
            sink: &mut h.rec,
        };
        h.p.start(&mut env).unwrap();
        h
    }
    pub fn at(&mut self, ms: u64) {
        self.now.set(T0 + ms * MS);
    }
    fn with<R>(
        &mut self,
        f: impl FnOnce(
            &mut Pipeline,
            &mut Env<'_>,
            &mut Vec<StreamId>,
            &Vec<FakeRequest>,
        ) -> (R, Outcome),
    ) -> R {
        let now = self.now.clone();
        let clock = move || Instant::from_ns(now.get());
        let (r, out) = {
            let mut env = Env {
                store: &self.store,
                clock: &clock,
                sink: &mut self.rec,
            };
            f(&mut self.p, &mut env, &mut self.streams, &self.reqs)
        };
        self.effects(out);
        r
    }
    fn effects(&mut self, out: Outcome) {
        for e in out.effects {
            match e {
                Effect::Resume { stream } => {
                    let id = stream.0 as usize;
                    let (v, headers) = self.with(|p, env, ss, rq| {
                        let (v, out) = p.resume(env, ss[id], &rq[id]);
                        ((v, out.request_headers.clone()), out)
                    });
                    // Set before it goes on, as the host does.
                    self.log
                        .push(format!("resume {stream} -> {:?} {:?}", v, headers));
                    for (k, v) in headers {
                        self.reqs[id].headers.insert(k, v.into_bytes());
                    }
                    assert_eq!(
                        self.phase[stream.0 as usize], 0,
                        "resume of non-paused {stream}"
                    );
                    self.phase[stream.0 as usize] = match v {
                        Verdict::Continue => 1,
                        Verdict::Pause => 0,
                        Verdict::Reply(_) => 2,
                    };
                }
                Effect::Again { stream } => {
                    let v = self.with(|p, env, ss, rq| {
                        let id = stream.0 as usize;
                        p.again(env, ss[id], &rq[id])
                    });
                    self.log.push(format!("again {stream} -> {:?}", v));
                }
                Effect::Reply { stream, rejection } => {
                    self.log
                        .push(format!("reply {stream} {}", rejection.status));
                    assert_eq!(
                        self.phase[stream.0 as usize], 0,
                        "reply to non-paused {stream}"
                    );
                    self.phase[stream.0 as usize] = 2;
                }
            }
        }
    }
    pub fn arrive(&mut self, req: FakeRequest) -> Verdict {
        let id = self.streams.len();
        self.streams.push(StreamId(id as u32));
        self.reqs.push(req);
        self.phase.push(9);
        let v = self.with(|p, env, ss, rq| p.request(env, ss[id], &rq[id]));
        self.log.push(format!("arrive {id} -> {:?}", v));
        self.phase[id] = match v {
            Verdict::Continue => 1,
            Verdict::Pause => 0,
            Verdict::Reply(_) => 2,
        };
        v
    }
    pub fn end(&mut self, id: usize) {
        self.phase[id] = 3;
        self.with(|p, env, ss, _| ((), p.end(env, ss[id])));
    }
    pub fn tick(&mut self) {
        self.with(|p, env, _, _| ((), p.tick(env)));
    }
    pub fn gauges(&self) -> Vec<(String, i64)> {
        let mut v: Vec<_> = self
            .rec
            .sums
            .iter()
            .filter(|(_, v)| **v != 0)
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        v.sort();
        v
    }
}

fn req(path: &str) -> FakeRequest {
    FakeRequest::new("GET", path)
}

fn grpc_timeout(h: &H, id: usize) -> String {
    String::from_utf8_lossy(&h.reqs[id].headers["grpc-timeout"]).into_owned()
}

const TWO: &str = r#"{"deadlines":{},
 "shedders":[{"name":"a","match":{"path_prefix":"/x"},"concurrency":{"max":1,"queue":5,"max_wait":"5s"}},
  {"name":"b","concurrency":{"max":1,"queue":5,"max_wait":"5s"}}]}"#;

#[test]
fn a_stream_queued_at_two_shedders_goes_on_with_both_waits_taken_off() {
    let mut h = H::new(TWO);
    h.arrive(req("/x")); // 0 holds a and b
    h.arrive(req("/x").with_header("grpc-timeout", b"1000m")); // 1 queued at a
    h.arrive(req("/y")); // 2 queued at b
    h.at(300);
    h.end(0); // 1 leaves a's queue, queues at b
    assert_eq!(h.phase[1], 0, "{:?}", h.log);
    h.at(500);
    h.end(2); // 1 goes on, 500 ms after it came
    assert_eq!(h.phase[1], 1, "{:?}", h.log);
    assert_eq!(grpc_timeout(&h, 1), "500m", "{:?}", h.log);
}

const BH: &str = r#"{"deadlines":{},
 "concurrency_limits":[{"name":"c","match":{"path_prefix":"/x/b"},"key":[{"header":"x-k"}],"max":1,"max_wait":"1s"}],
 "shedders":[{"name":"a","match":{"path_prefix":"/x"},"concurrency":{"max":1,"queue":5,"max_wait":"5s"}},
  {"name":"b","concurrency":{"max":5,"queue":5,"max_wait":"5s"}}]}"#;

#[test]
fn a_wait_in_an_earlier_stage_is_taken_off_once() {
    let mut h = H::new(BH);
    h.arrive(req("/x/b").with_header("x-k", b"1")); // 0 holds c, a, b
    h.arrive(
        req("/x/b")
            .with_header("x-k", b"1")
            .with_header("grpc-timeout", b"1000m"),
    ); // 1 waits at c
    h.arrive(req("/x")); // 2 queued at a
    h.at(100);
    h.end(0); // 1 leaves c with 900m, queues at a
    h.at(300);
    h.end(2); // 1 passes b and goes on
    assert_eq!(h.phase[1], 1, "{:?}", h.log);
    assert_eq!(grpc_timeout(&h, 1), "700m", "{:?}", h.log);
}

/// `min_remaining`'s promise at its edge: a request with that much left
/// or less is refused, one with any more goes on, a part of a millisecond
/// (`u`, `n`) counting as Envoy's router counts it, rounded up.
#[test]
fn a_request_with_more_than_min_remaining_left_goes_on_to_the_microsecond() {
    for (min, cases) in [
        (
            "0s",
            &[("1n", true), ("999u", true), ("0u", false), ("0m", false)][..],
        ),
        (
            "10ms",
            &[
                ("10m", false),
                ("10000u", false),
                ("10000000n", false),
                ("10001u", true),
                ("10000001n", true),
                ("11m", true),
                ("9999u", false),
            ][..],
        ),
    ] {
        for &(timeout, goes_on) in cases {
            let mut h = H::new(&format!(r#"{{"deadlines":{{"min_remaining":"{min}"}}}}"#));
            let v = h.arrive(req("/").with_header("grpc-timeout", timeout.as_bytes()));
            assert_eq!(
                matches!(v, Verdict::Continue),
                goes_on,
                "min_remaining {min}, grpc-timeout {timeout}: {v:?}"
            );
        }
    }
}

const THREE: &str = r#"{"deadlines":{"min_remaining":"5ms"},
 "shedders":[{"name":"a","match":{"path_prefix":"/x"},"concurrency":{"max":2,"queue":2,"max_wait":"40ms"},"priority":{"header":"x-prio"}},
  {"name":"b","match":{"path_prefix":"/x/y"},"concurrency":{"max":1,"queue":2,"max_wait":"30ms"},"priority":{"header":"x-prio"}},
  {"name":"c","concurrency":{"max":3,"queue":3,"max_wait":"50ms"},"priority":{"header":"x-prio"}}]}"#;

fn life(seed: u64) {
    let mut rng = crate::rng::SplitMix(seed);
    let mut h = H::new(THREE);
    let mut t = 0;
    for _ in 0..400 {
        t += rng.below(8);
        h.at(t);
        match rng.below(10) {
            0..=3 => {
                let path = ["/x/y/1", "/x/z", "/w"][rng.below(3) as usize];
                let prio = ["sheddable", "default", "critical"][rng.below(3) as usize];
                let mut r = req(path).with_header("x-prio", prio.as_bytes());
                if rng.below(2) == 0 {
                    r = r.with_header(
                        "grpc-timeout",
                        format!("{}m", 10 + rng.below(80)).as_bytes(),
                    );
                }
                h.arrive(r);
            }
            4..=6 => {
                let open: Vec<usize> = (0..h.phase.len()).filter(|&i| h.phase[i] != 3).collect();
                if !open.is_empty() {
                    let id = open[rng.below(open.len() as u64) as usize];
                    h.end(id);
                }
            }
            _ => h.tick(),
        }
        let inflight = |pre: &str| {
            (0..h.phase.len())
                .filter(|&i| {
                    h.phase[i] == 1 && h.reqs[i].headers[":path"].starts_with(pre.as_bytes())
                })
                .count()
        };
        assert!(inflight("/x") <= 2, "seed {seed}: a over its max");
        assert!(inflight("/x/y") <= 1, "seed {seed}: b over its max");
        assert!(inflight("/") <= 3, "seed {seed}: c over its max");
    }
    for id in 0..h.phase.len() {
        if h.phase[id] != 3 {
            h.end(id);
        }
    }
    h.at(t + 1000);
    h.tick();
    let left: Vec<_> = h
        .gauges()
        .into_iter()
        .filter(|(k, _)| k.contains("in_flight") || k.contains("queued"))
        .collect();
    assert!(left.is_empty(), "seed {seed}: {left:?}");
}

#[test]
fn three_chained_shedders_never_exceed_a_limit_nor_leak() {
    for seed in 0..crate::test_seeds(300) {
        life(seed);
    }
}
