//! A discrete-event simulation of an adaptive limit in front of an
//! upstream with `capacity` slots and a first-come-first-served queue,
//! under a demand above any limit, in 1 ms steps: latency runs from
//! admission to response, so it lags the limit as in Envoy (a response
//! may have waited behind what a larger limit let in before), and each
//! worker reads the limit back on its own tick. It catches a measured
//! floor that takes a queue for the upstream's own time and runs the
//! limit up to its maximum.

#[cfg(test)]
use super::adaptive::STUCK_RUN;
use super::adaptive::{AdaptiveSpec, Auto, Samples};
use crate::rng::SplitMix;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// A worker starved of CPU: from each millisecond it runs, a stall of 1
/// to `max_ms` ms starts with probability `per_mille` / 1000. A stalled
/// worker admits nothing, its tick waits (one missed fires when it runs
/// again), and the responses to its requests are taken in then (the
/// upstream's slot is free at once).
#[derive(Clone, Copy, Debug)]
pub struct Starve {
    pub per_mille: u64,
    pub max_ms: u64,
}

/// Service times (µs).
#[derive(Clone, Copy, Debug)]
pub enum Dist {
    /// Uniform within mean ± spread.
    Uniform(u64, u64),
    /// Exponential with this mean, plus a constant.
    Exp(u64, u64),
    /// `pct`% take `fast`, the others `slow` ± 1%.
    Bimodal(u64, u64, u64),
}

pub struct Des {
    pub spec: AdaptiveSpec,
    pub auto: Auto,
    now_us: u64,
    cap: u64,
    pub dist: Dist,
    rng: SplitMix,
    busy: u64,
    /// Admission times and workers of the requests queued upstream.
    queue: VecDeque<(u64, usize)>,
    /// (finish, admission, worker) of the requests in service.
    done: BinaryHeap<Reverse<(u64, u64, usize)>>,
    inflight: u64,
    /// Per worker: its tick (ms), samples, the limit it read, last merge.
    ticks: Vec<u64>,
    samples: Vec<Samples>,
    limits: Vec<u64>,
    merged: Vec<u64>,
    busy_us: u128,
    queued_us: u128,
    time_us: u128,
    pub max_limit: u64,
    /// Responses so far.
    pub served: u64,
    /// The capacity summed over time, for the part used when it changes.
    cap_us: u128,
    /// How long each request started since `reset_stats` waited in the
    /// upstream's queue (µs).
    pub waits: Vec<u64>,
    /// The longest and the current run of milliseconds with the limit at
    /// `min` while the upstream has more slots than that (not reset by
    /// `reset_stats`).
    pub longest_at_min_ms: u64,
    at_min_ms: u64,
    /// The same for the limit at or under half the upstream's slots (most
    /// of them idle).
    pub longest_low_ms: u64,
    low_ms: u64,
    starve: Option<(Starve, SplitMix)>,
    /// Per worker: stalled until (ms), a tick missed meanwhile, and the
    /// (admission, worker) of responses waiting for it.
    stalled_until: Vec<u64>,
    missed: Vec<bool>,
    deferred: Vec<(u64, usize)>,
    /// Workers merge on the next millisecond once they found the limit in
    /// full use with samples to merge (`Shedders::merge_soon`), as in
    /// Envoy; otherwise on their own tick.
    pub merge_soon: bool,
    full: Vec<bool>,
}

impl Des {
    pub fn new(spec: AdaptiveSpec, cap: u64, dist: Dist, ticks: &[u64], seed: u64) -> Self {
        let now_us = 1_000_000_000;
        let auto = Auto::new(&spec, now_us / 1000);
        Des {
            spec,
            auto,
            now_us,
            cap,
            dist,
            rng: SplitMix(seed),
            busy: 0,
            queue: VecDeque::new(),
            done: BinaryHeap::new(),
            inflight: 0,
            ticks: ticks.to_vec(),
            samples: vec![Samples::default(); ticks.len()],
            limits: vec![auto.limit(); ticks.len()],
            merged: vec![now_us / 1000; ticks.len()],
            busy_us: 0,
            queued_us: 0,
            time_us: 0,
            max_limit: 0,
            served: 0,
            cap_us: 0,
            waits: Vec::new(),
            longest_at_min_ms: 0,
            at_min_ms: 0,
            longest_low_ms: 0,
            low_ms: 0,
            starve: None,
            stalled_until: vec![0; ticks.len()],
            missed: vec![false; ticks.len()],
            deferred: Vec::new(),
            merge_soon: false,
            full: vec![false; ticks.len()],
        }
    }

