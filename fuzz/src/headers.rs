//! Target `headers`: request header values sluice parses (cost,
//! deadlines, retry markers, priority classes, key parts of any bytes),
//! through the real request path: a pipeline with every mechanism on.

use crate::harness::{Host, Input, MemStore, Phase, Req};
use sluice::pipeline::{StreamId, Verdict};
use sluice::reply::{Detail, Rejection};

/// Every mechanism, each reading request headers where it can.
pub const EVERYTHING: &str = r#"{
 "deadlines":{"headers":["grpc-timeout","x-deadline-ms"],"min_remaining":"5ms"},
 "circuit_breakers":[{"name":"b","key":{"header":"x-dep"},"min_requests":2,
  "error_rate":0.5,"window":"1s","open":{"base":"30ms","max":"60ms"},"max_keys":100}],
 "retry_budgets":[{"name":"rb","min_per_second":1}],
 "concurrency_limits":[{"name":"c","key":[{"header":"x-k"}],"max":2,"max_wait":"30ms","queue":2,
  "max_keys":8}],
 "rate_limits":[
  {"name":"r","key":[{"header":"x-k"},"client_address","path","method","authority"],
   "bucket":{"rate":20,"period":"1s","burst":6},"cost":{"header":"x-cost","max":5},"max_keys":8},
  {"name":"pace","match":{"path_prefix":"/p"},"bucket":{"rate":200,"period":"1s","burst":1},
   "on_limit":"delay","max_delay":"20ms","max_delayed":3,"max_keys":8},
  {"name":"w","key":[{"header":"x-w"}],"algorithm":"sliding_window",
   "window":{"limit":5,"period":"1s"},"cost":{"header":"x-cost","max":3},"max_keys":8},
  {"name":"g","key":[{"header":"x-g"}],"algorithm":"sliding_window",
   "window":{"limit":100,"period":"1h"},"global":{"cluster":"rls","domain":"fleet","instances":1},"max_keys":8}],
 "shedders":[
  {"name":"q","match":{"path_prefix":"/q"},"concurrency":{"max":2,"queue":3,"max_wait":"40ms"},
   "priority":{"header":"x-prio"}},
  {"name":"a","match":{"path_prefix":"/a"},"concurrency":{"max":"auto","adaptive":{}}},
  {"name":"lat","match":{"path_prefix":"/l"},"target":"5ms","interval":"20ms"}]
}"#;

/// [`EVERYTHING`], parsed once.
pub fn everything() -> &'static sluice::wiring::Config {
    static CONFIG: std::sync::OnceLock<sluice::wiring::Config> = std::sync::OnceLock::new();
    CONFIG.get_or_init(|| sluice::wiring::parse(EVERYTHING.as_bytes()).expect("EVERYTHING loads"))
}

/// The headers a request of the target may carry.
const NAMES: [&str; 16] = [
    "grpc-timeout",
    "x-deadline-ms",
    "x-envoy-expected-rq-timeout-ms",
    "x-cost",
    "x-k",
    "x-w",
    "x-g",
    "x-dep",
    "x-prio",
    "x-envoy-attempt-count",
    "grpc-previous-rpc-attempts",
    "content-type",
    ":path",
    ":method",
    ":authority",
    "x-other",
];

const PATHS: [&str; 6] = ["/", "/p", "/q/x", "/a", "/l", "/p/../q"];

/// A request read off the input: a path, then headers of any bytes.
pub fn request(input: &mut Input<'_>) -> Req {
    let path = PATHS[input.byte() as usize % PATHS.len()];
    let mut req = Req::new("GET", path);
    for _ in 0..input.byte() % 6 {
        let name = NAMES[input.byte() as usize % NAMES.len()];
        let value = input.piece();
        if name == "x-other" {
            req.address = value.to_vec();
        } else {
            req = req.with(name, value);
        }
    }
    req
}

