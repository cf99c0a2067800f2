//! The scenario matrix of issue 38 in the simulation: kinds of upstream
//! (steady, changing capacity, noisy from the start or from mid-run, slow,
//! bimodal), each also with its workers starved of CPU, run from a fresh
//! entry at the default settings (`min` 2). For each cell: the longest
//! stretch the limit sits at `min` while the upstream has more slots than
//! that (demand always exceeds the limit here, and with the limit under
//! the capacity nothing queues at the upstream: its latency is its own),
//! the part of its capacity used, and the 99th percentile of the wait in
//! its queue (what the limit adds to a response's latency).

use super::super::adaptive::Measured;
use super::{median, AdaptiveSpec, Des, Dist, Starve};
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The defaults of `concurrency.max: "auto"` with `max` 200, as the
/// shedder's own configuration reader makes them.
fn spec() -> AdaptiveSpec {
    let json = br#"{"name": "m", "concurrency": {"max": "auto", "adaptive": {"max": 200}}}"#;
    serde_json::from_slice(json)
        .ok()
        .and_then(|raw| super::super::config::validate("shedders[0]", raw).ok())
        .and_then(|s| s.concurrency?.adaptive)
        .expect("the defaults load")
}

const MS: u64 = 1000;
/// 20 ms.
const STEADY: Dist = Dist::Uniform(20 * MS, 0);

/// A phase: how long (ms), the upstream's slots, its service time.
type Phase = (u64, u64, Dist);

/// The cells' upstreams, by name.
fn upstreams() -> Vec<(&'static str, Vec<Phase>)> {
    vec![
        ("steady 12 x 20 ms", vec![(60_000, 12, STEADY)]),
        (
            "capacity 4 -> 12 -> 2",
            vec![
                (20_000, 4, STEADY),
                (20_000, 12, STEADY),
                (20_000, 2, STEADY),
            ],
        ),
        (
            "noisy 6 x 10-50 ms",
            vec![(60_000, 6, Dist::Uniform(30 * MS, 20 * MS))],
        ),
        (
            "12 x 20 ms, then 20-45 ms",
            vec![
                (20_000, 12, STEADY),
                (60_000, 12, Dist::Uniform(32_500, 12_500)),
            ],
        ),
        (
            "slow 8 x 100 ms",
            vec![(60_000, 8, Dist::Uniform(100 * MS, 0))],
        ),
        (
            "bimodal 12 x 10/100 ms",
            vec![(60_000, 12, Dist::Bimodal(10 * MS, 100 * MS, 90))],
        ),
    ]
}

/// Other processes take about half of each worker's CPU, in stalls of up
/// to 50 ms.
const STARVED: Starve = Starve {
    per_mille: 40,
    max_ms: 50,
};

/// What one cell measured.
pub struct Row {
    pub name: String,
    /// The longest stretch at `min` with idle slots (ms).
    pub at_min_ms: u64,
    /// The longest stretch at or under half the slots (ms).
    pub low_ms: u64,
    /// The part of the capacity used, over the run and by phase.
    pub used: f64,
    pub used_by_phase: Vec<f64>,
    /// The median limit by phase.
    pub limit_by_phase: Vec<u64>,
    /// The 99th percentile of the wait in the upstream's queue (ms).
    pub p99_wait_ms: f64,
}

