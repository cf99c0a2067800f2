//! Envoy metrics for the core's [`Registry`]: defines every metric the
//! stages declared and maps the core's metric ids onto Envoy's.
//!
//! Counters and gauges that change per request are not handed to Envoy one
//! host call at a time: `add` merges the changes per metric in the VM and
//! every worker's tick (`flush`: every 100 ms, or 1 ms while it has to act
//! sooner) hands them over, one host call per metric that changed.
//! Breaker transitions and state are set at once.

use crate::pipeline::telemetry::{Kind, MetricId, Registry, Sink};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use std::cell::RefCell;
use std::collections::BTreeMap;

std::thread_local! {
    /// Changes not yet handed to Envoy, by Envoy metric id (ids are per
    /// VM, so this is too). Entries stay, at zero, once flushed: at most
    /// one per metric this VM defined.
    static PENDING: RefCell<Vec<(u32, i64)>> = const { RefCell::new(Vec::new()) };
    /// Envoy's id of every metric this VM defined, by kind and name. Envoy
    /// gives each `define_metric` call a new id and keeps it for the VM's
    /// life, so a configuration replaced (ECDS, every few seconds in some
    /// meshes) that defined its metrics again would grow Envoy's table and
    /// `PENDING` by one entry per metric each time; found here, they are
    /// defined once per name.
    static DEFINED: RefCell<BTreeMap<(u8, String), u32>> = const { RefCell::new(BTreeMap::new()) };
    /// How many of this VM's live configurations define each gauge (by
    /// Envoy id): one none defines any more is set to 0 ([`release`]).
    static LIVE: RefCell<BTreeMap<u32, u32>> = const { RefCell::new(BTreeMap::new()) };
}

/// Adds `by` to a counter or gauge, handed to Envoy at the next `flush`.
fn add(id: u32, by: i64) {
    PENDING.with(|p| match p.try_borrow_mut() {
        Ok(mut p) => match p.iter_mut().find(|(m, _)| *m == id) {
            Some((_, d)) => *d = d.saturating_add(by),
            None => p.push((id, by)),
        },
        Err(_) => {
            let _ = hostcalls::increment_metric(id, by);
        }
    });
}

/// Hands every pending change to Envoy (on each tick and when a
/// configuration goes away).
pub fn flush() {
    PENDING.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut() {
            for (id, d) in p.iter_mut().filter(|(_, d)| *d != 0) {
                let _ = hostcalls::increment_metric(*id, *d);
                *d = 0;
            }
        }
    });
}

/// Adds a count of events (such as a tick's worth of them) to a counter.
fn add_count(id: u32, n: u64) {
    if n > 0 {
        add(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// Defines (or finds) every metric of a registry in this VM; Envoy's ids,
/// indexed by the core's. A name this VM defined before keeps its id.
pub fn define(reg: &Registry) -> Vec<u32> {
    let ids: Vec<u32> = reg
        .defs
        .iter()
        .map(|d| define_one(d.kind, &d.name))
        .collect();
    LIVE.with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            for id in gauges(reg, &ids) {
                *l.entry(id).or_default() += 1;
            }
        }
    });
    ids
}

/// The Envoy ids of a registry's gauges.
fn gauges<'a>(reg: &'a Registry, ids: &'a [u32]) -> impl Iterator<Item = u32> + 'a {
    reg.defs
        .iter()
        .zip(ids)
        .filter(|(d, _)| d.kind == Kind::Gauge)
        .map(|(_, &id)| id)
}

/// A configuration (`define`'s registry and ids) goes away: its gauges
/// that no other live configuration of this VM defines go to 0. Envoy
/// keeps a gauge by its name for the process's life, and one of a
/// mechanism the next configuration lacks (a breaker open, a global
/// rule on its backstop, a retry ratio) would otherwise read as it last
/// was, for good; one the next configuration keeps is left to it.
pub fn release(reg: &Registry, ids: &[u32]) {
    LIVE.with(|l| {
        let Ok(mut l) = l.try_borrow_mut() else {
            return;
        };
        for id in gauges(reg, ids) {
            let Some(n) = l.get_mut(&id) else {
                continue;
            };
            *n = n.saturating_sub(1);
            if *n == 0 {
                l.remove(&id);
                let _ = hostcalls::record_metric(id, 0);
            }
        }
    });
}

fn define_one(kind: Kind, name: &str) -> u32 {
    let (tag, host_kind) = match kind {
        Kind::Counter => (0, MetricType::Counter),
        Kind::Gauge => (1, MetricType::Gauge),
        Kind::Histogram => (2, MetricType::Histogram),
    };
    let key = (tag, name.to_string());
    let known = DEFINED.with(|d| d.try_borrow().ok().and_then(|d| d.get(&key).copied()));
    if let Some(id) = known {
        return id;
    }
    match hostcalls::define_metric(host_kind, name) {
        Ok(id) => {
            DEFINED.with(|d| d.try_borrow_mut().map(|mut d| d.insert(key, id)).ok());
            id
        }
        Err(_) => 0,
    }
}

/// The core's metric changes, to Envoy.
pub struct HostSink<'a>(pub &'a [u32]);

impl HostSink<'_> {
    fn id(&self, m: MetricId) -> Option<u32> {
        self.0.get(m as usize).copied()
    }
}

impl Sink for HostSink<'_> {
    fn add(&mut self, m: MetricId, by: i64) {
        if let Some(id) = self.id(m) {
            add(id, by);
        }
    }

    fn add_now(&mut self, m: MetricId, by: i64) {
        if let Some(id) = self.id(m) {
            let _ = hostcalls::increment_metric(id, by);
        }
    }

    fn record(&mut self, m: MetricId, value: u64) {
        if let Some(id) = self.id(m) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// The VM's shared-data reads saved by remembering its own writes
/// (`sluice_store_reads_skipped_total`) and remembered values found out of
/// date (`sluice_store_stale_reads_total`); see `store::Remembering`. They
/// belong to the proxy (every configuration of a VM shares the layer), so
/// they carry no `domain`.
#[derive(Default)]
pub struct StoreMetrics {
    reads_skipped: u32,
    stale_reads: u32,
}

impl StoreMetrics {
    pub fn define() -> Self {
        let counter = |name| define_one(Kind::Counter, name);
        StoreMetrics {
            reads_skipped: counter("sluice_store_reads_skipped_total"),
            stale_reads: counter("sluice_store_stale_reads_total"),
        }
    }

    /// Adds the counts since the last call (on each tick).
    pub fn record(&self, (skipped, stale): (u64, u64)) {
        add_count(self.reads_skipped, skipped);
        add_count(self.stale_reads, stale);
    }
}