    /// Starves every worker of CPU from now on (see [`Starve`]).
    pub fn starve(&mut self, starve: Starve, seed: u64) {
        self.starve = Some((starve, SplitMix(seed ^ 0x5eed)));
    }

    fn stalled(&self, w: usize, now_ms: u64) -> bool {
        self.stalled_until.get(w).is_some_and(|&u| now_ms < u)
    }

    /// Starts stalls, and lets workers whose stall ended take in their
    /// responses.
    fn stalls(&mut self, now_ms: u64) {
        let Some((st, rng)) = self.starve.as_mut() else {
            return;
        };
        for w in 0..self.ticks.len() {
            if now_ms >= self.stalled_until[w] && rng.below(1000) < st.per_mille {
                self.stalled_until[w] = now_ms + 1 + rng.below(st.max_ms);
            }
        }
        let mut i = 0;
        while i < self.deferred.len() {
            let (admitted, w) = self.deferred[i];
            if self.stalled(w, now_ms) {
                i += 1;
                continue;
            }
            self.deferred.swap_remove(i);
            self.respond(self.now_us, admitted, w);
        }
    }

    fn draw(&mut self) -> u64 {
        match self.dist {
            Dist::Uniform(m, s) => m - s + self.rng.below(2 * s + 1),
            Dist::Exp(m, c) => {
                let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                c + (-(1.0 - u).ln() * m as f64) as u64
            }
            Dist::Bimodal(f, sl, pct) => {
                if self.rng.below(100) < pct {
                    f
                } else {
                    sl - sl / 100 + self.rng.below(sl / 50 + 1)
                }
            }
        }
    }

    fn start(&mut self, admitted: u64, w: usize) {
        self.busy += 1;
        self.waits.push(self.now_us - admitted);
        let t = self.now_us + self.draw();
        self.done.push(Reverse((t, admitted, w)));
    }

    /// Runs `ms` milliseconds; returns the limit every 100 ms.
    pub fn run(&mut self, ms: u64) -> Vec<u64> {
        let mut out = Vec::new();
        for _ in 0..ms {
            let end = self.now_us + 1000;
            self.complete(end);
            self.now_us = end;
            self.busy_us += u128::from(self.busy) * 1000;
            self.queued_us += self.queue.len() as u128 * 1000;
            self.time_us += 1000;
            self.cap_us += u128::from(self.cap) * 1000;
            let now_ms = self.now_us / 1000;
            self.stalls(now_ms);
            self.admit();
            for w in 0..self.ticks.len() {
                let soon = self.merge_soon && self.full[w] && self.samples[w].count > 0;
                let due = now_ms % self.ticks[w] == 0 || self.missed[w] || soon;
                self.missed[w] = due && self.stalled(w, now_ms);
                if due && !self.missed[w] {
                    let s = Samples {
                        span_ms: now_ms - self.merged[w],
                        ..std::mem::take(&mut self.samples[w])
                    };
                    self.merged[w] = now_ms;
                    self.full[w] = false;
                    self.auto = self.auto.merge(&self.spec, &s, now_ms);
                    self.limits[w] = self.auto.limit();
                }
            }
            self.max_limit = self.max_limit.max(self.auto.limit());
            let min = u64::from(self.spec.min);
            if self.auto.limit() <= min && self.cap > min {
                self.at_min_ms += 1;
                self.longest_at_min_ms = self.longest_at_min_ms.max(self.at_min_ms);
            } else {
                self.at_min_ms = 0;
            }
            if self.auto.limit() * 2 <= self.cap && self.cap > min {
                self.low_ms += 1;
                self.longest_low_ms = self.longest_low_ms.max(self.low_ms);
            } else {
                self.low_ms = 0;
            }
            if now_ms % 100 == 0 {
                out.push(self.auto.limit());
            }
        }
        out
    }

