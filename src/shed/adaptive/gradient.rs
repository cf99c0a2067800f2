//! The limit's update at the end of an interval: what the interval saw
//! ([`Seen`]), the gradient and the next limit within the bounds, and the
//! count of shrinks held back that starts a measurement of the floor.

use super::floor::held_limit;
use super::spec::AdaptiveSpec;
use super::state::{Auto, Measured};

/// Shrinks held back (by less than 15%), counted up and down by each
/// growth, before the floor is measured.
pub(crate) const STUCK_RUN: u64 = 6;
/// The rate of responses counts when every batch merged in the interval
/// spans at most this part of it (a worker merges its samples on its
/// 1 ms tick while the limit is in full use).
const RATE_SPANS: u64 = 10;

impl Auto {
    /// The next limit (or a measurement of the floor) from the interval's
    /// samples, and a new interval.
    pub(super) fn end_interval(&mut self, spec: &AdaptiveSpec, now_ms: u64, elapsed_ms: u64) {
        self.expire_measured(spec, now_ms);
        let measuring = self.measure_limit.is_some() || self.quiet > 0;
        self.quiet = self.quiet.saturating_sub(1);
        if let Some(held) = self.measure_limit {
            self.measure(spec, held, now_ms);
        }
        if let (Some(floor), Some(avg), false) = (
            self.floor_us(),
            self.sum_us.checked_div(self.count),
            measuring,
        ) {
            // The rate of responses only if every batch is a small part
            // of the interval: a worker merging on its slow tick (100 ms)
            // brings samples from up to a tick before, which the interval
            // would count as its own (or the next interval would).
            let timely = self.max_span_ms.saturating_mul(RATE_SPANS) <= elapsed_ms;
            let seen = Seen {
                avg_us: avg,
                peak: self.peak_inflight,
                served: if timely { self.count } else { 0 },
                elapsed_ms,
            };
            self.step(spec, floor, &seen, now_ms);
        }
        self.interval_start_ms = now_ms;
        self.sum_us = 0;
        self.count = 0;
        self.peak_inflight = 0;
        self.max_span_ms = 0;
    }

    /// The next limit from what the interval saw; and the start of a
    /// measurement of the floor when a shrink has been held back by the
    /// bounds for [`STUCK_RUN`] intervals with no measured floor, or at
    /// once when the limit would shrink to `min` or below (the whole limit,
    /// rounded).
    ///
    /// The lowest latency seen is the floor of an upstream whose service
    /// time barely varies. Of one whose service time varies widely even
    /// when nothing queues (10 to 50 ms), it is far below the average:
    /// every interval looks queued and the limit falls until its bounds
    /// hold it (`adaptive.min`, or one over what the upstream serves at
    /// that floor), leaving the upstream mostly idle. There the floor is
    /// measured instead ([`Auto::measure`]).
    fn step(&mut self, spec: &AdaptiveSpec, floor_us: u64, seen: &Seen, now_ms: u64) {
        let limit = self.limit_milli as f64 / 1000.0;
        let g = gradient(spec, limit, floor_us, seen);
        let next = next_limit(spec, limit, g, floor_us, seen);
        let serving = seen.serving(limit, floor_us);
        self.serving_milli = (serving * 1000.0) as u64;
        // Held back: a shrink by less than 15% (10% left an upstream of 31
        // to 111 ms 42% used: its shrinks of 10 to 13% never counted).
        // Counted up, and down by a growth (noise lets one through now and
        // then). Not within a window of a measurement that left the floor
        // at the lowest latency (a real queue held the limit), unless the
        // limit has since fallen to half of the one before it (no longer
        // held by that queue: the upstream changed; its noise
        // starting, 12 slots of 20 ms becoming 20 to 45 ms, held the limit
        // at 3 for 3 to 4 s in Envoy); nor within a quarter window of one
        // that measured it (it may have come out low).
        let since = now_ms.saturating_sub(self.floor_cal_ms);
        let may_measure = match self.floor_cal {
            None => true,
            Some(Measured::NothingLearned) => {
                since >= spec.floor_window_ms
                    || self.limit_milli.saturating_mul(2) <= self.before_measure_milli
            }
            Some(Measured::FloorUs(_)) => since >= spec.floor_window_ms / 4,
        };
        self.stuck_run = if !may_measure {
            0
        } else if g >= 1.0 {
            self.stuck_run.saturating_sub(1)
        } else if next.saturating_mul(20) >= self.limit_milli.saturating_mul(17) {
            self.stuck_run.saturating_add(1).min(STUCK_RUN)
        } else {
            self.stuck_run
        };
        let min = u64::from(spec.min);
        if g < 1.0 && next.saturating_add(500) / 1000 <= min {
            // At `min` and still looking queued: measured there at once,
            // whatever the run or the last measurement (a real queue at
            // `min` measures nothing, and the limit stays where it is).
            self.limit_milli = next;
            self.start_measure(spec, min, now_ms);
        } else if self.stuck_run >= STUCK_RUN {
            // What the upstream serves at once by this floor: under its
            // capacity if the floor is too low, at it if a queue holds the
            // limit (nothing queues either way); by the lowest latency if a
            // measured floor is over it (it may be too high).
            let at = match self.lowest_us() {
                Some(low) if floor_us > low => self.measure_point(spec, low, floor_us),
                _ => held_limit(u128::from(self.serving_milli)),
            };
            self.start_measure(spec, at, now_ms);
        } else {
            self.limit_milli = next;
        }
    }
}

