//! Retry budgets in the pipeline, after the breakers and before the rate
//! limits (a retry refused by its budget spends no token): counts first
//! tries, decides on retries, merges the counts on the tick.

use super::config::BudgetSpec;
use super::{Budgets, RetryVerdict};
use crate::config::{Common, ConfigError};
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::Declared;
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::RequestView;

/// The metrics of retry budgets.
pub const METRICS: &[Declared] = &[
    Declared {
        name: "sluice_retry_requests_total",
        kind: Kind::Counter,
        labels: &["domain", "budget", "result"],
    },
    Declared {
        name: "sluice_retry_ratio_permille",
        kind: Kind::Gauge,
        labels: &["domain", "budget"],
    },
    Declared {
        name: "sluice_retry_store_failures_total",
        kind: Kind::Counter,
        labels: &["domain"],
    },
];

/// Metric ids of one budget (labels `domain`, `budget`).
#[derive(Clone, Copy)]
struct OneBudget {
    first_tries: MetricId,
    admitted: MetricId,
    refused: MetricId,
    ratio: MetricId,
}

/// The retry-budget stage of one configuration.
pub struct RetryStage {
    budgets: Budgets,
    jitter_ns: u64,
    metrics: Vec<OneBudget>,
    store_failures: MetricId,
}

/// The stage, if the configuration has retry budgets.
pub fn build(
    specs: &[BudgetSpec],
    common: &Common,
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if specs.is_empty() {
        return Ok(None);
    }
    let metrics = specs
        .iter()
        .map(|b| {
            let labels = [
                ("domain", common.domain.as_str()),
                ("budget", b.name.as_str()),
            ];
            let [first_tries, admitted, refused] = reg.variants(
                "sluice_retry_requests_total",
                &labels,
                "result",
                ["first_try", "retry_admitted", "retry_refused"],
            );
            OneBudget {
                first_tries,
                admitted,
                refused,
                ratio: reg.labelled(Kind::Gauge, "sluice_retry_ratio_permille", &labels),
            }
        })
        .collect();
    Ok(Some(Box::new(RetryStage {
        budgets: Budgets::new(specs, common)?,
        jitter_ns: common.response.retry_after_jitter_ns,
        metrics,
        store_failures: reg.labelled(
            Kind::Counter,
            "sluice_retry_store_failures_total",
            &[("domain", common.domain.as_str())],
        ),
    })))
}

impl RetryStage {
    /// Counts the store failures a call on the budgets met.
    fn count_failures(&self, cx: &mut Cx<'_, '_>, n: u32) {
        if n > 0 {
            cx.add(self.store_failures, i64::from(n));
        }
    }
}

impl Stage for RetryStage {
    fn start(&mut self, cx: &mut Cx<'_, '_>) -> Result<(), String> {
        self.budgets
            .create(cx.store())
            .map_err(|e| format!("could not create retry budgets in shared data: {e:?}"))
    }

    fn request(
        &mut self,
        cx: &mut Cx<'_, '_>,
        _stream: StreamId,
        req: &dyn RequestView,
    ) -> Decision {
        // The budgets that admitted this retry so far: one refusing later
        // takes their charges back (it never goes out), as rate limits do.
        let mut admitted: Vec<(usize, u64)> = Vec::new();
        for b in 0..self.budgets.rules.len() {
            let Some(rule) = self.budgets.rules.get(b) else {
                continue;
            };
            if !rule.spec.matcher.matches(req) {
                continue;
            }
            let Some(&m) = self.metrics.get(b) else {
                continue;
            };
            if !self.budgets.is_retry(b, req) {
                self.budgets.first_try(b);
                cx.add(m.first_tries, 1);
                continue;
            }
            let now = cx.now().as_ms();
            let (verdict, ratio, failed) = self.budgets.retry(cx.store(), now, b);
            self.count_failures(cx, failed);
            cx.record(m.ratio, ratio);
            if verdict == RetryVerdict::Refuse {
                cx.add(m.refused, 1);
                for &(a, charged) in &admitted {
                    let failed = self.budgets.give_back(cx.store(), now, charged, a);
                    self.count_failures(cx, failed);
                }
                let spec = &self.budgets.rules.get(b).map(|r| r.spec.clone());
                let Some(spec) = spec else {
                    continue;
                };
                let r = super::reply::rejection(&spec.name, spec.status, self.jitter_ns, cx.rng);
                return Decision::of(Step::Reply(r), false);
            }
            admitted.push((b, now));
        }
        for (b, _) in admitted {
            if let Some(m) = self.metrics.get(b) {
                cx.add(m.admitted, 1);
            }
        }
        Decision::pass()
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        let now = cx.now().as_ms();
        let failed = self.budgets.flush(cx.store(), now);
        self.count_failures(cx, failed);
    }
}
