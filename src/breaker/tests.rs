//! Breaker tests: the state machine under random outcome sequences, and the
//! runtime with several simulated VMs sharing one store.

use super::runtime::{Breakers, CallOutcome, Check, SYNC_MS};
use super::*;
use crate::request::fake::FakeRequest;
use crate::store::memory::{views, MemoryStore};
use crate::store::Store;
use crate::wiring::parse;
use std::rc::Rc;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const T0: u64 = 1_700_000_000_000;

fn spec_from(json: &str) -> BreakerSpec {
    let c = parse(json.as_bytes()).expect("valid");
    c.breakers.into_iter().next().expect("one breaker")
}

fn default_spec() -> BreakerSpec {
    spec_from(
        r#"{"circuit_breakers":[{"name":"b","min_requests":10,"error_rate":0.5,"window":"10s",
        "open":{"base":"1s","max":"8s"},"half_open":{"probes":2,"successes_to_close":2}}]}"#,
    )
}

#[test]
fn defaults_are_documented_values() {
    let s = spec_from(r#"{"circuit_breakers":[{"name":"b"}]}"#);
    assert_eq!(
        (s.error_rate_permille, s.window_ms, s.min_requests),
        (500, 10_000, 20)
    );
    assert_eq!(
        (s.open_base_ms, s.open_max_ms, s.open_multiplier),
        (5_000, 60_000, 2)
    );
    assert_eq!((s.probes, s.successes_to_close, s.status), (1, 1, 503));
    assert_eq!(s.key, BreakerKey::Cluster);
    assert!(
        s.failure.is_failure_status(503)
            && !s.failure.is_failure_status(429)
            && !s.failure.is_failure_status(404)
    );
    assert!(s.failure.local_failures);
}

#[test]
fn bad_breaker_configs_name_the_field() {
    for (json, field) in [
        (
            r#"{"circuit_breakers":[{"name":"b","error_rate":0}]}"#,
            "circuit_breakers[0].error_rate",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","error_rate":1.5}]}"#,
            "circuit_breakers[0].error_rate",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","min_requests":0}]}"#,
            "circuit_breakers[0].min_requests",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","window":"10"}]}"#,
            "circuit_breakers[0].window",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","open":{"base":"10s","max":"1s"}}]}"#,
            "circuit_breakers[0].open.max",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","failure":{"statuses":["6xx"]}}]}"#,
            "circuit_breakers[0].failure.statuses[0]",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","half_open":{"probes":0}}]}"#,
            "circuit_breakers[0].half_open.probes",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","key":"pod"}]}"#,
            "circuit_breakers[0].key",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b"},{"name":"b"}]}"#,
            "circuit_breakers[1].name",
        ),
        (
            r#"{"circuit_breakers":[{"name":"b","status":200}]}"#,
            "circuit_breakers[0].status",
        ),
    ] {
        let e = parse(json.as_bytes()).expect_err(json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}

#[test]
fn trips_on_error_rate_only_after_min_requests() {
    let spec = default_spec();
    let mut rng = SplitMix(1);
    let mut s = State::new();
    for i in 0..9 {
        assert_eq!(
            s.record(&spec, T0 + i, 0, 1, &mut rng),
            None,
            "tripped on {} requests",
            i + 1
        );
    }
    assert!(matches!(
        s.record(&spec, T0 + 9, 0, 1, &mut rng),
        Some(Transition::Opened { .. })
    ));
    assert_eq!(s.phase, Phase::Open);
    assert!(s.until_ms >= T0 + 9 + 1000 && s.until_ms <= T0 + 9 + 1200);
}

#[test]
fn old_failures_leave_the_window() {
    let spec = default_spec();
    let mut rng = SplitMix(1);
    let mut s = State::new();
    s.record(&spec, T0, 0, 9, &mut rng);
    // 11 s later those failures are gone; 9 successes and 1 failure do not trip.
    assert_eq!(s.record(&spec, T0 + 11_000, 9, 1, &mut rng), None);
    assert_eq!(s.totals(&spec, T0 + 11_000), (9, 1));
}

#[test]
fn consecutive_failures_trip_when_configured() {
    let spec = spec_from(
        r#"{"circuit_breakers":[{"name":"b","min_requests":1000,"consecutive_failures":3}]}"#,
    );
    let mut rng = SplitMix(2);
    let mut s = State::new();
    s.record(&spec, T0, 50, 2, &mut rng);
    assert_eq!(s.consecutive, 2);
    assert_eq!(s.record(&spec, T0, 1, 0, &mut rng), None);
    assert_eq!(s.consecutive, 0);
    s.record(&spec, T0, 0, 2, &mut rng);
    assert!(matches!(
        s.record(&spec, T0, 0, 1, &mut rng),
        Some(Transition::Opened { .. })
    ));
}

#[test]
fn half_open_probes_close_or_reopen_for_longer() {
    let spec = default_spec();
    let mut rng = SplitMix(3);
    let mut s = State::new();
    s.record(&spec, T0, 0, 10, &mut rng);
    let until = s.until_ms;
    assert!(matches!(
        s.admit(&spec, until - 1),
        Admit::FailFast { retry_after_ms: 1 }
    ));
    assert_eq!(s.admit(&spec, until), Admit::TryProbe);
    assert_eq!(
        s.claim_probe(&spec, until),
        Ok(Some(Transition::HalfOpened))
    );
    assert_eq!(s.claim_probe(&spec, until), Ok(None));
    assert_eq!(s.claim_probe(&spec, until), Err(NoProbe), "only 2 probes");
    assert_eq!(
        s.probe_result(&spec, until + 5, (false, s.epoch), &mut rng)
            .map(|t| matches!(t, Transition::Reopened { .. })),
        Some(true)
    );
    assert_eq!(s.trips, 2);
    let second = s.until_ms - (until + 5);
    assert!((2000..=2400).contains(&second), "{second}");
    // Recovery: two successful probes close it with a fresh window.
    let at = s.until_ms;
    s.claim_probe(&spec, at).expect("probe");
    s.claim_probe(&spec, at).expect("probe");
    assert_eq!(
        s.probe_result(&spec, at + 1, (true, s.epoch), &mut rng),
        None
    );
    assert_eq!(
        s.probe_result(&spec, at + 2, (true, s.epoch), &mut rng),
        Some(Transition::Closed)
    );
    assert_eq!(
        s,
        State {
            epoch: s.epoch,
            ..State::new()
        }
    );
}

#[test]
fn lost_probe_claims_expire_after_the_probe_timeout() {
    let spec = spec_from(
        r#"{"circuit_breakers":[{"name":"b","min_requests":1,"half_open":{"probe_timeout":"2s"}}]}"#,
    );
    let mut rng = SplitMix(4);
    let mut s = State::new();
    s.record(&spec, T0, 0, 1, &mut rng);
    let at = s.until_ms;
    s.claim_probe(&spec, at).expect("probe");
    assert_eq!(s.claim_probe(&spec, at + 1000), Err(NoProbe));
    assert_eq!(s.claim_probe(&spec, at + 2001), Ok(None));
}

#[test]
fn property_state_machine_invariants_under_random_sequences() {
    let spec = spec_from(
        r#"{"circuit_breakers":[{"name":"b","min_requests":5,"error_rate":0.3,"window":"1s",
        "open":{"base":"100ms","max":"1s","multiplier":3},"half_open":{"probes":3,"successes_to_close":2}}]}"#,
    );
    let mut rng = SplitMix(99);
    for _case in 0..300 {
        let mut s = State::new();
        let mut now = T0;
        let mut claimed = 0u32;
        for _ in 0..300 {
            now += rng.below(60);
            let before = s;
            match rng.below(4) {
                0 | 1 => {
                    let (ok, bad) = (rng.below(3) as u32, rng.below(2) as u32);
                    let (ps, pf) = before.totals(&spec, now);
                    if let Some(Transition::Opened { open_ms }) =
                        s.record(&spec, now, ok, bad, &mut rng)
                    {
                        assert!(
                            ps + pf + (ok + bad) as u64 >= 5,
                            "tripped below min_requests"
                        );
                        assert!((100..=120).contains(&open_ms), "{open_ms}");
                        claimed = 0;
                    }
                }
                2 => {
                    if s.claim_probe(&spec, now).is_ok() {
                        claimed += 1;
                    }
                }
                _ => {
                    if claimed > 0 {
                        claimed -= 1;
                        let ok = rng.below(2) == 0;
                        if let Some(Transition::Reopened { open_ms }) =
                            s.probe_result(&spec, now, (ok, s.epoch), &mut rng)
                        {
                            let period = State::open_period_ms(&spec, s.trips);
                            assert!(period >= State::open_period_ms(&spec, s.trips - 1));
                            assert!(
                                period <= 1000
                                    && open_ms >= period
                                    && open_ms <= period + period / 5
                            );
                            claimed = 0;
                        }
                    }
                }
            }
            assert!(
                s.in_flight <= spec.probes,
                "more probes than allowed: {s:?}"
            );
            if s.phase == Phase::Closed {
                assert_eq!(s.in_flight, 0);
            }
        }
    }
}

