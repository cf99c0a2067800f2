//! Deadlines: reading them as gRPC and Envoy write them, reducing them by a
//! wait, refusing what cannot finish, and never queueing past one.

use crate::pipeline::deadline::*;
use crate::pipeline::telemetry::Registry;
use crate::pipeline::wait::WaitList;
use crate::request::fake::FakeRequest;
use crate::shed::{Arrival, Class, Shedders, Wake};
use crate::store::memory::MemoryStore;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn spec(json: &str) -> DeadlineSpec {
    parse(json.as_bytes())
        .expect("valid")
        .deadlines
        .expect("a deadlines section")
}

#[test]
fn grpc_timeouts_parse_in_every_unit_and_junk_does_not() {
    for (text, ms) in [
        ("2H", 7_200_000),
        ("3M", 180_000),
        ("5S", 5_000),
        ("250m", 250),
        // A part of a millisecond rounds up, as Envoy's router reads it.
        ("1500u", 2),
        ("1000u", 1),
        ("999u", 1),
        ("0u", 0),
        ("999999n", 1),
        ("1n", 1),
        ("2000000n", 2),
        ("99999999m", 99_999_999),
    ] {
        assert_eq!(parse_grpc_timeout(text), Some(ms), "{text}");
    }
    for bad in ["", "m", "100", "100x", "123456789m", "-1m", "1.5S", "１m"] {
        assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
    }
}

