//! Envoy metrics for the limiter. Names are `sluice_rl_<what>.rule.<rule>`:
//! Envoy shows them as `wasmcustom.sluice_rl_<what>.rule.<rule>` in /stats,
//! and with the `stats_tags` shipped in `envoy/`, as
//! `sluice_rl_<what>{rule="<rule>"}` in /stats/prometheus.

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