#[test]
fn codec_round_trips_and_rejects_corruption() {
    let spec = default_spec();
    let mut s = State::new();
    s.record(&spec, T0, 3, 10, &mut SplitMix(5));
    let bytes = codec::encode(&s);
    assert_eq!(codec::decode(&bytes), Ok(s));
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x10;
        assert!(codec::decode(&bad).is_err(), "flip at {i}");
    }
    assert!(codec::decode(&bytes[..bytes.len() - 1]).is_err());
    assert!(codec::decode(b"").is_err());
}

#[test]
fn the_count_of_keys_open_is_shared_starts_at_zero_and_survives_corruption() {
    let (b, store) = vms(r#"{"circuit_breakers": [{"name": "a"}, {"name": "b"}]}"#, 2);
    assert_eq!(
        b[0].open_count(&store, 0),
        Ok(0),
        "an empty store: none open"
    );
    assert_eq!(b[0].add_open(&store, 0, 1), Ok(1));
    assert_eq!(
        b[1].add_open(&store, 0, 1),
        Ok(2),
        "the other VM adds to the same count"
    );
    assert_eq!(
        b[1].open_count(&store, 1),
        Ok(0),
        "each breaker has its own"
    );
    assert_eq!(b[0].add_open(&store, 0, -1), Ok(1));
    assert_eq!(b[1].open_count(&store, 0), Ok(1));
    let name = format!("{}open", b[0].rules[0].prefix);
    store.set(&name, b"garbage", None).expect("set");
    assert_eq!(
        b[0].open_count(&store, 0),
        Ok(0),
        "a corrupt count reads as none"
    );
    assert_eq!(b[0].add_open(&store, 0, -1), Ok(0), "never below 0");
    assert_eq!(b[1].add_open(&store, 0, 1), Ok(1));
    assert_eq!(codec::decode_count(&codec::encode_count(7)), Ok(7));
}

fn vms(json: &str, n: usize) -> (Vec<Breakers>, MemoryStore) {
    let c = parse(json.as_bytes()).expect("valid");
    (
        (0..n)
            .map(|_| Breakers::new(&c.breakers, &c.common, (7, 8)).expect("ok"))
            .collect(),
        MemoryStore::default(),
    )
}

fn to(cluster: &str) -> FakeRequest {
    let mut r = FakeRequest::new("GET", "/");
    r.attributes.insert("cluster", cluster.as_bytes().to_vec());
    r
}

const RUNTIME: &str = r#"{"circuit_breakers":[{"name":"b","min_requests":10,"error_rate":0.5,
    "open":{"base":"1s","max":"4s"},"half_open":{"probes":1}}]}"#;