    /// Responses until `end`, sampled as `Shedders::sample` does.
    fn complete(&mut self, end: u64) {
        while let Some(&Reverse((t, admitted, w))) = self.done.peek() {
            if t > end {
                break;
            }
            self.done.pop();
            self.now_us = t;
            self.busy -= 1;
            self.served += 1;
            if self.stalled(w, t / 1000) {
                self.deferred.push((admitted, w));
            } else {
                self.respond(t, admitted, w);
            }
            self.fill();
        }
        self.fill();
    }

    /// Worker `w` takes in the response, at `t`, to a request admitted at
    /// `admitted`.
    fn respond(&mut self, t: u64, admitted: u64, w: usize) {
        let s = &mut self.samples[w];
        s.peak_inflight = s.peak_inflight.max(self.inflight + 1);
        self.inflight -= 1;
        if self
            .auto
            .measured_from_ms(&self.spec)
            .is_some_and(|from| admitted / 1000 >= from)
        {
            s.add_measured(t - admitted);
        }
        s.add(t - admitted);
    }

    /// Starts queued requests while slots are free.
    fn fill(&mut self) {
        while self.busy < self.cap {
            let Some((a, w)) = self.queue.pop_front() else {
                break;
            };
            self.start(a, w);
        }
    }

    /// Each worker in turn admits up to the limit it read.
    fn admit(&mut self) {
        let n = self.ticks.len();
        for k in 0..n {
            let w = ((self.now_us / 1000) as usize + k) % n;
            if self.stalled(w, self.now_us / 1000) {
                continue;
            }
            let s = &mut self.samples[w];
            s.peak_inflight = s.peak_inflight.max(self.inflight + 1);
            while self.inflight < self.limits[w] {
                self.inflight += 1;
                if self.busy < self.cap {
                    self.start(self.now_us, w);
                } else {
                    self.queue.push_back((self.now_us, w));
                }
            }
            // It found the limit in full use (demand always exceeds it).
            self.full[w] = true;
        }
    }

    /// The upstream's slots from now on (requests in service over it
    /// finish; no new one starts until fewer are busy).
    pub fn set_capacity(&mut self, cap: u64) {
        self.cap = cap;
    }

    pub fn reset_stats(&mut self) {
        self.busy_us = 0;
        self.queued_us = 0;
        self.time_us = 0;
        self.max_limit = 0;
        self.cap_us = 0;
        self.waits.clear();
    }

    /// The part of the capacity in use, with the capacity as it was over
    /// time.
    pub fn used_over_time(&self) -> f64 {
        self.busy_us as f64 / self.cap_us.max(1) as f64
    }

    /// The `pct`th percentile of the waits in the upstream's queue (ms).
    pub fn wait_pct_ms(&self, pct: usize) -> f64 {
        let mut w = self.waits.clone();
        w.sort_unstable();
        let i = (w.len() * pct / 100).min(w.len().saturating_sub(1));
        w.get(i).copied().unwrap_or(0) as f64 / 1000.0
    }

    /// The part of the capacity in use.
    pub fn used(&self) -> f64 {
        self.busy_us as f64 / self.time_us as f64 / self.cap as f64
    }

    /// The average queue at the upstream.
    pub fn queued(&self) -> f64 {
        self.queued_us as f64 / self.time_us as f64
    }
}

