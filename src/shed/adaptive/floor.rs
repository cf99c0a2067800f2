//! The latency floor: its estimate (the lowest latency seen in the window,
//! or a floor measured at a held limit if higher), and its measurement as
//! Envoy's `adaptive_concurrency` measures its own: started, judged and
//! expired here.

use super::spec::AdaptiveSpec;
use super::state::{Auto, Measured};

/// After a measurement starts, how long until every worker admits under
/// the held limit: each reads the limit on its tick, at least every 100 ms.
const READ_LAG_MS: u64 = 100;
/// Responses averaged for a measured floor (as Envoy's
/// `adaptive_concurrency` takes 50 by default, at its minimum concurrency).
pub const CAL_SAMPLES: u64 = 50;
/// Responses that may end a measurement that finds nothing early
/// ([`Auto::finds_nothing`]).
const EARLY_SAMPLES: u64 = 10;
/// A measurement ends early, finding nothing, only after this many times
/// the average latency before it ([`Auto::finds_nothing`]).
const EARLY_SPAN: u64 = 5;
/// Held at `min`: how long a measurement gathers responses before 10 are
/// enough ([`Auto::measure`]).
const QUICK_MS: u64 = 400;

impl Auto {
    /// The floor estimate: the lowest latency seen in the window, or the
    /// floor measured at a held limit if that is higher.
    pub fn floor_us(&self) -> Option<u64> {
        let seen = self.lowest_us();
        match self.floor_cal {
            None | Some(Measured::NothingLearned) => seen,
            Some(Measured::FloorUs(cal)) => Some(seen.map_or(cal, |s| s.max(cal))),
        }
    }

    /// The lowest latency seen in the window.
    pub(super) fn lowest_us(&self) -> Option<u64> {
        match (self.floor_current_us, self.floor_previous_us) {
            (Some(c), Some(p)) => Some(c.min(p)),
            (c, p) => c.or(p),
        }
    }

    /// Holds the limit at `at` (within the bounds) to measure the floor.
    pub(super) fn start_measure(&mut self, spec: &AdaptiveSpec, at: u64, now_ms: u64) {
        let held = at.clamp(u64::from(spec.min).max(1), u64::from(spec.max).max(1));
        self.measure_limit = Some(held);
        self.measure_start_ms = now_ms;
        self.before_measure_milli = self.limit_milli;
        self.before_measure_avg_us = self.sum_us.checked_div(self.count);
        self.before_measure_count = self.count;
        self.limit_milli = held.saturating_mul(1000);
        self.stuck_run = 0;
        self.cal_sum_us = 0;
        self.cal_count = 0;
        self.cal_min_us = None;
    }

    /// Responses averaged for a measured floor: [`CAL_SAMPLES`], or 10 per
    /// request in flight if more (a mean over more requests in flight
    /// costs no more time, and a long-tailed upstream needs them: the
    /// mean of 50 exponential samples is off by 14% on average), at most
    /// 500.
    fn samples_to_measure(held: u64) -> u64 {
        held.saturating_mul(10).clamp(CAL_SAMPLES, 500)
    }

    /// While the floor is measured, the admission time (ms) from which a
    /// request's latency counts: every worker admits under the held limit
    /// by then, so nothing admitted since waits behind what the larger
    /// limit let in before (a response arriving after the start may have
    /// been admitted long before it, with an upstream slower than an
    /// interval).
    pub fn measured_from_ms(&self, spec: &AdaptiveSpec) -> Option<u64> {
        self.measure_limit.map(|_| {
            self.measure_start_ms
                .saturating_add(spec.interval_ms.max(READ_LAG_MS))
        })
    }