/// Runs one cell: two workers, each merging its samples on the next
/// millisecond while it finds the limit in full use, else on its 100 ms
/// tick, as in Envoy (`Shedders::merge_soon`). Demand exceeds the limit
/// here, so both merge every millisecond they have samples: the rate of
/// responses counts in every interval, as it does in Envoy under overload.
/// With one worker on a fixed 100 ms tick instead, no interval counted it,
/// and the limit of a steady upstream of 12 slots cycled from 7 to 30
/// (86% used) where in Envoy it stays within 14 to 20 (98%).
pub fn run_cell(spec: AdaptiveSpec, name: &str, phases: &[Phase], starve: bool, seed: u64) -> Row {
    let first = phases.first().map_or(1, |p| p.1);
    let mut d = Des::new(spec, first, STEADY, &[100, 100], seed);
    d.merge_soon = true;
    if starve {
        d.starve(STARVED, seed);
    }
    let (mut busy, mut cap, mut waits) = (0.0, 0.0, Vec::new());
    let (mut used_by_phase, mut limit_by_phase) = (Vec::new(), Vec::new());
    for &(ms, slots, dist) in phases {
        d.set_capacity(slots);
        d.dist = dist;
        d.reset_stats();
        let limits = d.run(ms);
        used_by_phase.push(d.used_over_time());
        limit_by_phase.push(median(&limits));
        busy += d.used_over_time() * (ms * slots) as f64;
        cap += (ms * slots) as f64;
        waits.append(&mut d.waits);
    }
    d.waits = waits;
    Row {
        name: format!("{name}{}", if starve { ", starved" } else { "" }),
        at_min_ms: d.longest_at_min_ms,
        low_ms: d.longest_low_ms,
        used: busy / cap,
        used_by_phase,
        limit_by_phase,
        p99_wait_ms: d.wait_pct_ms(99),
    }
}

/// Every cell of the matrix, by seed.
pub fn matrix(spec: AdaptiveSpec, seed: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    for starve in [false, true] {
        for (name, phases) in upstreams() {
            rows.push(run_cell(spec, name, &phases, starve, seed));
        }
    }
    rows
}

pub fn print(rows: &[Row]) {
    println!(
        "{:<40} {:>10} {:>10} {:>6} {:>9}  {:<18} median limit by phase",
        "cell", "at min ms", "low ms", "used", "p99 wait", "used by phase"
    );
    for r in rows {
        let phases: Vec<String> = r.used_by_phase.iter().map(|u| format!("{u:.2}")).collect();
        println!(
            "{:<40} {:>10} {:>10} {:>6.2} {:>9.1}  {:<18} {:?}",
            r.name,
            r.at_min_ms,
            r.low_ms,
            r.used,
            r.p99_wait_ms,
            phases.join(" "),
            r.limit_by_phase
        );
    }
}

/// The least part of the capacity each cell uses over seeds 1 to 6,
/// rounded down to 5 points, in the order of [`matrix`]'s rows.
const USED_AT_LEAST: [f64; 12] = [
    0.95, 0.95, 0.90, 0.90, 0.95, 0.80, // not starved
    0.70, 0.75, 0.85, 0.80, 0.90, 0.70, // starved
];

/// The longest the limit may sit at `min` while requests wait and the
/// upstream has more slots than that (ms).
const AT_MIN_AT_MOST_MS: u64 = 1000;

/// Every cell keeps demand above the limit. A step to `min` that still
/// looks queued measures the floor there at once, and a measurement there
/// ends after 0.4 s of responses (0.5 to 0.6 s at `min` in all). Measured
/// only after 6 shrinks held back, and not within a floor's window of a
/// measurement that learned nothing, a noisy upstream (its lowest latency
/// a third of its average), a bimodal one, or one whose noise starts
/// mid-run would sit at `min` for 1 to 2 s, and up to 16 s with its
/// workers starved of CPU.
#[test]
fn no_cell_holds_the_limit_at_min_over_a_second_nor_uses_less_than_its_bound() {
    // `cargo test no_cell_holds -- --nocapture` prints the table.
    for seed in 1..=6 {
        let rows = matrix(spec(), seed);
        println!("seed {seed}");
        print(&rows);
        for (r, least) in rows.iter().zip(USED_AT_LEAST) {
            let what = format!("seed {seed}, {}", r.name);
            assert!(r.used >= least, "{what}: used {:.2}", r.used);
            assert!(
                r.at_min_ms <= AT_MIN_AT_MOST_MS,
                "{what}: {} ms at min",
                r.at_min_ms
            );
        }
    }
}

