//! The hooks as Envoy calls them, over the fake callbacks of `fake_envoy`.

use crate::abi::{self, Buffer, FilterPtr};
use crate::fake_envoy::FakeStream;
use crate::hooks::*;
use std::ffi::c_void;

fn config(json: &str) -> *const c_void {
    envoy_dynamic_module_on_http_filter_config_new(
        std::ptr::null_mut(),
        Buffer::of(b"sluice"),
        Buffer::of(json.as_bytes()),
    )
}

/// One stream through the hooks: its request status and the stream.
fn stream(cfg: *const c_void, worker: u32, headers: &[(&str, &str)]) -> (u32, Box<FakeStream>) {
    let mut s = Box::new(FakeStream {
        worker,
        request: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..FakeStream::default()
    });
    let envoy = s.ptr();
    let f = envoy_dynamic_module_on_http_filter_new(cfg, envoy);
    let status = envoy_dynamic_module_on_http_filter_request_headers(envoy, f, true);
    if status == abi::CONTINUE {
        s.response.push((":status".into(), "200".into()));
        envoy_dynamic_module_on_http_filter_response_headers(envoy, f, true);
    }
    envoy_dynamic_module_on_http_filter_stream_complete(envoy, f);
    envoy_dynamic_module_on_http_filter_destroy(f);
    (status, s)
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// A configuration of one concurrency slot whose waiters wait up to 10 s.
fn one_slot(domain: &str) -> *const c_void {
    config(&format!(
        r#"{{"domain":"{domain}","concurrency_limits":[{{"name":"c","max":1,"max_wait":"10s"}}]}}"#
    ))
}

/// Streams on worker 0 whose request headers went through the hooks in
/// turn: under [`one_slot`], the first takes the slot and the others wait.
struct Held {
    /// Never grown once the pointers are taken: they stay valid.
    fakes: Vec<FakeStream>,
    envoys: Vec<FilterPtr>,
    filters: Vec<*mut c_void>,
}

impl Held {
    fn new(cfg: *const c_void, n: usize) -> Held {
        let mut fakes: Vec<FakeStream> = (0..n).map(|_| FakeStream::default()).collect();
        let envoys: Vec<_> = fakes.iter_mut().map(|s| s.ptr()).collect();
        let filters: Vec<_> = envoys
            .iter()
            .map(|&e| envoy_dynamic_module_on_http_filter_new(cfg, e))
            .collect();
        let statuses: Vec<_> = envoys
            .iter()
            .zip(&filters)
            .map(|(&e, &f)| envoy_dynamic_module_on_http_filter_request_headers(e, f, true))
            .collect();
        let mut expected = vec![abi::STOP_ITERATION; n];
        expected[0] = abi::CONTINUE;
        assert_eq!(statuses, expected);
        Held {
            fakes,
            envoys,
            filters,
        }
    }

    /// Stream `i` completes (unless it already has) and is destroyed.
    fn end(&self, i: usize, completed: bool) {
        if !completed {
            envoy_dynamic_module_on_http_filter_stream_complete(self.envoys[i], self.filters[i]);
        }
        envoy_dynamic_module_on_http_filter_destroy(self.filters[i]);
    }
}

/// A panic inside worker 0's pipeline, as a bug in a stage would raise.
fn panic_in_worker(cfg: *const c_void) {
    // SAFETY: the pointer `config_new` made; the caller destroys it later.
    let c = unsafe { &*cfg.cast::<crate::config::FilterConfig>() };
    let w = c.worker(0).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.with(w, 0, |_, _| panic!("a bug"))
    }));
    assert!(panicked.is_err());
}

#[test]
fn the_abi_version_is_envoy_1_40s() {
    let v = envoy_dynamic_module_on_program_init();
    // SAFETY: a static C string.
    assert_eq!(unsafe { std::ffi::CStr::from_ptr(v) }, c"v0.2.0");
}