    /// The floor measured as Envoy's `adaptive_concurrency` measures its
    /// own, at a held low limit: the average latency of the first
    /// [`CAL_SAMPLES`] requests admitted under it ([`Samples::add_measured`]).
    /// Then the limit moves on from there, or, if the floor stays the
    /// lowest seen, from where it was before. A measurement that gets too
    /// few samples within `floor_window` (idle, or slots held long after
    /// their response headers) gives up, and the limit is given back.
    ///
    /// Held at `min`, a measurement ends [`QUICK_MS`] after the held limit
    /// reached every worker, with 10 responses or more (2 per held request
    /// if more): while requests wait, the limit stays at `min` for about
    /// half a second (with the time for the held limit to reach every
    /// worker), not the second or more that 50 responses of 2 slots take.
    /// Then it steps up at once, as a growth by a gradient of `tolerance`
    /// would, if the floor is learned: left at `min` for another interval,
    /// the few responses of it (5 to 8 of 2 slots of 10 to 50 ms) looked
    /// queued half of the time, and the floor was measured again. If
    /// nothing was learned but nothing queues at `min` either (the
    /// responses came within the tolerance of the lowest latency), it
    /// steps to one over `min`, the spare a shrink keeps, and the next
    /// interval's step is skipped: its responses were let in at `min`, and
    /// grown on them an upstream of exactly `min` slots saw the limit go
    /// from 2 to 7 and back every second, a queue of 1.25 at it.
    ///
    /// [`Samples::add_measured`]: super::samples::Samples::add_measured
    pub(super) fn measure(&mut self, spec: &AdaptiveSpec, held: u64, now_ms: u64) {
        let timed_out = now_ms.saturating_sub(self.measure_start_ms) >= spec.floor_window_ms;
        let at_min = held <= u64::from(spec.min);
        let quick = at_min
            && self
                .measured_from_ms(spec)
                .is_some_and(|from| now_ms >= from.saturating_add(QUICK_MS));
        // At the deadline, what came in is enough if at least 10, or 2 per
        // held request (an upstream slower than a few hundred ms does not
        // bring 50 within a window at a low limit).
        let enough = if timed_out || quick {
            held.saturating_mul(2).max(10)
        } else {
            Self::samples_to_measure(held)
        };
        let low = self.lowest_us();
        let avg = self.cal_sum_us.checked_div(self.cal_count).filter(|&a| {
            self.cal_count >= enough || self.finds_nothing(spec, held, low, a, now_ms)
        });
        if avg.is_none() && !timed_out {
            return;
        }
        let learned = avg.filter(|&a| self.teaches(spec, held, low, a));
        let no_queue = avg.is_some_and(|a| low.is_none_or(|l| within_tolerance(spec, l, a)));
        if at_min && learned.is_some() {
            self.limit_milli = lifted(spec, held);
        } else if at_min && no_queue {
            self.limit_milli = held
                .saturating_add(1)
                .min(u64::from(spec.max))
                .saturating_mul(1000);
            self.quiet = 1;
        } else if learned.is_none() {
            self.limit_milli = self.before_measure_milli;
            self.quiet = 1;
        }
        self.floor_cal = Some(match (learned, avg, self.floor_cal) {
            (Some(avg), _, _) => Measured::FloorUs(avg.max(1)),
            // Too few: a measured floor in force stays.
            (None, None, Some(kept)) => kept,
            _ => Measured::NothingLearned,
        });
        self.floor_cal_ms = now_ms;
        self.measure_limit = None;
        self.cal_sum_us = 0;
        self.cal_count = 0;
        // The lowest latency when a floor was measured, to tell when the
        // upstream becomes faster ([`Auto::follow_faster`]).
        self.cal_min_us = match self.floor_cal {
            Some(Measured::FloorUs(_)) => low,
            _ => None,
        };
    }

    /// Whether a measurement's average `avg` of responses is the floor.
    ///
    /// Only if the lowest latency seen is below it by more than the
    /// tolerance: within it, the limit was held by a real queue, and the
    /// floor stays the lowest seen (following it down if it falls), with
    /// nothing measured again until `floor_window`.
    /// Nor if the upstream became slower during the hold, its capacity
    /// falling (8 held on 2 slots of 20 ms measured 80 ms, and the limit
    /// then kept a queue of 10 at the upstream for the floor's window):
    /// held at or under what it served, it cannot queue more than before,
    /// so the average is within the tolerance of the interval's before the
    /// hold, and the fastest measured response is below the average by
    /// more than the tolerance (the upstream's own time varies: the reason
    /// to measure), where all of them would wait in a queue. Not the
    /// fastest at `min`, where the limit cannot go lower anyway: the 20 to
    /// 30 responses of a measurement there often have no fast one (24 of
    /// 18 to 54 ms: 21 ms the fastest, within 1.65 times their average).
    fn teaches(&self, spec: &AdaptiveSpec, held: u64, low: Option<u64>, avg: u64) -> bool {
        // Only an average of enough responses to compare with.
        let before = match self.before_measure_count {
            n if n >= CAL_SAMPLES / 2 => self.before_measure_avg_us,
            _ => None,
        };
        !low.is_some_and(|l| within_tolerance(spec, l, avg))
            && (held <= u64::from(spec.min)
                || self
                    .cal_min_us
                    .is_some_and(|f| !within_tolerance(spec, f, avg)))
            && before.is_none_or(|b| within_tolerance(spec, b, avg))
    }

