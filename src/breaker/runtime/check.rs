//! The breakers' verdict on a request: each matching breaker's key is
//! tracked, refreshed from the shared state and asked to admit; a refusal
//! (open, no probe left, graded breaking, the store down) gives back what
//! the request claimed at the other breakers.

use super::{Breakers, CallOutcome, Check, Event, Ticket, Tickets};
use crate::breaker::{Admit, BreakerKey, BreakerSpec, Phase, HALF_OPEN_RETRY_MS};
use crate::hash::Keyed;
use crate::request::{Attribute, RequestView};
use crate::rng::SplitMix;
use crate::store::Store;

/// One breaker key's verdict (see `Breakers::check_one`).
pub(super) enum One {
    /// Pass, with a ticket if the key is tracked.
    Pass(Option<Ticket>),
    /// Open: fail fast, the next probe in `retry_after_ms`.
    Open { retry_after_ms: u64 },
    /// Half-open with every probe taken: fail fast.
    NoProbeLeft,
    /// The store failed and the breaker fails closed (`failure_mode_deny`).
    StoreDown,
}

impl One {
    /// The verdict when the store fails: the failure policy decides.
    pub(super) fn store_down(spec: &BreakerSpec) -> One {
        if spec.failure_mode_deny {
            One::StoreDown
        } else {
            One::Pass(None)
        }
    }
}

/// `Retry-After` of a request refused because the store failed (fail closed).
const STORE_DOWN_RETRY_MS: u64 = 1000;

impl Breakers {
    /// The request's key for breaker `b`: its hash, and its value if the
    /// key is not tracked yet (read in place, copied only then).
    fn key_of(
        &self,
        b: usize,
        spec: &BreakerSpec,
        req: &dyn RequestView,
    ) -> Option<(u64, Option<Vec<u8>>)> {
        let mut found = None;
        let mut key = |v: Option<&[u8]>| {
            found = v.map(|value| {
                let mut h = Keyed::new(self.seed);
                h.field(value);
                let key = h.finish();
                let new = !self.local.contains_key(&(b, key));
                (key, new.then(|| value.to_vec()))
            });
        };
        match &spec.key {
            BreakerKey::Cluster => req.attribute_with(Attribute::ClusterName, &mut key),
            BreakerKey::Route => req.attribute_with(Attribute::RouteName, &mut key),
            BreakerKey::Header(h) => req.header_with(h, &mut key),
        }
        found
    }

    /// Checks every matching breaker. A request failing fast at one breaker
    /// gives back any probe it claimed at another. Returns the verdict and
    /// the store failures met.
    pub fn check(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        req: &dyn RequestView,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) -> (Check, u32) {
        let mut tickets = Tickets::new();
        let mut failures = 0;
        for b in 0..self.rules.len() {
            let Some(rule) = self.rules.get(b) else {
                continue;
            };
            if !rule.spec.matcher.matches(req) {
                continue;
            }
            let Some((key, value)) = self.key_of(b, &rule.spec, req) else {
                continue;
            };
            let spec = rule.spec.clone();
            let value = value.as_deref().unwrap_or_default();
            let (one, failed) = self.check_one(store, now_ms, (b, key), value, &spec, events);
            failures += failed;
            let (retry_after_ms, half_open) = match one {
                One::Pass(Some(t)) if spec.graded.is_some() => {
                    let p = self
                        .local
                        .get(&(b, key))
                        .map_or(0, |l| l.state.reject_permille(&spec, now_ms));
                    if p > 0 && rng.below(1000) < u64::from(p) {
                        failures += self.give_back(store, now_ms, tickets, rng, events);
                        let throttle = Check::Throttle {
                            breaker: b,
                            reject_permille: p,
                        };
                        return (throttle, failures);
                    }
                    tickets.push(t);
                    continue;
                }
                One::Pass(t) => {
                    tickets.extend(t);
                    continue;
                }
                One::Open { retry_after_ms } => (retry_after_ms, false),
                One::NoProbeLeft => (HALF_OPEN_RETRY_MS, true),
                One::StoreDown => (STORE_DOWN_RETRY_MS, false),
            };
            failures += self.give_back(store, now_ms, tickets, rng, events);
            let fail_fast = Check::FailFast {
                breaker: b,
                retry_after_ms: retry_after_ms.max(1),
                half_open,
            };
            return (fail_fast, failures);
        }
        (Check::Pass(tickets), failures)
    }

    /// Gives back what a refused request claimed at other breakers (its
    /// tickets' probes); returns the store failures met.
    fn give_back(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        tickets: Tickets,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) -> u32 {
        let mut failures = 0;
        for t in tickets {
            failures += self.record(store, now_ms, t, CallOutcome::Ignored, rng, events);
        }
        failures
    }

    /// One breaker key's verdict on a request, with the store failures met.
    fn check_one(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (b, key): (usize, u64),
        value: &[u8],
        spec: &BreakerSpec,
        events: &mut Vec<Event>,
    ) -> (One, u32) {
        if !self.track(b, key, value, spec, now_ms) {
            return (One::Pass(None), 0); // beyond max_keys: not tracked, passes
        }
        if self.refresh(store, b, key, now_ms).is_err() {
            return (One::store_down(spec), 1);
        }
        let state = self
            .local
            .get(&(b, key))
            .map(|l| l.state)
            .unwrap_or_default();
        let one = match state.admit(spec, now_ms) {
            Admit::Pass => One::Pass(Some(Ticket {
                breaker: b,
                key,
                probe: false,
                epoch: state.epoch,
            })),
            Admit::FailFast { .. } if state.phase == Phase::HalfOpen => One::NoProbeLeft,
            Admit::FailFast { retry_after_ms } => One::Open { retry_after_ms },
            Admit::TryProbe => return self.probe(store, now_ms, (b, key), spec, events),
        };
        (one, 0)
    }
}
