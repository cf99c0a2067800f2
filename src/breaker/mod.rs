//! Circuit breaking on upstream error rates: closed, open, half-open.
//!
//! This module is the pure state machine of one breaker key (one protected
//! dependency). `State` is what lives in shared data; every transition is a
//! method taking `now` and, where jitter is drawn, a random source, so every
//! decision can be replayed in tests. `runtime` adds the per-VM cache and
//! the compare-and-swap updates; `codec` the bytes; `config` the settings;
//! `reply` the answer of an open breaker; `stage` its place in the pipeline.
//!
//! Invariants (property-tested): the breaker never trips before
//! `min_requests` requests are in the window; never more than `probes` probe
//! claims are outstanding; open periods grow with repeated trips and never
//! exceed `open_max` plus 20% jitter; jitter stays within [0, 20%].

pub mod codec;
pub mod config;
pub mod reply;
pub mod runtime;
pub mod stage;
#[cfg(test)]
mod tests;

use crate::rng::SplitMix;
pub use config::{BreakerKey, BreakerSpec, FailureSpec};

/// Buckets in the rolling window.
pub const BUCKETS: usize = 10;

/// Adds a bucket's (successes, failures) to a sum.
fn add((a, b): (u64, u64), &(x, y): &(u32, u32)) -> (u64, u64) {
    (a + u64::from(x), b + u64::from(y))
}

/// The breaker's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Closed,
    Open,
    HalfOpen,
}

/// The shared state of one breaker key. Times are milliseconds since the
/// Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub phase: Phase,
    /// Consecutive trips without a successful close (drives the backoff).
    pub trips: u32,
    /// While open: when probes may start.
    pub until_ms: u64,
    /// While half-open: probes claimed and not yet finished.
    pub in_flight: u32,
    /// While half-open: probes that succeeded.
    pub probe_successes: u32,
    /// While half-open: claims older than this are considered lost.
    pub probe_deadline_ms: u64,
    /// Failures since the last success (across workers, see README).
    pub consecutive: u32,
    /// Probe episode: bumped whenever the breaker opens and whenever
    /// outstanding probe claims expire, so that the result of a probe from
    /// an earlier episode can never count in (or free a claim of) a later one.
    pub epoch: u32,
    /// Window bucket index of `buckets[0]`.
    pub base_bucket: u64,
    /// (successes, failures) per bucket.
    pub buckets: [(u32, u32); BUCKETS],
}

/// What happened to the breaker, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Closed to open: the error rate or consecutive failures crossed the threshold.
    Opened { open_ms: u64 },
    /// Open to half-open: the first probe was let through.
    HalfOpened,
    /// Half-open to closed: enough probes succeeded.
    Closed,
    /// Half-open to open: a probe failed; open again for longer.
    Reopened { open_ms: u64 },
}

/// The earliest useful retry told to a request refused by a half-open
/// breaker whose probes are all out: a probe's answer usually comes within
/// it (its `probe_timeout` may be far later).
pub const HALF_OPEN_RETRY_MS: u64 = 1000;

/// Whether a request may go to the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Pass,
    /// Try to claim a probe (needs a fresh read and a CAS).
    TryProbe,
    /// Fail fast; the earliest useful retry is in `retry_after_ms`.
    FailFast {
        retry_after_ms: u64,
    },
}

/// No probe is available: the breaker is closed, still open, or all
/// probes are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoProbe;

impl State {
    /// A closed breaker with an empty window.
    pub fn new() -> Self {
        State {
            phase: Phase::Closed,
            trips: 0,
            until_ms: 0,
            in_flight: 0,
            probe_successes: 0,
            probe_deadline_ms: 0,
            consecutive: 0,
            epoch: 0,
            base_bucket: 0,
            buckets: [(0, 0); BUCKETS],
        }
    }

    /// (successes, failures) in the window ending at `now_ms`.
    pub fn totals(&self, spec: &BreakerSpec, now_ms: u64) -> (u64, u64) {
        self.newest(spec, now_ms).iter().fold((0, 0), add)
    }

    /// The window's buckets at `now_ms`, the newest last.
    fn newest(&self, spec: &BreakerSpec, now_ms: u64) -> [(u32, u32); BUCKETS] {
        let mut s = *self;
        s.advance(spec, now_ms);
        s.buckets
    }

