//! Rate limiting in the pipeline: evaluates the matching rules on each
//! request, counts the results, turns a refusal into its reply, and holds
//! a request a shaping rule delayed until its turn.

use super::config::RuleSpec;
use super::global::{CallResult, Coordinator, GlobalRule, Mode, Report, Service};
use super::reply::{action, Action, PolicyInfo};
use super::shaping::{Held, HeldList};
use super::{Evaluation, Limiter, RuleResult};
use crate::config::{Common, ConfigError, ResponseSpec};
use crate::duration::{NS_PER_MS, NS_PER_S};
use crate::pipeline::stage::{Cx, Decision, Effect, Signal, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::RequestView;
use log::{info, warn};

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

/// A request refused only for want of a global key's tokens, waiting for
/// them (`global.wait_for_tokens`): decided on again on every fast tick
/// until admitted or `until_ns`.
struct Waiting {
    stream: StreamId,
    /// Until when it may wait.
    until_ns: u64,
    /// When its demand was last noted.
    noted_ns: u64,
}

/// A request still waiting for tokens notes its demand again this often:
/// the leader that took the first note may be gone with its call (a new
/// configuration), and the next one must learn that the key is wanted.
/// (Each note counts the request's cost once more in the key's rate: a
/// request that waits long looks like a few, which only makes the next
/// batch larger, within its caps.)
const NOTE_AGAIN_NS: u64 = 250 * NS_PER_MS;

/// Requests that may wait for tokens on one worker at once; more are
/// refused at once, as without `wait_for_tokens`.
const MAX_WAITING: usize = 256;

/// The rate-limit stage of one configuration.
pub struct RateLimits {
    limiter: Limiter,
    policies: Vec<PolicyInfo>,
    response: ResponseSpec,
    metrics: Vec<RuleMetrics>,
    /// Whether any rule shapes (then requests may be held here).
    shaping: bool,
    held: HeldList,
    /// Requests waiting for global keys' first tokens (`wait_for_tokens`).
    waiting: Vec<Waiting>,
    /// Global rules: their coordinator, and each rule's index among them.
    global: Option<Coordinator>,
    global_of: Vec<Option<usize>>,
    global_metrics: Vec<GlobalMetrics>,
    leader_metric: MetricId,
}

/// Tokens granted by the service, and dropped unspent.
#[derive(Default, Clone, Copy)]
struct TokenMetrics {
    granted: MetricId,
    dropped: MetricId,
}

/// Metric ids of one global rule (labels `domain`, `rule`).
#[derive(Default, Clone, Copy)]
struct GlobalMetrics {
    mode: MetricId,
    /// Requests refused for want of tokens (the key's pool being filled).
    starved: MetricId,
    /// Calls: ok, over_limit, error.
    calls: [MetricId; 3],
    tokens: TokenMetrics,
}

/// The stage, if the configuration has rules.
pub fn build(
    specs: &[RuleSpec],
    common: &Common,
    seed: (u64, u64),
    vm: u64,
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if specs.is_empty() {
        return Ok(None);
    }
    let limiter = Limiter::new(specs, common, seed)?;
    let (global, global_of) = coordinator(common, &limiter, vm);
    let global_metrics = specs
        .iter()
        .filter(|r| r.global.is_some())
        .map(|r| global_metrics(reg, &common.domain, &r.name))
        .collect();
    let leader_metric = match global {
        Some(_) => reg.labelled(
            Kind::Gauge,
            "sluice_global_leader",
            &[("domain", &common.domain)],
        ),
        None => 0,
    };
    let metrics = specs
        .iter()
        .map(|r| rule_metrics(reg, &common.domain, r))
        .collect();
    let policies = specs
        .iter()
        .map(|r| PolicyInfo::of(&r.name, &r.algorithm))
        .collect();
    let shaping = specs.iter().any(|r| r.shaping.is_some());
    Ok(Some(Box::new(RateLimits {
        limiter,
        policies,
        response: common.response.clone(),
        metrics,
        shaping,
        held: HeldList::new(specs.len()),
        waiting: Vec::new(),
        global,
        global_of,
        global_metrics,
        leader_metric,
    })))
}

/// The coordinator of the configuration's global rules, if it has any,
/// and each rule's index among them.
fn coordinator(
    common: &Common,
    limiter: &Limiter,
    vm: u64,
) -> (Option<Coordinator>, Vec<Option<usize>>) {
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
        if let Some(o) = of.get_mut(i) {
            *o = Some(rules.len());
        }
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
        });
    }
    if rules.is_empty() {
        return (None, of);
    }
    (
        Some(Coordinator::new(
            &common.domain,
            rules,
            services,
            (vm, common.version),
        )),
        of,
    )
}

/// The coordinator of a configuration, for the core's tests.
#[cfg(test)]
pub fn test_coordinator(common: &Common, limiter: &Limiter, vm: u64) -> Option<Coordinator> {
    coordinator(common, limiter, vm).0
}