#[test]
fn a_trip_in_one_vm_fails_fast_in_the_others_within_sync_ms() {
    let (mut vm, store) = vms(RUNTIME, 3);
    let mut rng = SplitMix(6);
    let mut ev = Vec::new();
    // Everyone has seen the closed state.
    for v in vm.iter_mut() {
        assert!(matches!(
            v.check(&store, T0, &to("a"), &mut rng, &mut ev).0,
            Check::Pass(_)
        ));
    }
    for i in 0..10 {
        let Check::Pass(t) = vm[0].check(&store, T0 + 1, &to("a"), &mut rng, &mut ev).0 else {
            panic!("{i}")
        };
        vm[0].record(
            &store,
            T0 + 1,
            t[0],
            CallOutcome::Failure,
            &mut rng,
            &mut ev,
        );
    }
    assert!(ev
        .iter()
        .any(|e| matches!(e.transition, Transition::Opened { .. })));
    assert!(matches!(
        vm[0].check(&store, T0 + 2, &to("a"), &mut rng, &mut ev).0,
        Check::FailFast { .. }
    ));
    // Another VM may pass on its cached state for less than SYNC_MS, then fails fast.
    assert!(matches!(
        vm[1]
            .check(&store, T0 + 1 + SYNC_MS, &to("a"), &mut rng, &mut ev)
            .0,
        Check::FailFast { .. }
    ));
    // A different cluster is unaffected.
    assert!(matches!(
        vm[2].check(&store, T0 + 100, &to("b"), &mut rng, &mut ev).0,
        Check::Pass(_)
    ));
}

