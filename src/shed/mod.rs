//! Load shedding by queue latency (CoDel), priority-aware, with an optional
//! concurrency limit and admission queue (a bulkhead).
//!
//! Two ways to measure queueing delay (see docs/configuration.md for when to use which):
//! 1. sluice's own queue: a global in-flight limit kept in shared data; a
//!    request over it waits, paused in the filter, in a bounded per-worker
//!    queue (lines of the pipeline's wait list, one per class: see
//!    `waiters.rs`); the time it waited is the delay, measured exactly.
//! 2. latency over the floor: without a sluice queue, the delay is the
//!    upstream latency minus its no-load floor (the minimum over a longer
//!    window), or a queue time the upstream reports in a header.
//!
//! Invariants (tested): a concurrency slot is released exactly once per
//! admitted request; the queue never exceeds its bound and nobody waits past
//! `max_wait`; higher classes are admitted first and shed last.
//!
//! Each shedder is one [`Shedder`] (its specification, what this worker
//! keeps of it, its metric ids), named by a [`ShedderId`]; a call on them
//! returns what it did besides its answer (a [`Report`]).

pub mod adaptive;
#[cfg(test)]
mod adaptive_sim;
mod arrive;
pub mod codec;
pub mod codel;
#[cfg(test)]
mod codel_tests;
pub mod config;
mod early;
#[cfg(test)]
mod early_tests;
mod entry;
mod local;
mod metrics;
mod observe;
pub mod reply;
mod shares;
#[cfg(test)]
mod shares_tests;
pub mod stage;
mod store_ops;
#[cfg(test)]
mod tests;
pub mod waiters;
mod wake;
#[cfg(test)]
mod workers_tests;

use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::pipeline::telemetry::Registry;
use crate::request::RequestView;
use crate::small::Small;
use crate::store::{Store, StoreError};
use adaptive::Auto;
use codec::{encode_shared, Shared};
pub use config::{Class, ShedderSpec};
pub use entry::lease_cap;
use entry::Op;
use local::OnWorker;
pub use local::Queued;
use metrics::shedder_metrics;
pub use metrics::{ShedMetrics, METRICS};
use waiters::Waiters;

/// What to do with an arriving request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Let it through; `slot` says whether it holds a concurrency slot to release.
    Admit { slot: bool },
    /// Pause it in the queue; `evicted` (a lower-priority waiter) must be shed.
    Queue { evicted: Option<Queued> },
    /// Shed it now.
    Shed,
    /// `shed_early`: it would wait past its deadline: answer it so now.
    Expired,
}

/// What to do with a queued request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Resume it; it waited `waited_ms` and holds a slot if `slot` (not
    /// when the store failed and it was let through without one).
    Resume { id: u32, waited_ms: u64, slot: bool },
    /// Answer it with a shed response.
    Shed { waiter: Queued },
    /// Its deadline passed while it waited: answer it so.
    Expired { waiter: Queued },
}

/// A shedder's number in its configuration: its place among the
/// shedders, given by them (`Shedders::ids`, `Shedders::classify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShedderId(u32);

/// One shedder: its specification, its shared entries' keys, what this
/// worker keeps of it, and its metric ids.
pub struct Shedder {
    pub spec: ShedderSpec,
    pub inflight_key: String,
    /// The adaptive limit's shared entry, with `max: "auto"`.
    pub auto_key: Option<String>,
    local: OnWorker,
    pub metrics: ShedMetrics,
}

/// What a call on the shedders did besides its answer. Empty lists hold
/// nothing on the heap.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Report {
    /// Overload state changes: (shedder, now overloaded).
    pub changes: Vec<(ShedderId, bool)>,
    /// Workers to wake, each once: a free slot is left to their waiter
    /// (see `to_wake`).
    pub wakes: Vec<u32>,
    /// Store errors and corrupt entries met.
    pub store_failures: u64,
}