pub fn median(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> AdaptiveSpec {
        AdaptiveSpec {
            min: 2,
            max: 1000,
            initial: 10,
            tolerance_pct: 125,
            interval_ms: 100,
            floor_window_ms: 30_000,
        }
    }

    /// Settles for a minute, then returns the limits, the part of the
    /// capacity used and the average queue at the upstream over `secs`.
    fn settle(d: &mut Des, secs: u64) -> (Vec<u64>, f64, f64) {
        d.run(60_000);
        d.reset_stats();
        let limits = d.run(secs * 1000);
        (limits, d.used(), d.queued())
    }

    #[test]
    fn any_upstream_is_kept_busy_without_a_standing_queue() {
        // Steady, noisy, long-tailed, faster and slower than an interval,
        // and a minimum over the capacity: the upstream is kept busy, the
        // queue at it stays within the tolerance's share of its capacity,
        // and the limit never runs away (a floor that takes a queue for the
        // upstream's own time runs up to the maximum, a queue of 990, with
        // 8 slots of 80 ± 70 ms, 200 ± 100 ms or exponential 30 ms, or 4
        // slots of a steady 200 ms).
        for (cap, dist, min) in [
            (4, Dist::Uniform(20_000, 0), 1),
            (2, Dist::Uniform(20_000, 0), 1),
            (8, Dist::Uniform(30_000, 20_000), 2),
            (8, Dist::Uniform(80_000, 70_000), 2),
            (8, Dist::Uniform(200_000, 100_000), 2),
            (8, Dist::Exp(30_000, 0), 2),
            (32, Dist::Exp(30_000, 0), 2),
            (4, Dist::Uniform(200_000, 0), 2),
            (1, Dist::Uniform(30_000, 20_000), 2),
        ] {
            let mut d = Des::new(AdaptiveSpec { min, ..spec() }, cap, dist, &[1, 100], 1);
            let (limits, used, queued) = settle(&mut d, 120);
            let what = format!(
                "{cap} slots of {dist:?}, min {min}: median limit {}, max {}, used {used:.2}, queue {queued:.1}",
                median(&limits),
                d.max_limit
            );
            let cap_f = cap.max(min.into()) as f64;
            assert!(used > 0.75, "{what}");
            assert!(queued <= cap_f * 0.75 + 2.0, "{what}");
            assert!(d.max_limit <= cap * 4 + 8, "{what}");
        }
    }

    #[test]
    fn a_capacity_that_falls_during_a_measurement_is_not_taken_for_the_floor() {
        // 8 slots of a steady 20 ms fall to 2 while the limit is held to
        // measure the floor. Every measured response then waited in the
        // queue of the held 8 (80 ms): taken for the floor, the limit kept
        // a queue of about 10 at the upstream for the floor's window
        // (bench/overload.py: 150 to 370 ms for the whole 2-slot phase).
        for held_at_drop_ms in [0, 150, 400] {
            let mut d = Des::new(
                AdaptiveSpec { min: 1, ..spec() },
                8,
                Dist::Uniform(20_000, 0),
                &[1, 100],
                1,
            );
            d.run(10_000);
            // A steady upstream's limit is seldom held back long enough
            // here (the bench's real one was): one shrink held back away.
            let mut waited = 0;
            while d.auto.measure_limit.is_none() && waited < 60_000 {
                d.auto.stuck_run = d.auto.stuck_run.max(STUCK_RUN - 1);
                d.run(10);
                waited += 10;
            }
            assert!(d.auto.measure_limit.is_some(), "no measurement in 60 s");
            d.run(held_at_drop_ms);
            d.set_capacity(2);
            d.run(2_000);
            d.reset_stats();
            let limits = d.run(20_000);
            let what = format!(
                "drop {held_at_drop_ms} ms into the hold: floor {:?}, limits {:?}.., queue {:.1}",
                d.auto.floor_us(),
                &limits[..20],
                d.queued()
            );
            assert!(d.auto.floor_us() <= Some(25_000), "{what}");
            assert!(d.queued() < 2.0, "{what}");
            assert!(d.used() > 0.85, "{what}");
        }
    }

    #[test]
    fn an_upstream_that_becomes_faster_is_followed() {
        // 16 slots of 30 ± 20 ms, then 10 ± 5: the measured floor of 30 ms
        // let a queue form (40 requests over 30 s when measurements were
        // made at what the upstream served by that floor, shrinking by a
        // few each window). Measured at what it serves by the lowest
        // latency instead, the queue stays within the tolerance.
        let mut d = Des::new(spec(), 16, Dist::Uniform(30_000, 20_000), &[1], 1);
        settle(&mut d, 30);
        d.dist = Dist::Uniform(10_000, 5_000);
        let mut queues = Vec::new();
        for _ in 0..6 {
            d.reset_stats();
            d.run(30_000);
            queues.push(d.queued());
        }
        assert!(queues.iter().all(|&q| q < 8.0), "{queues:?}");
    }

    #[test]
    fn a_few_very_fast_responses_among_slow_ones_do_not_run_the_limit_away() {
        // 4 slots, 5% of responses in 1 ms and the rest in 200 ms: the
        // lowest latency is next to nothing. With intervals twice the
        // average latency, one seed in ten would run the limit to 260 with
        // a queue of 72 at the upstream; with intervals twice the floor,
        // at most 15.
        for seed in 1..=10 {
            let mut d = Des::new(spec(), 4, Dist::Bimodal(1_000, 200_000, 5), &[1, 100], seed);
            d.run(60_000);
            d.reset_stats();
            d.run(120_000);
            let what = format!(
                "seed {seed}: max {}, used {:.2}, queue {:.1}",
                d.max_limit,
                d.used(),
                d.queued()
            );
            assert!(d.max_limit <= 4 * 4 + 8, "{what}");
            assert!(d.queued() < 4.0, "{what}");
            assert!(d.used() > 0.6, "{what}");
        }
    }

    #[test]
    fn a_capacity_that_changes_under_load_is_used_and_never_exceeded() {
        // The bench's upstream (bench/overload.py): 4 slots, then 8, then
        // 2, 5 s each, from a fresh entry at `initial: 4`. Each phase after
        // its first half second is served near its capacity and never over
        // it. The simulation starts a queued request only when the
        // capacity has room: one started on every response would serve
        // the queue of the 8 after a drop to 2 for as long as it stood
        // (727 responses in 4.5 s, against 391 at most).
        let spec = AdaptiveSpec {
            min: 1,
            max: 64,
            initial: 4,
            ..spec()
        };
        for seed in 1..=10 {
            let mut d = Des::new(spec, 4, Dist::Uniform(23_000, 3_000), &[1, 1], seed);
            for cap in [4u64, 8, 2] {
                d.set_capacity(cap);
                d.run(500);
                let before = d.served;
                d.run(4_500);
                let served = d.served - before;
                // 4.5 s of `cap` slots at 23 ms on average.
                let most = cap as f64 * 4_500.0 / 23.0;
                let what = format!("seed {seed}, {cap} slots: {served} served, at most {most:.0}");
                assert!(served as f64 <= most * 1.02, "{what}");
                assert!(served as f64 >= most * 0.9, "{what}");
            }
        }
    }

    #[test]
    fn a_measurement_of_a_bimodal_upstream_is_not_ended_early_by_its_fast_responses() {
        // 8 slots whose responses take 5 ms or 200 ms (80 / 20%), and 10 ms
        // or 300 ms (90 / 10%): a measurement's first responses back are
        // the fast ones. Ended early on them alone, the first upstream's
        // least used seed of ten falls from 52% to 41%; a measurement ends
        // early only if the interval before it averaged what a steady
        // upstream does ([`Auto::finds_nothing`]).
        // (The second upstream's seeds came out the same either way here,
        // 38% to 65% used: its bound guards against a regression only.)
        let spec = AdaptiveSpec { min: 1, ..spec() };
        for (dist, least) in [
            (Dist::Bimodal(5_000, 200_000, 80), 0.48),
            (Dist::Bimodal(10_000, 300_000, 90), 0.35),
        ] {
            for seed in 1..=10 {
                let mut d = Des::new(spec, 8, dist, &[1, 100], seed);
                d.run(30_000);
                d.reset_stats();
                d.run(120_000);
                assert!(
                    d.used() >= least,
                    "{dist:?}, seed {seed}: used {:.2}",
                    d.used()
                );
            }
        }
    }
}

#[cfg(test)]
mod matrix;