#[test]
fn a_bad_configuration_is_refused() {
    assert!(
        config(r#"{"rate_limits":[{"name":"a","bucket":{"rate":0,"period":"1s"}}]}"#).is_null()
    );
    assert!(config("not json").is_null());
    let ok = config("{}");
    assert!(!ok.is_null());
    envoy_dynamic_module_on_http_filter_config_destroy(ok);
}

#[test]
fn a_bucket_is_shared_by_every_worker_and_refusals_carry_the_headers() {
    let cfg = config(
        r#"{"domain":"unit-shared","rate_limits":[{"name":"r","bucket":{"rate":1,"period":"1h","burst":3}}],
            "response":{"headers_on_allowed":true,"retry_after_jitter":"0s"}}"#,
    );
    let got: Vec<_> = (0..5).map(|i| stream(cfg, i % 2, &[])).collect();
    let statuses: Vec<u32> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(statuses, [0, 0, 0, 1, 1]);
    let (_, allowed) = &got[0];
    assert_eq!(
        header(&allowed.response, "x-ratelimit-remaining"),
        Some("2")
    );
    let (_, refused) = &got[3];
    let (status, headers, body) = &refused.replies[0];
    assert_eq!(*status, 429);
    assert_eq!(header(headers, "retry-after"), Some("3600"));
    assert_eq!(header(headers, "content-type"), Some("application/json"));
    assert!(body.contains("\"rule\":\"r\""), "{body}");
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

#[test]
fn an_admitted_requests_headers_reach_its_response_whatever_the_pipeline_keeps() {
    let rule = r#""rate_limits":[{"name":"r","bucket":{"rate":1,"period":"1h","burst":3}}],
        "response":{"headers_on_allowed":true}"#;
    // Nothing kept, with or without a deadline (the headers come at once);
    // a breaker holding the stream (they come with its response).
    for (i, extra) in [
        "",
        r#","deadlines":{}"#,
        r#","circuit_breakers":[{"name":"b"}]"#,
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = config(&format!(r#"{{"domain":"unit-kept-{i}",{rule}{extra}}}"#));
        let (status, s) = stream(cfg, 0, &[("x-envoy-expected-rq-timeout-ms", "5000")]);
        assert_eq!(status, abi::CONTINUE, "{extra}");
        assert_eq!(
            header(&s.response, "x-ratelimit-remaining"),
            Some("2"),
            "{extra}"
        );
        envoy_dynamic_module_on_http_filter_config_destroy(cfg);
    }
}

#[test]
fn a_grpc_refusal_has_an_explicit_grpc_status() {
    let cfg = config(
        r#"{"domain":"unit-grpc","rate_limits":[{"name":"g","bucket":{"rate":1,"period":"1h","burst":1}}]}"#,
    );
    let grpc = [("content-type", "application/grpc")];
    assert_eq!(stream(cfg, 0, &grpc).0, abi::CONTINUE);
    let (status, s) = stream(cfg, 0, &grpc);
    assert_eq!(status, abi::STOP_ITERATION);
    let (_, headers, body) = &s.replies[0];
    assert_eq!(header(headers, "grpc-status"), Some("8"));
    assert!(header(headers, "grpc-message").is_some_and(|m| m.contains("rate limited")));
    assert!(body.is_empty());
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

#[test]
fn a_worker_beyond_the_served_ones_passes() {
    let cfg = config(
        r#"{"domain":"unit-far","rate_limits":[{"name":"f","bucket":{"rate":1,"period":"1h","burst":1}}]}"#,
    );
    let far = crate::config::MAX_WORKERS as u32;
    assert!((0..3).all(|_| stream(cfg, far, &[]).0 == abi::CONTINUE));
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

#[test]
fn a_held_request_is_resumed_on_its_worker_when_a_slot_frees() {
    let cfg = one_slot("unit-hold");
    let held = Held::new(cfg, 2);
    // The one slot is taken: the second waits.
    assert_eq!(held.fakes[1].continued, 0);
    // The first ends: the second goes on.
    held.end(0, false);
    assert_eq!(held.fakes[1].continued, 1);
    held.end(1, false);
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

#[test]
fn a_stream_let_go_inside_its_own_request_hook_goes_on_from_it_and_leaves_the_ticker() {
    let cfg = one_slot("unit-reenter");
    let mut h = Box::new(FakeStream {
        worker: 1,
        ..FakeStream::default()
    });
    let mut b = Box::new(FakeStream::default());
    let mut a = Box::new(FakeStream::default());
    let (eh, eb, ea) = (h.ptr(), b.ptr(), a.ptr());
    let fh = envoy_dynamic_module_on_http_filter_new(cfg, eh);
    let fb = envoy_dynamic_module_on_http_filter_new(cfg, eb);
    let fa = envoy_dynamic_module_on_http_filter_new(cfg, ea);
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(eh, fh, true),
        abi::CONTINUE
    );
    assert_eq!(
        envoy_dynamic_module_on_http_filter_request_headers(eb, fb, true),
        abi::STOP_ITERATION
    );
    // The holder ends on the other worker; worker 0 finds the slot on its next tick.
    envoy_dynamic_module_on_http_filter_stream_complete(eh, fh);
    envoy_dynamic_module_on_http_filter_destroy(fh);
    std::thread::sleep(std::time::Duration::from_millis(150));
    // Envoy answers b at once when it is continued (router: no healthy upstream), and it completes.
    crate::fake_envoy::ON_CONTINUE.with(|c| {
        *c.borrow_mut() = Some(Box::new(move |f| {
            if f == eb {
                envoy_dynamic_module_on_http_filter_stream_complete(eb, fb);
            }
        }))
    });
    let a_id = unsafe { &*fa.cast::<crate::filter::Filter>() }.id();
    let status = envoy_dynamic_module_on_http_filter_request_headers(ea, fa, true);
    crate::fake_envoy::ON_CONTINUE.with(|c| *c.borrow_mut() = None);
    // b's end left the slot to a, inside a's own hook: the hook goes on
    // (no continue_decoding from within it), and a waits nowhere.
    assert_eq!(status, abi::CONTINUE);
    assert_eq!((a.continued, b.continued), (0, 1));
    assert!(!crate::ticker::waiting_ids().contains(&a_id));
    envoy_dynamic_module_on_http_filter_stream_complete(ea, fa);
    envoy_dynamic_module_on_http_filter_destroy(fa);
    envoy_dynamic_module_on_http_filter_destroy(fb);
    assert!(!crate::ticker::waiting_ids().contains(&a_id));
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

#[test]
fn after_a_panic_the_streams_its_pipeline_had_paused_go_on_and_a_new_pipeline_serves() {
    let cfg = one_slot("unit-panic");
    let held = Held::new(cfg, 2);
    panic_in_worker(cfg);
    assert_eq!(held.fakes[1].continued, 0);
    // The worker's next hook finds a new pipeline; the waiter, which no
    // pipeline knows any more, goes on (the default failure policy).
    let (status, _) = stream(cfg, 0, &[]);
    assert_eq!(held.fakes[1].continued, 1);
    // What the lost pipeline held stays held (as a crashed wasm VM's):
    // the first stream's slot, in the store.
    assert_eq!(status, abi::STOP_ITERATION);
    held.end(0, false);
    held.end(1, false);
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}

/// After a panic, the worker's next hook may be a paused stream's own end
/// (its client went away while it waited): that stream is not told to go
/// on, nor answered, from inside its end; the other waiters are.
#[test]
fn after_a_panic_a_paused_stream_ending_is_not_continued_from_its_own_end() {
    let cfg = one_slot("unit-panic-end");
    let held = Held::new(cfg, 3);
    panic_in_worker(cfg);
    // The second waiter's stream ends first: it alone is left alone.
    envoy_dynamic_module_on_http_filter_stream_complete(held.envoys[1], held.filters[1]);
    assert_eq!(
        held.fakes[1].continued, 0,
        "continued from inside its own end"
    );
    assert!(
        held.fakes[1].replies.is_empty(),
        "answered from inside its own end"
    );
    assert_eq!(held.fakes[2].continued, 1, "the other waiter goes on");
    for i in 0..3 {
        held.end(i, i == 1);
    }
    envoy_dynamic_module_on_http_filter_config_destroy(cfg);
}