/// All shedders of one configuration, in one worker.
pub struct Shedders {
    /// In order of configuration: a `ShedderId` is a place here.
    all: Vec<Shedder>,
    max_retries: u32,
    /// What the call running did so far, handed over as its result
    /// (`Shedders::done`).
    report: Report,
    /// Counter decrements that failed, to retry (see `try_op`).
    retry: Vec<(ShedderId, Op)>,
    /// This worker's tag in claims (see `Shared`).
    worker: u32,
    /// The latest time this worker saw (for the age of claims).
    now_ms: u64,
}

/// The shedder's state id: its name and its concurrency settings.
fn table_id(domain: &str, spec: &ShedderSpec) -> u32 {
    let id = StateId::new((0x7368_6564, 0x646572), domain).text(&spec.name);
    match &spec.concurrency {
        None => id.num(0),
        Some(c) => {
            let id = id
                .num(1)
                .num(u64::from(c.max))
                .num(u64::from(c.queue))
                .num(c.max_wait_ms);
            let id = match &c.adaptive {
                // A fixed limit's id has no adaptive fields: its entry stays
                // the same across sluice versions.
                None => id,
                Some(a) => id
                    .text("auto")
                    .num(u64::from(a.min))
                    .num(u64::from(a.initial))
                    .num(u64::from(a.tolerance_pct))
                    .num(a.interval_ms)
                    .num(a.floor_window_ms),
            };
            // Shares order the claims by turn, not by class: a configuration
            // that turns them on or off gets an entry of its own, never one
            // whose claims another configuration keeps in the other order.
            match &spec.shares {
                None => id,
                Some(sh) => sh
                    .iter()
                    .fold(id.text("shares"), |id, &x| id.num(u64::from(x))),
            }
        }
    }
    .finish()
}

