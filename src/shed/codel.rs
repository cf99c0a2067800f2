//! CoDel over queueing delay, as large operators use it for RPC queues:
//! when the *minimum* delay seen during an interval stays above `target`,
//! the queue is standing (not a burst draining) and the shedder enters
//! overload; the first interval whose minimum is under target (or that saw
//! no request at all) leaves it. One instance per worker: each worker has its
//! own queue.
//!
//! Without a sluice queue (latency mode), the samples are response
//! latencies: an interval in which every request was shed has none, yet the
//! overload goes on, so such an interval keeps the state and the estimate;
//! and one request per interval is let through as a probe while no sample
//! came in, so that a recovery is seen.
//!
//! With sluice's own queue, the waits of admitted requests are cut short by
//! the shedding itself, so their minimum says little about the standing
//! queue while shedding; there, overload ends only when an interval sees the
//! queue empty (a request admitted without waiting) or no request at all.
//!
//! While overloaded the thresholds tighten by priority: a sheddable request
//! is shed as soon as it would have to wait, a default one once it has waited
//! (or would wait) `2 * target`, a critical one never by CoDel, only when
//! the queue is full or its own `max_wait` is over.

use super::config::Class;

/// CoDel state of one shedder in one worker. Times are milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Codel {
    pub target_ms: u64,
    pub interval_ms: u64,
    interval_start: u64,
    min_in_interval: Option<u64>,
    /// Minimum delay of the last complete interval.
    pub last_min: Option<u64>,
    pub overloaded: bool,
    /// Queue mode: leave overload only on an empty-queue interval.
    exit_on_empty: bool,
    saw_empty: bool,
    shed_in_interval: bool,
    /// Latency mode: a probe was let through in this interval.
    probed: bool,
    /// Latency mode: a request other than a probe was let through in this
    /// interval.
    passed: bool,
    /// Latency mode: the last interval shed everything but probes.
    starved: bool,
    /// Latency mode: requests let through and not answered yet.
    in_flight: u64,
}

impl Codel {
    pub fn new(target_ms: u64, interval_ms: u64, now_ms: u64, exit_on_empty: bool) -> Self {
        Codel {
            target_ms,
            interval_ms,
            interval_start: now_ms,
            min_in_interval: None,
            last_min: None,
            overloaded: false,
            exit_on_empty,
            saw_empty: false,
            shed_in_interval: false,
            probed: false,
            passed: false,
            starved: false,
            in_flight: 0,
        }
    }

    /// Latency mode: a request was let through (its answer will be a sample).
    pub fn started(&mut self) {
        self.in_flight += 1;
    }

    /// Latency mode: a request let through was answered or abandoned.
    pub fn finished(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Closes finished intervals. Returns `Some(new state)` when the
    /// overload state changed.
    pub fn roll(&mut self, now_ms: u64) -> Option<bool> {
        if now_ms < self.interval_start.saturating_add(self.interval_ms) {
            return None;
        }
        let before = self.overloaded;
        let elapsed = now_ms - self.interval_start;
        // More than one interval passed: the later ones saw nothing (idle),
        // unless requests were in flight (latency mode): a slow upstream
        // answers late, and a gap before its answers is not idleness.
        let idle = elapsed >= 2 * self.interval_ms && self.in_flight == 0;
        // Latency mode: no response measured the delay, yet there was
        // traffic (everything was shed, or it is still in flight): the
        // state holds, and so does the last estimate.
        let unmeasured = !self.exit_on_empty
            && !idle
            && self.min_in_interval.is_none()
            && (self.shed_in_interval || self.in_flight > 0);
        // Everything was shed but probes: the next interval probes too (a
        // probe answered within its interval is not traffic let through).
        let shed_all = self.shed_in_interval && (unmeasured || !self.passed);
        if unmeasured {
            self.starved = self.overloaded && shed_all;
            self.reset_interval(now_ms, elapsed);
            return None;
        }
        if !self.exit_on_empty && !idle && elapsed >= 2 * self.interval_ms {
            // Latency mode, answers late: the span closes as one interval.
            self.last_min = self.min_in_interval;
            self.overloaded = self.last_min.is_some_and(|m| m > self.target_ms);
            self.starved = self.overloaded && shed_all;
            self.reset_interval(now_ms, elapsed);
            return (before != self.overloaded).then_some(self.overloaded);
        }
        self.last_min = if idle { None } else { self.min_in_interval };
        let standing = self.last_min.is_some_and(|m| m > self.target_ms);
        self.overloaded = if self.overloaded && self.exit_on_empty {
            // An idle gap (more than one interval without a sample) always
            // ends overload, whatever the last busy interval saw.
            let calm =
                idle || !self.shed_in_interval && (self.last_min.is_none() || self.saw_empty);
            !calm
        } else {
            standing
        };
        // Read in latency mode only, where an idle gap is no overload.
        self.starved = self.overloaded && shed_all;
        self.reset_interval(now_ms, elapsed);
        (before != self.overloaded).then_some(self.overloaded)
    }

    fn reset_interval(&mut self, now_ms: u64, elapsed: u64) {
        self.min_in_interval = None;
        self.saw_empty = false;
        self.shed_in_interval = false;
        self.probed = false;
        self.passed = false;
        self.interval_start = now_ms - elapsed % self.interval_ms;
    }

    /// Records one request's queueing delay (0 for a request admitted
    /// without queueing: the queue was empty).
    pub fn observe(&mut self, now_ms: u64, delay_ms: u64) -> Option<bool> {
        let changed = self.roll(now_ms);
        self.saw_empty |= delay_ms == 0;
        self.min_in_interval = Some(self.min_in_interval.map_or(delay_ms, |m| m.min(delay_ms)));
        changed
    }

    /// Enters overload now, without waiting for an interval to judge the
    /// queue (see `Shedders::overload_while_learning`). Returns `Some(true)`
    /// when the state changed.
    pub fn overload(&mut self, now_ms: u64) -> Option<bool> {
        let rolled = self.roll(now_ms);
        if self.overloaded {
            return rolled;
        }
        self.overloaded = true;
        // Left overload in that roll and back now: no change.
        rolled.is_none().then_some(true)
    }

    /// Records that a request had to be shed (queue mode: overload goes on).
    pub fn shed(&mut self, now_ms: u64) -> Option<bool> {
        let changed = self.roll(now_ms);
        self.shed_in_interval = true;
        changed
    }

    /// The longest a request of `class` may wait before being shed by
    /// CoDel, or `None` if CoDel does not shed it now.
    pub fn threshold(&self, class: Class) -> Option<u64> {
        if !self.overloaded {
            return None;
        }
        match class {
            Class::Sheddable => Some(0),
            Class::Default => Some(2 * self.target_ms),
            Class::Critical => None,
        }
    }

    /// For routes without a sluice queue: whether a request of `class`
    /// should be shed on arrival given the estimated delay of the last
    /// interval (sheddable above target, default above twice the target).
    /// After an interval in which everything was shed (no sample), the
    /// first request of each interval that would be shed goes through
    /// instead, as a probe.
    pub fn shed_on_arrival(&mut self, now_ms: u64, class: Class) -> bool {
        self.roll(now_ms);
        let Some(delay) = self.last_min else {
            self.passed = true;
            return false;
        };
        let shed = self.overloaded
            && match class {
                Class::Sheddable => delay > self.target_ms,
                Class::Default => delay > 2 * self.target_ms,
                Class::Critical => false,
            };
        if shed && self.starved && !self.probed {
            self.probed = true;
            return false;
        }
        if shed {
            self.shed_in_interval = true;
        } else {
            self.passed = true;
        }
        shed
    }
}
