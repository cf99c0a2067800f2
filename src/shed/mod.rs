//! Load shedding by queue latency (CoDel), priority-aware, with an optional
//! concurrency limit and admission queue (a bulkhead).
//!
//! Two ways to measure queueing delay (see docs/configuration.md for when to use which):
//! 1. sluice's own queue: a global in-flight limit kept in shared data; a
//!    request over it waits, paused in the filter, in a bounded per-worker
//!    queue; the time it waited is the delay, measured exactly.
//! 2. latency over the floor: without a sluice queue, the delay is the
//!    upstream latency minus its no-load floor (the minimum over a longer
//!    window), or a queue time the upstream reports in a header.
//!
//! Invariants (tested): a concurrency slot is released exactly once per
//! admitted request; the queue never exceeds its bound and nobody waits past
//! `max_wait`; higher classes are admitted first and shed last.

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
mod observe;
pub mod reply;
mod shares;
#[cfg(test)]
mod shares_tests;
pub mod stage;
mod store_ops;
#[cfg(test)]
mod tests;
mod wake;
#[cfg(test)]
mod workers_tests;

use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::request::RequestView;
use crate::store::{Store, StoreError};
use adaptive::Auto;
use codec::{encode_shared, Shared};
pub use config::{Class, ShedderSpec};
pub use entry::lease_cap;
use entry::Op;
use local::OnWorker;
pub use local::Queued;
use std::collections::VecDeque;

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

/// A shedder and its shared in-flight counter key.
#[derive(Debug, Clone)]
pub struct Shedder {
    pub spec: ShedderSpec,
    pub inflight_key: String,
    /// The adaptive limit's shared entry, with `max: "auto"`.
    pub auto_key: Option<String>,
}

/// All shedders of one configuration, in one worker.
pub struct Shedders {
    pub rules: Vec<Shedder>,
    local: Vec<OnWorker>,
    max_retries: u32,
    /// Store errors and corrupt counters seen (for metrics).
    pub store_failures: u64,
    /// Overload state changes: (shedder, now overloaded).
    pub changes: Vec<(usize, bool)>,
    /// Counter decrements that failed, to retry (see `try_op`).
    retry: Vec<(usize, Op)>,
    /// This worker's tag in claims (see `Shared`).
    worker: u32,
    /// The latest time this worker saw (for the age of claims).
    now_ms: u64,
    /// Workers to wake: a free slot is left to their waiter (see `to_wake`).
    wakes: Vec<u32>,
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
    /// `worker` tags this worker's claims: random per worker VM.
    pub fn new(
        specs: &[ShedderSpec],
        common: &Common,
        now_ms: u64,
        worker: u32,
    ) -> Result<Self, ConfigError> {
        let mut rules: Vec<Shedder> = Vec::new();
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
            let earlier = rules
                .iter()
                .map(|r| (r.inflight_key.as_str(), r.spec.name.as_str()));
            check_state_id("shedders", i, &inflight_key, earlier)?;
            rules.push(Shedder {
                spec: spec.clone(),
                inflight_key,
                auto_key,
            });
        }
        let local = rules
            .iter()
            .map(|r| OnWorker::new(&r.spec, now_ms))
            .collect();
        Ok(Shedders {
            rules,
            local,
            max_retries: common.max_cas_retries,
            store_failures: 0,
            changes: Vec::new(),
            retry: Vec::new(),
            worker,
            now_ms,
            wakes: Vec::new(),
        })
    }

    /// This worker's tag (its claims', and its wake-up queue's).
    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// The workers to wake since the last call, each once.
    pub fn take_wakes(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.wakes)
    }

    /// The shedders matching a request, with the request's class in each.
    pub fn classify(&self, req: &dyn RequestView) -> Vec<(usize, Class)> {
        let mut out = Vec::new();
        for (i, r) in self.rules.iter().enumerate() {
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
    pub fn overloaded(&self, s: usize) -> bool {
        self.local.get(s).is_some_and(|l| l.codel.overloaded)
    }

    /// Requests waiting in this worker's queue of shedder `s`.
    pub fn queued(&self, s: usize) -> usize {
        self.local
            .get(s)
            .map_or(0, |l| l.queues.iter().map(VecDeque::len).sum())
    }

    /// Shedder `s`'s concurrency limit, if it has one (queue mode): the
    /// fixed one, or the adaptive one as last read.
    pub fn limit(&self, s: usize) -> Option<u64> {
        let conc = self.rules.get(s)?.spec.concurrency.as_ref()?;
        match self.local.get(s).and_then(|l| l.auto.as_ref()) {
            Some(a) => Some(a.limit()),
            None => Some(conc.max as u64),
        }
    }

    /// The adaptive limit's floor estimate (µs), as last read.
    pub fn floor_us(&self, s: usize) -> Option<u64> {
        self.local.get(s)?.auto.as_ref()?.floor_us()
    }

    /// Shedder `s`'s shares, if it has them.
    fn shares(&self, s: usize) -> Option<[u32; 3]> {
        self.rules.get(s)?.spec.shares
    }

    /// Creates the shared counters (at configuration).
    pub fn create(&self, store: &dyn Store) -> Result<(), StoreError> {
        for r in self.rules.iter().filter(|r| r.spec.concurrency.is_some()) {
            if store.get(&r.inflight_key)?.is_none() {
                store.set(&r.inflight_key, &encode_shared(&Shared::default()), None)?;
            }
        }
        Ok(())
    }

    /// Reads each adaptive limit's shared entry (at configuration: an
    /// unchanged shedder keeps what it learned).
    pub fn read_limits(&mut self, store: &dyn Store) {
        for (r, l) in self.rules.iter().zip(self.local.iter_mut()) {
            let Some(key) = &r.auto_key else { continue };
            if let Ok(Some(e)) = store.get(key) {
                if let Ok(a) = Auto::decode(&e.bytes) {
                    l.auto = Some(a);
                }
            }
        }
    }

    /// Whether decrements that failed are waiting to be retried.
    pub fn has_retries(&self) -> bool {
        !self.retry.is_empty()
    }

    /// Whether shedder `s` sheds early, and its interval (ms).
    fn early(&self, s: usize) -> (bool, u64) {
        self.rules.get(s).map_or((false, 0), |r| {
            let early = r.spec.concurrency.as_ref().is_some_and(|c| c.shed_early);
            (early, r.spec.interval_ms)
        })
    }

    /// Slots leased by this worker for shedder `s` (for tests and metrics).
    pub fn leased(&self, s: usize) -> u64 {
        self.local.get(s).map_or(0, |l| l.lease)
    }
}