/// Operations on the pipeline read off the input: arrivals with fuzzed
/// headers, time, ticks, responses, aborts, RLS answers. Every refusal's
/// `Retry-After` is whole seconds, at least 1, and not sooner than the
/// wait it announces; whatever happened, nothing is held at the end.
pub fn headers(data: &[u8]) {
    let store = MemStore::default();
    let mut host = Host::new(everything(), &store, 1);
    let mut input = Input(data);
    let mut first = None;
    let mut ops = 0;
    while !input.is_empty() && ops < 64 {
        ops += 1;
        match input.byte() % 6 {
            0 | 1 => {
                let req = request(&mut input);
                first.get_or_insert_with(|| req.clone());
                host.arrive(req);
            }
            2 => host.advance_ms(u64::from(input.byte()) * 3),
            3 => host.tick(),
            4 => {
                let open = (0..host.streams.len()).find(|&i| host.streams[i].1 != Phase::Ended);
                let status = [200, 503, 429, 500][input.byte() as usize % 4];
                if let Some(id) = open {
                    host.finish(StreamId(id as u32), status, Vec::new());
                }
            }
            _ => {
                let body = input.piece();
                host.answer_call(Some(body));
            }
        }
    }
    host.advance_ms(1000);
    host.tick();
    host.wind_down();
    for r in &host.refusals {
        check_rejection(r);
    }
    assert_eq!(
        host.pipeline.streams_kept(),
        0,
        "streams kept after their end"
    );
    if let Some(req) = first {
        retry_after_is_when_it_passes(&req, BUCKET);
        retry_after_is_when_it_passes(&req, WINDOW);
    }
}

/// A refusal's status, and its `Retry-After` against its wait.
pub fn check_rejection(r: &Rejection) {
    assert!((400..600).contains(&r.status), "status {}", r.status);
    let retry_after = r.headers.iter().find(|(h, _)| *h == "retry-after");
    let Some((_, v)) = retry_after else { return };
    let secs: u64 = v.parse().unwrap_or_else(|_| panic!("Retry-After {v:?}"));
    assert!(secs >= 1, "Retry-After {secs}");
    match &r.detail {
        Detail::RateLimited {
            wait_ms,
            retry_after_s,
            ..
        }
        | Detail::CircuitOpen {
            wait_ms,
            retry_after_s,
            ..
        } => {
            assert_eq!(secs, *retry_after_s, "header and body disagree");
            assert!(
                secs * 1000 >= *wait_ms,
                "Retry-After {secs}s before {wait_ms}ms"
            );
        }
        _ => {}
    }
}

const BUCKET: &str = r#"{"response":{"retry_after_jitter":"0s"},"rate_limits":[{"name":"r",
  "key":[{"header":"x-k"},"client_address","path"],"bucket":{"rate":3,"period":"1s","burst":4},
  "cost":{"header":"x-cost","max":4},"max_keys":8}]}"#;
const WINDOW: &str = r#"{"response":{"retry_after_jitter":"0s"},"rate_limits":[{"name":"w",
  "key":[{"header":"x-k"},"client_address"],"algorithm":"sliding_window",
  "window":{"limit":4,"period":"1s"},"cost":{"header":"x-cost","max":4},"max_keys":8}]}"#;

/// The same request, alone, until refused: once the wait it was told has
/// passed, it passes (the wait is never before the moment it could).
fn retry_after_is_when_it_passes(req: &Req, json: &str) {
    let config = sluice::wiring::parse(json.as_bytes()).expect("loads");
    let store = MemStore::default();
    let mut host = Host::new(&config, &store, 1);
    for _ in 0..6 {
        let (id, v) = host.arrive(req.clone());
        host.finish(id, 200, Vec::new());
        let Verdict::Reply(r) = v else {
            host.advance_ms(7);
            continue;
        };
        check_rejection(&r);
        let Detail::RateLimited { wait_ms, .. } = r.detail else {
            return;
        };
        host.advance_ms(wait_ms);
        let (id, v) = host.arrive(req.clone());
        host.finish(id, 200, Vec::new());
        assert_eq!(
            v,
            Verdict::Continue,
            "refused again after the {wait_ms} ms told"
        );
        return;
    }
}
