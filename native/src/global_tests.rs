//! Global rules through the hooks, over the fake callbacks: the main
//! thread's pipeline leads and calls the service over a stream Envoy's
//! configuration starts, its answer fills the pool a worker spends, a
//! worker without traffic is ticked by the main thread, and a starved key
//! wakes the leader.

use crate::abi::{self, Buffer, Header};
use crate::calls::frame;
use crate::config_hooks::*;
use crate::fake_envoy::{
    FakeStream, Started, CONFIG_COMMITS, RESET_ON_START, STARTED, START_FAILS,
};
use crate::hooks::*;
use crate::ticker::{EVENT_TICK, EVENT_WAKE};
use std::ffi::c_void;
use std::time::Duration;

fn config(domain: &str) -> *const c_void {
    let json = format!(
        r#"{{"domain":"{domain}","rate_limits":[{{"name":"g","key":[{{"header":"x-tenant"}}],
        "algorithm":"sliding_window","window":{{"limit":1000,"period":"1h"}},
        "global":{{"cluster":"rls","domain":"fleet","instances":1,"breaker":{{"failures":2}}}}}}]}}"#
    );
    envoy_dynamic_module_on_http_filter_config_new(
        std::ptr::null_mut(),
        Buffer::of(b"sluice"),
        Buffer::of(json.as_bytes()),
    )
}

/// One request of `tenant` on worker 0: its request status.
fn request(cfg: *const c_void, tenant: &str) -> u32 {
    let mut s = Box::new(FakeStream {
        request: vec![("x-tenant".into(), tenant.into())],
        ..FakeStream::default()
    });
    let envoy = s.ptr();
    let f = envoy_dynamic_module_on_http_filter_new(cfg, envoy);
    let status = envoy_dynamic_module_on_http_filter_request_headers(envoy, f, true);
    envoy_dynamic_module_on_http_filter_stream_complete(envoy, f);
    envoy_dynamic_module_on_http_filter_destroy(f);
    status
}

fn started() -> Vec<Started> {
    STARTED.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

fn header<'a>(s: &'a Started, name: &str) -> Option<&'a str> {
    s.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// An OK `RateLimitResponse`: 1,000 an hour, `remaining` left, reset in 3000 s.
fn ok_answer(remaining: u8) -> Vec<u8> {
    let status = [
        0x08, 1, 0x12, 5, 0x08, 0xe8, 0x07, 0x10, 3, 0x18, remaining, 0x22, 3, 0x08, 0xb8, 0x17,
    ];
    let mut out = vec![0x08, 1, 0x12, status.len() as u8];
    out.extend(status);
    out
}

/// Envoy hands back a call's answer: headers, body, trailers, the end.
fn answer(cfg: *const c_void, stream: u64, body: &[u8], grpc_status: &str) {
    let envoy = std::ptr::null_mut();
    let h = [
        Header::of(":status", "200"),
        Header::of("content-type", "application/grpc"),
    ];
    envoy_dynamic_module_on_http_filter_config_http_stream_headers(
        envoy,
        cfg,
        stream,
        h.as_ptr(),
        2,
        false,
    );
    let framed = frame(body);
    let (a, b) = framed.split_at(3);
    let chunks = [Buffer::of(a), Buffer::of(b)];
    envoy_dynamic_module_on_http_filter_config_http_stream_data(
        envoy,
        cfg,
        stream,
        chunks.as_ptr(),
        2,
        false,
    );
    let t = [Header::of("grpc-status", grpc_status)];
    envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
        envoy,
        cfg,
        stream,
        t.as_ptr(),
        1,
    );
    envoy_dynamic_module_on_http_filter_config_http_stream_complete(envoy, cfg, stream);
}

fn tick(cfg: *const c_void, event: u64) {
    envoy_dynamic_module_on_http_filter_config_scheduled(std::ptr::null_mut(), cfg, event);
}