    /// Graded breaking: the chance (permille) that a request to this closed
    /// key is refused: none up to `graded.from`, rising in proportion to
    /// the error rate up to `graded.max` at the rate that trips the breaker.
    ///
    /// The error rate is the whole window's, or its newer half's when that
    /// half holds `min_requests` and its rate is lower by more than twice
    /// its own standard error (chance alone puts it lower half the time,
    /// and the lower of the two would refuse less than the settings say):
    /// refusals start as the window fills, but stop within about half a
    /// window once the upstream recovers, where the whole window's rate
    /// kept refusing until it fell to `from` (1.5 s of a 2 s window,
    /// against 1 s for `admission_control`). Even a half with no failure
    /// counts only with more than 4 × (1 − w) / w requests, `w` the whole
    /// window's rate: a recovery from a low error rate needs more traffic
    /// to be told from chance.
    pub fn reject_permille(&self, spec: &BreakerSpec, now_ms: u64) -> u32 {
        let Some(g) = spec.graded.filter(|_| self.phase == Phase::Closed) else {
            return 0;
        };
        let buckets = self.newest(spec, now_ms);
        let (older, newer) = buckets.split_at(BUCKETS / 2);
        let newer = newer.iter().fold((0, 0), add);
        let whole = older.iter().fold(newer, add);
        let min_requests = u64::from(spec.min_requests).max(1);
        let rate = |(ok, bad): (u64, u64)| {
            let requests = ok + bad;
            (requests >= min_requests).then(|| (bad * 1000 / requests, requests))
        };
        let Some((whole, _)) = rate(whole) else {
            return 0;
        };
        let rate = match rate(newer) {
            Some((n, requests)) => {
                let variance = (whole * (1000 - whole.min(1000))) as f64 / requests as f64;
                let margin = 2.0 * variance.sqrt();
                if (n as f64) + margin < whole as f64 {
                    n
                } else {
                    whole
                }
            }
            None => whole,
        };
        let from = u64::from(g.from_permille);
        if rate <= from {
            return 0;
        }
        let span = u64::from(spec.error_rate_permille)
            .saturating_sub(from)
            .max(1);
        let p = u64::from(g.max_permille) * (rate - from) / span;
        p.min(u64::from(g.max_permille)) as u32
    }

    fn bucket_ms(spec: &BreakerSpec) -> u64 {
        (spec.window_ms / BUCKETS as u64).max(1)
    }

    /// Slides the window so that the bucket of `now_ms` is the last one.
    fn advance(&mut self, spec: &BreakerSpec, now_ms: u64) -> usize {
        let current = now_ms / Self::bucket_ms(spec);
        let last = self.base_bucket.saturating_add(BUCKETS as u64 - 1);
        if current > last {
            let shift = current - last;
            if shift >= BUCKETS as u64 {
                self.buckets = [(0, 0); BUCKETS];
            } else {
                self.buckets.rotate_left(shift as usize);
                for b in self.buckets.iter_mut().rev().take(shift as usize) {
                    *b = (0, 0);
                }
            }
            self.base_bucket = current + 1 - BUCKETS as u64;
        }
        // A clock that went back records into the oldest bucket.
        current
            .saturating_sub(self.base_bucket)
            .min(BUCKETS as u64 - 1) as usize
    }

    /// The open period after `trips` trips, before jitter.
    pub fn open_period_ms(spec: &BreakerSpec, trips: u32) -> u64 {
        let mut period = spec.open_base_ms;
        for _ in 1..trips {
            period = period.saturating_mul(spec.open_multiplier as u64);
            if period >= spec.open_max_ms {
                break;
            }
        }
        period.min(spec.open_max_ms)
    }

    fn open(&mut self, spec: &BreakerSpec, now_ms: u64, rng: &mut SplitMix) -> u64 {
        let period = Self::open_period_ms(spec, self.trips);
        let jitter = rng.below(period / 5 + 1);
        self.phase = Phase::Open;
        self.epoch = self.epoch.wrapping_add(1);
        self.until_ms = now_ms.saturating_add(period + jitter);
        self.in_flight = 0;
        self.probe_successes = 0;
        period + jitter
    }

