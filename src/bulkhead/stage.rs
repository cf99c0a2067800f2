//! Concurrency limits per key in the pipeline, after retry budgets and
//! before rate limits (a request refused here spends no token; one refused
//! by a rate limit gives its slot back at once): holds each admitted
//! stream's slots until the stream ends, however it ends.

use super::{Admission, Bulkheads};
use crate::config::{Config, ConfigError};
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::RequestView;

/// Metric ids of one limit (labels `domain`, `limit`).
#[derive(Default, Clone, Copy)]
struct OneLimit {
    admitted: MetricId,
    limited: MetricId,
    in_flight: MetricId,
}

/// The bulkhead stage of one configuration.
pub struct BulkheadStage {
    bulkheads: Bulkheads,
    jitter_ns: u64,
    metrics: Vec<OneLimit>,
    store_failures: MetricId,
    /// Slots held, by stream: (limit, slot).
    held: FastMap<StreamId, Vec<(usize, u32)>>,
}

/// The stage, if the configuration has concurrency limits.
pub fn build(
    config: &Config,
    seed: (u64, u64),
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if config.concurrency_limits.is_empty() {
        return Ok(None);
    }
    let metrics = config
        .concurrency_limits
        .iter()
        .map(|l| {
            let labels = [
                ("domain", config.domain.as_str()),
                ("limit", l.name.as_str()),
            ];
            let [admitted, limited] = reg.variants(
                "sluice_bulkhead_requests_total",
                &labels,
                "result",
                ["admitted", "limited"],
            );
            OneLimit {
                admitted,
                limited,
                in_flight: reg.labelled(Kind::Gauge, "sluice_bulkhead_in_flight", &labels),
            }
        })
        .collect();
    Ok(Some(Box::new(BulkheadStage {
        bulkheads: Bulkheads::new(config, seed)?,
        jitter_ns: config.response.retry_after_jitter_ns,
        metrics,
        store_failures: reg.labelled(
            Kind::Counter,
            "sluice_bulkhead_store_failures_total",
            &[("domain", config.domain.as_str())],
        ),
        held: FastMap::default(),
    })))
}

impl BulkheadStage {
    fn m(&self, b: usize) -> OneLimit {
        self.metrics.get(b).copied().unwrap_or_default()
    }

    fn count_failures(&self, cx: &mut Cx<'_, '_>, before: u64) {
        let n = self.bulkheads.store_failures - before;
        if n > 0 {
            cx.add(self.store_failures, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Gives back every slot the stream holds.
    fn release(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        let Some(slots) = self.held.remove(&id) else {
            return;
        };
        let before = self.bulkheads.store_failures;
        for (b, slot) in slots {
            self.bulkheads.release(cx.store(), b, slot);
            cx.add(self.m(b).in_flight, -1);
        }
        self.count_failures(cx, before);
    }
}

impl Stage for BulkheadStage {
    fn start(&mut self, cx: &mut Cx<'_, '_>) -> Result<(), String> {
        self.bulkheads
            .create(cx.store())
            .map_err(|e| format!("could not create concurrency limits in shared data: {e:?}"))
    }

    fn request(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, req: &dyn RequestView) -> Decision {
        let before = self.bulkheads.store_failures;
        for b in 0..self.bulkheads.rules.len() {
            let Some(rule) = self.bulkheads.rules.get(b) else {
                continue;
            };
            if !rule.spec.matcher.matches(req) {
                continue;
            }
            match self.bulkheads.admit(cx.store(), b, req) {
                Admission::Holds { slot } => {
                    self.held.entry(id).or_default().push((b, slot));
                    cx.add(self.m(b).admitted, 1);
                    cx.add(self.m(b).in_flight, 1);
                }
                Admission::Free => cx.add(self.m(b).admitted, 1),
                Admission::Full => {
                    cx.add(self.m(b).limited, 1);
                    self.count_failures(cx, before);
                    // Slots taken at earlier limits go back at once.
                    self.release(cx, id);
                    let spec = self.bulkheads.rules.get(b).map(|r| r.spec.clone());
                    let Some(spec) = spec else {
                        return Decision::pass();
                    };
                    let r = super::reply::rejection(
                        &spec.name,
                        spec.max,
                        spec.status,
                        self.jitter_ns,
                        cx.rng,
                    );
                    return Decision::of(Step::Reply(r), false);
                }
            }
        }
        self.count_failures(cx, before);
        Decision::of(Step::Continue, self.held.contains_key(&id))
    }

    fn response(
        &mut self,
        _cx: &mut Cx<'_, '_>,
        id: StreamId,
        _resp: &dyn crate::request::ResponseView,
    ) -> bool {
        self.held.contains_key(&id)
    }

    fn end(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        self.release(cx, id);
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        self.bulkheads.retry_failed(cx.store());
    }
}