/// `consecutive_failures` counts failures in a row across workers: a
/// success on a worker that had not seen the key yet ends the streak at
/// once (merged with its first result, not held back for its tick).
#[test]
fn a_success_on_another_worker_ends_a_streak_of_failures() {
    let (mut vm, store) = vms(
        r#"{"circuit_breakers":[{"name":"b","min_requests":1000,"consecutive_failures":3}]}"#,
        2,
    );
    let mut rng = SplitMix(9);
    let mut ev = Vec::new();
    let (a, b) = vm.split_at_mut(1);
    let (a, b) = (&mut a[0], &mut b[0]);
    let mut call = |v: &mut Breakers, at: u64, outcome: CallOutcome| {
        let Check::Pass(t) = v.check(&store, at, &to("a"), &mut rng, &mut ev).0 else {
            panic!("refused at {at}")
        };
        v.record(&store, at + 2, t[0], outcome, &mut rng, &mut ev);
        ev.len()
    };
    call(a, T0, CallOutcome::Failure);
    call(a, T0 + 50, CallOutcome::Failure);
    call(b, T0 + 100, CallOutcome::Success);
    call(a, T0 + 150, CallOutcome::Failure);
    let events = call(a, T0 + 200, CallOutcome::Failure);
    assert_eq!(events, 0, "tripped on F F S F F");
    call(a, T0 + 250, CallOutcome::Failure);
    assert!(
        matches!(ev.as_slice(), [e] if matches!(e.transition, Transition::Opened { .. })),
        "{ev:?}"
    );
}

#[test]
fn exactly_the_configured_probes_pass_across_vms_and_recovery_closes() {
    // Also with each VM remembering its own writes (skipping reads).
    probes_across_vms(false);
    probes_across_vms(true);
}