    /// Whether the responses measured so far already say what the
    /// measurement's end would, nothing learned, for an upstream whose own
    /// time barely varies: a steady upstream held at its capacity idles a
    /// slot through each hand-over (4 slots of 20 ms held at 4 served 12%
    /// less for 0.4 to 0.6 s in `bench/overload.py`, and half as much when
    /// the capacity rose to 8 during the hold). Not before [`EARLY_SPAN`]
    /// times the average latency before the hold (at least two intervals)
    /// has passed since the held limit reached every worker: the first
    /// responses back are the fastest. A bimodal upstream's (90% in 10 ms,
    /// 10% in 100 ms) were all fast, and 16 of 20 of its measurements
    /// after the floor's window ended on 15 to 20 of them as if a queue
    /// had held the limit (2 of 20 with this wait); the floor fell to the
    /// lowest latency and the limit to `min`, where it sat for 1.3 s in
    /// one run of 60 with its workers starved of CPU. Then two conditions:
    /// - at least [`EARLY_SAMPLES`] responses (2 per held request if
    ///   more) average within 1 + ¾ × (tolerance − 1) times the lowest
    ///   latency (a margin for the responses still to come);
    /// - the interval before the hold (of at least [`EARLY_SAMPLES`]
    ///   responses) averaged what such an upstream averages with the
    ///   limit in flight then: within the tolerance × (limit before ÷ held
    ///   limit) times the lowest latency (a queue of the
    ///   difference). An upstream whose own time varies widely (the reason
    ///   to measure) averages several times its lowest latency before the
    ///   hold: 8 slots, 80% of responses in 5 ms and 20% in 200 ms, 8.8
    ///   times, against 1.56 allowed. Without this condition such an
    ///   upstream's first responses back, the fast ones, would end its
    ///   measurements early and leave it less used.
    fn finds_nothing(
        &self,
        spec: &AdaptiveSpec,
        held: u64,
        low: Option<u64>,
        avg: u64,
        now_ms: u64,
    ) -> bool {
        let needed = held.saturating_mul(2).max(EARLY_SAMPLES);
        let Some(low) = low else {
            return false;
        };
        let span_ms = self
            .before_measure_avg_us
            .map_or(0, |b| b.saturating_mul(EARLY_SPAN) / 1000)
            .max(spec.interval_ms.saturating_mul(2));
        let from = self.measured_from_ms(spec).unwrap_or(self.measure_start_ms);
        if now_ms < from.saturating_add(span_ms) {
            return false;
        }
        if self.cal_count < needed || self.before_measure_count < EARLY_SAMPLES {
            return false;
        }
        let tol = u128::from(spec.tolerance_pct);
        let early = 100 + tol.saturating_sub(100) * 3 / 4;
        // tolerance × before ÷ held, in hundredths (the limit before in
        // thousandths, as learned, not rounded).
        let held_milli = u128::from(held.max(1)) * 1000;
        let before_milli = u128::from(self.before_measure_milli).max(held_milli);
        let steady = tol * before_milli / held_milli;
        within_pct(early, low, avg)
            && self
                .before_measure_avg_us
                .is_some_and(|b| within_pct(steady, low, b))
    }