/// Noise that starts while a measurement that found nothing is in force
/// (a real queue held the limit, as one of a steady upstream's often
/// does): in Envoy the limit fell to 3 on 12 slots and stayed there for 3
/// to 4 s (`bench/adaptive_matrix.py`'s noise-mid cell), no floor being
/// measured within a window of that measurement.
#[test]
fn noise_that_starts_after_a_measurement_found_nothing_is_measured_within_two_seconds() {
    for seed in 1..=6 {
        let mut d = Des::new(spec(), 12, STEADY, &[1, 100], seed);
        d.run(5_000);
        d.auto.floor_cal = Some(Measured::NothingLearned);
        d.auto.floor_cal_ms = d.auto.interval_start_ms;
        d.auto.before_measure_milli = d.auto.limit_milli;
        d.longest_low_ms = 0;
        d.dist = Dist::Uniform(32_500, 12_500);
        d.run(10_000);
        println!(
            "seed {seed}: {} ms at or under half the slots",
            d.longest_low_ms
        );
        assert!(
            d.longest_low_ms <= 1_600,
            "seed {seed}: {} ms",
            d.longest_low_ms
        );
    }
}

/// An upstream of exactly `min` slots (2 of 20 ms): the limit keeps the
/// one spare over it a shrink keeps. Stepped up to `min × tolerance +
/// √min` after a measurement at `min` that found no queue, then grown on
/// the responses let in at `min`, it went from 2 to 7 and back every
/// second, with a queue of 1.25 at the upstream.
#[test]
fn an_upstream_of_exactly_min_slots_keeps_one_spare_without_cycling() {
    for seed in 1..=6 {
        let mut d = Des::new(spec(), 2, STEADY, &[1, 100], seed);
        d.run(20_000);
        d.reset_stats();
        let limits = d.run(20_000);
        let what = format!("seed {seed}: {limits:?}, queue {:.2}", d.queued());
        assert!(limits.iter().all(|l| (2..=3).contains(l)), "{what}");
        assert!(d.used() > 0.95 && d.queued() < 1.1, "{what}");
    }
}

/// A measured floor of a bimodal upstream (90% in 10 ms, 10% in 100 ms)
/// expiring after its window: measured again, not ended on the first
/// responses back, all of them fast, as if a queue had held the limit
/// (then the floor fell to the lowest latency and the limit to `min`:
/// without the wait of `Auto::finds_nothing`, 16 of these 20 did, and
/// seed 20 of the matrix's starved cell sat at `min` for 1.3 s).
#[test]
fn a_bimodal_upstream_measured_again_after_the_window_is_not_taken_for_a_queue() {
    let mut nothing = 0;
    for seed in 1..=20 {
        let mut d = Des::new(
            spec(),
            12,
            Dist::Bimodal(10 * MS, 100 * MS, 90),
            &[100, 100],
            seed,
        );
        d.merge_soon = true;
        d.run(5_000);
        // The floor measured now expires at the end of this interval.
        d.auto.floor_cal = Some(Measured::FloorUs(19 * MS));
        d.auto.floor_cal_ms = d
            .auto
            .interval_start_ms
            .saturating_sub(d.spec.floor_window_ms);
        d.longest_at_min_ms = 0;
        let mut measured = None;
        for _ in 0..400 {
            d.run(5);
            if d.auto.measure_limit.is_some() {
                measured = Some(false);
            } else if measured == Some(false) {
                measured = Some(true);
                break;
            }
        }
        assert_eq!(measured, Some(true), "seed {seed}: measured again");
        if d.auto.floor_cal == Some(Measured::NothingLearned) {
            nothing += 1;
        }
        d.run(10_000);
        assert!(
            d.longest_at_min_ms <= 1_000,
            "seed {seed}: {} ms at min",
            d.longest_at_min_ms
        );
    }
    println!("{nothing} of 20 measurements learned nothing");
    assert!(nothing <= 2, "{nothing} of 20 measurements learned nothing");
}
