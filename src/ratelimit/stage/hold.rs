//! The shaping hold: a request a shaping rule (`on_limit: delay`)
//! admitted for a later turn is held here until it, within the rule's
//! `max_delay` and `max_delayed` and what is left of its deadline. Its
//! own file because it is the one path on which the stage holds an
//! admitted request.

use super::RateLimits;
use crate::pipeline::stage::{Cx, Decision, Step, StreamId};
use crate::ratelimit::shaping::Held;
use crate::ratelimit::{LimitVerdict, RuleResult};
use crate::request::RequestView;

impl RateLimits {
    /// Adds `by` to the held gauge of each rule holding `h`.
    pub(super) fn count_held(&self, cx: &mut Cx<'_, '_>, h: &Held, by: i64) {
        for &r in &h.rules {
            if let Some((_, _, gauge)) = self.delayed(r) {
                cx.add(gauge, by);
            }
        }
    }

    /// A request where some rule shapes: it may be held for its turn, up
    /// to the rule's `max_delay`, what is left of its deadline, and while
    /// this worker holds fewer than the rule's `max_delayed`.
    pub(super) fn shape(
        &mut self,
        cx: &mut Cx<'_, '_>,
        stream: StreamId,
        req: &dyn RequestView,
        now: u64,
    ) -> Decision {
        let left_ns = super::wait_left_ns(cx, stream, now);
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
        if eval.delay_ns == 0 || !matches!(eval.verdict, LimitVerdict::Allow) {
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
        // In line in order of turns; let go on the tick its turn comes.
        cx.wait(stream, super::TURNS, h.due_ns, None);
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
}
