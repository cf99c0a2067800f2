//! Outcomes: a ticket's outcome reported, successes counted locally and
//! merged every `SYNC_MS` (or with the next failure, or on a tick), a
//! failure or a probe's result merged at once, and the transitions the
//! merges cause, as events.

use super::{Breakers, CallOutcome, Event, Ticket, SYNC_MS};
use crate::breaker::{State, Transition};
use crate::rng::SplitMix;
use crate::store::{Store, StoreError};

impl Breakers {
    /// Reports a ticket's outcome; returns the store failures it met.
    pub fn record(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        t: Ticket,
        outcome: CallOutcome,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) -> u32 {
        let Some(spec) = self.rules.get(t.breaker).map(|r| r.spec.clone()) else {
            return 0;
        };
        if t.probe {
            let result = self.update(store, t.breaker, t.key, |s| match outcome {
                CallOutcome::Success => s.probe_result(&spec, now_ms, (true, t.epoch), rng),
                CallOutcome::Failure => s.probe_result(&spec, now_ms, (false, t.epoch), rng),
                CallOutcome::Ignored => {
                    s.release_probe(t.epoch);
                    None
                }
            });
            return self.finish((t.breaker, t.key), now_ms, result, events);
        }
        let Some(local) = self.local.get_mut(&(t.breaker, t.key)) else {
            return 0;
        };
        match outcome {
            CallOutcome::Ignored => 0,
            CallOutcome::Success => {
                local.pending = local.pending.saturating_add(1);
                if now_ms.saturating_sub(local.flushed_ms) >= SYNC_MS {
                    self.flush_one(store, now_ms, (t.breaker, t.key), 0, rng, events)
                } else {
                    0
                }
            }
            CallOutcome::Failure => {
                self.flush_one(store, now_ms, (t.breaker, t.key), 1, rng, events)
            }
        }
    }

    /// Merges a key's successes counted locally, and `failures`; returns
    /// the store failures it met.
    fn flush_one(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (b, key): (usize, u64),
        failures: u32,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) -> u32 {
        let Some(spec) = self.rules.get(b).map(|r| r.spec.clone()) else {
            return 0;
        };
        let Some(local) = self.local.get_mut(&(b, key)) else {
            return 0;
        };
        let successes = std::mem::take(&mut local.pending);
        local.flushed_ms = now_ms;
        let result = self.update(store, b, key, |s| {
            s.record(&spec, now_ms, successes, failures, rng)
        });
        self.finish((b, key), now_ms, result, events)
    }

    /// Settles an update of a key's shared state (see `update`); returns
    /// the store failures it met.
    fn finish(
        &mut self,
        (b, key): (usize, u64),
        now_ms: u64,
        (result, corrupt): (Result<(State, Option<Transition>), StoreError>, u32),
        events: &mut Vec<Event>,
    ) -> u32 {
        match result {
            Ok((s, transition)) => {
                self.settle((b, key), now_ms, s, transition, events);
                corrupt
            }
            Err(_) => corrupt + 1,
        }
    }

    /// Remembers a key's new state and reports the transition it made.
    pub(super) fn settle(
        &mut self,
        (b, key): (usize, u64),
        now_ms: u64,
        s: State,
        transition: Option<Transition>,
        events: &mut Vec<Event>,
    ) {
        self.remember(b, key, s, now_ms);
        if let Some(t) = transition {
            events.push(Event {
                breaker: b,
                key,
                transition: t,
            });
        }
    }

    /// Merges successes counted locally for at least `SYNC_MS` (call on a
    /// tick); returns the store failures it met.
    pub fn flush(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) -> u32 {
        let due: Vec<(usize, u64)> = self
            .local
            .iter()
            .filter(|(_, l)| l.pending > 0 && now_ms.saturating_sub(l.flushed_ms) >= SYNC_MS)
            .map(|(k, _)| *k)
            .collect();
        let mut failures = 0;
        for (b, key) in due {
            failures += self.flush_one(store, now_ms, (b, key), 0, rng, events);
        }
        failures
    }
}