fn probes_across_vms(remembering: bool) {
    let (mut vm, store) = vms(RUNTIME, 4);
    let store = Rc::new(store);
    let views = views(&store, 4, remembering);
    let mut rng = SplitMix(7);
    let mut ev = Vec::new();
    for _ in 0..10 {
        let Check::Pass(t) = vm[0].check(&*views[0], T0, &to("a"), &mut rng, &mut ev).0 else {
            panic!()
        };
        vm[0].record(
            &*views[0],
            T0,
            t[0],
            CallOutcome::Failure,
            &mut rng,
            &mut ev,
        );
    }
    let later = T0 + 5_000;
    let mut probes = Vec::new();
    for round in 0..5 {
        for (v, view) in vm.iter_mut().zip(&views) {
            match v
                .check(&**view, later + round, &to("a"), &mut rng, &mut ev)
                .0
            {
                Check::Pass(t) => probes.push(t),
                // Every probe out: a retry in a second, not at once.
                Check::FailFast {
                    retry_after_ms,
                    half_open,
                    ..
                } => assert_eq!((retry_after_ms, half_open), (1000, true)),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(probes.len(), 1, "one probe across all VMs");
    assert!(probes[0][0].probe);
    vm[0].record(
        &*views[0],
        later + 10,
        probes[0][0],
        CallOutcome::Success,
        &mut rng,
        &mut ev,
    );
    assert!(ev.iter().any(|e| e.transition == Transition::Closed));
    assert!(matches!(
        vm[3]
            .check(
                &*views[3],
                later + 10 + SYNC_MS,
                &to("a"),
                &mut rng,
                &mut ev
            )
            .0,
        Check::Pass(_)
    ));
}

#[test]
fn successes_are_batched_and_ignored_outcomes_do_not_count() {
    let (mut vm, store) = vms(RUNTIME, 1);
    let mut rng = SplitMix(8);
    let mut ev = Vec::new();
    for i in 0..100 {
        let Check::Pass(t) = vm[0]
            .check(&store, T0 + i / 10, &to("a"), &mut rng, &mut ev)
            .0
        else {
            panic!()
        };
        vm[0].record(
            &store,
            T0 + i / 10,
            t[0],
            if i % 2 == 0 {
                CallOutcome::Success
            } else {
                CallOutcome::Ignored
            },
            &mut rng,
            &mut ev,
        );
    }
    // 50 successes over 10 ms: the key's first merged at once (it may end
    // a streak), the other 49 batched, then one merge on flush.
    assert_eq!(store.sets.get(), 1);
    vm[0].flush(&store, T0 + 100, &mut rng, &mut ev);
    assert_eq!(store.sets.get(), 2);
    let (ok, bad) = store
        .map
        .borrow()
        .values()
        .next()
        .map(|(b, _)| {
            codec::decode(b)
                .expect("state")
                .totals(&default_spec(), T0 + 100)
        })
        .expect("one key");
    assert_eq!((ok, bad), (50, 0));
}

#[test]
fn a_grpc_error_in_an_upstream_200_is_a_failure_as_admission_control_counts_it() {
    let f = default_spec().failure;
    let up = Some(&b"via_upstream"[..]);
    for (grpc, want) in [
        ("14", CallOutcome::Failure), // UNAVAILABLE
        ("4", CallOutcome::Failure),  // DEADLINE_EXCEEDED
        (" 13 ", CallOutcome::Failure),
        ("0", CallOutcome::Success),
        ("5", CallOutcome::Success), // NOT_FOUND: the caller's
        ("16", CallOutcome::Success),
        ("x", CallOutcome::Success),
        ("99999999999", CallOutcome::Success),
    ] {
        assert_eq!(
            f.classify(Some(200), up, Some(grpc.as_bytes())),
            want,
            "{grpc}"
        );
    }
    // A local reply's grpc-status says nothing about the upstream.
    assert_eq!(
        f.classify(Some(200), Some(b"wasm_send_local_response"), Some(b"14")),
        CallOutcome::Ignored
    );
    let mine =
        spec_from(r#"{"circuit_breakers":[{"name":"b","failure":{"grpc_statuses":[5]}}]}"#).failure;
    assert_eq!(
        mine.classify(Some(200), up, Some(b"5")),
        CallOutcome::Failure
    );
    assert_eq!(
        mine.classify(Some(200), up, Some(b"14")),
        CallOutcome::Success
    );
    let none =
        spec_from(r#"{"circuit_breakers":[{"name":"b","failure":{"grpc_statuses":[]}}]}"#).failure;
    assert_eq!(none.grpc_statuses, 0);
}

#[test]
fn responses_are_classified_by_status_and_envoy_details() {
    let f = default_spec().failure;
    assert_eq!(
        f.classify(Some(200), Some(b"via_upstream"), None),
        CallOutcome::Success
    );
    assert_eq!(
        f.classify(Some(503), Some(b"via_upstream"), None),
        CallOutcome::Failure
    );
    assert_eq!(
        f.classify(Some(429), Some(b"via_upstream"), None),
        CallOutcome::Success
    );
    assert_eq!(
        f.classify(Some(504), Some(b"upstream_response_timeout"), None),
        CallOutcome::Failure
    );
    assert_eq!(
        f.classify(
            Some(503),
            Some(b"upstream_reset_before_response_started{remote_connection_failure}"),
            None
        ),
        CallOutcome::Failure
    );
    assert_eq!(
        f.classify(Some(503), Some(b"no_healthy_upstream"), None),
        CallOutcome::Failure
    );
    assert_eq!(
        f.classify(Some(403), Some(b"ext_authz_denied"), None),
        CallOutcome::Ignored
    );
    assert_eq!(
        f.classify(Some(429), Some(b"wasm_send_local_response"), None),
        CallOutcome::Ignored
    );
    assert_eq!(f.classify(None, None, None), CallOutcome::Ignored);
    // sluice's own local replies (a shed or refused request) carry no details.
    assert_eq!(f.classify(Some(503), None, None), CallOutcome::Ignored);
    assert_eq!(f.classify(Some(200), None, None), CallOutcome::Success);
    let with_429 = spec_from(r#"{"circuit_breakers":[{"name":"b","failure":{"statuses":["5xx","429"],"local_failures":false}}]}"#).failure;
    assert_eq!(
        with_429.classify(Some(429), Some(b"via_upstream"), None),
        CallOutcome::Failure
    );
    assert_eq!(
        with_429.classify(Some(504), Some(b"upstream_response_timeout"), None),
        CallOutcome::Ignored
    );
}

#[test]
fn a_probe_from_an_earlier_episode_never_counts_or_frees_a_claim() {
    let spec = spec_from(
        r#"{"circuit_breakers":[{"name":"b","min_requests":1,"open":{"base":"1s","max":"8s"},
        "half_open":{"probes":1,"probe_timeout":"2s"}}]}"#,
    );
    let mut rng = SplitMix(11);
    let mut s = State::new();
    s.record(&spec, T0, 0, 1, &mut rng);
    let at = s.until_ms;
    s.claim_probe(&spec, at).expect("probe");
    let old = s.epoch;
    // The claim expires; a new probe is claimed in a new episode.
    s.claim_probe(&spec, at + 2_001).expect("new probe");
    assert_ne!(s.epoch, old);
    // The old probe's late answer neither closes the breaker nor frees the new claim.
    assert_eq!(
        s.probe_result(&spec, at + 2_100, (true, old), &mut rng),
        None
    );
    s.release_probe(old);
    assert_eq!(s.in_flight, 1);
    assert_eq!(s.claim_probe(&spec, at + 2_200), Err(NoProbe));
    assert_eq!(
        s.probe_result(&spec, at + 2_300, (true, s.epoch), &mut rng),
        Some(Transition::Closed)
    );
}

#[test]
fn slow_call_thresholds_are_read_and_checked() {
    let spec = spec_from(r#"{"circuit_breakers":[{"name":"b","failure":{"slow_call":"250ms"}}]}"#);
    assert_eq!(spec.failure.slow_ms, Some(250));
    assert_eq!(default_spec().failure.slow_ms, None);
    let e = crate::wiring::parse(
        br#"{"circuit_breakers":[{"name":"b","failure":{"slow_call":"fast"}}]}"#,
    )
    .expect_err("bad duration");
    assert_eq!(e.field, "circuit_breakers[0].failure.slow_call");
}

#[test]
fn graded_breaking_refuses_in_proportion_to_the_error_rate() {
    let spec = spec_from(
        r#"{"circuit_breakers":[{"name":"b","error_rate":1.0,"min_requests":10,
            "graded":{"from":0.1,"max":0.9}}]}"#,
    );
    let at = |errors: u32| {
        let mut s = State::new();
        let mut rng = SplitMix(1);
        s.record(&spec, T0, 100 - errors, errors, &mut rng);
        s.reject_permille(&spec, T0)
    };
    assert_eq!(at(0), 0);
    assert_eq!(at(10), 0);
    assert_eq!(at(30), 200);
    assert_eq!(at(50), 400);
    assert_eq!(at(70), 600);
    // Never above max, and nothing below min_requests.
    let mut s = State::new();
    s.record(&spec, T0, 0, 5, &mut SplitMix(1));
    assert_eq!(s.reject_permille(&spec, T0), 0);
    let e = crate::wiring::parse(
        br#"{"circuit_breakers":[{"name":"b","error_rate":0.5,"graded":{"from":0.6}}]}"#,
    )
    .expect_err("from over the trip rate");
    assert_eq!(e.field, "circuit_breakers[0].graded.from");
    let e = crate::wiring::parse(br#"{"circuit_breakers":[{"name":"b","graded":{"max":0}}]}"#)
        .expect_err("no chance");
    assert_eq!(e.field, "circuit_breakers[0].graded.max");
}

#[test]
fn graded_refusals_follow_a_recovery_within_half_a_window_and_an_onset_with_the_window() {
    let spec = spec_from(
        r#"{"circuit_breakers":[{"name":"b","error_rate":1.0,"min_requests":20,"window":"2s",
            "graded":{"from":0.1,"max":0.9}}]}"#,
    );
    // Buckets of 200 ms (10 in the window), each run of them recording
    // (successes, failures) in every bucket.
    let filled = |runs: &[(std::ops::Range<u64>, u32, u32)]| {
        let mut s = State::new();
        for (buckets, ok, bad) in runs {
            for b in buckets.clone() {
                s.record(&spec, T0 + b * 200, *ok, *bad, &mut SplitMix(1));
            }
        }
        s
    };
    // Half failing in buckets 0..=last, then healed up to bucket 13.
    let healed_after = |last: u64| filled(&[(0..last + 1, 10, 10), (last + 1..14, 16, 0)]);
    let at = |s: &State, bucket: u64| s.reject_permille(&spec, T0 + bucket * 200);
    assert_eq!(at(&healed_after(13), 13), 400);
    // Asked at bucket 14: the newer half is buckets 10 to 14 (14 is empty).
    // Failures up to bucket 9 have left it: nothing refused, where the
    // whole window's rate (50 of 164 failing: 30%) would still refuse 20%.
    let s = healed_after(9);
    assert_eq!(s.totals(&spec, T0 + 14 * 200), (114, 50));
    assert_eq!(at(&s, 14), 0);
    // Failures up to bucket 10: the newer half's 10 of 68 (147 permille;
    // 4 buckets would hold none, 6 would hold 20 of 88).
    assert_eq!(at(&healed_after(10), 14), 900 * (147 - 100) / 900);
    // A newer half with too few requests to judge leaves the whole window's rate.
    let s = filled(&[(0..5, 10, 10), (9..10, 5, 0)]);
    assert_eq!(at(&s, 9), 900 * (476 - 100) / 900);
    // A newer half lower by chance (45 of 100 against 95 of 200, within
    // twice its standard error of 50 permille) leaves the whole window's.
    let s = filled(&[(0..5, 10, 10), (5..10, 11, 9)]);
    assert_eq!(at(&s, 9), 900 * (475 - 100) / 900);
    // Onset: failures only in the newer half never raise the rate above
    // the whole window's (50 of 200 = 250 permille; the newer half's 500).
    let s = filled(&[(0..5, 20, 0), (5..10, 10, 10)]);
    assert_eq!(at(&s, 9), 900 * (250 - 100) / 900);
    // Only a closed breaker refuses by chance.
    let mut s = healed_after(13);
    s.phase = Phase::Open;
    assert_eq!(at(&s, 13), 0);
}

#[test]
fn graded_breaking_takes_its_default_from_whatever_the_error_rate() {
    for (rate, from) in [("0.005", 2), ("0.333", 166), ("0.001", 0), ("0.5", 250)] {
        let s = spec_from(&format!(
            r#"{{"circuit_breakers":[{{"name":"b","error_rate":{rate},"graded":{{}}}}]}}"#
        ));
        assert_eq!(s.graded.map(|g| g.from_permille), Some(from), "{rate}");
    }
    // A `from` written finer than 0.001 is still refused, naming it.
    let e = parse(
        br#"{"circuit_breakers":[{"name":"b","error_rate":0.005,"graded":{"from":0.0025}}]}"#,
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("graded.from"), "{e}");
}