/// The metrics of one global rule.
fn global_metrics(reg: &mut Registry, domain: &str, rule: &str) -> GlobalMetrics {
    let labels = [("domain", domain), ("rule", rule)];
    GlobalMetrics {
        mode: reg.labelled(Kind::Gauge, "sluice_global_mode", &labels),
        starved: reg.labelled(Kind::Counter, "sluice_global_starved_total", &labels),
        calls: reg.variants(
            "sluice_global_calls_total",
            &labels,
            "result",
            ["ok", "over_limit", "error"],
        ),
        tokens: {
            let [granted, dropped] = reg.variants(
                "sluice_global_tokens_total",
                &labels,
                "result",
                ["granted", "dropped"],
            );
            TokenMetrics { granted, dropped }
        },
    }
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
        if let Some(g) = self.global.as_mut() {
            g.announce(cx.store());
            let mut report = Report::default();
            g.follow_health(cx.store(), &mut report);
            self.apply(cx, report);
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
        let again = self.waiting.iter().position(|w| w.stream == stream);
        if let Some(wait) = self.wait_for_tokens(cx, (stream, req), &eval, again, now) {
            return wait;
        }
        match again {
            // Decided at last: its demand was noted when it arrived (the
            // pipeline reduces its deadline headers by the wait).
            Some(i) => {
                cx.tick_changed = true;
                self.waiting.swap_remove(i);
            }
            None => self.note_demand(cx, &eval, req, false),
        }
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
        // A client gone while it waited for tokens.
        if let Some(i) = self.waiting.iter().position(|w| w.stream == stream) {
            self.waiting.swap_remove(i);
            cx.tick_changed = true;
        }
        // A client gone before its turn gives its turn back.
        if let Some(h) = self.held.take(stream) {
            self.limiter.give_back(cx.store(), &h.reservations);
            self.count_held(cx, &h, -1);
            cx.tick_changed = true;
        }
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        if let Some(g) = self.global.as_mut() {
            let now_ms = cx.now_ms();
            let report = g.tick(cx.store(), now_ms, cx.rng);
            self.apply(cx, report);
        }
        if !self.waiting.is_empty() {
            let now = cx.now_ns();
            // One the host no longer knows of (never decided again) is
            // dropped a second past its time.
            self.waiting
                .retain(|w| now < w.until_ns.saturating_add(NS_PER_S));
            for w in &self.waiting {
                cx.effects.push(Effect::Again { stream: w.stream });
            }
            cx.tick_changed = true;
        }
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
            cx.effects.push(Effect::Resume { stream: h.stream });
        }
        cx.tick_changed = true;
    }

    fn wants_fast_tick(&self) -> bool {
        !self.held.is_empty()
            || !self.waiting.is_empty()
            || self
                .global
                .as_ref()
                .is_some_and(Coordinator::wants_fast_tick)
    }

    fn call_done(&mut self, cx: &mut Cx<'_, '_>, id: u64, body: Option<&[u8]>) {
        if let Some(g) = self.global.as_mut() {
            let now_ms = cx.now_ms();
            let report = g.done(cx.store(), now_ms, cx.rng, id, body);
            self.apply(cx, report);
        }
    }

    fn woken(&mut self, cx: &mut Cx<'_, '_>, queue: &str) {
        if let Some(g) = self.global.as_mut().filter(|g| g.queue == queue) {
            let now_ms = cx.now_ms();
            let mut report = Report::default();
            g.hurry(cx.store(), now_ms, &mut report);
            self.apply(cx, report);
        }
    }

    fn close(&mut self, cx: &mut Cx<'_, '_>) {
        if let Some(g) = self.global.as_mut() {
            if g.is_leader() {
                cx.add(self.leader_metric, -1);
            }
            let now_ms = cx.now_ms();
            g.close(cx.store(), now_ms);
        }
    }
}

impl RateLimits {
    /// Notes the demand of the global rules a request matched (reading
    /// the key's parts only the first time in a report interval).
    /// `again`: a request still waiting notes its demand once more (not
    /// counted as starved twice).
    fn note_demand(
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
            let (Some(Some(gi)), Some(r)) =
                (self.global_of.get(rule), self.limiter.rules.get(rule))
            else {
                continue;
            };
            // A request another rule refused did not need this one's token.
            if matches!(eval.verdict, super::Verdict::Deny { rule: by, .. } if by != rule) {
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
            ) && report.wait_ns == super::global::STARVED_WAIT_NS
                && g.mode(*gi) == Mode::Service;
            if starved {
                if let (Some(m), false) = (self.global_metrics.get(*gi), again) {
                    cx.add(m.starved, 1);
                }
                if !g.wants_fast_tick() {
                    cx.tick_changed = true;
                }
            }
            g.note(*gi, fp, starved, report.cost, || {
                crate::keys::values(&r.spec.key, req)
            });
        }
    }

    /// Carries out what the coordinator reports: calls to start, modes to
    /// switch, metrics and logs.
    fn apply(&mut self, cx: &mut Cx<'_, '_>, report: Report) {
        let Some(g) = self.global.as_ref() else {
            return;
        };
        cx.calls.extend(report.calls);
        for (gi, mode) in report.modes {
            let Some(rule) = g.rules.get(gi).map(|r| r.rule) else {
                continue;
            };
            self.limiter.use_backstop(rule, mode == Mode::Backstop);
            if let Some(m) = self.global_metrics.get(gi) {
                cx.record(m.mode, mode.gauge());
            }
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
        for (gi, result) in report.results {
            if let Some(m) = self.global_metrics.get(gi) {
                let [ok, over, error] = m.calls;
                let id = match result {
                    CallResult::Ok => ok,
                    CallResult::OverLimit => over,
                    CallResult::Error => error,
                };
                cx.add(id, 1);
            }
        }
        for (gi, n) in report.granted {
            if let Some(m) = self.global_metrics.get(gi) {
                cx.add(m.tokens.granted, n as i64);
            }
        }
        for (gi, n) in report.dropped {
            if let Some(m) = self.global_metrics.get(gi) {
                cx.add(m.tokens.dropped, n as i64);
            }
        }
    }
}

