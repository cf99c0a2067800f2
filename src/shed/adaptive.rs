//! An adaptive concurrency limit (`concurrency.max: "auto"`), learned from
//! latency as Netflix's gradient limiter and Envoy's `adaptive_concurrency`
//! do: while admitted requests take about as long as the upstream's
//! no-load floor, the limit grows in proportion and by about its square
//! root per interval; when they take longer (the upstream queues), it
//! shrinks in proportion (`limit × tolerance × floor / latency`, at most
//! halving per interval), keeping one request over what the upstream
//! serves at its floor latency.
//!
//! Shared across Envoy's workers: each worker adds its latency samples to
//! one shared entry on its tick (one CAS per tick, never per request), and
//! the first worker to find an interval over computes the next limit from
//! everyone's samples. The floor is the lowest latency seen over the last
//! one to two half-windows of `floor_window`, so it follows an upstream
//! whose own speed changes, within a window. Every worker reads the limit
//! back on its tick: an update reaches all of them within a tick.

use crate::codec::{check, checked_body, Corrupt, Reader};

/// Validated settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveSpec {
    /// Bounds of the limit.
    pub min: u32,
    pub max: u32,
    /// The limit before anything is learned.
    pub initial: u32,
    /// Latency up to `floor × tolerance_pct / 100` counts as no queueing.
    pub tolerance_pct: u32,
    /// How often the limit is recomputed.
    pub interval_ms: u64,
    /// The floor is the minimum over the last one to two half-windows.
    pub floor_window_ms: u64,
}

/// Latency samples one worker gathered since its last tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Samples {
    pub sum_us: u64,
    pub count: u64,
    pub min_us: Option<u64>,
    /// The most requests in flight (all workers) this worker saw.
    pub peak_inflight: u64,
    /// How long since the first of these samples came (ms): the stretch
    /// of time they come from.
    pub span_ms: u64,
    /// While the floor is measured: the latencies of the requests
    /// admitted under the held limit ([`Auto::measured_from_ms`]).
    pub cal_sum_us: u64,
    pub cal_count: u64,
    /// The fastest of them.
    pub cal_min_us: Option<u64>,
}

impl Samples {
    pub fn add(&mut self, latency_us: u64) {
        self.sum_us = self.sum_us.saturating_add(latency_us);
        self.count += 1;
        self.min_us = Some(self.min_us.map_or(latency_us, |m| m.min(latency_us)));
    }

    /// A latency that counts towards a measurement of the floor.
    pub fn add_measured(&mut self, latency_us: u64) {
        self.cal_sum_us = self.cal_sum_us.saturating_add(latency_us);
        self.cal_count += 1;
        self.cal_min_us = Some(self.cal_min_us.map_or(latency_us, |m| m.min(latency_us)));
    }
}

/// After a measurement starts, how long until every worker admits under
/// the held limit: each reads the limit on its tick, at least every 100 ms.
const READ_LAG_MS: u64 = 100;

/// The shared entry: the limit (in thousandths, so that small steps add
/// up), the floor's two half-windows, and the current interval's samples
/// from every worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Auto {
    pub limit_milli: u64,
    pub floor_current_us: u64,
    pub floor_previous_us: u64,
    pub floor_rotated_ms: u64,
    pub interval_start_ms: u64,
    pub sum_us: u64,
    pub count: u64,
    pub peak_inflight: u64,
    /// The longest span of a batch of samples merged in this interval.
    pub max_span_ms: u64,
    /// The floor measured at a low limit ([`Auto::measure`]), and when
    /// (`NONE`: none).
    pub floor_cal_us: u64,
    pub floor_cal_ms: u64,
    /// Samples gathered towards that measurement, and the fastest of
    /// them (`NONE`: none yet).
    pub cal_sum_us: u64,
    pub cal_count: u64,
    pub cal_min_us: u64,
    /// How many intervals in a row the limit wanted to shrink and could
    /// not.
    pub stuck_run: u64,
    /// The limit held while measuring the floor (0: not measuring), and
    /// since when.
    pub measure_limit: u64,
    pub measure_start_ms: u64,
    /// What the upstream served at once in the last interval, by Little's
    /// law at the floor ([`Seen::serving`]), in thousandths.
    pub serving_milli: u64,
    /// The limit before the measurement, given back if the floor stays.
    pub before_measure_milli: u64,
    /// The average latency of the interval before the measurement (`NONE`:
    /// no response), and of how many responses.
    pub before_measure_avg_us: u64,
    pub before_measure_count: u64,
    /// Intervals left whose step is skipped: the one after a limit is
    /// given back (its responses were let in under the held limit).
    pub quiet: u64,
}