    /// A measured floor holds for `floor_window`; then it is dropped (the
    /// upstream may have become faster) and, if the lowest latency seen is
    /// still below it by more than the tolerance (that floor alone would
    /// take the limit down again), measured again at once.
    pub(super) fn expire_measured(&mut self, spec: &AdaptiveSpec, now_ms: u64) {
        let Some(cal) = self.floor_cal else {
            return;
        };
        if self.measure_limit.is_some()
            || now_ms.saturating_sub(self.floor_cal_ms) < spec.floor_window_ms
        {
            return;
        }
        self.floor_cal = None;
        self.cal_min_us = None;
        // Nothing learned: the floor is the lowest latency seen already.
        let Measured::FloorUs(measured) = cal else {
            return;
        };
        let Some(low) = self
            .lowest_us()
            .filter(|&l| !within_tolerance(spec, l, measured))
        else {
            return;
        };
        // What the upstream served at once by the lowest latency: at or
        // under its capacity, however wrong the measured floor was
        // (measuring over the capacity takes the queue for the floor, and
        // each measurement would ratchet it up). But not below what it
        // served divided by 4 × the tolerance: the lowest latency of a
        // long-tailed upstream is next to nothing. A measured floor `f`
        // times too high then measures at most `f / (4 × tolerance)` times
        // over, so an error shrinks at each measurement instead of
        // growing.
        let at = self.measure_point(spec, low, measured);
        self.start_measure(spec, at, now_ms);
    }

    /// A response faster than the lowest latency seen when the floor was
    /// measured, by more than the tolerance: the upstream became faster,
    /// and the measured floor in force (the average latency of the slower
    /// upstream) would let a queue build at it. It expires at the end of
    /// the interval, and is measured again if the lowest latency is still
    /// below it by more than the tolerance ([`Auto::expire_measured`]).
    /// Not if the lowest latency then was under a 4 × tolerance-th of that
    /// floor (a long-tailed upstream's, next to nothing, which a few
    /// responses lower further). A queue already standing at the upstream
    /// when it becomes faster keeps its faster responses out of sight: the
    /// floor then waits for a run of shrinks held back or its window.
    pub(super) fn follow_faster(&mut self, spec: &AdaptiveSpec, latency_us: u64, now_ms: u64) {
        let Some(Measured::FloorUs(floor)) = self.floor_cal else {
            return;
        };
        let Some(then) = self.cal_min_us.filter(|_| self.measure_limit.is_none()) else {
            return;
        };
        let tol = u128::from(spec.tolerance_pct);
        let telling = u128::from(then) * 4 * tol >= u128::from(floor) * 100;
        if telling && !within_tolerance(spec, latency_us, then) {
            self.floor_cal_ms = now_ms.saturating_sub(spec.floor_window_ms);
            self.cal_min_us = None;
        }
    }

    pub(super) fn measure_point(&self, spec: &AdaptiveSpec, low: u64, floor: u64) -> u64 {
        let tol = u128::from(spec.tolerance_pct.max(100));
        let serving = u128::from(self.serving_milli);
        let by_lowest = serving * u128::from(low) / u128::from(floor.max(1));
        held_limit(by_lowest.max(serving * 100 / (4 * tol)))
    }
}

/// The whole limit a measurement holds for what the upstream serves at
/// once (in thousandths): rounded up from three quarters. A real upstream
/// serves a little under its rate (2 slots: 1.9), and cut down to 1 half
/// of it idled through the measurement; rounded up from a half, a
/// standing queue of one over 1 slot (1.6) was measured at 2, queued, and
/// the lowest latency it should have reset stayed high.
pub(super) fn held_limit(serving_milli: u128) -> u64 {
    u64::try_from(serving_milli.saturating_add(250) / 1000).unwrap_or(u64::MAX)
}

/// The limit (in thousandths) a measurement held at `held` steps up to,
/// as a growth by a gradient of `tolerance`: `held × tolerance + √held`,
/// at most `max`.
fn lifted(spec: &AdaptiveSpec, held: u64) -> u64 {
    let h = held as f64;
    let up = h * f64::from(spec.tolerance_pct) / 100.0 + h.sqrt();
    (up.min(f64::from(spec.max)) * 1000.0) as u64
}

/// Whether `latency_us` is within the tolerance of the lowest latency
/// `low_us` (no queueing by that floor).
fn within_tolerance(spec: &AdaptiveSpec, low_us: u64, latency_us: u64) -> bool {
    within_pct(u128::from(spec.tolerance_pct), low_us, latency_us)
}

/// Whether `latency_us` is at most `pct`% of `low_us`.
fn within_pct(pct: u128, low_us: u64, latency_us: u64) -> bool {
    u128::from(low_us) * pct >= u128::from(latency_us) * 100
}