#[test]
fn the_main_thread_leads_calls_the_service_and_its_tokens_admit_on_a_worker() {
    let cfg = config("unit-global");
    // A new key: refused while its first tokens are fetched.
    assert_eq!(request(cfg, "a"), abi::STOP_ITERATION);
    // The worker has no more traffic: the main thread ticks it (its demand
    // reported), then leads and calls for the key.
    std::thread::sleep(Duration::from_millis(15));
    tick(cfg, EVENT_TICK);
    let calls = started();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let c = &calls[0];
    assert_eq!(c.cluster, "rls");
    assert_eq!(header(c, ":method"), Some("POST"));
    assert_eq!(
        header(c, ":path"),
        Some("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
    );
    assert_eq!(header(c, "content-type"), Some("application/grpc"));
    assert_eq!(header(c, "te"), Some("trailers"));
    assert_eq!(header(c, ":authority"), Some("rls"));
    assert!(c.end_stream && c.timeout_ms == 200, "{c:?}");
    assert_eq!(c.body[0], 0, "not compressed");
    let len = u32::from_be_bytes([c.body[1], c.body[2], c.body[3], c.body[4]]) as usize;
    assert_eq!(len, c.body.len() - 5);
    assert!(c.body.windows(5).any(|w| w == b"fleet"), "the RLS domain");
    // The answer fills the key's pool: its requests pass on the worker.
    answer(cfg, c.id, &ok_answer(100), "0");
    assert_eq!(request(cfg, "a"), abi::CONTINUE);
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

#[test]
fn a_failed_call_brings_no_tokens_and_a_starved_key_wakes_the_leader() {
    let cfg = config("unit-global-wake");
    tick(cfg, EVENT_TICK); // the main thread leads, and listens
    assert!(started().is_empty());
    assert_eq!(request(cfg, "b"), abi::STOP_ITERATION);
    std::thread::sleep(Duration::from_millis(15));
    let before = CONFIG_COMMITS.lock().map(|c| c.len()).unwrap_or(0);
    // The idle worker's tick reports the key and wakes the leader, whose
    // own tick is not due yet: the call goes on the wake-up.
    tick(cfg, EVENT_TICK);
    assert!(started().is_empty(), "not on the leader's tick");
    let woken = CONFIG_COMMITS.lock().unwrap()[before..]
        .iter()
        .any(|&(_, e)| e == EVENT_WAKE);
    assert!(woken, "the leader was woken");
    tick(cfg, EVENT_WAKE);
    let calls = started();
    assert_eq!(calls.len(), 1, "{calls:?}");
    // A gRPC error: no tokens.
    answer(cfg, calls[0].id, &ok_answer(100), "14");
    assert_eq!(request(cfg, "b"), abi::STOP_ITERATION);
    // A call that cannot start is a failed call too (nothing follows):
    // the second failure in a row opens the breaker, and the worker,
    // ticked by the main thread, serves the key from its backstop.
    START_FAILS.with(|f| f.set(true));
    std::thread::sleep(Duration::from_millis(110));
    tick(cfg, EVENT_TICK);
    START_FAILS.with(|f| f.set(false));
    assert!(started().is_empty());
    std::thread::sleep(Duration::from_millis(110));
    tick(cfg, EVENT_TICK);
    assert_eq!(request(cfg, "b"), abi::CONTINUE, "the backstop");
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

/// Envoy resets a call's stream inside `start_http_stream` (a cluster
/// without a healthy host answers 503 before the start returns): the call
/// is a failed one, as a call that cannot start is. Lost, it left the key
/// waiting for it for good: never called for again, the breaker never
/// opened, the backstop never served it.
#[test]
fn a_call_envoy_resets_while_it_starts_is_a_failed_call() {
    let cfg = config("unit-global-reset");
    tick(cfg, EVENT_TICK); // the main thread leads, and listens
    assert_eq!(request(cfg, "c"), abi::STOP_ITERATION);
    RESET_ON_START.with(|r| r.set(cfg as usize));
    std::thread::sleep(Duration::from_millis(15));
    tick(cfg, EVENT_TICK); // the idle worker reports the key, wakes the leader
    tick(cfg, EVENT_WAKE);
    assert_eq!(started().len(), 1, "called, and reset");
    std::thread::sleep(Duration::from_millis(110));
    tick(cfg, EVENT_TICK);
    assert_eq!(
        started().len(),
        1,
        "called again, and reset: the breaker opens"
    );
    RESET_ON_START.with(|r| r.set(0));
    std::thread::sleep(Duration::from_millis(110));
    tick(cfg, EVENT_TICK);
    assert_eq!(request(cfg, "c"), abi::CONTINUE, "the backstop");
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}