#[test]
fn the_first_deadline_header_that_parses_wins_and_is_reduced_in_its_format() {
    let s = spec(r#"{"deadlines":{}}"#);
    let req = FakeRequest::new("POST", "/s/M")
        .with_header("grpc-timeout", b"bad")
        .with_header("x-envoy-expected-rq-timeout-ms", b"800");
    let d = read(&s, &req).expect("a deadline");
    assert_eq!(
        (d.header.as_str(), d.remaining_ms),
        ("x-envoy-expected-rq-timeout-ms", 800)
    );
    assert_eq!(d.reduced(300), "500");
    assert_eq!(d.reduced(900), "0");
    let grpc = FakeRequest::new("POST", "/s/M").with_header("grpc-timeout", b"2S");
    let d = read(&s, &grpc).expect("a deadline");
    assert_eq!(
        (d.remaining_ms, d.reduced(250)),
        (2_000, "1750m".to_string())
    );
    assert_eq!(read(&s, &FakeRequest::new("GET", "/")), None);
    // Envoy joins a repeated grpc-timeout (or expected-rq-timeout) into
    // one value: the first counts, as for any repeated header.
    for (header, value, ms) in [
        ("grpc-timeout", &b"5m,5m"[..], 5),
        ("grpc-timeout", b"300m, 2S", 300),
        ("x-envoy-expected-rq-timeout-ms", b"800,900", 800),
    ] {
        let r = FakeRequest::new("POST", "/s/M").with_header(header, value);
        assert_eq!(read(&s, &r).map(|d| d.remaining_ms), Some(ms), "{header}");
    }
}

#[test]
fn every_deadline_header_the_request_carries_is_reduced_by_the_wait() {
    let s = spec(r#"{"deadlines":{"headers":["grpc-timeout","x-deadline-ms"]}}"#);
    let req = FakeRequest::new("POST", "/s/M")
        .with_header("grpc-timeout", b"3000m")
        .with_header("x-deadline-ms", b"3000");
    let d = read(&s, &req).expect("a deadline");
    assert_eq!((d.header.as_str(), d.remaining_ms), ("grpc-timeout", 3_000));
    assert_eq!(
        resume_headers(Some(&s), Some(&d), 304),
        vec![
            ("grpc-timeout".to_string(), "2696m".to_string()),
            ("x-deadline-ms".to_string(), "2696".to_string()),
        ]
    );
    // Each from its own value, and a malformed one is left as it came.
    let req = FakeRequest::new("POST", "/s/M")
        .with_header("grpc-timeout", b"soon")
        .with_header("x-deadline-ms", b"5000");
    let d = read(&s, &req).expect("a deadline");
    assert_eq!(
        resume_headers(Some(&s), Some(&d), 100),
        vec![("x-deadline-ms".to_string(), "4900".to_string())]
    );
    // Nothing waited, or propagation off: nothing is rewritten.
    assert_eq!(resume_headers(Some(&s), Some(&d), 0), vec![]);
    let off =
        spec(r#"{"deadlines":{"headers":["grpc-timeout","x-deadline-ms"],"propagate":false}}"#);
    assert_eq!(resume_headers(Some(&off), Some(&d), 100), vec![]);
}

#[test]
fn a_queued_request_never_waits_past_its_deadline() {
    let c =
        parse(br#"{"shedders":[{"name":"q","concurrency":{"max":1,"queue":4,"max_wait":"1s"}}]}"#)
            .expect("valid");
    let mut sh =
        Shedders::new(&c.shedders, &c.common, (1_000, 7), &mut Registry::default()).expect("ok");
    let store = MemoryStore::default();
    sh.create(&store).expect("created");
    // The lines its waiters wait in (the pipeline's, in the stage).
    let mut lines = WaitList::default();
    let s = sh.ids().next().expect("a shedder");
    assert_eq!(
        sh.arrive(&mut lines, &store, 1_000, s, 1, Class::Default).0,
        Arrival::Admit { slot: true }
    );
    let got = sh.arrive_until(
        &mut lines,
        &store,
        1_000,
        s,
        (2, Class::Critical),
        Some(1_150),
    );
    assert_eq!(got.0, Arrival::Queue { evicted: None });
    assert_eq!(sh.wake(&mut lines, &store, 1_149, s).0, vec![]);
    let (woke, _) = sh.wake(&mut lines, &store, 1_150, s);
    assert!(
        matches!(woke.as_slice(), [Wake::Expired { waiter }] if waiter.id == 2),
        "{woke:?}"
    );
    assert_eq!(sh.queued(&lines, s), 0);
}

#[test]
fn min_remaining_may_be_written_as_its_default_zero() {
    for zero in ["0s", "0ms", "0.0s"] {
        let json = format!(r#"{{"deadlines":{{"min_remaining":"{zero}"}}}}"#);
        assert_eq!(spec(&json).min_remaining.as_ns(), 0, "{json}");
    }
    assert_eq!(
        spec(r#"{"deadlines":{"min_remaining":"20ms"}}"#).min_remaining,
        crate::time::Duration::from_ms(20)
    );
}

#[test]
fn a_reduced_grpc_timeout_keeps_to_eight_digits() {
    let d = |ms| Deadline {
        header: "grpc-timeout".into(),
        format: Format::GrpcTimeout,
        remaining_ms: ms,
        also: Vec::new(),
    };
    // 99,999,999 ms fits in milliseconds; one more goes to seconds.
    assert_eq!(d(99_999_999).reduced(0), "99999999m");
    assert_eq!(d(100_000_000).reduced(0), "100000S");
    // 30H less a 300 ms wait: 107,999,700 ms, rounded down to seconds.
    assert_eq!(d(108_000_000).reduced(300), "107999S");
    // 999,999 S (as the review sent it) less a 1.2 s wait.
    assert_eq!(d(999_999_000).reduced(1_197), "999997S");
    // Past 99,999,999 s: minutes, then hours; never more than 8 digits.
    assert_eq!(d(100_000_000_000).reduced(0), "1666666M");
    assert_eq!(d(u64::MAX).reduced(0), "99999999H");
    for ms in [
        0,
        1,
        99_999_999,
        100_000_000,
        6_000_000_000_000,
        u64::MAX / 2,
    ] {
        let v = d(ms).reduced(0);
        let digits = &v[..v.len() - 1];
        assert!(digits.len() <= 8, "{ms}: {v}");
        // What sluice sends, sluice reads back: no later than the budget.
        let back = parse_grpc_timeout(&v).expect("parses");
        assert!(back <= ms, "{ms}: {v} reads back as {back}");
    }
}

#[test]
fn bad_deadline_settings_are_refused_naming_the_field() {
    for (json, field) in [
        (r#"{"deadlines":{"headers":[]}}"#, "deadlines.headers"),
        (
            r#"{"deadlines":{"headers":["a b"]}}"#,
            "deadlines.headers[0]",
        ),
        (
            r#"{"deadlines":{"min_remaining":"soon"}}"#,
            "deadlines.min_remaining",
        ),
        (
            r#"{"deadlines":{"min_remaining":"0.5ms"}}"#,
            "deadlines.min_remaining",
        ),
        (r#"{"deadlines":{"status":302}}"#, "deadlines.status"),
        (r#"{"deadlines":{"propagte":true}}"#, "deadlines.propagte"),
        (r#"{"deadlines":[]}"#, "deadlines"),
    ] {
        let e = parse(json.as_bytes()).expect_err(json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}
