//! Rate limiting in the pipeline: evaluates the matching rules on each
//! request, counts the results, and turns a refusal into its reply.

use super::reply::{action, Action, PolicyInfo};
use super::{Evaluation, Limiter, RuleResult};
use crate::config::{Config, ConfigError, ResponseSpec};
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::RequestView;
use log::info;

/// Metric ids of one rule (labels `domain`, `rule`).
#[derive(Default, Clone, Copy)]
struct RuleMetrics {
    allowed: MetricId,
    limited: MetricId,
    shadow_limited: MetricId,
    store_failures: MetricId,
    cas_retries: MetricId,
    corrupt: MetricId,
    collisions: MetricId,
    table_entries: MetricId,
}

/// The rate-limit stage of one configuration.
pub struct RateLimits {
    limiter: Limiter,
    policies: Vec<PolicyInfo>,
    response: ResponseSpec,
    metrics: Vec<RuleMetrics>,
}

/// The stage, if the configuration has rules.
pub fn build(
    config: &Config,
    seed: (u64, u64),
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if config.rules.is_empty() {
        return Ok(None);
    }
    let limiter = Limiter::new(config, seed)?;
    let metrics = config
        .rules
        .iter()
        .map(|r| {
            let labels = [
                ("domain", config.domain.as_str()),
                ("rule", r.name.as_str()),
            ];
            let [allowed, limited, shadow_limited, store_failures] = reg.variants(
                "sluice_rl_requests_total",
                &labels,
                "result",
                ["allowed", "limited", "shadow_limited", "store_failure"],
            );
            let mut m = |kind, name| reg.labelled(kind, name, &labels);
            RuleMetrics {
                allowed,
                limited,
                shadow_limited,
                store_failures,
                table_entries: m(Kind::Gauge, "sluice_rl_table_entries"),
                cas_retries: m(Kind::Counter, "sluice_rl_cas_retries_total"),
                corrupt: m(Kind::Counter, "sluice_rl_corrupt_state_total"),
                collisions: m(Kind::Counter, "sluice_rl_collisions_total"),
            }
        })
        .collect();
    let policies = config
        .rules
        .iter()
        .map(|r| PolicyInfo::of(&r.name, &r.bucket))
        .collect();
    Ok(Some(Box::new(RateLimits {
        limiter,
        policies,
        response: config.response.clone(),
        metrics,
    })))
}

impl RateLimits {
    /// Counts one evaluation.
    fn record(&self, cx: &mut Cx<'_, '_>, eval: &Evaluation) {
        for r in &eval.reports {
            let Some(m) = self.metrics.get(r.rule) else {
                continue;
            };
            let id = match r.result {
                RuleResult::Allowed => m.allowed,
                RuleResult::Limited => m.limited,
                RuleResult::ShadowLimited => m.shadow_limited,
                RuleResult::StoreFailure => m.store_failures,
            };
            cx.add(id, 1);
            if r.cas_retries > 0 {
                cx.add(m.cas_retries, i64::from(r.cas_retries));
            }
            if r.corrupt {
                cx.add(m.corrupt, 1);
            }
            if r.collision {
                cx.add(m.collisions, 1);
            }
        }
    }
}

impl Stage for RateLimits {
    fn start(&mut self, cx: &mut Cx<'_, '_>) -> Result<(), String> {
        match self.limiter.create_tables(cx.store()) {
            Ok(created) if created > 0 => info!("sluice: created {created} shared-data slots"),
            Ok(_) => {}
            Err(e) => {
                return Err(format!(
                    "could not create slot tables in shared data: {e:?}"
                ))
            }
        }
        for (i, m) in self.metrics.iter().enumerate() {
            cx.record(m.table_entries, u64::from(self.limiter.table_len(i)));
        }
        Ok(())
    }

    fn request(
        &mut self,
        cx: &mut Cx<'_, '_>,
        _stream: StreamId,
        req: &dyn RequestView,
    ) -> Decision {
        let now = cx.now_ns();
        let eval = self.limiter.evaluate(cx.store(), now, req);
        self.record(cx, &eval);
        match action(&eval, &self.response, &self.policies, cx.rng) {
            Action::Continue { response_headers } => Decision {
                step: Step::Continue,
                held: false,
                response_headers,
            },
            Action::Reject(r) => Decision::of(Step::Reply(r), false),
        }
    }
}
