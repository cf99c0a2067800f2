use super::state::Measured;
use super::*;
use crate::codec::Corrupt;
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
        floor_current_us: Some(20_000),
        floor_previous_us: None,
        floor_rotated_ms: 7,
        interval_start_ms: 9,
        sum_us: 1 << 40,
        count: 77,
        peak_inflight: 12,
        max_span_ms: 3,
        floor_cal: Some(Measured::FloorUs(31_000)),
        floor_cal_ms: 5,
        cal_sum_us: 40_000,
        cal_count: 2,
        cal_min_us: Some(15_000),
        stuck_run: 1,
        measure_limit: Some(3),
        measure_start_ms: 4,
        serving_milli: 2_500,
        before_measure_milli: 9_000,
        before_measure_avg_us: Some(21_000),
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

/// The stored bytes of a state with every value present (measuring a
/// floor), with the absent ones, with a measurement that learned nothing,
/// and of a fresh entry: the layout of `sh…/auto5`, byte for byte.
#[test]
fn the_stored_bytes_are_the_layout_of_version_5() {
    let full = Auto {
        limit_milli: 12_345,
        floor_current_us: Some(20_000),
        floor_previous_us: Some(22_000),
        floor_rotated_ms: 7,
        interval_start_ms: 9,
        sum_us: 1 << 40,
        count: 77,
        peak_inflight: 12,
        max_span_ms: 3,
        floor_cal: Some(Measured::FloorUs(31_000)),
        floor_cal_ms: 5,
        cal_sum_us: 40_000,
        cal_count: 2,
        cal_min_us: Some(15_000),
        stuck_run: 1,
        measure_limit: Some(3),
        measure_start_ms: 4,
        serving_milli: 2_500,
        before_measure_milli: 9_000,
        before_measure_avg_us: Some(21_000),
        before_measure_count: 30,
        quiet: 1,
    };
    let absent = Auto {
        limit_milli: 2_000,
        floor_current_us: None,
        floor_previous_us: None,
        floor_rotated_ms: 1_000_100,
        interval_start_ms: 1_000_200,
        sum_us: 0,
        count: 0,
        peak_inflight: 0,
        max_span_ms: 0,
        floor_cal: None,
        floor_cal_ms: 1_000_050,
        cal_sum_us: 0,
        cal_count: 0,
        cal_min_us: None,
        stuck_run: 0,
        measure_limit: None,
        measure_start_ms: 999_000,
        serving_milli: 1_900,
        before_measure_milli: 4_000,
        before_measure_avg_us: None,
        before_measure_count: 0,
        quiet: 0,
    };
    let nothing_learned = Auto {
        floor_current_us: Some(18_000),
        floor_cal: Some(Measured::NothingLearned),
        quiet: 1,
        ..absent
    };
    let cases = [
        (
            full,
            concat!(
                "053930000000000000204e000000000000f0550000000000000700000000000000090000",
                "000000000000000000000100004d000000000000000c0000000000000003000000000000",
                "0018790000000000000500000000000000409c0000000000000200000000000000983a00",
                "0000000000010000000000000003000000000000000400000000000000c4090000000000",
                "00282300000000000008520000000000001e0000000000000001000000000000002cc430",
                "af",
            ),
        ),
        (
            absent,
            concat!(
                "05d007000000000000ffffffffffffffffffffffffffffffffa4420f000000000008430f",
                "000000000000000000000000000000000000000000000000000000000000000000000000",
                "00ffffffffffffffff72420f000000000000000000000000000000000000000000ffffff",
                "ffffffffff00000000000000000000000000000000583e0f00000000006c070000000000",
                "00a00f000000000000ffffffffffffffff00000000000000000000000000000000c421a4",
                "13",
            ),
        ),
        (
            nothing_learned,
            concat!(
                "05d0070000000000005046000000000000ffffffffffffffffa4420f000000000008430f",
                "000000000000000000000000000000000000000000000000000000000000000000000000",
                "00000000000000000072420f000000000000000000000000000000000000000000ffffff",
                "ffffffffff00000000000000000000000000000000583e0f00000000006c070000000000",
                "00a00f000000000000ffffffffffffffff00000000000000000100000000000000bfc179",
                "d2",
            ),
        ),
        (
            Auto::new(&spec(), 1_000_000),
            concat!(
                "051027000000000000ffffffffffffffffffffffffffffffff40420f000000000040420f",
                "000000000000000000000000000000000000000000000000000000000000000000000000",
                "00ffffffffffffffff40420f000000000000000000000000000000000000000000ffffff",
                "ffffffffff00000000000000000000000000000000000000000000000000000000000000",
                "000000000000000000ffffffffffffffff00000000000000000000000000000000d4392c",
                "26",
            ),
        ),
    ];
    for (a, expected) in cases {
        let bytes = a.encode();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected, "{a:?}");
        assert_eq!(Auto::decode(&bytes), Ok(a));
    }
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
    assert_eq!(sim.auto.floor_cal, Some(Measured::NothingLearned));
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
            assert_eq!(
                sim.auto.floor_cal,
                Some(Measured::NothingLearned),
                "{limits:?}"
            );
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
    // stays, and the spare comes back in between. Once more when the
    // limit has halved since a measurement that found nothing, the
    // capacity having fallen: at 2 nothing queues, and the limit steps
    // to the spare.)
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
            assert!(auto.measure_limit.is_none_or(|held| auto.limit() == held));
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
        for case in 0..crate::test_seeds(150) {
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
