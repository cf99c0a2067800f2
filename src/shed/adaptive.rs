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
    /// How long since this worker's last merge (ms): the stretch of time
    /// its samples may come from.
    pub span_ms: u64,
}

impl Samples {
    pub fn add(&mut self, latency_us: u64) {
        self.sum_us = self.sum_us.saturating_add(latency_us);
        self.count += 1;
        self.min_us = Some(self.min_us.map_or(latency_us, |m| m.min(latency_us)));
    }
}

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
}

const VERSION: u8 = 2;
const BODY: usize = 1 + 9 * 8;
/// No floor seen yet.
const NONE: u64 = u64::MAX;
/// The rate of responses counts when every batch merged in the interval
/// spans at most this part of it (workers with waiters merge on their
/// 1 ms tick).
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
        }
    }

    /// The limit in whole requests, rounded to the nearest (rounding down
    /// would keep a small limit half a request below what was learned: 2
    /// instead of 2.5 leaves an upstream of 2 slots idle between requests).
    pub fn limit(&self) -> u64 {
        self.limit_milli.saturating_add(500) / 1000
    }

    /// The floor estimate, if any sample was seen in the window.
    pub fn floor_us(&self) -> Option<u64> {
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
        if now_ms.saturating_sub(self.interval_start_ms) < spec.interval_ms {
            return self;
        }
        if let (Some(floor), Some(avg)) = (self.floor_us(), self.sum_us.checked_div(self.count)) {
            let elapsed_ms = now_ms.saturating_sub(self.interval_start_ms);
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
            self.limit_milli = next_limit(spec, self.limit_milli, floor, &seen);
        }
        self.interval_start_ms = now_ms;
        self.sum_us = 0;
        self.count = 0;
        self.peak_inflight = 0;
        self.max_span_ms = 0;
        self
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

/// The gradient step: `limit × tolerance × floor / latency`, at least
/// half and at most double; it grows (by that, plus `√limit` of headroom)
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
fn next_limit(spec: &AdaptiveSpec, limit_milli: u64, floor_us: u64, seen: &Seen) -> u64 {
    let limit = limit_milli as f64 / 1000.0;
    let avg = seen.avg_us.max(1) as f64;
    let tolerance = f64::from(spec.tolerance_pct) / 100.0;
    let by_latency = floor_us as f64 * tolerance / avg;
    let inflight = (seen.peak as f64).min(limit).max(1.0);
    let by_rate = seen.by_rate(floor_us) * tolerance / inflight;
    let gradient = by_latency.max(by_rate).clamp(0.5, 2.0);
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
                let mut n = 5 * limit.min(capacity);
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
        let mut sim = Sim::new(4);
        for (capacity, spare) in [(4, 5..=8), (8, 9..=16), (2, 3..=4)] {
            sim.run(capacity, 20);
            let limits = sim.run(capacity, 40);
            assert!(
                limits.iter().all(|l| spare.contains(l)),
                "{capacity}: {limits:?}"
            );
        }
    }

    #[test]
    fn the_rate_of_responses_is_not_used_when_samples_come_in_late_batches() {
        // Workers without waiters merge their samples on the 100 ms tick:
        // a batch may hold a whole interval's responses from before it, and
        // batches land unevenly. Counted as the interval's rate, every
        // overcount made the limit grow (to 29-36 for 16 slots in a
        // review's simulation); the latency alone keeps it within its
        // tolerance (up to 21.3 here, and one √limit step over it).
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
        let mut auto = settle(auto, 2, &mut now, 10);
        for _ in 0..20 {
            auto = settle(auto, 2, &mut now, 1);
            assert_eq!(auto.limit(), 3);
        }
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
        for _ in 0..50 {
            let mut s = Samples {
                peak_inflight: 10,
                ..Samples::default()
            };
            s.add(20_000_000);
            now += 100;
            auto = auto.merge(&spec(), &s, now);
        }
        assert_eq!(auto.limit(), 2);
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