impl Shedders {
    /// `worker` tags this worker's claims: random per worker VM; each
    /// shedder's metrics are defined in `reg`.
    pub fn new(
        specs: &[ShedderSpec],
        common: &Common,
        (now_ms, worker): (u64, u32),
        reg: &mut Registry,
    ) -> Result<Self, ConfigError> {
        let mut all: Vec<Shedder> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            // `/q3`: the entry with claims that count their worker's
            // waiters. An older sluice (`/q2`: claims without counts;
            // `/inflight`: 16 bytes) sharing the VM id while it drains
            // keeps its own.
            let id = table_id(&common.domain, spec);
            let inflight_key = format!("sh{id:08x}/q3");
            let auto_key = spec
                .concurrency
                .as_ref()
                .and_then(|c| c.adaptive)
                .map(|_| format!("sh{id:08x}/auto5"));
            let earlier = all
                .iter()
                .map(|r| (r.inflight_key.as_str(), r.spec.name.as_str()));
            check_state_id("shedders", i, &inflight_key, earlier)?;
            all.push(Shedder {
                spec: spec.clone(),
                inflight_key,
                auto_key,
                local: OnWorker::new(spec, now_ms),
                metrics: shedder_metrics(reg, &common.domain, spec),
            });
        }
        Ok(Shedders {
            all,
            max_retries: common.max_cas_retries,
            report: Report::default(),
            retry: Vec::new(),
            worker,
            now_ms,
        })
    }

    /// This worker's tag (its claims', and its wake-up queue's).
    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// What the call ending did (see `Report`).
    fn done(&mut self) -> Report {
        std::mem::take(&mut self.report)
    }

    /// The shedders, in order.
    pub fn ids(&self) -> impl Iterator<Item = ShedderId> {
        let n = u32::try_from(self.all.len()).unwrap_or(u32::MAX);
        (0..n).map(ShedderId)
    }

    /// Shedder `s`.
    pub fn get(&self, s: ShedderId) -> Option<&Shedder> {
        self.all.get(s.0 as usize)
    }

    fn get_mut(&mut self, s: ShedderId) -> Option<&mut Shedder> {
        self.all.get_mut(s.0 as usize)
    }

    /// What this worker keeps of shedder `s`.
    fn local(&self, s: ShedderId) -> Option<&OnWorker> {
        self.get(s).map(|x| &x.local)
    }

    fn local_mut(&mut self, s: ShedderId) -> Option<&mut OnWorker> {
        self.get_mut(s).map(|x| &mut x.local)
    }

    /// The shedders matching a request, with the request's class in each.
    pub fn classify(&self, req: &dyn RequestView) -> Small<(ShedderId, Class), 1> {
        let mut out = Small::new();
        for (i, r) in self.ids().zip(&self.all) {
            if !r.spec.matcher.matches(req) {
                continue;
            }
            let by_rule = r
                .spec
                .classes
                .iter()
                .find(|(m, _)| m.matches(req))
                .map(|(_, c)| *c);
            let by_header = || {
                r.spec
                    .priority_header
                    .as_ref()
                    .and_then(|h| req.header(h))
                    .and_then(|v| Class::parse(&v))
            };
            out.push((
                i,
                by_rule.or_else(by_header).unwrap_or(r.spec.default_class),
            ));
        }
        out
    }

    /// Whether the shedder is overloaded in this worker.
    pub fn overloaded(&self, s: ShedderId) -> bool {
        self.local(s).is_some_and(|l| l.codel.overloaded)
    }

    /// Requests waiting in this worker's queue of shedder `s`.
    pub fn queued(&self, w: &impl Waiters, s: ShedderId) -> usize {
        waiters::waiting(w, s)
    }

    /// Shedder `s`'s concurrency limit, if it has one (queue mode): the
    /// fixed one, or the adaptive one as last read.
    pub fn limit(&self, s: ShedderId) -> Option<u64> {
        let conc = self.get(s)?.spec.concurrency.as_ref()?;
        match self.local(s).and_then(|l| l.auto.as_ref()) {
            Some(a) => Some(a.limit()),
            None => Some(conc.max as u64),
        }
    }

    /// The adaptive limit's floor estimate (µs), as last read.
    pub fn floor_us(&self, s: ShedderId) -> Option<u64> {
        self.local(s)?.auto.as_ref()?.floor_us()
    }

    /// Shedder `s`'s shares, if it has them.
    fn shares(&self, s: ShedderId) -> Option<[u32; 3]> {
        self.get(s)?.spec.shares
    }

    /// Creates the shared counters (at configuration).
    pub fn create(&self, store: &dyn Store) -> Result<(), StoreError> {
        for r in self.all.iter().filter(|r| r.spec.concurrency.is_some()) {
            if store.get(&r.inflight_key)?.is_none() {
                store.set(&r.inflight_key, &encode_shared(&Shared::default()), None)?;
            }
        }
        Ok(())
    }

    /// Reads each adaptive limit's shared entry (at configuration: an
    /// unchanged shedder keeps what it learned).
    pub fn read_limits(&mut self, store: &dyn Store) {
        for r in &mut self.all {
            let Some(key) = &r.auto_key else { continue };
            if let Ok(Some(e)) = store.get(key) {
                if let Ok(a) = Auto::decode(&e.bytes) {
                    r.local.auto = Some(a);
                }
            }
        }
    }

    /// Whether decrements that failed are waiting to be retried.
    pub fn has_retries(&self) -> bool {
        !self.retry.is_empty()
    }

    /// Whether shedder `s` sheds early, and its interval (ms).
    fn early(&self, s: ShedderId) -> (bool, u64) {
        self.get(s).map_or((false, 0), |r| {
            let early = r.spec.concurrency.as_ref().is_some_and(|c| c.shed_early);
            (early, r.spec.interval_ms)
        })
    }

    /// Slots leased by this worker for shedder `s` (for tests and metrics).
    pub fn leased(&self, s: ShedderId) -> u64 {
        self.local(s).map_or(0, |l| l.lease)
    }
}
