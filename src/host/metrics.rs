//! Envoy metrics for the limiter. Names are `sluice_rl_<what>.rule.<rule>`:
//! Envoy shows them as `wasmcustom.sluice_rl_<what>.rule.<rule>` in /stats,
//! and with the `stats_tags` shipped in `envoy/`, as
//! `sluice_rl_<what>{rule="<rule>"}` in /stats/prometheus.

use crate::breaker::Transition;
use crate::limiter::{Evaluation, RuleResult};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

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

fn define(kind: MetricType, what: &str, rule: &str) -> u32 {
    hostcalls::define_metric(kind, &format!("sluice_rl_{what}.rule.{rule}")).unwrap_or(0)
}

impl Metrics {
    /// Defines (or finds) the metrics of every rule and sets each rule's
    /// table gauge.
    pub fn define(rules: &[(&str, u32)]) -> Self {
        let rules = rules
            .iter()
            .map(|&(name, table)| {
                let gauge = define(MetricType::Gauge, "table_entries", name);
                let _ = hostcalls::record_metric(gauge, table as u64);
                RuleMetrics {
                    allowed: define(MetricType::Counter, "allowed", name),
                    limited: define(MetricType::Counter, "limited", name),
                    shadow_limited: define(MetricType::Counter, "shadow_limited", name),
                    store_failures: define(MetricType::Counter, "store_failures", name),
                    cas_retries: define(MetricType::Counter, "cas_retries", name),
                    corrupt: define(MetricType::Counter, "corrupt_state", name),
                    collisions: define(MetricType::Counter, "collisions", name),
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
            let _ = hostcalls::increment_metric(id, 1);
            if r.cas_retries > 0 {
                let _ = hostcalls::increment_metric(m.cas_retries, r.cas_retries as i64);
            }
            if r.corrupt {
                let _ = hostcalls::increment_metric(m.corrupt, 1);
            }
            if r.collision {
                let _ = hostcalls::increment_metric(m.collisions, 1);
            }
        }
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
    hostcalls::define_metric(kind, &format!("sluice_cb_{what}.breaker.{name}")).unwrap_or(0)
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
        let store_failures =
            hostcalls::define_metric(MetricType::Counter, "sluice_cb_store_failures").unwrap_or(0);
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
            let _ = hostcalls::increment_metric(m.fast_failed, 1);
        }
    }

    pub fn probe(&self, breaker: usize) {
        if let Some(m) = self.breakers.get(breaker) {
            let _ = hostcalls::increment_metric(m.probes, 1);
        }
    }

    pub fn store_failures(&self, n: u64) {
        if n > 0 {
            let _ = hostcalls::increment_metric(self.store_failures, n as i64);
        }
    }
}
