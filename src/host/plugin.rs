//! The per-VM state shared by all streams of one configuration, and the
//! small glue between streams and the core's breakers (borrowing the
//! per-VM caches, counting transitions, logging them).

use super::metrics::{BreakerMetrics, Metrics, StoreMetrics};
use super::shedding::ShedMetrics;
use super::store::SharedData;
use crate::breaker::runtime::{Breakers, Check, Event, Outcome, Ticket};
use crate::breaker::{BreakerSpec, Transition};
use crate::config::Config;
use crate::fastmap::FastMap;
use crate::limiter::Limiter;
use crate::request::RequestView;
use crate::response::{breaker_rejection, PolicyInfo, Rejection};
use crate::rng::SplitMix;
use crate::shed::Shedders;
use log::{info, warn};
use std::cell::RefCell;

/// Everything a stream needs, derived once per configuration.
pub struct Plugin {
    pub config: Config,
    pub limiter: Limiter,
    pub policies: Vec<PolicyInfo>,
    pub metrics: Metrics,
    pub breakers: RefCell<Breakers>,
    pub breaker_metrics: BreakerMetrics,
    pub shedders: RefCell<Shedders>,
    /// Concurrency slots held, by stream id (see `shedding`).
    pub held: RefCell<FastMap<u32, Vec<usize>>>,
    /// Whether this VM ticks every millisecond (requests are queued).
    pub fast_tick: std::cell::Cell<bool>,
    pub shed_metrics: ShedMetrics,
    pub store_metrics: StoreMetrics,
    pub rng: RefCell<SplitMix>,
}

/// A configuration going away (replaced, or the plugin removed) gives its
/// leased concurrency slots back (the next configuration may share them)
/// and hands its last metric changes to Envoy.
impl Drop for Plugin {
    fn drop(&mut self) {
        if self.has_shedders() {
            self.shed_return_leases();
        }
        super::metrics::flush();
    }
}

impl Plugin {
    pub fn has_breakers(&self) -> bool {
        !self.config.breakers.is_empty()
    }

    pub fn breaker_spec(&self, i: usize) -> Option<&BreakerSpec> {
        self.config.breakers.get(i)
    }

    fn with_breakers<R>(
        &self,
        f: impl FnOnce(&mut Breakers, &mut SplitMix, &mut Vec<Event>) -> R,
    ) -> Option<R> {
        let mut breakers = self.breakers.try_borrow_mut().ok()?;
        let mut rng = self.rng.try_borrow_mut().ok()?;
        let failures_before = breakers.store_failures;
        let mut events = Vec::new();
        let r = f(&mut breakers, &mut rng, &mut events);
        self.breaker_metrics
            .store_failures(breakers.store_failures - failures_before);
        drop(breakers);
        drop(rng);
        for e in events {
            self.on_event(e);
        }
        Some(r)
    }

    fn on_event(&self, e: Event) {
        let name = self.breaker_spec(e.breaker).map_or("", |s| s.name.as_str());
        self.breaker_metrics.transition(e.breaker, e.transition);
        match e.transition {
            Transition::Opened { open_ms } => {
                warn!("sluice: circuit breaker `{name}` opened for {open_ms} ms")
            }
            Transition::Reopened { open_ms } => {
                warn!("sluice: circuit breaker `{name}` probe failed; open again for {open_ms} ms")
            }
            Transition::HalfOpened => info!("sluice: circuit breaker `{name}` half-open: probing"),
            Transition::Closed => info!("sluice: circuit breaker `{name}` closed"),
        }
    }

    /// Checks the request against every matching breaker.
    pub fn breaker_check(&self, now_ms: u64, req: &dyn RequestView) -> Check {
        let check = self
            .with_breakers(|b, rng, ev| b.check(&SharedData, now_ms, req, rng, ev))
            .unwrap_or(Check::Pass(Vec::new()));
        match &check {
            Check::FailFast { breaker, .. } => self.breaker_metrics.fast_failed(*breaker),
            Check::Pass(tickets) => tickets
                .iter()
                .filter(|t| t.probe)
                .for_each(|t| self.breaker_metrics.probe(t.breaker)),
        }
        check
    }

    /// Reports a ticket's outcome.
    pub fn breaker_record(&self, now_ms: u64, t: Ticket, outcome: Outcome) {
        self.with_breakers(|b, rng, ev| b.record(&SharedData, now_ms, t, outcome, rng, ev));
    }

    /// Merges locally counted successes (on a tick).
    pub fn breaker_flush(&self, now_ms: u64) {
        self.with_breakers(|b, rng, ev| b.flush(&SharedData, now_ms, rng, ev));
    }

    /// The local reply of a breaker that fails fast.
    pub fn breaker_answer(
        &self,
        breaker: usize,
        wait_ms: u64,
        half_open: bool,
    ) -> Option<Rejection> {
        let spec = self.breaker_spec(breaker)?;
        let mut rng = self.rng.try_borrow_mut().ok()?;
        let spread = self.config.response.retry_after_jitter_ns;
        Some(breaker_rejection(
            &spec.name,
            spec.status,
            wait_ms,
            half_open,
            spread,
            &mut rng,
        ))
    }
}
