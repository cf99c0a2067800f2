//! Breakers in one VM: a per-VM cache of each key's shared state, refreshed
//! at most every `sync_ms`, and compare-and-swap updates of the shared state.
//!
//! Cost per request is kept low on purpose: while closed, a request costs no
//! shared-data call at all except one read per `sync_ms` per key; successes
//! are counted locally and merged at most every `sync_ms` (or on the next
//! failure, or on a tick); a failure is merged at once, so a trip happens on
//! the failure that crosses the threshold. Every worker therefore sees a
//! trip within `sync_ms` (20 ms) of it.

use super::codec::{decode, encode};
pub use super::config::Outcome;
use super::{Admit, BreakerKey, BreakerSpec, State, Transition};
use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::hash::{FastMap, Keyed};
use crate::request::{Attribute, RequestView};
use crate::rng::SplitMix;
use crate::store::{update, Store, StoreError, Update};
use std::rc::Rc;

/// How often a VM re-reads a key's shared state and merges its successes.
pub const SYNC_MS: u64 = 20;

/// A breaker and the shared-data key prefix of its keys.
#[derive(Debug, Clone)]
pub struct Breaker {
    /// Shared, so the per-request paths clone a pointer, not the spec.
    pub spec: Rc<BreakerSpec>,
    pub prefix: String,
}

/// A request that passed a breaker and must report its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub breaker: usize,
    pub key: u64,
    pub probe: bool,
    /// The probe episode the claim belongs to.
    pub epoch: u32,
}

/// The breakers' verdict on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Go on; report each ticket's outcome later.
    Pass(Vec<Ticket>),
    /// Fail fast.
    FailFast {
        breaker: usize,
        retry_after_ms: u64,
        half_open: bool,
    },
    /// Graded breaking: refused by chance, in proportion to the error rate
    /// (the breaker is closed).
    Throttle {
        breaker: usize,
        /// The chance a request had of being refused, in permille.
        reject_permille: u32,
    },
}

/// One breaker key's verdict (see `Breakers::check_one`).
enum One {
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
    fn store_down(spec: &BreakerSpec) -> One {
        if spec.failure_mode_deny {
            One::StoreDown
        } else {
            One::Pass(None)
        }
    }
}

/// `Retry-After` of a request refused because the store failed (fail closed).
const STORE_DOWN_RETRY_MS: u64 = 1000;

/// A transition, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub breaker: usize,
    /// The breaker key (see `Breakers::key_name` for its value).
    pub key: u64,
    pub transition: Transition,
}

struct Local {
    /// The key's value (the cluster, route or header value), for logs.
    name: Box<str>,
    state: State,
    fetched_ms: Option<u64>,
    pending: u32,
    flushed_ms: u64,
}

/// All breakers of one configuration, in one VM.
pub struct Breakers {
    pub rules: Vec<Breaker>,
    seed: (u64, u64),
    max_retries: u32,
    /// Keyed by breaker and key hash (a keyed SipHash: not chosen by clients).
    local: FastMap<(usize, u64), Local>,
    tracked: Vec<u32>,
    /// Counts of store errors and corrupt states seen (for metrics).
    pub store_failures: u64,
}

/// The breaker's state id: its name, its key and every setting of its
/// state machine (not its match, status or failure classification, which
/// do not change what the shared state means).
fn table_id(domain: &str, spec: &BreakerSpec) -> u32 {
    let key = match &spec.key {
        BreakerKey::Cluster => "cluster".to_string(),
        BreakerKey::Route => "route".to_string(),
        BreakerKey::Header(h) => format!("header:{h}"),
    };
    StateId::new((0x6272_6561_6b65, 0x7273), domain)
        .text(&spec.name)
        .text(key)
        .num(u64::from(spec.error_rate_permille))
        .num(spec.window_ms)
        .num(u64::from(spec.min_requests))
        .num(spec.consecutive_failures.map_or(0, u64::from))
        .num(spec.open_base_ms)
        .num(spec.open_max_ms)
        .num(u64::from(spec.open_multiplier))
        .num(u64::from(spec.probes))
        .num(u64::from(spec.successes_to_close))
        .num(spec.probe_timeout_ms)
        .num(u64::from(spec.max_keys))
        .finish()
}

