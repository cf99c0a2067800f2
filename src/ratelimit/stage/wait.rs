//! Waiting for global tokens (`global.wait_for_tokens`): a request
//! refused only because its global keys' pools are being filled is
//! paused and decided on again on every fast tick, until admitted or out
//! of time. Its own file because it is a second way of holding a request,
//! for refused requests, apart from shaping's.

use super::RateLimits;
use crate::duration::{NS_PER_MS, NS_PER_S};
use crate::pipeline::stage::{Cx, Decision, Step, StreamId};
use crate::ratelimit::global::{Mode, STARVED_WAIT_NS};
use crate::ratelimit::{Evaluation, LimitVerdict, RuleResult};
use crate::request::RequestView;
use crate::time::Instant;

/// A request refused only for want of a global key's tokens, waiting for
/// them (`global.wait_for_tokens`): decided on again on every fast tick
/// until admitted or `until_ns`.
pub(super) struct Waiting {
    /// Until when it may wait.
    pub(super) until_ns: u64,
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

impl RateLimits {
    /// `global.wait_for_tokens`: a request refused only because global
    /// keys' pools are being filled waits for them (paused here, decided
    /// on again on every fast tick: `again` when it waits already), up to the shortest `wait_for_tokens` of those rules and
    /// what is left of its deadline, while this worker holds fewer than
    /// `MAX_WAITING`. `None`: decide now.
    pub(super) fn wait_for_tokens(
        &mut self,
        cx: &mut Cx<'_, '_>,
        (stream, req): (StreamId, &dyn RequestView),
        eval: &Evaluation,
        again: bool,
        now: u64,
    ) -> Option<Decision> {
        let wait_ns = self.tokens_wait(eval)?;
        let until_ns = match again {
            true => {
                let w = self.waiting.get_mut(&stream)?;
                let until_ns = w.until_ns;
                if now < until_ns && now.saturating_sub(w.noted_ns) >= NOTE_AGAIN_NS {
                    w.noted_ns = now;
                    self.note_demand(cx, eval, req, true);
                }
                until_ns
            }
            false if self.waiting.len() >= MAX_WAITING => return None,
            false => {
                let left_ns = super::wait_left_ns(cx, stream, now);
                now.saturating_add(wait_ns.min(left_ns))
            }
        };
        if now >= until_ns {
            return None;
        }
        if !again {
            self.note_demand(cx, eval, req, false);
            let w = Waiting {
                until_ns,
                noted_ns: now,
            };
            self.waiting.insert(stream, w);
            // Decided on again on every tick; in line a second past its
            // time at most (see `timed_out`).
            let last_ms = until_ns.saturating_add(NS_PER_S) / NS_PER_MS;
            cx.wait(stream, super::TOKENS, now, Some(Instant::from_ms(last_ms)));
            cx.tick_changed = true;
        }
        Some(Decision::of(Step::Pause, true))
    }

    /// How long a refused request may wait for tokens: the shortest
    /// `wait_for_tokens` of the rules that refused it, if every one of
    /// them is a global rule whose key's pool is being filled (not over
    /// its limit, nor on its backstop) with `wait_for_tokens` set.
    fn tokens_wait(&self, eval: &Evaluation) -> Option<u64> {
        if eval.verdict == LimitVerdict::Allow {
            return None;
        }
        let g = self.global.as_ref()?;
        let mut wait: Option<u64> = None;
        for r in eval
            .reports
            .iter()
            .filter(|r| r.result == RuleResult::Limited)
        {
            let id = self.global_of.get(r.rule).copied().flatten()?;
            let rule = g.rule(id)?;
            let ms = rule.spec.wait_for_tokens_ms;
            if ms == 0 || r.wait_ns != STARVED_WAIT_NS || rule.mode != Mode::Service {
                return None;
            }
            wait = Some(wait.map_or(ms, |w: u64| w.min(ms)));
        }
        wait.map(|ms| ms.saturating_mul(NS_PER_MS))
    }
}
