//! CoDel: entering and leaving overload, idleness, shedding by class on
//! arrival, latency mode.

use super::codel::Codel;
use super::tests::*;
use super::*;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Latency mode, target 5 ms, interval 100 ms: overloaded by an interval
/// of responses `delay_ms` over the floor.
fn latency_overloaded(delay_ms: u64) -> Codel {
    let mut c = Codel::new(5, 100, T0, false);
    for t in (0..100).step_by(10) {
        c.observe(T0 + t, delay_ms);
    }
    c.roll(T0 + 100);
    c
}

#[test]
fn codel_enters_stays_and_leaves_on_the_interval_minimum() {
    let mut c = Codel::new(5, 100, T0, false);
    // A burst (one long delay, then short ones) is not a standing queue.
    c.observe(T0 + 1, 50);
    c.observe(T0 + 50, 1);
    assert_eq!(c.roll(T0 + 100), None);
    assert!(!c.overloaded);
    // Every delay of an interval above target: overloaded at its end.
    for t in (100..200).step_by(10) {
        c.observe(T0 + t, 20);
    }
    assert_eq!(c.roll(T0 + 200), Some(true));
    assert_eq!(c.threshold(Class::Sheddable), Some(0));
    assert_eq!(c.threshold(Class::Default), Some(10));
    assert_eq!(c.threshold(Class::Critical), None);
    // Still standing: stays overloaded.
    c.observe(T0 + 250, 30);
    assert_eq!(c.roll(T0 + 300), None);
    assert!(c.overloaded);
    // One quick request in an interval: it leaves.
    c.observe(T0 + 310, 30);
    c.observe(T0 + 320, 2);
    assert_eq!(c.roll(T0 + 400), Some(false));
}

#[test]
fn codel_in_queue_mode_leaves_overload_only_when_the_queue_empties() {
    let mut c = Codel::new(5, 100, T0, true);
    for t in (0..100).step_by(10) {
        c.observe(T0 + t, 20);
    }
    assert_eq!(c.roll(T0 + 100), Some(true));
    // While shedding, admitted waits are cut short (some under target):
    // the queue is still standing, so shedding goes on.
    c.observe(T0 + 110, 1);
    c.observe(T0 + 150, 9);
    assert_eq!(c.roll(T0 + 200), None);
    assert!(c.overloaded);
    // A request admitted without waiting: the queue emptied.
    c.observe(T0 + 250, 0);
    assert_eq!(c.roll(T0 + 300), Some(false));
}

#[test]
fn codel_never_sheds_the_first_sample_after_an_idle_period() {
    let mut c = latency_overloaded(40);
    assert!(c.overloaded);
    // Nothing for a second, then a request: not overloaded any more.
    assert_eq!(c.observe(T0 + 1_100, 40), Some(false));
    assert_eq!(c.threshold(Class::Sheddable), None);
    assert!(!c.shed_on_arrival(T0 + 1_100, Class::Sheddable));
}

#[test]
fn codel_arrival_shedding_respects_priorities() {
    let mut c = Codel::new(5, 100, T0, false);
    for t in (0..100).step_by(10) {
        c.observe(T0 + t, 8);
    }
    c.roll(T0 + 100);
    assert!(c.shed_on_arrival(T0 + 100, Class::Sheddable));
    assert!(
        !c.shed_on_arrival(T0 + 100, Class::Default),
        "8 ms is under twice the target"
    );
    for t in (100..200).step_by(10) {
        c.observe(T0 + t, 50);
    }
    c.roll(T0 + 200);
    assert!(c.shed_on_arrival(T0 + 200, Class::Default));
    assert!(!c.shed_on_arrival(T0 + 200, Class::Critical));
}

#[test]
fn codel_latency_overload_holds_while_everything_is_shed_and_probes_find_recovery() {
    let mut c = latency_overloaded(195);
    assert!(c.overloaded);
    // Every request is shed for a while: no response, no sample.
    for t in (100..1_000).step_by(5) {
        let probe = !c.shed_on_arrival(T0 + t, Class::Sheddable);
        // From the second starved interval on, one probe per interval.
        assert_eq!(probe, t >= 200 && t % 100 == 0, "at {t}");
        assert!(c.overloaded, "overload ended at {t} with nothing measured");
    }
    // A probe still sees the slow upstream: overload holds.
    c.observe(T0 + 1_000, 195);
    assert_eq!(c.roll(T0 + 1_100), None);
    assert!(c.overloaded);
    // A probe sees the upstream recovered: overload ends.
    c.observe(T0 + 1_150, 1);
    assert_eq!(c.roll(T0 + 1_200), Some(false));
    assert!(!c.shed_on_arrival(T0 + 1_200, Class::Sheddable));
}

#[test]
fn codel_latency_probes_every_interval_while_each_probe_is_answered_within_its_own() {
    let mut c = latency_overloaded(195);
    // Everything shed; each probe's slow answer (40 ms over the floor)
    // comes back 40 ms later, within the interval it went out in.
    let mut probes = vec![];
    let mut answer_at = None;
    for t in (100..1_000).step_by(5) {
        if answer_at == Some(t) {
            c.finished();
            c.observe(T0 + t, 40);
            answer_at = None;
        }
        if !c.shed_on_arrival(T0 + t, Class::Sheddable) {
            c.started();
            probes.push(t);
            answer_at = Some(t + 40);
        }
        assert!(c.overloaded, "overload ended at {t}");
    }
    // From the second interval all was shed in on, one probe in each.
    assert_eq!(probes, (200..1_000).step_by(100).collect::<Vec<_>>());
}

#[test]
fn codel_latency_gaps_while_answers_are_awaited_are_not_idleness() {
    let mut c = Codel::new(5, 100, T0, false);
    // Eight requests go out; a 200 ms upstream answers them all at once.
    for _ in 0..8 {
        c.started();
    }
    assert_eq!(c.roll(T0 + 200), None, "a gap with requests in flight");
    for _ in 0..8 {
        c.finished();
        c.observe(T0 + 200, 195);
    }
    for _ in 0..8 {
        c.started();
    }
    // The next answers come 200 ms later: the samples were not discarded.
    assert_eq!(c.roll(T0 + 400), Some(true));
    assert!(c.shed_on_arrival(T0 + 400, Class::Sheddable));
    // With nothing in flight, a long gap is idleness and ends overload.
    for _ in 0..8 {
        c.finished();
    }
    c.observe(T0 + 401, 195);
    assert_eq!(c.roll(T0 + 2_000), Some(false));
}