    /// Counts results from ordinary (non-probe) requests: `successes` first,
    /// then `failures`. Only a closed breaker counts; it may trip.
    pub fn record(
        &mut self,
        spec: &BreakerSpec,
        now_ms: u64,
        successes: u32,
        failures: u32,
        rng: &mut SplitMix,
    ) -> Option<Transition> {
        if self.phase != Phase::Closed {
            return None;
        }
        let i = self.advance(spec, now_ms);
        if let Some(b) = self.buckets.get_mut(i) {
            b.0 = b.0.saturating_add(successes);
            b.1 = b.1.saturating_add(failures);
        }
        self.consecutive = match (successes, failures) {
            (_, 0) if successes > 0 => 0,
            (0, f) => self.consecutive.saturating_add(f),
            (_, f) => f,
        };
        let (s, f) = self.totals(spec, now_ms);
        let total = s + f;
        let by_rate = total >= spec.min_requests as u64
            && f * 1000 >= spec.error_rate_permille as u64 * total
            && f > 0;
        let by_streak = spec
            .consecutive_failures
            .is_some_and(|n| self.consecutive >= n);
        if !(by_rate || by_streak) {
            return None;
        }
        self.trips = 1;
        let open_ms = self.open(spec, now_ms, rng);
        Some(Transition::Opened { open_ms })
    }

    /// Whether a request may pass, from this (possibly cached) state.
    pub fn admit(&self, spec: &BreakerSpec, now_ms: u64) -> Admit {
        match self.phase {
            Phase::Closed => Admit::Pass,
            Phase::Open if now_ms < self.until_ms => Admit::FailFast {
                retry_after_ms: self.until_ms - now_ms,
            },
            Phase::Open => Admit::TryProbe,
            Phase::HalfOpen if self.in_flight < spec.probes || now_ms > self.probe_deadline_ms => {
                Admit::TryProbe
            }
            Phase::HalfOpen => Admit::FailFast {
                retry_after_ms: HALF_OPEN_RETRY_MS,
            },
        }
    }

    /// Claims a probe if one is available; returns the transition if this
    /// claim moved the breaker from open to half-open.
    pub fn claim_probe(
        &mut self,
        spec: &BreakerSpec,
        now_ms: u64,
    ) -> Result<Option<Transition>, NoProbe> {
        let deadline = now_ms.saturating_add(spec.probe_timeout_ms);
        match self.phase {
            Phase::Open if now_ms >= self.until_ms => {
                self.phase = Phase::HalfOpen;
                self.in_flight = 1;
                self.probe_successes = 0;
                self.probe_deadline_ms = deadline;
                Ok(Some(Transition::HalfOpened))
            }
            Phase::HalfOpen => {
                if now_ms > self.probe_deadline_ms {
                    // Claims past their deadline are lost: a new episode.
                    self.in_flight = 0;
                    self.probe_successes = 0;
                    self.epoch = self.epoch.wrapping_add(1);
                }
                if self.in_flight >= spec.probes {
                    return Err(NoProbe);
                }
                self.in_flight += 1;
                self.probe_deadline_ms = deadline;
                Ok(None)
            }
            _ => Err(NoProbe),
        }
    }

    /// A probe's result: enough successes close the breaker with a fresh
    /// window; a failure opens it again for longer.
    pub fn probe_result(
        &mut self,
        spec: &BreakerSpec,
        now_ms: u64,
        (success, epoch): (bool, u32),
        rng: &mut SplitMix,
    ) -> Option<Transition> {
        if self.phase != Phase::HalfOpen || epoch != self.epoch {
            return None;
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        if !success {
            self.trips = self.trips.saturating_add(1);
            let open_ms = self.open(spec, now_ms, rng);
            return Some(Transition::Reopened { open_ms });
        }
        self.probe_successes += 1;
        if self.probe_successes < spec.successes_to_close {
            return None;
        }
        let epoch = self.epoch.wrapping_add(1);
        *self = State {
            epoch,
            ..State::new()
        };
        Some(Transition::Closed)
    }

    /// A probe that ended without an upstream verdict (client gone, or
    /// refused by another mechanism) gives its claim back.
    pub fn release_probe(&mut self, epoch: u32) {
        if self.phase == Phase::HalfOpen && epoch == self.epoch {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
    }
}

impl Default for State {
    fn default() -> Self {
        Self::new()
    }
}
