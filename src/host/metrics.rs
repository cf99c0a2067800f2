//! Envoy metrics. Names are `sluice_<mechanism>_<what>.<tag>.<name>`, such
//! as `sluice_rl_allowed.rule.<rule>`: Envoy shows them with a `wasmcustom.`
//! prefix in /stats, and with the `stats_tags` shipped in `envoy/`, as
//! `sluice_rl_allowed{rule="<rule>"}` in /stats/prometheus.
//!
//! Counters and gauges that change per request are not handed to Envoy one
//! host call at a time: `add` merges the changes per metric in the VM and
//! every worker's 100 ms tick (`flush`) hands them over, one host call per
//! metric that changed. Breaker transitions and state are set at once.

use crate::breaker::Transition;
use crate::limiter::{Evaluation, RuleResult};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use std::cell::RefCell;

std::thread_local! {
    /// Changes not yet handed to Envoy, by metric id (ids are per VM, so
    /// this is too). Entries stay, at zero, once flushed: at most one per
    /// metric this VM defined.
    static PENDING: RefCell<Vec<(u32, i64)>> = const { RefCell::new(Vec::new()) };
}

/// Adds `by` to a counter or gauge, handed to Envoy at the next `flush`.
pub fn add(id: u32, by: i64) {
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

/// Adds a count of events (such as a tick's worth of them) to a counter,
/// handed to Envoy at the next `flush`.
pub fn add_count(id: u32, n: u64) {
    if n > 0 {
        add(id, i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// Defines (or finds) the untagged counter `name` in this VM.
fn define_counter(name: &str) -> u32 {
    hostcalls::define_metric(MetricType::Counter, name).unwrap_or(0)
}

/// Defines (or finds) the metric `sluice_<prefix><what>.<tag>.<name>` in
/// this VM.
pub fn define(kind: MetricType, prefix: &str, what: &str, tag: &str, name: &str) -> u32 {
    hostcalls::define_metric(kind, &format!("sluice_{prefix}{what}.{tag}.{name}")).unwrap_or(0)
}

/// Metric ids of one rule, in this VM.
#[derive(Default, Clone, Copy)]
struct RuleMetrics {
    allowed: u32,
    limited: u32,
    shadow_limited: u32,
    store_failures: u32,
    cas_retries: u32,
    corrupt: u32,
    collisions: u32,
}

/// All of the limiter's metrics.
#[derive(Default)]
pub struct Metrics {
    rules: Vec<RuleMetrics>,
}

fn define_rl(kind: MetricType, what: &str, rule: &str) -> u32 {
    define(kind, "rl_", what, "rule", rule)
}

impl Metrics {
    /// Defines (or finds) the metrics of every rule and sets each rule's
    /// table gauge.
    pub fn define(rules: &[(&str, u32)]) -> Self {
        let rules = rules
            .iter()
            .map(|&(name, table)| {
                let gauge = define_rl(MetricType::Gauge, "table_entries", name);
                let _ = hostcalls::record_metric(gauge, table as u64);
                RuleMetrics {
                    allowed: define_rl(MetricType::Counter, "allowed", name),
                    limited: define_rl(MetricType::Counter, "limited", name),
                    shadow_limited: define_rl(MetricType::Counter, "shadow_limited", name),
                    store_failures: define_rl(MetricType::Counter, "store_failures", name),
                    cas_retries: define_rl(MetricType::Counter, "cas_retries", name),
                    corrupt: define_rl(MetricType::Counter, "corrupt_state", name),
                    collisions: define_rl(MetricType::Counter, "collisions", name),
                }
            })
            .collect();
        Metrics { rules }
    }

    /// Counts one evaluation.
    pub fn record(&self, eval: &Evaluation) {
        for r in &eval.reports {
            let Some(m) = self.rules.get(r.rule) else {
                continue;
            };
            let id = match r.result {
                RuleResult::Allowed => m.allowed,
                RuleResult::Limited => m.limited,
                RuleResult::ShadowLimited => m.shadow_limited,
                RuleResult::StoreFailure => m.store_failures,
            };
            add(id, 1);
            if r.cas_retries > 0 {
                add(m.cas_retries, i64::from(r.cas_retries));
            }
            if r.corrupt {
                add(m.corrupt, 1);
            }
            if r.collision {
                add(m.collisions, 1);
            }
        }
    }
}

/// The VM's shared-data reads saved by remembering its own writes
/// (`sluice_store_reads_skipped`) and remembered values found out of date
/// (`sluice_store_stale_reads`); see `store::Remembering`.
#[derive(Default)]
pub struct StoreMetrics {
    reads_skipped: u32,
    stale_reads: u32,
}

impl StoreMetrics {
    pub fn define() -> Self {
        StoreMetrics {
            reads_skipped: define_counter("sluice_store_reads_skipped"),
            stale_reads: define_counter("sluice_store_stale_reads"),
        }
    }

    /// Adds the counts since the last call (on each tick).
    pub fn record(&self, (skipped, stale): (u64, u64)) {
        add_count(self.reads_skipped, skipped);
        add_count(self.stale_reads, stale);
    }
}

/// Metric ids of one breaker, in this VM. Names are
/// `sluice_cb_<what>.breaker.<name>` (tag `breaker` with the shipped
/// `stats_tags`).
#[derive(Default, Clone, Copy)]
struct OneBreaker {
    state: u32,
    opened: u32,
    half_opened: u32,
    closed: u32,
    reopened: u32,
    fast_failed: u32,
    probes: u32,
}

/// All breakers' metrics.
#[derive(Default)]
pub struct BreakerMetrics {
    breakers: Vec<OneBreaker>,
    store_failures: u32,
}

fn define_cb(kind: MetricType, what: &str, name: &str) -> u32 {
    define(kind, "cb_", what, "breaker", name)
}

impl BreakerMetrics {
    pub fn define(names: &[&str]) -> Self {
        if names.is_empty() {
            return Self::default();
        }
        let breakers = names
            .iter()
            .map(|name| OneBreaker {
                state: define_cb(MetricType::Gauge, "state", name),
                opened: define_cb(MetricType::Counter, "opened", name),
                half_opened: define_cb(MetricType::Counter, "half_opened", name),
                closed: define_cb(MetricType::Counter, "closed", name),
                reopened: define_cb(MetricType::Counter, "reopened", name),
                fast_failed: define_cb(MetricType::Counter, "fast_failed", name),
                probes: define_cb(MetricType::Counter, "probes", name),
            })
            .collect();
        let store_failures = define_counter("sluice_cb_store_failures");
        BreakerMetrics {
            breakers,
            store_failures,
        }
    }

    /// Counts a transition and sets the state gauge (0 closed, 1 open, 2 half-open).
    pub fn transition(&self, breaker: usize, t: Transition) {
        let Some(m) = self.breakers.get(breaker) else {
            return;
        };
        let (counter, state) = match t {
            Transition::Opened { .. } => (m.opened, 1),
            Transition::Reopened { .. } => (m.reopened, 1),
            Transition::HalfOpened => (m.half_opened, 2),
            Transition::Closed => (m.closed, 0),
        };
        let _ = hostcalls::increment_metric(counter, 1);
        let _ = hostcalls::record_metric(m.state, state);
    }

    pub fn fast_failed(&self, breaker: usize) {
        if let Some(m) = self.breakers.get(breaker) {
            add(m.fast_failed, 1);
        }
    }

    pub fn probe(&self, breaker: usize) {
        if let Some(m) = self.breakers.get(breaker) {
            add(m.probes, 1);
        }
    }

    pub fn store_failures(&self, n: u64) {
        add_count(self.store_failures, n);
    }
}
