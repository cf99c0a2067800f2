//! Rate limiting in the pipeline: evaluates the matching rules on each
//! request, counts the results, turns a refusal into its reply, and holds
//! a request a shaping rule delayed until its turn.
//!
//! Where each part lives: this file holds the stage itself (its state,
//! its construction, and the host's calls into it); `metrics.rs` the
//! metrics it declares; `hold.rs` the holding of a request a shaping
//! rule delayed; `wait.rs` the waiting of a request for a global key's
//! first tokens; `coordinator.rs` the stage's side of the global rules
//! (their coordinator, the demand noted, and its reports carried out).

mod coordinator;
mod hold;
mod metrics;
mod wait;

use super::config::RuleSpec;
use super::global::{Coordinator, Leading, Report, RuleId};
use super::reply::{action, PolicyInfo};
use super::shaping::HeldList;
use super::{Evaluation, Limiter, RuleResult};
use crate::config::{Common, ConfigError, ResponseSpec};
use crate::duration::NS_PER_MS;
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Effect, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::pipeline::wait::{LineId, Wait};
use crate::request::RequestView;
use coordinator::coordinator;
use log::info;
pub use metrics::METRICS;
use metrics::{rule_metrics, RuleMetrics};
use wait::Waiting;

/// This stage's lines in the pipeline's wait list: requests waiting for a
/// global key's first tokens (in order of arrival), and requests a shaping
/// rule holds until their turns (in order of their turns, ns).
const TOKENS: LineId = 0;
const TURNS: LineId = 1;

#[cfg(test)]
pub use coordinator::test_coordinator;

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
    waiting: FastMap<StreamId, Waiting>,
    /// Global rules: their coordinator, and each rule's id among them.
    global: Option<Coordinator>,
    global_of: Vec<Option<RuleId>>,
    leader_metric: MetricId,
}

/// The stage, if the configuration has rules; `vm` is a random id of this
/// VM, `leading` whether its global rules may lead.
pub fn build(
    specs: &[RuleSpec],
    common: &Common,
    seed: (u64, u64),
    vm: (u64, Leading),
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if specs.is_empty() {
        return Ok(None);
    }
    let limiter = Limiter::new(specs, common, seed)?;
    let (global, global_of) = coordinator(common, &limiter, vm, reg);
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
        .map(|r| PolicyInfo {
            shadow: r.shadow,
            ..PolicyInfo::of(&r.name, &r.algorithm)
        })
        .collect();
    let shaping = specs.iter().any(|r| r.shaping.is_some());
    Ok(Some(Box::new(RateLimits {
        limiter,
        policies,
        response: common.response.clone(),
        metrics,
        shaping,
        held: HeldList::new(specs.len()),
        waiting: FastMap::default(),
        global,
        global_of,
        leader_metric,
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

    /// A shaping rule's metrics of delayed requests (none for a rule that
    /// does not shape).
    fn delayed(&self, rule: usize) -> Option<(MetricId, MetricId, MetricId)> {
        self.metrics.get(rule).and_then(|m| m.delayed)
    }

    /// The decision on an evaluated request that is not held.
    fn answer(&self, cx: &mut Cx<'_, '_>, eval: &Evaluation) -> Decision {
        let mut d = Decision::pass();
        match action(
            eval,
            &self.response,
            &self.policies,
            cx.rng,
            &mut d.response_headers,
        ) {
            None => d,
            Some(r) => Decision::of(Step::Reply(r), false),
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
        let now = cx.now().as_ns();
        if self.shaping {
            return self.shape(cx, stream, req, now);
        }
        let eval = self.limiter.evaluate(cx.store(), now, req);
        let again = !self.waiting.is_empty() && self.waiting.contains_key(&stream);
        if let Some(wait) = self.wait_for_tokens(cx, (stream, req), &eval, again, now) {
            return wait;
        }
        if again {
            // Decided at last: its demand was noted when it arrived (the
            // pipeline reduces its deadline headers by the wait).
            cx.tick_changed = true;
            cx.leave(stream);
            self.waiting.remove(&stream);
        } else {
            self.note_demand(cx, &eval, req, false);
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
        if self.waiting.remove(&stream).is_some() {
            cx.leave(stream);
            cx.tick_changed = true;
        }
        // A client gone before its turn gives its turn back.
        if let Some(h) = self.held.take(stream) {
            cx.leave(stream);
            self.limiter.give_back(cx.store(), &h.reservations);
            self.count_held(cx, &h, -1);
            cx.tick_changed = true;
        }
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        if let Some(g) = self.global.as_mut() {
            let now_ms = cx.now().as_ms();
            let report = g.tick(cx.store(), now_ms, cx.rng);
            self.apply(cx, report);
        }
        if !self.waiting.is_empty() {
            for (stream, _) in cx.in_line(TOKENS) {
                cx.effects.push(Effect::Again { stream });
            }
            cx.tick_changed = true;
        }
        if self.held.is_empty() {
            return;
        }
        // Those whose turn came, in order of their turns.
        let now = cx.now().as_ns();
        while let Some((stream, w)) = cx.first_in(TURNS) {
            if w.key > now {
                break;
            }
            cx.leave(stream);
            let Some(h) = self.held.take(stream) else {
                continue;
            };
            self.count_held(cx, &h, -1);
            let waited_ms = now.saturating_sub(h.since_ns) / NS_PER_MS;
            for &r in &h.rules {
                if let Some((_, histogram, _)) = self.delayed(r) {
                    cx.record(histogram, waited_ms);
                }
            }
            cx.effects.push(Effect::Resume { stream: h.stream });
        }
        cx.tick_changed = true;
    }

    /// (While requests wait, the pipeline keeps the fast tick.)
    fn wants_fast_tick(&self) -> bool {
        self.global
            .as_ref()
            .is_some_and(Coordinator::wants_fast_tick)
    }

    /// Still waiting for tokens a second past its time (its decisions on
    /// the ticks did not come): decided on again, it is refused.
    fn timed_out(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId, _waiter: Wait) {
        if self.waiting.contains_key(&stream) {
            cx.effects.push(Effect::Again { stream });
        }
    }

    fn call_done(&mut self, cx: &mut Cx<'_, '_>, id: u64, body: Option<&[u8]>) {
        if let Some(g) = self.global.as_mut() {
            let now_ms = cx.now().as_ms();
            let report = g.done(cx.store(), now_ms, cx.rng, id, body);
            self.apply(cx, report);
        }
    }

    fn woken(&mut self, cx: &mut Cx<'_, '_>, queue: &str) {
        if let Some(g) = self.global.as_mut().filter(|g| g.queue == queue) {
            let now_ms = cx.now().as_ms();
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
            let now_ms = cx.now().as_ms();
            g.close(cx.store(), now_ms);
        }
    }
}

/// How long stream `stream` may still wait here at `now_ns` (ns): until
/// `min_remaining` before its deadline, or without end if it sent none.
fn wait_left_ns(cx: &Cx<'_, '_>, stream: StreamId, now_ns: u64) -> u64 {
    match cx.wait_until(stream) {
        Some(until) => until.as_ns().saturating_sub(now_ns),
        None => u64::MAX,
    }
}
