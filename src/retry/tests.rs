//! Retry budgets: the budget's arithmetic, exactness across simulated
//! workers, recovery after a storm, and bad settings named by field.

use super::*;
use crate::request::fake::FakeRequest;
use crate::store::memory::{views, MemoryStore};
use crate::wiring::parse;
use std::rc::Rc;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const T0: u64 = 1_700_000_000_000;

fn budgets(json: &str) -> Budgets {
    let c = parse(json.as_bytes()).expect("valid");
    Budgets::new(&c.retry_budgets, &c.common).expect("no collision")
}

const ONE: &str =
    r#"{"retry_budgets":[{"name":"b","ratio":0.1,"min_per_second":2,"window":"1s"}]}"#;

fn retry() -> FakeRequest {
    FakeRequest::new("GET", "/").with_header("x-envoy-attempt-count", b"2")
}

#[test]
fn retries_are_told_apart_by_what_clients_and_proxies_send() {
    let b = budgets(ONE);
    assert!(!b.is_retry(0, &FakeRequest::new("GET", "/")));
    assert!(!b.is_retry(
        0,
        &FakeRequest::new("GET", "/").with_header("x-envoy-attempt-count", b"1")
    ));
    assert!(b.is_retry(0, &retry()));
    let grpc = FakeRequest::new("POST", "/s/M").with_header("grpc-previous-rpc-attempts", b"1");
    assert!(b.is_retry(0, &grpc));
    let junk = FakeRequest::new("GET", "/").with_header("x-envoy-attempt-count", b"two");
    assert!(!b.is_retry(0, &junk));
    // Envoy joins a repeated attempt count into one value: the first
    // counts, as for any repeated header; a count past u64 is a retry.
    for (value, is_retry) in [
        (&b"3,3"[..], true),
        (b" 2 , 1", true),
        (b"1,5", false),
        (b"+2", true),
        (b"99999999999999999999", true),
        (b"-3", false),
        (b",2", false),
    ] {
        let r = FakeRequest::new("GET", "/").with_header("x-envoy-attempt-count", value);
        assert_eq!(
            b.is_retry(0, &r),
            is_retry,
            "{:?}",
            String::from_utf8_lossy(value)
        );
    }
    let own = budgets(
        r#"{"retry_budgets":[{"name":"b","retry_when":[{"header":"X-Retry","above":0}]}]}"#,
    );
    assert!(own.is_retry(
        0,
        &FakeRequest::new("GET", "/").with_header("x-retry", b"3")
    ));
    assert!(!own.is_retry(0, &retry()));
}

#[test]
fn a_storm_gets_ratio_of_first_tries_plus_the_minimum_then_the_budget_recovers() {
    let mut b = budgets(ONE);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    let now = T0 * 1000 + 500; // mid-window
    for _ in 0..1000 {
        b.first_try(0);
    }
    b.flush(&store, now);
    let admitted = (0..500)
        .filter(|_| b.retry(&store, now, 0).0 == RetryVerdict::Admit)
        .count();
    // 10% of 1,000 first tries, plus 2 per second over a 1 s window.
    assert_eq!(admitted, 102);
    // Two windows later, with first tries only, retries fit again.
    let later = now + 2_000;
    for _ in 0..100 {
        b.first_try(0);
    }
    assert_eq!(b.retry(&store, later, 0).0, RetryVerdict::Admit);
}

#[test]
fn a_quiet_service_can_still_retry_at_the_minimum_rate() {
    let mut b = budgets(ONE);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    let got: Vec<RetryVerdict> = (0..3).map(|_| b.retry(&store, T0 * 1000, 0).0).collect();
    assert_eq!(
        got,
        [
            RetryVerdict::Admit,
            RetryVerdict::Admit,
            RetryVerdict::Refuse
        ]
    );
}

#[test]
fn property_workers_never_spend_the_same_allowance() {
    for remembering in [false, true] {
        for seed in 0..40u64 {
            let store = Rc::new(MemoryStore::default());
            let mut vms: Vec<Budgets> = (0..3).map(|_| budgets(ONE)).collect();
            vms[0].create(&*store).expect("created");
            let stores = views(&store, 3, remembering);
            let mut rng = crate::rng::SplitMix(seed);
            let mut now = T0 * 1000;
            let (mut tries, mut admitted) = (0u64, 0u64);
            for _ in 0..600 {
                now += rng.below(3);
                let w = rng.below(3) as usize;
                match rng.below(4) {
                    0 => {
                        vms[w].first_try(0);
                        tries += 1;
                    }
                    1 => {
                        vms[w].flush(&*stores[w], now);
                    }
                    _ => {
                        if vms[w].retry(&*stores[w], now, 0).0 == RetryVerdict::Admit {
                            admitted += 1;
                        }
                    }
                }
            }
            // Over the whole run (a bit over one window): never more than
            // the ratio of every first try plus the minimum for the span
            // and the window before.
            let span_s = (now - T0 * 1000) / 1000 + 2;
            assert!(
                admitted <= tries / 10 + 2 * span_s,
                "seed {seed}: {admitted} retries for {tries} first tries"
            );
            assert!(admitted > 0, "seed {seed}");
        }
    }
}