impl Breakers {
    /// Prepares the breakers; `seed` must be the same in every VM.
    pub fn new(
        specs: &[BreakerSpec],
        common: &Common,
        seed: (u64, u64),
    ) -> Result<Self, ConfigError> {
        let mut rules: Vec<Breaker> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let prefix = format!("cb{:08x}/", table_id(&common.domain, spec));
            let earlier = rules
                .iter()
                .map(|r| (r.prefix.as_str(), r.spec.name.as_str()));
            check_state_id("circuit_breakers", i, &prefix, earlier)?;
            rules.push(Breaker {
                spec: Rc::new(spec.clone()),
                prefix,
            });
        }
        let tracked = vec![0; rules.len()];
        Ok(Breakers {
            rules,
            seed,
            max_retries: common.max_cas_retries,
            local: FastMap::default(),
            tracked,
            store_failures: 0,
        })
    }

    /// The request's key for a breaker: its hash, and its value.
    fn key_of(&self, spec: &BreakerSpec, req: &dyn RequestView) -> Option<(u64, Vec<u8>)> {
        let value = match &spec.key {
            BreakerKey::Cluster => req.attribute(Attribute::ClusterName),
            BreakerKey::Route => req.attribute(Attribute::RouteName),
            BreakerKey::Header(h) => req.header(h),
        }?;
        let mut h = Keyed::new(self.seed);
        h.field(&value);
        Some((h.finish(), value))
    }

    /// The value of a tracked key (the cluster, route or header value it
    /// was seen with), for logs.
    pub fn key_name(&self, breaker: usize, key: u64) -> &str {
        self.local.get(&(breaker, key)).map_or("?", |l| &l.name)
    }

    fn shared_key(&self, breaker: usize, key: u64) -> String {
        let prefix = self.rules.get(breaker).map_or("", |r| r.prefix.as_str());
        format!("{prefix}{key:016x}")
    }

    /// Reads, changes and writes one key's shared state with CAS, retrying
    /// conflicts; returns the new state and `f`'s result.
    fn update<R>(
        &mut self,
        store: &dyn Store,
        breaker: usize,
        key: u64,
        mut f: impl FnMut(&mut State) -> R,
    ) -> Result<(State, R), StoreError> {
        let name = self.shared_key(breaker, key);
        let failures = &mut self.store_failures;
        update(store, &name, self.max_retries, |found| {
            let old = match found {
                Some(e) => decode(&e.bytes).unwrap_or_else(|_| {
                    *failures += 1;
                    State::new()
                }),
                None => State::new(),
            };
            let mut new = old;
            let r = f(&mut new);
            if new == old {
                Update::Keep((new, r))
            } else {
                Update::Write(encode(&new), (new, r))
            }
        })
    }

    fn remember(&mut self, breaker: usize, key: u64, state: State, now_ms: u64) {
        if let Some(l) = self.local.get_mut(&(breaker, key)) {
            l.state = state;
            l.fetched_ms = Some(now_ms);
        }
    }

    /// Checks every matching breaker. A request failing fast at one breaker
    /// gives back any probe it claimed at another.
    pub fn check(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        req: &dyn RequestView,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) -> Check {
        let mut tickets = Vec::new();
        for b in 0..self.rules.len() {
            let Some(rule) = self.rules.get(b) else {
                continue;
            };
            if !rule.spec.matcher.matches(req) {
                continue;
            }
            let Some((key, value)) = self.key_of(&rule.spec, req) else {
                continue;
            };
            let spec = rule.spec.clone();
            let (retry_after_ms, half_open) =
                match self.check_one(store, now_ms, (b, key), &value, &spec, events) {
                    One::Pass(Some(t)) if spec.graded.is_some() => {
                        let p = self
                            .local
                            .get(&(b, key))
                            .map_or(0, |l| l.state.reject_permille(&spec, now_ms));
                        if p > 0 && rng.below(1000) < u64::from(p) {
                            for t in tickets {
                                self.record(store, now_ms, t, Outcome::Ignored, rng, events);
                            }
                            return Check::Throttle {
                                breaker: b,
                                reject_permille: p,
                            };
                        }
                        tickets.push(t);
                        continue;
                    }
                    One::Pass(t) => {
                        tickets.extend(t);
                        continue;
                    }
                    One::Open { retry_after_ms } => (retry_after_ms, false),
                    One::NoProbeLeft => (0, true),
                    One::StoreDown => (STORE_DOWN_RETRY_MS, false),
                };
            for t in tickets {
                self.record(store, now_ms, t, Outcome::Ignored, rng, events);
            }
            return Check::FailFast {
                breaker: b,
                retry_after_ms: retry_after_ms.max(1),
                half_open,
            };
        }
        Check::Pass(tickets)
    }

    /// One breaker key's verdict on a request.
    fn check_one(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (b, key): (usize, u64),
        value: &[u8],
        spec: &BreakerSpec,
        events: &mut Vec<Event>,
    ) -> One {
        if !self.track(b, key, value, spec, now_ms) {
            return One::Pass(None); // beyond max_keys: not tracked, passes
        }
        if self.refresh(store, b, key, now_ms).is_err() {
            self.store_failures += 1;
            return One::store_down(spec);
        }
        let state = self
            .local
            .get(&(b, key))
            .map(|l| l.state)
            .unwrap_or_default();
        match state.admit(spec, now_ms) {
            Admit::Pass => One::Pass(Some(Ticket {
                breaker: b,
                key,
                probe: false,
                epoch: state.epoch,
            })),
            Admit::FailFast { .. } if state.phase == super::Phase::HalfOpen => One::NoProbeLeft,
            Admit::FailFast { retry_after_ms } => One::Open { retry_after_ms },
            Admit::TryProbe => self.probe(store, now_ms, (b, key), spec, events),
        }
    }

    /// Starts tracking a key if there is room; whether it is tracked.
    fn track(&mut self, b: usize, key: u64, value: &[u8], spec: &BreakerSpec, now_ms: u64) -> bool {
        if self.local.contains_key(&(b, key)) {
            return true;
        }
        let Some(n) = self.tracked.get_mut(b) else {
            return false;
        };
        if *n >= spec.max_keys {
            return false;
        }
        *n += 1;
        self.local.insert(
            (b, key),
            Local {
                name: String::from_utf8_lossy(value.get(..128).unwrap_or(value)).into(),
                state: State::new(),
                fetched_ms: None,
                pending: 0,
                flushed_ms: now_ms,
            },
        );
        true
    }

    /// Re-reads a key's shared state if the cached one is `SYNC_MS` old;
    /// `Err` when the store failed or the state is corrupt.
    fn refresh(&mut self, store: &dyn Store, b: usize, key: u64, now_ms: u64) -> Result<(), ()> {
        let stale = self.local.get(&(b, key)).is_some_and(|l| {
            l.fetched_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= SYNC_MS)
        });
        if !stale {
            return Ok(());
        }
        let fresh = match store.get(&self.shared_key(b, key)) {
            Ok(Some(e)) => decode(&e.bytes).map_err(|_| ())?,
            Ok(None) => State::new(),
            Err(_) => return Err(()),
        };
        self.remember(b, key, fresh, now_ms);
        Ok(())
    }

    /// Claims a probe of a half-open (or due) key across the VMs.
    fn probe(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (b, key): (usize, u64),
        spec: &BreakerSpec,
        events: &mut Vec<Event>,
    ) -> One {
        match self.update(store, b, key, |s| s.claim_probe(spec, now_ms)) {
            Ok((s, Ok(transition))) => {
                self.remember(b, key, s, now_ms);
                if let Some(t) = transition {
                    events.push(Event {
                        breaker: b,
                        key,
                        transition: t,
                    });
                }
                One::Pass(Some(Ticket {
                    breaker: b,
                    key,
                    probe: true,
                    epoch: s.epoch,
                }))
            }
            Ok((s, Err(_))) => {
                self.remember(b, key, s, now_ms);
                match s.admit(spec, now_ms) {
                    Admit::FailFast { retry_after_ms } if s.phase == super::Phase::Open => {
                        One::Open { retry_after_ms }
                    }
                    _ => One::NoProbeLeft,
                }
            }
            Err(_) => {
                self.store_failures += 1;
                One::store_down(spec)
            }
        }
    }

    /// Reports a ticket's outcome.
    pub fn record(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        t: Ticket,
        outcome: Outcome,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) {
        let Some(spec) = self.rules.get(t.breaker).map(|r| r.spec.clone()) else {
            return;
        };
        if t.probe {
            let result = self.update(store, t.breaker, t.key, |s| match outcome {
                Outcome::Success => s.probe_result(&spec, now_ms, (true, t.epoch), rng),
                Outcome::Failure => s.probe_result(&spec, now_ms, (false, t.epoch), rng),
                Outcome::Ignored => {
                    s.release_probe(t.epoch);
                    None
                }
            });
            self.finish(t.breaker, t.key, now_ms, result, events);
            return;
        }
        let Some(local) = self.local.get_mut(&(t.breaker, t.key)) else {
            return;
        };
        match outcome {
            Outcome::Ignored => {}
            Outcome::Success => {
                local.pending = local.pending.saturating_add(1);
                if now_ms.saturating_sub(local.flushed_ms) >= SYNC_MS {
                    self.flush_one(store, now_ms, (t.breaker, t.key), 0, rng, events);
                }
            }
            Outcome::Failure => self.flush_one(store, now_ms, (t.breaker, t.key), 1, rng, events),
        }
    }

    fn flush_one(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (b, key): (usize, u64),
        failures: u32,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) {
        let Some(spec) = self.rules.get(b).map(|r| r.spec.clone()) else {
            return;
        };
        let Some(local) = self.local.get_mut(&(b, key)) else {
            return;
        };
        let successes = std::mem::take(&mut local.pending);
        local.flushed_ms = now_ms;
        let result = self.update(store, b, key, |s| {
            s.record(&spec, now_ms, successes, failures, rng)
        });
        self.finish(b, key, now_ms, result, events);
    }

    fn finish(
        &mut self,
        b: usize,
        key: u64,
        now_ms: u64,
        result: Result<(State, Option<Transition>), StoreError>,
        events: &mut Vec<Event>,
    ) {
        match result {
            Ok((s, transition)) => {
                self.remember(b, key, s, now_ms);
                if let Some(t) = transition {
                    events.push(Event {
                        breaker: b,
                        key,
                        transition: t,
                    });
                }
            }
            Err(_) => self.store_failures += 1,
        }
    }

    /// Merges successes counted locally for at least `SYNC_MS` (call on a tick).
    pub fn flush(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        events: &mut Vec<Event>,
    ) {
        let due: Vec<(usize, u64)> = self
            .local
            .iter()
            .filter(|(_, l)| l.pending > 0 && now_ms.saturating_sub(l.flushed_ms) >= SYNC_MS)
            .map(|(k, _)| *k)
            .collect();
        for (b, key) in due {
            self.flush_one(store, now_ms, (b, key), 0, rng, events);
        }
    }

    /// The cached phase of a key (for tests and metrics).
    pub fn cached(&self, breaker: usize, key: u64) -> Option<State> {
        self.local.get(&(breaker, key)).map(|l| l.state)
    }
}