impl RateLimits {
    fn m(&self, rule: usize) -> RuleMetrics {
        self.metrics.get(rule).copied().unwrap_or_default()
    }

    /// `global.wait_for_tokens`: a request refused only because global
    /// keys' pools are being filled waits for them (paused here, decided
    /// on again on every fast tick: `again` is its place among the
    /// waiting), up to the shortest `wait_for_tokens` of those rules and
    /// what is left of its deadline, while this worker holds fewer than
    /// `MAX_WAITING`. `None`: decide now.
    fn wait_for_tokens(
        &mut self,
        cx: &mut Cx<'_, '_>,
        (stream, req): (StreamId, &dyn RequestView),
        eval: &Evaluation,
        again: Option<usize>,
        now: u64,
    ) -> Option<Decision> {
        let wait_ns = self.tokens_wait(eval)?;
        let until_ns = match again {
            Some(i) => {
                let w = self.waiting.get_mut(i)?;
                let until_ns = w.until_ns;
                if now < until_ns && now.saturating_sub(w.noted_ns) >= NOTE_AGAIN_NS {
                    w.noted_ns = now;
                    self.note_demand(cx, eval, req, true);
                }
                until_ns
            }
            None if self.waiting.len() >= MAX_WAITING => return None,
            None => {
                let left_ns = wait_left_ns(cx, stream, now);
                now.saturating_add(wait_ns.min(left_ns))
            }
        };
        if now >= until_ns {
            return None;
        }
        if again.is_none() {
            self.note_demand(cx, eval, req, false);
            self.waiting.push(Waiting {
                stream,
                until_ns,
                noted_ns: now,
            });
            cx.tick_changed = true;
        }
        Some(Decision::of(Step::Pause, true))
    }

    /// How long a refused request may wait for tokens: the shortest
    /// `wait_for_tokens` of the rules that refused it, if every one of
    /// them is a global rule whose key's pool is being filled (not over
    /// its limit, nor on its backstop) with `wait_for_tokens` set.
    fn tokens_wait(&self, eval: &Evaluation) -> Option<u64> {
        if eval.verdict == super::Verdict::Allow {
            return None;
        }
        let g = self.global.as_ref()?;
        let mut wait: Option<u64> = None;
        for r in eval
            .reports
            .iter()
            .filter(|r| r.result == RuleResult::Limited)
        {
            let gi = self.global_of.get(r.rule).copied().flatten()?;
            let spec = self.limiter.rules.get(r.rule)?.spec.global.as_ref()?;
            let ms = spec.service.wait_for_tokens_ms;
            if ms == 0 || r.wait_ns != super::global::STARVED_WAIT_NS || g.mode(gi) != Mode::Service
            {
                return None;
            }
            wait = Some(wait.map_or(ms, |w: u64| w.min(ms)));
        }
        wait.map(|ms| ms.saturating_mul(NS_PER_MS))
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
        let left_ns = wait_left_ns(cx, stream, now);
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
        self.note_demand(cx, &eval, req, false);
        let decision = self.answer(cx, &eval);
        if eval.delay_ns == 0 || !matches!(eval.verdict, super::Verdict::Allow) {
            return decision;
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
        };
        self.count_held(cx, &h, 1);
        self.held.hold(h);
        cx.tick_changed = true;
        // Admitted, held until its turn: its response carries the
        // rate-limit headers as any admitted one's (`headers_on_allowed`).
        Decision {
            step: Step::Pause,
            held: true,
            ..decision
        }
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

/// How long stream `stream` may still wait here at `now_ns` (ns): until
/// `min_remaining` before its deadline, or without end if it sent none.
fn wait_left_ns(cx: &Cx<'_, '_>, stream: StreamId, now_ns: u64) -> u64 {
    match cx.wait_until_ms(stream) {
        Some(until_ms) => until_ms.saturating_mul(NS_PER_MS).saturating_sub(now_ns),
        None => u64::MAX,
    }
}
