//! Rate limiting in the pipeline: evaluates the matching rules on each
//! request, counts the results, turns a refusal into its reply, and holds
//! a request a shaping rule delayed until its turn.

use super::config::RuleSpec;
use super::reply::{action, Action, PolicyInfo};
use super::shaping::{Held, HeldList};
use super::{Evaluation, Limiter, RuleResult};
use crate::config::{Config, ConfigError, ResponseSpec};
use crate::deadline::config::DeadlineSpec;
use crate::duration::NS_PER_MS;
use crate::pipeline::stage::{Cx, Decision, Effect, Stage, Step, StreamId};
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
    /// Shaping rules only: delayed requests, the delay histogram (ms), and
    /// the requests held now.
    delayed: Option<(MetricId, MetricId, MetricId)>,
}

/// The rate-limit stage of one configuration.
pub struct RateLimits {
    limiter: Limiter,
    policies: Vec<PolicyInfo>,
    response: ResponseSpec,
    metrics: Vec<RuleMetrics>,
    /// Whether any rule shapes (then requests may be held here).
    shaping: bool,
    held: HeldList,
    /// Held requests never wait past their deadline, and go upstream with
    /// it reduced by the wait.
    deadlines: Option<DeadlineSpec>,
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
        .map(|r| rule_metrics(reg, &config.domain, r))
        .collect();
    let policies = config
        .rules
        .iter()
        .map(|r| PolicyInfo::of(&r.name, &r.algorithm))
        .collect();
    let shaping = config.rules.iter().any(|r| r.shaping.is_some());
    Ok(Some(Box::new(RateLimits {
        limiter,
        policies,
        response: config.response.clone(),
        metrics,
        shaping,
        held: HeldList::new(config.rules.len()),
        deadlines: config.deadlines.clone(),
    })))
}

/// The metrics of one rule (labels `domain`, `rule`).
fn rule_metrics(reg: &mut Registry, domain: &str, r: &RuleSpec) -> RuleMetrics {
    let labels = [("domain", domain), ("rule", r.name.as_str())];
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
        delayed: r.shaping.map(|_| {
            let delayed = [labels[0], labels[1], ("result", "delayed")];
            (
                reg.labelled(Kind::Counter, "sluice_rl_requests_total", &delayed),
                reg.labelled(Kind::Histogram, "sluice_rl_delay_ms", &labels),
                reg.labelled(Kind::Gauge, "sluice_rl_held", &labels),
            )
        }),
    }
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
                RuleResult::Delayed => match m.delayed {
                    Some((delayed, ..)) => delayed,
                    None => m.allowed,
                },
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
        stream: StreamId,
        req: &dyn RequestView,
    ) -> Decision {
        let now = cx.now_ns();
        if self.shaping {
            return self.shape(cx, stream, req, now);
        }
        let eval = self.limiter.evaluate(cx.store(), now, req);
        self.record(cx, &eval);
        self.answer(cx, &eval)
    }

    fn response(
        &mut self,
        _cx: &mut Cx<'_, '_>,
        stream: StreamId,
        _resp: &dyn crate::request::ResponseView,
    ) -> bool {
        // Held only until its turn; one answered before it (Envoy's own
        // local reply, say) still holds its turn, given back at its end.
        !self.held.is_empty() && self.held.contains(stream)
    }

    fn end(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId) {
        // A client gone before its turn gives its turn back.
        if let Some(h) = self.held.take(stream) {
            self.limiter.give_back(cx.store(), &h.reservations);
            self.count_held(cx, &h, -1);
            cx.tick_changed = true;
        }
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        if self.held.is_empty() {
            return;
        }
        let now = cx.now_ns();
        for h in self.held.due(now) {
            self.count_held(cx, &h, -1);
            let waited_ms = now.saturating_sub(h.since_ns) / NS_PER_MS;
            for &r in &h.rules {
                if let Some((_, histogram, _)) = self.m(r).delayed {
                    cx.record(histogram, waited_ms);
                }
            }
            let set_headers = crate::deadline::resume_headers(
                self.deadlines.as_ref(),
                h.deadline.as_ref(),
                waited_ms,
            );
            cx.effects.push(Effect::Resume {
                stream: h.stream,
                set_headers,
            });
        }
        cx.tick_changed = true;
    }

    fn wants_fast_tick(&self) -> bool {
        !self.held.is_empty()
    }
}

impl RateLimits {
    fn m(&self, rule: usize) -> RuleMetrics {
        self.metrics.get(rule).copied().unwrap_or_default()
    }

    /// Adds `by` to the held gauge of each rule holding `h`.
    fn count_held(&self, cx: &mut Cx<'_, '_>, h: &Held, by: i64) {
        for &r in &h.rules {
            if let Some((_, _, gauge)) = self.m(r).delayed {
                cx.add(gauge, by);
            }
        }
    }

    /// A request where some rule shapes: it may be held for its turn, up
    /// to the rule's `max_delay`, what is left of its deadline, and while
    /// this worker holds fewer than the rule's `max_delayed`.
    fn shape(
        &mut self,
        cx: &mut Cx<'_, '_>,
        stream: StreamId,
        req: &dyn RequestView,
        now: u64,
    ) -> Decision {
        let deadline = self
            .deadlines
            .as_ref()
            .and_then(|d| crate::deadline::read(d, req));
        let waited = cx.waited_ms();
        let left_ns = match (&deadline, &self.deadlines) {
            (Some(d), Some(spec)) => spec.remaining_ms(d, waited).saturating_mul(NS_PER_MS),
            _ => u64::MAX,
        };
        let (held, limiter) = (&self.held, &self.limiter);
        let cap = |rule: usize| {
            let full = limiter
                .rules
                .get(rule)
                .and_then(|r| r.spec.shaping)
                .is_none_or(|sh| held.count(rule) >= sh.max_delayed);
            if full {
                0
            } else {
                left_ns
            }
        };
        let eval = limiter.evaluate_shaped(cx.store(), now, req, &cap);
        self.record(cx, &eval);
        if eval.delay_ns == 0 || !matches!(eval.verdict, super::Verdict::Allow) {
            return self.answer(cx, &eval);
        }
        let rules = eval
            .reports
            .iter()
            .filter(|r| r.result == RuleResult::Delayed)
            .map(|r| r.rule)
            .collect();
        let h = Held {
            stream,
            since_ns: now,
            due_ns: now.saturating_add(eval.delay_ns),
            rules,
            reservations: eval.reservations,
            deadline,
        };
        self.count_held(cx, &h, 1);
        self.held.hold(h);
        cx.tick_changed = true;
        Decision::of(Step::Pause, true)
    }

    /// The decision on an evaluated request that is not held.
    fn answer(&self, cx: &mut Cx<'_, '_>, eval: &Evaluation) -> Decision {
        match action(eval, &self.response, &self.policies, cx.rng) {
            Action::Continue { response_headers } => Decision {
                step: Step::Continue,
                held: false,
                response_headers,
            },
            Action::Reject(r) => Decision::of(Step::Reply(r), false),
        }
    }
}