/// What one interval saw, from every worker.
struct Seen {
    /// The average latency of the responses in it.
    avg_us: u64,
    /// The most requests in flight.
    peak: u64,
    /// How many responses, over how long.
    served: u64,
    elapsed_ms: u64,
}

impl Seen {
    /// How many requests the upstream serves at once at its floor latency,
    /// by Little's law, the larger of two estimates: the requests in flight
    /// × floor / latency, and the rate of responses × floor. The first
    /// alone falls short after the limit came down: the interval's
    /// responses still waited behind the larger number let in before
    /// (their latency is a limit's worth behind), so the upstream looks
    /// slower than it is. The rate of responses does not lag.
    fn serving(&self, limit: f64, floor_us: u64) -> f64 {
        let floor = floor_us as f64;
        let by_latency = (self.peak as f64).min(limit) * floor / self.avg_us.max(1) as f64;
        by_latency.max(self.by_rate(floor_us))
    }

    fn by_rate(&self, floor_us: u64) -> f64 {
        self.served as f64 * floor_us as f64 / (self.elapsed_ms.max(1) as f64 * 1000.0)
    }
}

/// The gradient: `tolerance × floor / latency`, or `tolerance × rate ×
/// floor / in flight` if larger (see [`Seen::serving`]), at least half and
/// at most double.
fn gradient(spec: &AdaptiveSpec, limit: f64, floor_us: u64, seen: &Seen) -> f64 {
    let avg = seen.avg_us.max(1) as f64;
    let tolerance = f64::from(spec.tolerance_pct) / 100.0;
    let by_latency = floor_us as f64 * tolerance / avg;
    let inflight = (seen.peak as f64).min(limit).max(1.0);
    let by_rate = seen.by_rate(floor_us) * tolerance / inflight;
    by_latency.max(by_rate).clamp(0.5, 2.0)
}

/// The step: `limit × gradient`; it grows (by that, plus `√limit` of headroom)
/// only while there is no queueing and the limit was more than half used
/// (an idle upstream teaches nothing about its capacity); within the
/// bounds. Growing by the gradient as well as the headroom reaches an
/// upstream whose capacity doubled in about two intervals instead of
/// four, so its new slots are not left idle meanwhile.
///
/// A shrink keeps one request over what the upstream serves at its floor
/// latency ([`Seen::serving`]): at a small capacity the tolerance alone
/// would not allow one (with 2 slots, a third request in flight makes the
/// average 1.5 times the floor), and a limit at the capacity leaves a slot
/// idle through every hand-over from a finished request to the next one
/// admitted.
fn next_limit(spec: &AdaptiveSpec, limit: f64, gradient: f64, floor_us: u64, seen: &Seen) -> u64 {
    let mut next = limit * gradient.min(1.0);
    if gradient >= 1.0 && (seen.peak as f64) * 2.0 >= limit {
        next = limit * gradient + limit.sqrt();
    } else if gradient < 1.0 {
        next = next.max(seen.serving(limit, floor_us) + 1.0).min(limit);
    }
    let next = next.clamp(f64::from(spec.min), f64::from(spec.max));
    (next * 1000.0) as u64
}
