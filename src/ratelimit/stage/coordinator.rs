//! The stage's side of the global rules: their coordinator, built from
//! the limiter's rules; the demand of each request noted with it; and
//! what it reports (calls to start, modes, leadership, breaker changes)
//! carried out as effects, signals and metrics. Its own file because the
//! coordinator itself knows nothing of the pipeline: this is the glue.

use super::metrics::global_metrics;
use super::RateLimits;
use crate::config::Common;
use crate::pipeline::stage::{Cx, Signal};
use crate::pipeline::telemetry::Registry;
use crate::ratelimit::global::{
    CallResult, Coordinator, GlobalRule, Leading, Mode, Report, RuleId, Service, STARVED_WAIT_NS,
};
use crate::ratelimit::{Evaluation, LimitVerdict, Limiter, RuleResult};
use crate::request::RequestView;
use log::{info, warn};

/// The coordinator of the configuration's global rules, if it has any
/// (their metrics declared in `reg`), and each rule's id among them.
pub(super) fn coordinator(
    common: &Common,
    limiter: &Limiter,
    (vm, leading): (u64, Leading),
    reg: &mut Registry,
) -> (Option<Coordinator>, Vec<Option<RuleId>>) {
    let mut rules = Vec::new();
    let mut services: Vec<Service> = Vec::new();
    let mut of = vec![None; limiter.rules.len()];
    for (i, rule) in limiter.rules.iter().enumerate() {
        let (Some(g), Some(tables)) = (rule.spec.global.as_deref(), &rule.global) else {
            continue;
        };
        let spec = &g.service;
        let service = match services.iter().position(|s| s.cluster == spec.cluster) {
            Some(s) => s,
            None => {
                services.push(Service::new(&common.domain, spec));
                services.len() - 1
            }
        };
        rules.push(GlobalRule {
            rule: i,
            spec: spec.clone(),
            domain: spec.domain.clone().unwrap_or_else(|| common.domain.clone()),
            pool_prefix: tables.pool_prefix.clone(),
            table_len: limiter.table_len(i),
            window_ms: u64::try_from(g.limit.window_ns() / 1_000_000)
                .unwrap_or(u64::MAX)
                .max(1),
            service,
            quota: g.limit.quota(),
            cost_max: rule.spec.cost.max,
            variable: crate::keys::has_variable_parts(&rule.spec.key),
            mode: Mode::Service,
            metrics: global_metrics(reg, &common.domain, &rule.spec.name),
        });
    }
    if rules.is_empty() {
        return (None, of);
    }
    let c = Coordinator::new(
        &common.domain,
        rules,
        services,
        (vm, common.version, leading),
    );
    for (id, r) in c.rules() {
        if let Some(o) = of.get_mut(r.rule) {
            *o = Some(id);
        }
    }
    (Some(c), of)
}

/// The coordinator of a configuration, for the core's tests.
#[cfg(test)]
pub fn test_coordinator(
    common: &Common,
    limiter: &Limiter,
    vm: u64,
    leading: Leading,
) -> Option<Coordinator> {
    let mut reg = Registry::declared(&[super::METRICS]);
    coordinator(common, limiter, (vm, leading), &mut reg).0
}

impl RateLimits {
    /// Notes the demand of the global rules a request matched (reading
    /// the key's parts only the first time in a report interval).
    /// `again`: a request still waiting notes its demand once more (not
    /// counted as starved twice).
    pub(super) fn note_demand(
        &mut self,
        cx: &mut Cx<'_, '_>,
        eval: &Evaluation,
        req: &dyn RequestView,
        again: bool,
    ) {
        let Some(g) = self.global.as_mut() else {
            return;
        };
        for &(rule, fp) in &eval.global_keys {
            let (Some(&Some(id)), Some(r)) =
                (self.global_of.get(rule), self.limiter.rules.get(rule))
            else {
                continue;
            };
            // A request another rule refused did not need this one's token.
            if matches!(eval.verdict, LimitVerdict::Deny { rule: by, .. } if by != rule) {
                continue;
            }
            // Refused for want of tokens being fetched (not over the limit:
            // that waits for the reset, not a second; nor refused with the
            // service down and `failure_mode_deny`: nothing is fetched).
            let Some(report) = eval.reports.iter().find(|x| x.rule == rule) else {
                continue;
            };
            let starved = matches!(
                report.result,
                RuleResult::Limited | RuleResult::ShadowLimited
            ) && report.wait_ns == STARVED_WAIT_NS
                && g.mode(id) == Mode::Service;
            if starved {
                if let (Some(global), false) = (g.rule(id), again) {
                    cx.add(global.metrics.starved, 1);
                }
                if !g.wants_fast_tick() {
                    cx.tick_changed = true;
                }
            }
            g.note(id, fp, starved, report.cost, || {
                crate::keys::values(&r.spec.key, req)
            });
        }
    }

    /// Carries out what the coordinator reports: calls to start, modes to
    /// switch, metrics and logs.
    pub(super) fn apply(&mut self, cx: &mut Cx<'_, '_>, report: Report) {
        let Some(g) = self.global.as_ref() else {
            return;
        };
        cx.calls.extend(report.calls);
        for (id, mode) in report.modes {
            let Some(r) = g.rule(id) else {
                continue;
            };
            self.limiter.use_backstop(r.rule, mode == Mode::Backstop);
            cx.record(r.metrics.mode, mode.gauge());
        }
        for (i, state) in report.transitions {
            if let Some(s) = g.services.get(i) {
                warn!(
                    "sluice: rate-limit service {} breaker now {:?}",
                    s.cluster, state
                );
            }
        }
        if let Some(lead) = report.leader {
            cx.add_now(self.leader_metric, if lead { 1 } else { -1 });
            if lead {
                info!("sluice: this VM now speaks to the rate-limit service(s)");
            }
        }
        if report.listen {
            cx.signals.push(Signal::Listen(g.queue.clone()));
        }
        if report.wake {
            cx.signals.push(Signal::Wake(g.queue.clone()));
        }
        for (id, result) in report.results {
            if let Some(r) = g.rule(id) {
                let [ok, over, error] = r.metrics.calls;
                let metric = match result {
                    CallResult::Ok => ok,
                    CallResult::OverLimit => over,
                    CallResult::Error => error,
                };
                cx.add(metric, 1);
            }
        }
        for (id, n) in report.granted {
            if let Some(r) = g.rule(id) {
                cx.add(r.metrics.tokens.granted, n as i64);
            }
        }
        for (id, n) in report.dropped {
            if let Some(r) = g.rule(id) {
                cx.add(r.metrics.tokens.dropped, n as i64);
            }
        }
    }
}