const VERSION: u8 = 5;
const BODY: usize = 1 + 22 * 8;
/// Responses averaged for a measured floor (as Envoy's
/// `adaptive_concurrency` takes 50 by default, at its minimum concurrency).
pub const CAL_SAMPLES: u64 = 50;
/// Responses that may end a measurement that finds nothing early
/// ([`Auto::finds_nothing`]).
const EARLY_SAMPLES: u64 = 10;
/// Shrinks held back (by less than 15%), counted up and down by each
/// growth, before the floor is measured.
pub(crate) const STUCK_RUN: u64 = 6;
/// No floor seen yet.
const NONE: u64 = u64::MAX;
/// A floor measurement that left the floor at the lowest latency seen.
const NOTHING_LEARNED: u64 = 0;
/// The rate of responses counts when every batch merged in the interval
/// spans at most this part of it (a worker merges its samples on its
/// 1 ms tick while the limit is in full use).
const RATE_SPANS: u64 = 10;

impl Auto {
    /// A fresh entry at the initial limit.
    pub fn new(spec: &AdaptiveSpec, now_ms: u64) -> Self {
        Auto {
            limit_milli: u64::from(spec.initial) * 1000,
            floor_current_us: NONE,
            floor_previous_us: NONE,
            floor_rotated_ms: now_ms,
            interval_start_ms: now_ms,
            sum_us: 0,
            count: 0,
            peak_inflight: 0,
            max_span_ms: 0,
            floor_cal_us: NONE,
            floor_cal_ms: now_ms,
            cal_sum_us: 0,
            cal_count: 0,
            cal_min_us: NONE,
            stuck_run: 0,
            measure_limit: 0,
            measure_start_ms: 0,
            serving_milli: 0,
            before_measure_milli: 0,
            before_measure_avg_us: NONE,
            before_measure_count: 0,
            quiet: 0,
        }
    }

    /// The limit in whole requests, rounded to the nearest (rounding down
    /// would keep a small limit half a request below what was learned: 2
    /// instead of 2.5 leaves an upstream of 2 slots idle between requests).
    pub fn limit(&self) -> u64 {
        self.limit_milli.saturating_add(500) / 1000
    }

    /// The floor estimate: the lowest latency seen in the window, or the
    /// floor measured at a held limit if that is higher.
    pub fn floor_us(&self) -> Option<u64> {
        let seen = self.lowest_us();
        match self.floor_cal_us {
            NONE | NOTHING_LEARNED => seen,
            cal => Some(seen.map_or(cal, |s| s.max(cal))),
        }
    }