#[test]
fn counts_round_trip_and_corruption_is_counted_and_replaced() {
    let c = Counts {
        window: 7,
        tries: 1,
        retries: 2,
        prev_tries: 3,
        prev_retries: 4,
    };
    assert_eq!(codec::decode(&codec::encode(&c)), Ok(c));
    let mut bad = codec::encode(&c);
    bad[3] ^= 1;
    assert!(codec::decode(&bad).is_err());
    let mut b = budgets(ONE);
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    store.raw_set(&b.rules[0].key, b"junk");
    let (verdict, _, store_failures) = b.retry(&store, T0 * 1000, 0);
    assert_eq!(verdict, RetryVerdict::Admit);
    assert_eq!(store_failures, 1);
}

#[test]
fn bad_budgets_are_refused_naming_the_field() {
    for (json, field) in [
        (
            r#"{"retry_budgets":[{"name":"b","ratio":-1}]}"#,
            "retry_budgets[0].ratio",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","ratio":0.0005}]}"#,
            "retry_budgets[0].ratio",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","ratio":0.0015}]}"#,
            "retry_budgets[0].ratio",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","min_per_second":-1}]}"#,
            "retry_budgets[0].min_per_second",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","window":"10ms"}]}"#,
            "retry_budgets[0].window",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","retry_when":[]}]}"#,
            "retry_budgets[0].retry_when",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","retry_when":[{"header":"a b","above":1}]}]}"#,
            "retry_budgets[0].retry_when[0].header",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","retry_when":[{"header":"x","above":-1}]}]}"#,
            "retry_budgets[0].retry_when[0].above",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","status":200}]}"#,
            "retry_budgets[0].status",
        ),
        (
            r#"{"retry_budgets":[{"name":"b","rate":1}]}"#,
            "retry_budgets[0].rate",
        ),
        (
            r#"{"retry_budgets":[{"name":"b"},{"name":"b"}]}"#,
            "retry_budgets[1].name",
        ),
    ] {
        let e = parse(json.as_bytes()).expect_err(json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}

#[test]
fn a_retry_decided_while_another_worker_spends_the_allowance_is_refused() {
    let store = Rc::new(MemoryStore::default());
    let mut a = budgets(ONE);
    a.create(&*store).expect("created");
    let b = Rc::new(std::cell::RefCell::new(budgets(ONE)));
    let now = T0 * 1000;
    // Just before worker A writes, worker B takes the whole allowance (2).
    let (b2, once) = (b.clone(), std::cell::Cell::new(true));
    *store.before_set.borrow_mut() = Some(Box::new(move |s: &MemoryStore, _key: &str| {
        if once.replace(false) {
            let mut b = b2.borrow_mut();
            assert_eq!(b.retry(s, now, 0).0, RetryVerdict::Admit);
            assert_eq!(b.retry(s, now, 0).0, RetryVerdict::Admit);
        }
    }));
    assert_eq!(a.retry(&*store, now, 0).0, RetryVerdict::Refuse);
}

#[test]
fn the_ratio_with_no_first_try_counts_one_whatever_the_window() {
    for window in ["1s", "10s"] {
        let mut b = budgets(&format!(
            r#"{{"retry_budgets":[{{"name":"b","ratio":0,"min_per_second":5,"window":"{window}"}}]}}"#
        ));
        let store = MemoryStore::default();
        b.create(&store).expect("created");
        let (verdict, ratio, _) = b.retry(&store, T0 * 1000, 0);
        assert_eq!((verdict, ratio), (RetryVerdict::Admit, 1000), "{window}");
    }
}

#[test]
fn a_retry_a_later_budget_refuses_is_given_back_to_the_earlier_one() {
    let mut b = budgets(
        r#"{"retry_budgets":[{"name":"p1","ratio":10,"min_per_second":0},
                             {"name":"p2","ratio":0,"min_per_second":0}]}"#,
    );
    let store = MemoryStore::default();
    b.create(&store).expect("created");
    let now = T0 * 1000;
    b.first_try(0);
    b.flush(&store, now);
    assert_eq!(b.retry(&store, now, 0).0, RetryVerdict::Admit);
    assert_eq!(b.retry(&store, now, 1).0, RetryVerdict::Refuse);
    assert_eq!(b.give_back(&store, now + 5, now, 0), 0);
    // p1's window holds no retry: its ratio is 0 again, and ten fit.
    let fit = (0..20)
        .filter(|_| b.retry(&store, now + 10, 0).0 == RetryVerdict::Admit)
        .count();
    assert_eq!(fit, 10);
    // Nothing to give back: no underflow.
    let mut fresh = budgets(ONE);
    fresh.create(&store).expect("created");
    assert_eq!(fresh.give_back(&store, now, now, 0), 0);
}