    /// The lowest latency seen in the window.
    fn lowest_us(&self) -> Option<u64> {
        let f = self.floor_current_us.min(self.floor_previous_us);
        (f != NONE).then_some(f)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BODY + 4);
        out.push(VERSION);
        for v in [
            self.limit_milli,
            self.floor_current_us,
            self.floor_previous_us,
            self.floor_rotated_ms,
            self.interval_start_ms,
            self.sum_us,
            self.count,
            self.peak_inflight,
            self.max_span_ms,
            self.floor_cal_us,
            self.floor_cal_ms,
            self.cal_sum_us,
            self.cal_count,
            self.cal_min_us,
            self.stuck_run,
            self.measure_limit,
            self.measure_start_ms,
            self.serving_milli,
            self.before_measure_milli,
            self.before_measure_avg_us,
            self.before_measure_count,
            self.quiet,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let sum = check(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Auto, Corrupt> {
        if bytes.len() != BODY + 4 || bytes.first() != Some(&VERSION) {
            return Err(Corrupt);
        }
        let body = checked_body(bytes, BODY)?;
        let mut r = Reader(body.get(1..).ok_or(Corrupt)?);
        let mut next = || r.u64();
        Ok(Auto {
            limit_milli: next()?,
            floor_current_us: next()?,
            floor_previous_us: next()?,
            floor_rotated_ms: next()?,
            interval_start_ms: next()?,
            sum_us: next()?,
            count: next()?,
            peak_inflight: next()?,
            max_span_ms: next()?,
            floor_cal_us: next()?,
            floor_cal_ms: next()?,
            cal_sum_us: next()?,
            cal_count: next()?,
            cal_min_us: next()?,
            stuck_run: next()?,
            measure_limit: next()?,
            measure_start_ms: next()?,
            serving_milli: next()?,
            before_measure_milli: next()?,
            before_measure_avg_us: next()?,
            before_measure_count: next()?,
            quiet: next()?,
        })
    }

    /// Adds a worker's samples and, once an interval is over, computes the
    /// next limit from every worker's samples.
    pub fn merge(mut self, spec: &AdaptiveSpec, s: &Samples, now_ms: u64) -> Auto {
        if now_ms.saturating_sub(self.floor_rotated_ms) >= spec.floor_window_ms / 2 {
            self.floor_previous_us = self.floor_current_us;
            self.floor_current_us = NONE;
            self.floor_rotated_ms = now_ms;
        }
        if let Some(m) = s.min_us {
            self.floor_current_us = self.floor_current_us.min(m);
        }
        self.sum_us = self.sum_us.saturating_add(s.sum_us);
        self.count = self.count.saturating_add(s.count);
        self.peak_inflight = self.peak_inflight.max(s.peak_inflight);
        if s.count > 0 {
            self.max_span_ms = self.max_span_ms.max(s.span_ms);
        }
        if self.measure_limit > 0 {
            self.cal_sum_us = self.cal_sum_us.saturating_add(s.cal_sum_us);
            self.cal_count = self.cal_count.saturating_add(s.cal_count);
            if let Some(m) = s.cal_min_us {
                self.cal_min_us = self.cal_min_us.min(m);
            }
        }
        // An interval lasts at least twice the floor (up to half the
        // floor window; the average latency before there is a floor):
        // with an upstream slower than `interval`, responses come in
        // bursts an interval holds all or none of (4 slots of 200 ms: 8
        // in one interval, then none), and its rate said twice the
        // capacity; the limit then kept a queue the lowest latency took
        // for the floor, and ran up to its maximum. Not twice the average
        // latency: that stretched intervals while a queue drained after a
        // drop in capacity, and with a few very long requests.
        let elapsed_ms = now_ms.saturating_sub(self.interval_start_ms);
        let typical_us = self
            .floor_us()
            .or(self.sum_us.checked_div(self.count))
            .unwrap_or(0);
        let long_enough = spec
            .interval_ms
            .max((typical_us / 500).min(spec.floor_window_ms / 2));
        if elapsed_ms >= long_enough {
            self.end_interval(spec, now_ms, elapsed_ms);
        }
        self
    }

    /// The next limit (or a measurement of the floor) from the interval's
    /// samples, and a new interval.
    fn end_interval(&mut self, spec: &AdaptiveSpec, now_ms: u64, elapsed_ms: u64) {
        self.expire_measured(spec, now_ms);
        let measuring = self.measure_limit > 0 || self.quiet > 0;
        self.quiet = self.quiet.saturating_sub(1);
        if self.measure_limit > 0 {
            self.measure(spec, now_ms);
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
}

impl Auto {
    /// The next limit from what the interval saw; and the start of a
    /// measurement of the floor when a shrink has been held back by the
    /// bounds for [`STUCK_RUN`] intervals with no measured floor.
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
        // at the lowest latency (a real queue held the limit), nor within
        // a quarter window of one that measured it (it may have come out
        // low).
        let since = now_ms.saturating_sub(self.floor_cal_ms);
        let may_measure = match self.floor_cal_us {
            NONE => true,
            NOTHING_LEARNED => since >= spec.floor_window_ms,
            _ => since >= spec.floor_window_ms / 4,
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
        if self.stuck_run >= STUCK_RUN {
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

    /// Holds the limit at `at` (within the bounds) to measure the floor.
    fn start_measure(&mut self, spec: &AdaptiveSpec, at: u64, now_ms: u64) {
        self.measure_limit = at.clamp(u64::from(spec.min).max(1), u64::from(spec.max).max(1));
        self.measure_start_ms = now_ms;
        self.before_measure_milli = self.limit_milli;
        self.before_measure_avg_us = self.sum_us.checked_div(self.count).unwrap_or(NONE);
        self.before_measure_count = self.count;
        self.limit_milli = self.measure_limit.saturating_mul(1000);
        self.stuck_run = 0;
        self.cal_sum_us = 0;
        self.cal_count = 0;
        self.cal_min_us = NONE;
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
        (self.measure_limit > 0).then(|| {
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
    fn measure(&mut self, spec: &AdaptiveSpec, now_ms: u64) {
        let timed_out = now_ms.saturating_sub(self.measure_start_ms) >= spec.floor_window_ms;
        // At the deadline, what came in is enough if at least 10, or 2 per
        // held request (an upstream slower than a few hundred ms does not
        // bring 50 within a window at a low limit).
        let enough = if timed_out {
            self.measure_limit.saturating_mul(2).max(10)
        } else {
            Self::samples_to_measure(self.measure_limit)
        };
        let low = self.lowest_us();
        let avg = self
            .cal_sum_us
            .checked_div(self.cal_count)
            .filter(|&a| self.cal_count >= enough || self.finds_nothing(spec, low, a));
        if avg.is_none() && !timed_out {
            return;
        }
        // Used only if the lowest latency seen is below it by more than
        // the tolerance: within it, the limit was held by a real queue,
        // and the floor stays the lowest seen (following it down if it
        // falls), with nothing measured again until `floor_window`.
        // Nor if the upstream became slower during the hold, its
        // capacity falling (8 held on 2 slots of 20 ms measured 80 ms,
        // and the limit then kept a queue of 10 at the upstream for the
        // floor's window): held at or under what it served, it cannot
        // queue more than before, so the average is within the tolerance
        // of the interval's before the hold, and the fastest measured
        // response is below the average by more than the tolerance (the
        // upstream's own time varies: the reason to measure), where all
        // of them would wait in a queue.
        // Only an average of enough responses to compare with.
        let before = match self.before_measure_count {
            n if n >= CAL_SAMPLES / 2 => self.before_measure_avg_us,
            _ => NONE,
        };
        let fastest = self.cal_min_us;
        let learned = avg.filter(|&a| {
            !low.is_some_and(|l| within_tolerance(spec, l, a))
                && !within_tolerance(spec, fastest, a)
                && (before == NONE || within_tolerance(spec, before, a))
        });
        if learned.is_none() {
            self.limit_milli = self.before_measure_milli;
            self.quiet = 1;
        }
        self.floor_cal_us = match (learned, avg, self.floor_cal_us) {
            (Some(avg), _, _) => avg.max(1),
            // Too few: a measured floor in force stays.
            (None, None, kept) if kept != NONE => kept,
            _ => NOTHING_LEARNED,
        };
        self.floor_cal_ms = now_ms;
        self.measure_limit = 0;
        self.cal_sum_us = 0;
        self.cal_count = 0;
        self.cal_min_us = NONE;
    }

    /// Whether the responses measured so far already say what the
    /// measurement's end would, nothing learned, for an upstream whose own
    /// time barely varies: a steady upstream held at its capacity idles a
    /// slot through each hand-over (4 slots of 20 ms held at 4 served 12%
    /// less for 0.4 to 0.6 s in `bench/overload.py`, and half as much when
    /// the capacity rose to 8 during the hold). Two conditions:
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
    fn finds_nothing(&self, spec: &AdaptiveSpec, low: Option<u64>, avg: u64) -> bool {
        let needed = self.measure_limit.saturating_mul(2).max(EARLY_SAMPLES);
        let Some(low) = low else {
            return false;
        };
        if self.cal_count < needed || self.before_measure_count < EARLY_SAMPLES {
            return false;
        }
        let tol = u128::from(spec.tolerance_pct);
        let early = 100 + tol.saturating_sub(100) * 3 / 4;
        // tolerance × before ÷ held, in hundredths (the limit before in
        // thousandths, as learned, not rounded).
        let held_milli = u128::from(self.measure_limit.max(1)) * 1000;
        let before_milli = u128::from(self.before_measure_milli).max(held_milli);
        let steady = tol * before_milli / held_milli;
        within_pct(early, low, avg) && within_pct(steady, low, self.before_measure_avg_us)
    }

    /// A measured floor holds for `floor_window`; then it is dropped (the
    /// upstream may have become faster) and, if the lowest latency seen is
    /// still below it by more than the tolerance (that floor alone would
    /// take the limit down again), measured again at once.
    fn expire_measured(&mut self, spec: &AdaptiveSpec, now_ms: u64) {
        if self.floor_cal_us == NONE
            || self.measure_limit > 0
            || now_ms.saturating_sub(self.floor_cal_ms) < spec.floor_window_ms
        {
            return;
        }
        let measured = std::mem::replace(&mut self.floor_cal_us, NONE);
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

    fn measure_point(&self, spec: &AdaptiveSpec, low: u64, floor: u64) -> u64 {
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
fn held_limit(serving_milli: u128) -> u64 {
    u64::try_from(serving_milli.saturating_add(250) / 1000).unwrap_or(u64::MAX)
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

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn spec() -> AdaptiveSpec {
        AdaptiveSpec {
            min: 2,
            max: 200,
            initial: 10,
            tolerance_pct: 125,
            interval_ms: 100,
            floor_window_ms: 10_000,
        }
    }

    /// In the simulations below every response of an interval was
    /// admitted in it: while the floor is measured, all of an interval's
    /// samples count once it starts after the held limit reached every
    /// worker.
    fn measured(auto: &Auto, spec: &AdaptiveSpec, s: &mut Samples, interval_start_ms: u64) {
        if auto
            .measured_from_ms(spec)
            .is_some_and(|from| interval_start_ms >= from)
        {
            s.cal_sum_us = s.sum_us;
            s.cal_count = s.count;
            s.cal_min_us = s.min_us;
        }
    }

    #[test]
    fn round_trips_and_rejects_any_flipped_bit() {
        let a = Auto {
            limit_milli: 12_345,
            floor_current_us: 20_000,
            floor_previous_us: NONE,
            floor_rotated_ms: 7,
            interval_start_ms: 9,
            sum_us: 1 << 40,
            count: 77,
            peak_inflight: 12,
            max_span_ms: 3,
            floor_cal_us: 31_000,
            floor_cal_ms: 5,
            cal_sum_us: 40_000,
            cal_count: 2,
            cal_min_us: 15_000,
            stuck_run: 1,
            measure_limit: 3,
            measure_start_ms: 4,
            serving_milli: 2_500,
            before_measure_milli: 9_000,
            before_measure_avg_us: 21_000,
            before_measure_count: 30,
            quiet: 1,
        };
        let bytes = a.encode();
        assert_eq!(Auto::decode(&bytes), Ok(a));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert_eq!(Auto::decode(&bad), Err(Corrupt), "byte {i}");
        }
        assert_eq!(Auto::decode(&bytes[1..]), Err(Corrupt));
    }

    /// A simulated upstream with `capacity` slots and a fixed service time
    /// under a demand above any limit: of the limit's requests, the first
    /// `capacity` take the service time, the next wait one turn more, and
    /// so on.
    fn settle(mut auto: Auto, capacity: u64, now: &mut u64, rounds: u32) -> Auto {
        let service_us = 20_000;
        for _ in 0..rounds {
            let limit = auto.limit().max(1);
            let mut s = Samples {
                peak_inflight: limit,
                ..Samples::default()
            };
            for k in 0..limit {
                s.add(service_us * (k / capacity + 1));
            }
            measured(&auto, &spec(), &mut s, *now);
            *now += 100;
            auto = auto.merge(&spec(), &s, *now);
        }
        auto
    }

    /// An upstream serving a demand above any limit, interval by interval
    /// (see `Sim::run`).
    struct Sim {
        auto: Auto,
        now: u64,
        /// The limit and the capacity of the interval before.
        before: (u64, u64),
        /// Batches merged late, on a slow tick: each spans a whole
        /// interval, and they land unevenly (half as many responses, then
        /// one and a half times as many, in turn).
        late: bool,
        /// The share (%) of its rate the upstream serves: a real one
        /// serves a little under it (hand-overs between requests).
        served_pct: u64,
    }

    impl Sim {
        fn new(capacity: u64) -> Self {
            let now = 1_000_000;
            let auto = Auto::new(&spec(), now);
            let before = (auto.limit(), capacity);
            Sim {
                auto,
                now,
                before,
                late: false,
                served_pct: 100,
            }
        }

        /// `rounds` intervals of an upstream with `capacity` slots of
        /// 23 ms: its responses come at its rate, `min(limit, capacity)`
        /// per service time (the rate does not lag), but each waited
        /// behind the requests let in under the limit of the interval
        /// before, on the slots of then (the latency does). Returns the
        /// limit after each.
        fn run(&mut self, capacity: u64, rounds: u32) -> Vec<u64> {
            let service_us = 23_000;
            let mut limits = Vec::new();
            for _ in 0..rounds {
                let limit = self.auto.limit().max(1);
                let (before, before_cap) = self.before;
                let mut s = Samples {
                    peak_inflight: limit,
                    ..Samples::default()
                };
                let mut n = 5 * limit.min(capacity) * self.served_pct / 100;
                if self.late {
                    s.span_ms = 100;
                    n = if (self.now / 100) % 2 == 0 {
                        n / 2
                    } else {
                        n * 3 / 2
                    };
                }
                for k in 0..n {
                    // Of `before` in flight, the first `before_cap` take
                    // the service time, the next wait one turn more...
                    s.add(service_us * ((k % before.max(1)) / before_cap + 1));
                }
                // One response as fast as the upstream ever is (the
                // floor); the others took 15% longer (a loaded machine).
                s.add(service_us * 100 / 115);
                measured(&self.auto, &spec(), &mut s, self.now);
                self.now += 100;
                self.auto = self.auto.merge(&spec(), &s, self.now);
                self.before = (limit, capacity);
                limits.push(self.auto.limit());
            }
            limits
        }
    }

    #[test]
    fn a_lagging_latency_never_takes_the_limit_below_a_spare_over_the_capacity() {
        // The responses of an interval after a shrink still waited behind
        // the larger limit before it: by their latency alone the upstream
        // looked slower than it is, and the limit fell to the capacity or
        // below (4 slots: 7, 5, 4, 3... measured in bench/overload.py;
        // 5, 4, 4 here), leaving slots idle. Their rate says what the
        // upstream serves.
        //
        // Once per floor window, a shrink held back by the spare
        // leads to a measurement of the floor at the capacity:
        // within the tolerance of the lowest latency seen, so the floor
        // stays the lowest and the limit is given back.
        let mut sim = Sim::new(4);
        let mut held = 0;
        for (capacity, spare) in [(4, 5..=8), (8, 9..=16), (2, 3..=4)] {
            sim.run(capacity, 20);
            let limits = sim.run(capacity, 40);
            let out: Vec<u64> = limits
                .iter()
                .copied()
                .filter(|l| !spare.contains(l))
                .collect();
            assert!(out.iter().all(|&l| l == capacity), "{capacity}: {limits:?}");
            held += out.len();
        }
        assert!(held <= 12, "{held}");
        assert_eq!(sim.auto.floor_cal_us, NOTHING_LEARNED);
        assert_eq!(sim.auto.floor_us(), sim.auto.lowest_us());
        // The floor still follows a faster upstream down at once.
        let mut s = Samples::default();
        s.add(5_000);
        sim.now += 10;
        let auto = sim.auto.merge(&spec(), &s, sim.now);
        assert_eq!(auto.floor_us(), Some(5_000));
    }

    #[test]
    fn a_measurement_holds_the_limit_at_the_capacity_when_the_rate_is_a_little_under_it() {
        // A real upstream serves a little under its rate (2 slots: 1.9 by
        // Little's law). The held limit was that estimate truncated: 1 on
        // 2 slots, half the upstream idle for the 50 responses of a
        // measurement (in bench/overload.py, 1.1 s at half the goodput and
        // the worst p99 of the run). It is rounded up from three quarters.
        for capacity in [2, 3, 4, 8] {
            let mut sim = Sim::new(capacity);
            sim.served_pct = 95;
            let limits = sim.run(capacity, 60);
            let lowest = limits[10..].iter().copied().min();
            assert!(lowest >= Some(capacity), "{capacity}: {limits:?}");
            if capacity == 2 {
                // Held at the spare over 2 slots: measured, at 2 (from the
                // 8th interval; a steady upstream's measurement ends after
                // one interval of responses, [`Auto::finds_nothing`]).
                assert_eq!(limits[1..].iter().min(), Some(&2), "{limits:?}");
                assert_eq!(sim.auto.floor_cal_us, NOTHING_LEARNED, "{limits:?}");
            }
        }
    }

    #[test]
    fn an_interval_lasts_twice_the_floor_not_twice_the_average_latency() {
        // Twice the floor keeps an upstream slower than `interval` judged
        // on whole bursts of responses (adaptive_sim). Twice the average
        // latency, as before, also stretched intervals while a queue
        // drained after a drop in capacity (100 ms responses of a 20 ms
        // upstream: 200 ms intervals, so the limit took twice as long to
        // come down, and the drain's p99 in bench/overload.py was up to
        // 143 ms against 67 now), and with a few very long requests
        // (long polls) among quick ones.
        let spec = spec();
        let now = 1_000_000;
        let mut auto = Auto::new(&spec, now);
        let mut s = Samples::default();
        s.add(20_000);
        auto = auto.merge(&spec, &s, now + 100);
        assert_eq!(auto.interval_start_ms, now + 100);
        let mut s = Samples {
            peak_inflight: 10,
            ..Samples::default()
        };
        for _ in 0..20 {
            s.add(100_000);
        }
        s.add(10_000_000);
        let auto = auto.merge(&spec, &s, now + 200);
        assert_eq!(
            auto.interval_start_ms,
            now + 200,
            "the interval ends after 100 ms"
        );
        assert!(auto.limit() < spec.initial.into(), "{}", auto.limit());
    }

    #[test]
    fn the_rate_of_responses_is_not_used_when_samples_come_in_late_batches() {
        // A worker merges its samples on the 100 ms tick while the limit
        // is not in full use: a batch may hold a whole interval's
        // responses from before it, and batches land unevenly. Counted as
        // the interval's rate, every overcount would make the limit grow
        // (to 29-36 for 16 slots in a simulation); the latency alone keeps
        // it within its tolerance (up to 21.3 here, and one √limit step
        // over it).
        let mut sim = Sim::new(16);
        sim.late = true;
        sim.run(16, 40);
        let limits = sim.run(16, 40);
        assert!(limits.iter().all(|l| (16..=26).contains(l)), "{limits:?}");
    }

    #[test]
    fn a_capacity_rise_is_followed_in_one_interval_whatever_the_latency_says() {
        // When the capacity doubles, the interval's responses still
        // waited in the old queue (their latency says "queueing"), but
        // they came at the rate of everything let in: nothing queues now.
        let mut sim = Sim::new(4);
        sim.run(4, 40);
        // At the bottom of its swing.
        for _ in 0..10 {
            if sim.auto.limit() <= 6 {
                break;
            }
            sim.run(4, 1);
        }
        let before = sim.auto.limit();
        assert!(before <= 6, "{before}");
        let limits = sim.run(8, 2);
        assert!(limits[0] >= 8, "{before} -> {limits:?}");
    }

    #[test]
    fn a_doubled_capacity_is_reached_in_one_interval_and_a_small_one_keeps_a_spare() {
        let mut now = 1_000_000;
        let auto = settle(Auto::new(&spec(), now), 8, &mut now, 40);
        let before = auto.limit();
        assert!(before < 16, "{before}");
        // No queueing at all now: grown by the gradient as well as √limit
        // (11 -> 17; by √limit alone, 11 -> 14 -> 18).
        let auto = settle(auto, 16, &mut now, 1);
        assert!(auto.limit() >= 16, "{before} -> {}", auto.limit());
        // Capacity 2: one request over it, every interval (with the
        // tolerance alone, 3 in flight average 1.5 times the floor, and it
        // fell back to 2 every few intervals: no spare for hand-overs).
        // (Held at 2 while the floor is measured, at most once a window,
        // until 50 responses came, 2 per interval here: the floor
        // stays, and the spare comes back in between.)
        let mut auto = settle(auto, 2, &mut now, 10);
        let mut limits = Vec::new();
        for _ in 0..60 {
            auto = settle(auto, 2, &mut now, 1);
            limits.push(auto.limit());
        }
        let runs_of_2 = limits.windows(2).filter(|w| w == &[3, 2]).count();
        assert!(limits.iter().all(|l| (2..=3).contains(l)), "{limits:?}");
        let spare_run = limits.split(|&l| l == 2).map(<[u64]>::len).max();
        assert!(runs_of_2 <= 2 && spare_run >= Some(25), "{limits:?}");
        assert_eq!(auto.floor_us(), Some(20_000));
    }

    #[test]
    fn the_whole_limit_is_the_learned_one_rounded_to_the_nearest() {
        let mut a = Auto::new(&spec(), 0);
        for (milli, whole) in [(2_499, 2), (2_500, 3), (3_000, 3), (999, 1)] {
            a.limit_milli = milli;
            assert_eq!(a.limit(), whole, "{milli}");
        }
    }

    #[test]
    fn the_limit_follows_the_upstream_capacity_up_and_down() {
        let mut now = 1_000_000;
        let auto = Auto::new(&spec(), now);
        // Capacity 8: the limit grows until requests queue, and stays
        // within the tolerance of it.
        let auto = settle(auto, 8, &mut now, 40);
        assert!((8..=12).contains(&auto.limit()), "{}", auto.limit());
        // Capacity 2: down within a few intervals.
        let auto = settle(auto, 2, &mut now, 6);
        assert!((2..=3).contains(&auto.limit()), "{}", auto.limit());
        // Capacity 16: up again. Within the tolerance up to 21.3 here, and
        // one √limit step over it at the top of its swing (25.9, rounded).
        let auto = settle(auto, 16, &mut now, 40);
        assert!((16..=26).contains(&auto.limit()), "{}", auto.limit());
        assert_eq!(auto.floor_us(), Some(20_000));
        // A steady upstream's floor stays the lowest latency seen.
        assert_eq!(auto.floor_us(), auto.lowest_us());
    }

    #[test]
    fn an_idle_upstream_does_not_raise_the_limit_and_bounds_hold() {
        let mut now = 1_000_000;
        let mut auto = Auto::new(&spec(), now);
        for _ in 0..50 {
            let mut s = Samples {
                peak_inflight: 1,
                ..Samples::default()
            };
            s.add(20_000);
            now += 100;
            auto = auto.merge(&spec(), &s, now);
        }
        assert_eq!(auto.limit(), 10);
        // Terrible latency: never below the minimum.
        for _ in 0..80 {
            let mut s = Samples {
                peak_inflight: 10,
                ..Samples::default()
            };
            s.add(1_000_000);
            now += 100;
            auto = auto.merge(&spec(), &s, now);
        }
        assert_eq!(auto.limit(), 2);
    }

    /// An upstream with `capacity` slots whose service time is uniform
    /// within `mean_us ± spread_us` even when nothing queues, under a
    /// demand above any limit: `min(limit, capacity)` served at a time,
    /// each response its own service time plus its wait behind the
    /// requests over the capacity (on average `mean_us` for each
    /// `capacity` of them, uniform from 0 to twice that), except the very
    /// first `capacity` responses, which found the upstream idle.
    struct Noisy {
        capacity: u64,
        mean_us: u64,
        spread_us: u64,
        rng: crate::rng::SplitMix,
        started: bool,
    }

    impl Noisy {
        /// 10 to 50 ms.
        fn new(capacity: u64) -> Self {
            Noisy {
                capacity,
                mean_us: 30_000,
                spread_us: 20_000,
                rng: crate::rng::SplitMix(12_345),
                started: false,
            }
        }

        /// `rounds` intervals of 100 ms: the limit after each and the
        /// part of the capacity used.
        fn run(
            &mut self,
            auto: &mut Auto,
            spec: &AdaptiveSpec,
            now: &mut u64,
            rounds: u32,
        ) -> (Vec<u64>, f64) {
            let (mut limits, mut used) = (Vec::new(), 0.0);
            let capacity = self.capacity;
            for _ in 0..rounds {
                let limit = auto.limit().max(1);
                let busy = limit.min(capacity);
                let mut s = Samples {
                    peak_inflight: limit,
                    ..Samples::default()
                };
                for k in 0..(busy * 100_000).div_ceil(self.mean_us) {
                    let wait_us = if k < capacity && !self.started {
                        0
                    } else {
                        // Behind the requests over the capacity: from next
                        // to nothing (a slot about to free) to twice the
                        // average.
                        let avg = limit.saturating_sub(capacity) * self.mean_us / capacity;
                        self.rng.below(2 * avg + 1)
                    };
                    let noise = self.rng.below(2 * self.spread_us + 1);
                    s.add(self.mean_us - self.spread_us + noise + wait_us);
                }
                self.started = true;
                measured(auto, spec, &mut s, *now);
                *now += 100;
                *auto = auto.merge(spec, &s, *now);
                assert!((spec.min as u64..=spec.max as u64).contains(&auto.limit()));
                assert!(auto.measure_limit == 0 || auto.limit() == auto.measure_limit);
                assert_eq!(Auto::decode(&auto.encode()), Ok(*auto));
                limits.push(auto.limit());
                used += busy as f64 / capacity as f64;
            }
            (limits, used / f64::from(rounds))
        }
    }

    fn noisy(
        auto: &mut Auto,
        spec: &AdaptiveSpec,
        capacity: u64,
        now: &mut u64,
        rounds: u32,
    ) -> (Vec<u64>, f64) {
        Noisy::new(capacity).run(auto, spec, now, rounds)
    }

    /// One random upstream and settings of the property tests below,
    /// run for 10 s, then 90 s measured: the upstream and settings, the
    /// part of the capacity used and the limit's median.
    fn random_case(rng: &mut crate::rng::SplitMix, case: u64) -> (Noisy, AdaptiveSpec, f64, u64) {
        let capacity = 1 + rng.below(24);
        let mean_us = 5_000 + rng.below(75_000);
        let spread_us = mean_us * rng.below(91) / 100;
        let spec = AdaptiveSpec {
            min: 1 + rng.below(capacity.min(3)) as u32,
            tolerance_pct: 110 + rng.below(91) as u32,
            floor_window_ms: 30_000,
            ..spec()
        };
        let mut up = Noisy {
            capacity,
            mean_us,
            spread_us,
            rng: crate::rng::SplitMix(case),
            started: false,
        };
        let mut now = 1_000_000;
        let mut auto = Auto::new(&spec, now);
        up.run(&mut auto, &spec, &mut now, 100);
        let (mut limits, used) = up.run(&mut auto, &spec, &mut now, 900);
        limits.sort_unstable();
        (up, spec, used, limits[450])
    }

    #[test]
    fn property_any_upstream_is_kept_busy_and_not_flooded() {
        // Random upstreams (1 to 24 slots, 5 to 80 ms, a spread of up to
        // 90% of that even when nothing queues) and settings (a minimum
        // the upstream takes, a tolerance of 1.1 to 2): over the 90 s after
        // the first 10, the upstream is kept busy (measurements included),
        // and the limit's median stays within a few times the capacity; the
        // limit stays within its bounds and a measurement holds it (checked
        // at every interval).
        let mut rng = crate::rng::SplitMix(7);
        for case in 0..150 {
            let (up, spec, used, median) = random_case(&mut rng, case);
            let capacity = up.capacity;
            let what = format!(
                "case {case}: {capacity} slots, {} ± {} µs, {spec:?}: used {used:.2}, median {median}",
                up.mean_us, up.spread_us
            );
            assert!(used > 0.85, "{what}");
            assert!(median <= capacity * 3 + 2, "{what}");
        }
    }

    #[test]
    fn property_over_many_seeds_no_noisy_upstream_is_left_mostly_idle() {
        // The random upstreams of the property above, over seven seeds
        // (1,050 cases). Before: a shrink of 10 to 15% per interval did
        // not count as held back, so an upstream of 8 slots at 31 to 111
        // ms (lowest latency 31, average 71, tolerance 1.68) never had
        // its floor measured and was 42% used (seed 9, case 95); 7 of
        // these cases were under 85% (that one under 75%).
        let (mut low, mut cases, mut used_sum) = (Vec::new(), 0, 0.0);
        for seed in [1, 2, 3, 4, 5, 6, 9] {
            let mut rng = crate::rng::SplitMix(seed);
            for case in 0..150 {
                let (up, _, used, median) = random_case(&mut rng, case);
                assert!(median <= up.capacity * 3 + 2, "seed {seed} case {case}");
                cases += 1;
                used_sum += used;
                if used <= 0.85 {
                    low.push((seed, case, used));
                }
            }
        }
        assert!(low.iter().all(|&(_, _, u)| u > 0.75), "{low:?}");
        assert!(low.len() <= cases / 200, "{low:?}");
        assert!(
            used_sum / cases as f64 > 0.98,
            "{}",
            used_sum / cases as f64
        );
    }

    #[test]
    fn an_upstream_whose_service_time_varies_widely_keeps_its_limit_near_the_capacity() {
        // The lowest latency seen (10 ms) is a third of the average: by it
        // alone every interval looked queued and the limit fell to its
        // minimum, the upstream 17% used (7 to 47% in a review's real
        // Envoy). Measured at the minimum, the floor is the average.
        let spec = spec();
        let mut now = 1_000_000;
        let mut auto = Auto::new(&spec, now);
        noisy(&mut auto, &spec, 12, &mut now, 30);
        let floor = auto.floor_us().unwrap_or(0);
        assert!((25_000..=35_000).contains(&floor), "{floor}");
        // Over three floor windows (10 s here): each expiry measures the
        // floor again, at the minimum limit for a few intervals.
        let (limits, used) = noisy(&mut auto, &spec, 12, &mut now, 300);
        let mut sorted = limits.clone();
        sorted.sort_unstable();
        assert!((12..=20).contains(&sorted[150]), "{limits:?}");
        assert!(used > 0.9, "{used} {limits:?}");
        eprintln!("{used} {}", sorted[150]);
        // Measured again at each expiry, at what the upstream serves by
        // the lowest latency (a third of the capacity here), for a few
        // intervals.
        let lows = limits.iter().filter(|&&l| l <= 10).count();
        assert!((2..=25).contains(&lows), "{lows} {limits:?}");
    }

    #[test]
    fn samples_from_several_workers_count_once_per_interval() {
        let now = 1_000_000;
        let auto = Auto::new(&spec(), now);
        let mut s = Samples::default();
        s.add(20_000);
        // Within the interval: gathered, no new limit yet.
        let a = auto
            .merge(&spec(), &s, now + 10)
            .merge(&spec(), &s, now + 20);
        assert_eq!((a.count, a.limit()), (2, 10));
        let b = a.merge(&spec(), &Samples::default(), now + 100);
        assert_eq!(b.count, 0);
        assert_eq!(b.interval_start_ms, now + 100);
    }
}
