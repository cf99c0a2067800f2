//! Global rules: a rule whose tokens come from a rate-limit service shared
//! by every Envoy of a fleet (Envoy's RLS protocol), without a call on the
//! request path.
//!
//! - A request spends a token this Envoy already holds for its key (the
//!   key's [`pool::Pool`] in the rule's slot table, with the limiter's CAS
//!   transaction, exact across workers). Every token was counted at the
//!   service before it was put there, so the fleet never admits more than
//!   the service granted.
//! - Each VM notes which keys wanted tokens; on its tick it adds that
//!   demand to one shared record ([`codec::Want`]).
//! - One VM per Envoy, the leader (a lease in shared data, renewed on its
//!   tick, taken over by another VM when it lapses), reads the demand,
//!   estimates each key's rate, and from its tick asks the service for
//!   batches of tokens ahead of need (`hits_addend`: a second of demand by
//!   default, at most `max_batch`, fewer as the service's remaining count
//!   runs low). A grant goes into the key's pool; an over-limit answer
//!   blocks the key until the service's reset.
//! - A breaker on the service (failed calls in a row; open for the
//!   cool-down plus up to 20%, then one probe) is shared in shared data:
//!   while it is not closed, every VM serves its global rules from a local
//!   backstop bucket of limit x share, or, with `failure_mode_deny`,
//!   spends what it holds and then refuses.

pub mod codec;
pub mod config;
pub mod pool;
pub mod proto;
#[cfg(test)]
mod scenario_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod wait_tests;

use crate::config::fields::StateId;
use crate::hash::FastMap;
use crate::rng::SplitMix;
use crate::store::{Store, StoreError};
use codec::{Health, HealthState, Lease, Want};
use config::GlobalSpec;
use pool::Pool;

pub const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";
pub const METHOD: &str = "ShouldRateLimit";
/// How long a leader's lease lasts without renewal (renewed every tick).
pub const LEASE_MS: u64 = 1_000;
/// Most keys a VM notes between two reports (more wait for the next).
pub const MAX_LOCAL_KEYS: usize = 10_000;
/// Most keys the leader tracks, and most calls it starts per tick.
pub const MAX_KEYS: usize = 50_000;
pub const MAX_CALLS_PER_TICK: usize = 128;
/// The lease, leader and breaker work runs at most this often (ms): on
/// the slow tick, not on the fast ticks a starved key asks for.
const SLOW_WORK_MS: u64 = 90;
/// A pool whose key had no demand for this long may be taken by a key
/// that has no slot (ms).
const FRESH_MS: u64 = 5_000;
/// A starved key's demand is reported at most this often (ms).
const FAST_REPORT_MS: u64 = 10;
/// The span a first rate is measured over, for want of a tick before it.
const FIRST_TICK_MS: u64 = 100;
/// How soon a request refused for want of tokens (the key's pool is being
/// filled; not over its limit) is told to come back.
pub const STARVED_WAIT_NS: u64 = 1_000_000_000;
/// A key without demand for this long is forgotten by the leader.
const IDLE_MS: u64 = 30_000;

pub use crate::pipeline::stage::Call;

/// How a global rule is served now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Tokens from the service.
    #[default]
    Service,
    /// The service is down: the local backstop bucket.
    Backstop,
    /// The service is down and the rule fails closed: held tokens only.
    Deny,
}

impl Mode {
    /// The value of the `sluice_global_mode` gauge.
    pub fn gauge(self) -> u64 {
        match self {
            Mode::Service => 0,
            Mode::Backstop => 1,
            Mode::Deny => 2,
        }
    }
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    Ok,
    OverLimit,
    Error,
}

/// A global rule as the coordinator sees it.
#[derive(Debug, Clone)]
pub struct GlobalRule {
    /// The rule's index in the configuration.
    pub rule: usize,
    pub spec: GlobalSpec,
    /// The RLS domain (the section's, or the configuration's).
    pub domain: String,
    /// Key prefix and length of the table of pools.
    pub pool_prefix: String,
    pub table_len: u32,
    /// The rule's window (ms): tokens' lifetime when the service says
    /// nothing of its own.
    pub window_ms: u64,
    /// Index of the rule's service (its cluster) in `Coordinator::services`.
    pub service: usize,
    /// The rule's own statement of the limit (per window).
    pub quota: u64,
    /// The most a request may cost (`cost.max`): a batch is never smaller.
    pub cost_max: u64,
    /// Whether the key has variable parts (two slots per key).
    pub variable: bool,
}

/// What happened during a call into the coordinator, for metrics and the
/// limiter.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub calls: Vec<Call>,
    /// (global rule, tokens) granted by the service.
    pub granted: Vec<(usize, u64)>,
    /// (global rule, tokens) paid for and dropped unspent: their window
    /// ended, or another key took the slot.
    pub dropped: Vec<(usize, u64)>,
    /// (global rule, result) of finished calls.
    pub results: Vec<(usize, CallResult)>,
    /// Whether this VM became (true) or stopped being (false) the leader.
    pub leader: Option<bool>,
    /// Rules whose mode changed.
    pub modes: Vec<(usize, Mode)>,
    /// Breaker transitions: (service, new state).
    pub transitions: Vec<(usize, HealthState)>,
    /// This VM reported starved demand and is not the leader: wake the
    /// leader (through the shared queue it listens on, [`Coordinator::queue`])
    /// so that it calls for the starved keys at once, not on its next tick.
    pub wake: bool,
    /// This VM leads: it listens on that queue (again on every slow tick,
    /// so that a registration another VM took over while the lease changed
    /// hands, or one that failed, comes back within a tick).
    pub listen: bool,
}

/// The leader's view of one key.
#[derive(Debug, Clone)]
struct Key {
    values: Vec<Vec<u8>>,
    /// Requests per second, smoothed.
    rate: f64,
    pending: u64,
    /// The demand of the last tick.
    last_pending: u64,
    /// When the last call for it started (0: never).
    last_call_ms: u64,
    last_demand_ms: u64,
    inflight: bool,
    blocked_until_ms: u64,
    /// What the service said remained of the key's limit, last time.
    remaining: Option<u64>,
}

/// One rate-limit service (cluster): its breaker, as the leader keeps it.
#[derive(Debug, Clone)]
pub struct Service {
    pub cluster: String,
    pub health_key: String,
    pub health: Health,
    pub failures: u32,
    pub cooldown_ms: u64,
    pub timeout_ms: u64,
}

/// The global rules of one configuration, in one VM.
pub struct Coordinator {
    pub rules: Vec<GlobalRule>,
    pub services: Vec<Service>,
    me: u64,
    /// The version of this VM's configuration (`Config::version`).
    config: u64,
    leader: bool,
    lease_key: String,
    /// The version of the newest configuration started with these rules.
    newest_key: String,
    want_key: String,
    /// The name of the shared queue the leader listens on (see `hurry`).
    pub queue: String,
    /// Demand noted by this VM since its last report, by (rule, key hash).
    local: FastMap<(u8, u64), Want>,
    keys: FastMap<(u8, u64), Key>,
    /// Calls out: (rule, key hash, hits, when it started).
    calls: FastMap<u64, (u8, u64, u32, u64)>,
    next_call: u64,
    last_tick_ms: u64,
    /// When the lease, leader and breaker work last ran.
    last_slow_ms: u64,
    /// When this VM last reported its demand.
    last_report_ms: u64,
    /// The leader's keys by (rule, pool tag): when each last had demand.
    owners: FastMap<(u8, u32), u64>,
    /// Starved keys were noted since the last report.
    cold: bool,
    modes: Vec<Mode>,
}

/// The tag a key's pool is marked with, as `owners` keeps it.
fn owner_tag(fingerprint: u64) -> u32 {
    ((fingerprint >> 32) as u32) | 1
}

/// Keys by the time given with each, the oldest first (one sort for both
/// the tick's calls and the evictions: each sort's code is kilobytes).
fn oldest_first(v: &mut [((u8, u64), u64)]) {
    v.sort_unstable_by_key(|&(_, t)| t);
}

impl Coordinator {
    /// `me`: a random id of this VM; `config`: its configuration's version.
    pub fn new(
        config_domain: &str,
        rules: Vec<GlobalRule>,
        services: Vec<Service>,
        (me, config): (u64, u64),
    ) -> Self {
        let mut id = StateId::new((0x676c_6f62_616c, 0x006c_6561_7365), config_domain);
        for r in &rules {
            id = id.text(&r.pool_prefix);
        }
        let id = id.finish();
        let modes = vec![Mode::Service; rules.len()];
        Coordinator {
            rules,
            services,
            me,
            config,
            leader: false,
            lease_key: format!("sg{id:08x}/lease2"),
            newest_key: format!("sg{id:08x}/newest"),
            want_key: format!("sg{id:08x}/want"),
            queue: format!("sg{id:08x}/hurry"),
            local: FastMap::default(),
            keys: FastMap::default(),
            calls: FastMap::default(),
            next_call: 1,
            last_tick_ms: 0,
            last_slow_ms: 0,
            last_report_ms: 0,
            owners: FastMap::default(),
            cold: false,
            modes,
        }
    }

    /// The shared-data key of the breaker on a service.
    pub fn health_key(config_domain: &str, cluster: &str) -> String {
        let id = StateId::new((0x676c_6f62_616c, 0x6865_616c_7468), config_domain)
            .text(cluster)
            .finish();
        format!("sg{id:08x}/health")
    }

    /// Whether this VM is the leader.
    pub fn is_leader(&self) -> bool {
        self.leader
    }

    /// The current mode of global rule `g`.
    pub fn mode(&self, g: usize) -> Mode {
        self.modes.get(g).copied().unwrap_or_default()
    }

    /// Whether the request path must read the key's parts to note its
    /// demand (the first time in a report interval).
    pub fn knows(&self, g: usize, fingerprint: u64) -> bool {
        self.local.contains_key(&(g as u8, fingerprint))
    }

    /// Notes that a request wanted a token of global rule `g` for a key;
    /// `values` reads the key's parts (called only for a key not yet noted
    /// since the last report). A key found without tokens (`starved`, not
    /// over its limit) asks for the demand to be reported on the next fast
    /// tick rather than the next slow one (see `wants_fast_tick`), so that
    /// its first tokens come sooner; nothing is written on the request path.
    /// Demand is counted in tokens (`cost`), as batches are.
    pub fn note(
        &mut self,
        g: usize,
        fingerprint: u64,
        starved: bool,
        cost: u64,
        values: impl FnOnce() -> Vec<Vec<u8>>,
    ) {
        self.cold |= starved;
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        if let Some(w) = self.local.get_mut(&(g as u8, fingerprint)) {
            w.count = w.count.saturating_add(cost);
            return;
        }
        if self.local.len() >= MAX_LOCAL_KEYS {
            return;
        }
        self.local.insert(
            (g as u8, fingerprint),
            Want {
                rule: g as u8,
                fingerprint,
                count: cost,
                // Cut here, not only when encoded: a VM keeps no more.
                values: values()
                    .into_iter()
                    .map(|mut v| {
                        v.truncate(codec::MAX_VALUE_LEN);
                        v
                    })
                    .collect(),
            },
        );
    }

    /// Whether this VM has demand of starved keys to report at once.
    pub fn wants_fast_tick(&self) -> bool {
        self.cold
    }

    /// Periodic work of every VM: report demand, hold or seek the lease,
    /// lead if it holds it, and follow the services' breakers. On a fast
    /// tick (asked for by a starved key) only the demand is reported.
    pub fn tick(&mut self, store: &dyn Store, now_ms: u64, rng: &mut SplitMix) -> Report {
        let mut report = Report::default();
        let slow = now_ms.saturating_sub(self.last_slow_ms) >= SLOW_WORK_MS;
        // Fast reports at most every FAST_REPORT_MS: each rewrites the
        // shared record.
        if slow || now_ms.saturating_sub(self.last_report_ms) >= FAST_REPORT_MS {
            let cold = std::mem::take(&mut self.cold);
            if self.report_demand(store) && cold {
                // Starved keys: their calls now, not on the leader's next tick.
                if self.leader {
                    self.hurry(store, now_ms, &mut report);
                } else {
                    report.wake = true;
                }
            }
            self.last_report_ms = now_ms;
        }
        if !slow {
            return report;
        }
        self.last_slow_ms = now_ms;
        let was = self.leader;
        self.leader = self.hold_lease(store, now_ms);
        if was != self.leader {
            report.leader = Some(self.leader);
        }
        if self.leader {
            report.listen = true;
            self.lead(store, now_ms, rng, &mut report);
        }
        self.follow_health(store, &mut report);
        report
    }

    /// Adds this VM's demand to the shared record; whether it did.
    fn report_demand(&mut self, store: &dyn Store) -> bool {
        if self.local.is_empty() {
            return false;
        }
        for _ in 0..8 {
            let (mut merged, cas) = match store.get(&self.want_key) {
                Ok(Some(e)) => (codec::decode_wants(&e.bytes).unwrap_or_default(), e.cas),
                Ok(None) => (Vec::new(), None),
                Err(_) => return false,
            };
            let mut at: FastMap<(u8, u64), usize> = merged
                .iter()
                .enumerate()
                .map(|(i, w)| ((w.rule, w.fingerprint), i))
                .collect();
            for (k, w) in &self.local {
                match at.get(k).and_then(|&i| merged.get_mut(i)) {
                    Some(m) => m.count = m.count.saturating_add(w.count),
                    None => {
                        at.insert(*k, merged.len());
                        merged.push(w.clone());
                    }
                }
            }
            let (bytes, left_out) = codec::encode_wants(merged.iter());
            match store.set(&self.want_key, &bytes, cas) {
                Ok(()) => {
                    // What did not fit waits here for the next report.
                    let kept: FastMap<(u8, u64), Want> = left_out
                        .iter()
                        .filter_map(|&i| merged.get(i))
                        .filter_map(|w| {
                            let k = (w.rule, w.fingerprint);
                            self.local.get(&k).map(|l| (k, l.clone()))
                        })
                        .collect();
                    self.local = kept;
                    return true;
                }
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Unavailable) => return false,
            }
        }
        false
    }

    /// The leader, woken by a VM that reported starved demand (or by its
    /// own report): takes the demand and calls at once for the keys never
    /// called for yet, instead of on its next tick (up to 100 ms later).
    /// Their rate is not known yet: it is taken as their demand so far
    /// over one tick, as the first tick does. Nothing for a VM that is not
    /// the leader (it lost the lease since it listened). Every wake-up
    /// takes the demand (two in one millisecond bring two workers' keys).
    pub fn hurry(&mut self, store: &dyn Store, now_ms: u64, report: &mut Report) {
        // Read again: a newer configuration's VM may have taken the lease
        // since this one's last tick (and this one's calls may die soon).
        if !self.leader || !self.holds_lease(store, now_ms) {
            return;
        }
        // Only the keys this demand brings (not every key the leader
        // knows: a wake-up must cost little however many keys there are).
        for (g, fp) in self.take_demand(store, now_ms) {
            if report.calls.len() >= MAX_CALLS_PER_TICK {
                break;
            }
            let closed = self
                .rules
                .get(g as usize)
                .and_then(|r| self.services.get(r.service))
                .is_some_and(|s| s.health.state == HealthState::Closed);
            let Some(k) = self.keys.get_mut(&(g, fp)) else {
                continue;
            };
            if !closed || k.last_call_ms != 0 || k.inflight || now_ms < k.blocked_until_ms {
                continue;
            }
            if k.rate == 0.0 {
                k.rate = k.pending as f64 * 1_000.0 / FIRST_TICK_MS as f64;
            }
            self.owners.insert((g, owner_tag(fp)), k.last_demand_ms);
            if let Some(call) = self.plan(store, now_ms, g, fp, false) {
                report.calls.push(call);
            }
        }
    }

    /// Says that this configuration is the newest with these rules (when
    /// it starts): a configuration it replaces gives the lease up to it.
    /// (Not retried on a tick: by then a newer one may have started.)
    pub fn announce(&self, store: &dyn Store) {
        let _ = store.set(&self.newest_key, &codec::encode_newest(self.config), None);
    }

    /// Whether this VM holds the lease, as shared data says now.
    fn holds_lease(&self, store: &dyn Store, now_ms: u64) -> bool {
        store
            .get(&self.lease_key)
            .ok()
            .flatten()
            .and_then(|e| Lease::decode(&e.bytes).ok())
            .is_some_and(|l| l.owner == self.me && l.until_ms > now_ms)
    }

    /// The newest configuration's version (none if unknown or corrupt).
    fn newest(&self, store: &dyn Store) -> Option<u64> {
        let e = store.get(&self.newest_key).ok()??;
        codec::decode_newest(&e.bytes).ok()
    }

    /// Renews or takes the lease; returns whether this VM holds it.
    ///
    /// A configuration replaced (ECDS) lives on in a VM only for its last
    /// requests, and its calls die with it. So a VM of the newest
    /// configuration takes the lease from an older configuration's VM at
    /// once, and an older configuration's VM takes a free lease only once
    /// it has been free for a whole lease (no VM of the newest is there to).
    fn hold_lease(&self, store: &dyn Store, now_ms: u64) -> bool {
        let (current, cas) = match store.get(&self.lease_key) {
            Ok(Some(e)) => (Lease::decode(&e.bytes).ok(), e.cas),
            Ok(None) => (None, None),
            Err(_) => return false,
        };
        if let Some(l) = current.filter(|l| l.owner != self.me) {
            let take = if l.until_ms > now_ms {
                l.config != self.config && self.newest(store) == Some(self.config)
            } else {
                now_ms >= l.until_ms.saturating_add(LEASE_MS)
                    || self.newest(store).is_none_or(|n| n == self.config)
            };
            if !take {
                return false;
            }
        }
        let lease = Lease {
            owner: self.me,
            until_ms: now_ms + LEASE_MS,
            config: self.config,
        };
        store.set(&self.lease_key, &lease.encode(), cas).is_ok()
    }

    /// Gives the lease up (the configuration is going away): free from
    /// now on.
    pub fn resign(&mut self, store: &dyn Store, now_ms: u64) {
        if !self.leader {
            return;
        }
        self.leader = false;
        if let Ok(Some(e)) = store.get(&self.lease_key) {
            if let Ok(mut l) = Lease::decode(&e.bytes) {
                if l.owner == self.me {
                    l.until_ms = now_ms;
                    let _ = store.set(&self.lease_key, &l.encode(), e.cas);
                }
            }
        }
    }

    /// Reads the breakers and sets each rule's mode (also at start, so
    /// that a new configuration starts in the mode the Envoy is in).
    pub fn follow_health(&mut self, store: &dyn Store, report: &mut Report) {
        for s in self.services.iter_mut() {
            if let Ok(Some(e)) = store.get(&s.health_key) {
                if let Ok(h) = Health::decode(&e.bytes) {
                    s.health = h;
                }
            }
        }
        for (g, r) in self.rules.iter().enumerate() {
            let down = self
                .services
                .get(r.service)
                .is_some_and(|s| s.health.down());
            let mode = match (down, r.spec.failure_mode_deny) {
                (false, _) => Mode::Service,
                (true, false) => Mode::Backstop,
                (true, true) => Mode::Deny,
            };
            if let Some(m) = self.modes.get_mut(g) {
                if *m != mode {
                    *m = mode;
                    report.modes.push((g, mode));
                }
            }
        }
    }

    /// The leader's work: take in the demand, move the breakers on, and
    /// ask for the tokens the keys will need.
    fn lead(&mut self, store: &dyn Store, now_ms: u64, rng: &mut SplitMix, report: &mut Report) {
        self.take_demand(store, now_ms);
        self.owners = self
            .keys
            .iter()
            .map(|(&(g, fp), k)| ((g, owner_tag(fp)), k.last_demand_ms))
            .collect();
        self.update_rates(now_ms);
        self.forget_idle(store, now_ms, report);
        let mut probes: Vec<bool> = Vec::with_capacity(self.services.len());
        for (i, s) in self.services.iter_mut().enumerate() {
            probes.push(s.advance(store, now_ms, rng, i, report));
        }
        for (g, fp) in self.due(now_ms) {
            if report.calls.len() >= MAX_CALLS_PER_TICK {
                break;
            }
            let Some(svc) = self.rules.get(g as usize).map(|r| r.service) else {
                continue;
            };
            let probe = match self.services.get(svc).map(|s| s.health.state) {
                Some(HealthState::Closed) => false,
                Some(HealthState::HalfOpen) if probes.get(svc) == Some(&true) => true,
                _ => continue,
            };
            if let Some(call) = self.plan(store, now_ms, g, fp, false) {
                report.calls.push(call);
                if probe {
                    // One probe: the first call made while half-open.
                    if let Some(p) = probes.get_mut(svc) {
                        *p = false;
                    }
                }
            }
        }
        // A half-open breaker whose probe found no key short of tokens
        // (on the backstop, pools are not spent): one hit for its busiest
        // key, so that the service's return is noticed anyway.
        for (svc, _) in probes.iter().enumerate().filter(|(_, p)| **p) {
            let busiest = self
                .keys
                .iter()
                .filter(|((g, _), k)| {
                    !k.inflight
                        && self
                            .rules
                            .get(*g as usize)
                            .is_some_and(|r| r.service == svc)
                })
                .max_by(|a, b| a.1.rate.total_cmp(&b.1.rate))
                .map(|(&id, _)| id);
            if let Some((g, fp)) = busiest {
                if let Some(call) = self.plan(store, now_ms, g, fp, true) {
                    report.calls.push(call);
                }
            }
        }
    }

    /// Each key's rate: the demand since the last tick, smoothed.
    fn update_rates(&mut self, now_ms: u64) {
        let dt_ms = match self.last_tick_ms {
            0 => FIRST_TICK_MS,
            last => now_ms.saturating_sub(last).clamp(1, 10_000),
        };
        self.last_tick_ms = now_ms;
        for k in self.keys.values_mut() {
            let seen = k.pending as f64 * 1_000.0 / dt_ms as f64;
            k.rate = if k.rate == 0.0 {
                seen
            } else {
                0.5 * k.rate + 0.5 * seen
            };
            k.last_pending = std::mem::take(&mut k.pending);
        }
    }

    /// Forgets the keys without demand for `IDLE_MS`.
    fn forget_idle(&mut self, store: &dyn Store, now_ms: u64, report: &mut Report) {
        let idle: Vec<(u8, u64)> = self
            .keys
            .iter()
            .filter(|(_, k)| !k.inflight && now_ms.saturating_sub(k.last_demand_ms) >= IDLE_MS)
            .map(|(&id, _)| id)
            .collect();
        for id in idle {
            self.keys.remove(&id);
            self.forget(store, now_ms, id, report);
        }
    }

    /// The keys that may need tokens now, the one called least recently
    /// first: when a tick cannot serve everyone, every key still gets its
    /// turn within a few ticks.
    fn due(&self, now_ms: u64) -> Vec<(u8, u64)> {
        let mut due: Vec<((u8, u64), u64)> = Vec::new();
        for (&(g, fp), k) in &self.keys {
            let lead_ms = self.rules.get(g as usize).map_or(1_000, |r| r.spec.lead_ms);
            if !k.inflight && now_ms >= k.blocked_until_ms && k.wanted(lead_ms) {
                due.push(((g, fp), k.last_call_ms));
            }
        }
        oldest_first(&mut due);
        due.into_iter().map(|(id, _)| id).collect()
    }

    /// A key forgotten for want of demand: what its pool still holds is
    /// counted as dropped if its window has ended (else it may still be
    /// spent, should the key come back).
    fn forget(&self, store: &dyn Store, now_ms: u64, (g, fp): (u8, u64), report: &mut Report) {
        let Some(rule) = self.rules.get(g as usize) else {
            return;
        };
        let (keys, tag) = pool_slots(rule, fp);
        let left: u32 = read_sites(store, &keys)
            .unwrap_or_default()
            .iter()
            .filter_map(|s| s.slot.filter(|s| s.fingerprint == tag))
            .map(|s| expired(s.tat, now_ms))
            .sum();
        if left > 0 {
            report.dropped.push((g as usize, u64::from(left)));
        }
    }

    /// Moves the shared demand record into the leader's keys.
    /// Takes the demand the VMs reported; the keys it was for.
    fn take_demand(&mut self, store: &dyn Store, now_ms: u64) -> Vec<(u8, u64)> {
        for _ in 0..8 {
            let (wants, cas) = match store.get(&self.want_key) {
                Ok(Some(e)) => (codec::decode_wants(&e.bytes).unwrap_or_default(), e.cas),
                _ => return Vec::new(),
            };
            if wants.is_empty() {
                return Vec::new();
            }
            let (empty, _) = codec::encode_wants(std::iter::empty());
            match store.set(&self.want_key, &empty, cas) {
                Ok(()) => {
                    let ids = wants.iter().map(|w| (w.rule, w.fingerprint)).collect();
                    for w in wants {
                        self.add_demand(w, now_ms);
                    }
                    return ids;
                }
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Unavailable) => return Vec::new(),
            }
        }
        Vec::new()
    }

    fn add_demand(&mut self, w: Want, now_ms: u64) {
        if usize::from(w.rule) >= self.rules.len() {
            return;
        }
        let key = (w.rule, w.fingerprint);
        if self.keys.len() >= MAX_KEYS && !self.keys.contains_key(&key) {
            self.evict();
        }
        let k = self.keys.entry(key).or_insert_with(|| Key {
            values: w.values,
            rate: 0.0,
            pending: 0,
            last_pending: 0,
            last_call_ms: 0,
            last_demand_ms: now_ms,
            inflight: false,
            blocked_until_ms: 0,
            remaining: None,
        });
        k.pending = k.pending.saturating_add(u64::from(w.count));
        k.last_demand_ms = now_ms;
    }

    /// Makes room in a full key table: the tenth of the keys whose demand
    /// is oldest are forgotten (a new key is never locked out).
    fn evict(&mut self) {
        let mut by_age: Vec<((u8, u64), u64)> = self
            .keys
            .iter()
            .filter(|(_, k)| !k.inflight)
            .map(|(&id, k)| (id, k.last_demand_ms))
            .collect();
        oldest_first(&mut by_age);
        for (id, _) in by_age.into_iter().take(MAX_KEYS / 10) {
            self.keys.remove(&id);
        }
    }

    /// The call for a key whose pool runs low, if it does.
    /// `probe`: a half-open breaker's probe, one hit, made even if the
    /// pool holds enough.
    fn plan(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        g: u8,
        fp: u64,
        probe: bool,
    ) -> Option<Call> {
        let rule = self.rules.get(g as usize)?;
        let k = self.keys.get(&(g, fp))?;
        let batch = batch(rule, k);
        let (keys, tag) = pool_slots(rule, fp);
        // No slot for a pool: no call (the tokens would have nowhere to go).
        let fresh = fresh(&self.owners, g, now_ms);
        let live = u64::from(live_tokens(
            &read_sites(store, &keys)?,
            tag,
            now_ms,
            &fresh,
        )?);
        if !probe && live > batch / 2 && live >= rule.cost_max.min(batch) {
            return None;
        }
        let hits = if probe {
            1
        } else {
            batch.saturating_sub(live).max(1) as u32
        };
        let parts: Vec<(&str, &[u8])> = rule
            .spec
            .descriptor_keys
            .iter()
            .map(String::as_str)
            .zip(k.values.iter().map(Vec::as_slice))
            .collect();
        let message = proto::request(&rule.domain, &parts, hits);
        let cluster = self.services.get(rule.service)?.cluster.clone();
        let timeout_ms = rule.spec.timeout_ms;
        let id = self.next_call;
        self.next_call += 1;
        self.calls.insert(id, (g, fp, hits, now_ms));
        if let Some(k) = self.keys.get_mut(&(g, fp)) {
            k.inflight = true;
            k.last_call_ms = now_ms;
        }
        Some(Call {
            id,
            cluster,
            service: SERVICE,
            method: METHOD,
            message,
            timeout_ms,
        })
    }

    /// A call the host could not start, or that ended: `body` is the
    /// response on success, `None` on a gRPC error or timeout.
    pub fn done(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        id: u64,
        body: Option<&[u8]>,
    ) -> Report {
        let mut report = Report::default();
        let Some((g, fp, hits, started_ms)) = self.calls.remove(&id) else {
            return report;
        };
        if let Some(k) = self.keys.get_mut(&(g, fp)) {
            k.inflight = false;
        }
        let gi = g as usize;
        let Some(rule) = self.rules.get(gi) else {
            return report;
        };
        let svc = rule.service;
        let answer = body.and_then(|b| proto::response(b).ok());
        let (result, status) = match answer {
            Some(r) if r.overall == proto::Code::Ok => (CallResult::Ok, r.status),
            Some(r) if r.overall == proto::Code::OverLimit => (CallResult::OverLimit, r.status),
            _ => (CallResult::Error, proto::Status::default()),
        };
        report.results.push((gi, result));
        if let Some(s) = self.services.get_mut(svc) {
            s.record(
                store,
                now_ms,
                rng,
                result != CallResult::Error,
                svc,
                &mut report,
            );
        }
        if result == CallResult::Error {
            return report;
        }
        let call = (g, fp, hits, started_ms);
        self.fill(store, now_ms, call, result, &status, &mut report);
        report
    }

    /// Puts an answer into the key's pool: the tokens granted, or the
    /// block until the reset.
    fn fill(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (g, fp, hits, started_ms): (u8, u64, u32, u64),
        result: CallResult,
        status: &proto::Status,
        report: &mut Report,
    ) {
        let gi = g as usize;
        let Some(rule) = self.rules.get(gi) else {
            return;
        };
        // The service counted the hits at some moment of the call: the
        // window's end is worked out from the call's start, the earliest
        // it may be (the time to the reset then runs from there, and the
        // unit's window is the one the call started in).
        let until = window_end(started_ms, status, rule.window_ms);
        let (slots, tag) = pool_slots(rule, fp);
        // A refused batch is followed by the smallest call made (a single
        // hit, or the dearest request's cost: a server that does not count
        // refused hits may still have a few); that one refused blocks the
        // key until the reset.
        let block = result == CallResult::OverLimit && u64::from(hits) <= rule.cost_max;
        let fresh = fresh(&self.owners, g, now_ms);
        let site = (slots.as_slice(), tag);
        let dropped = match result {
            CallResult::Ok => {
                report.granted.push((gi, u64::from(hits)));
                // Granted tokens with nowhere to go are dropped, all of them.
                update_pool(store, site, now_ms, &fresh, |old| {
                    Pool::grant(old, hits, until, now_ms)
                })
                .unwrap_or(u64::from(hits))
            }
            _ if block => update_pool(store, site, now_ms, &fresh, |old| {
                Pool::block(old, until, now_ms)
            })
            .unwrap_or(0),
            _ => 0,
        };
        if dropped > 0 {
            report.dropped.push((gi, dropped));
        }
        if let Some(k) = self.keys.get_mut(&(g, fp)) {
            k.remaining = match result {
                CallResult::OverLimit => Some(0),
                _ => status.remaining,
            };
            if block {
                k.blocked_until_ms = until;
            }
        }
    }

    /// The configuration is going away.
    pub fn close(&mut self, store: &dyn Store, now_ms: u64) {
        self.resign(store, now_ms);
    }
}

/// How many tokens to ask for: a lead's worth of demand, at most
/// max_batch and half this Envoy's share of the limit (what a refused batch
/// may waste) and, near the limit, half its share of what the service last
/// said was left (so batches shrink as the count nears the limit); never
/// below the dearest request (`cost.max`).
fn batch(rule: &GlobalRule, k: &Key) -> u64 {
    let lead_s = rule.spec.lead_ms as f64 / 1_000.0;
    let cap = u64::from(rule.spec.max_batch)
        .min(((rule.quota as f64 * rule.spec.share / 2.0) as u64).max(1))
        .max(rule.cost_max);
    let mut batch = ((k.rate * lead_s).ceil() as u64).clamp(1, cap);
    if let Some(left) = k.remaining {
        batch = batch.min(((left as f64 * rule.spec.share / 2.0) as u64).max(1));
    }
    batch.max(rule.cost_max)
}

impl Key {
    /// Whether tokens should be fetched for the key: someone asked since
    /// the last tick, or its rate expects a request within its lead.
    fn wanted(&self, lead_ms: u64) -> bool {
        self.last_pending > 0 || self.rate * lead_ms as f64 / 1_000.0 >= 0.5
    }
}

/// The slot keys and tag of a key's pool: its two slots (one for a key
/// without variable parts), as `keys::place` gives them; the pool is in
/// whichever it holds.
fn pool_slots(rule: &GlobalRule, fingerprint: u64) -> (Vec<String>, u32) {
    let p = crate::keys::placement(fingerprint, rule.variable, rule.table_len);
    let keys = p
        .slots()
        .iter()
        .map(|&s| crate::keys::slot_key(&rule.pool_prefix, s))
        .collect();
    (keys, p.pool_tag())
}

/// One of a key's slots as the leader reads it.
struct Site {
    cas: Option<u32>,
    slot: Option<crate::ratelimit::codec::Slot>,
}

impl Site {
    fn ours(&self, tag: u32) -> Option<Pool> {
        self.slot
            .filter(|s| s.fingerprint == tag)
            .map(|s| Pool::decode(s.tat))
    }

    /// Free for a new pool: empty, unreadable, another key's pool with
    /// nothing live (no tokens, no block), or the pool of a key without
    /// recent demand (`fresh` says which owners had some); returns the
    /// tokens it held, dropped by taking it.
    fn free(&self, now_ms: u64, fresh: &dyn Fn(u32) -> bool) -> Option<u32> {
        let Some(s) = self.slot else { return Some(0) };
        let p = Pool::decode(s.tat);
        let blocked = p.blocked && now_ms < p.until_ms;
        let dead = p.live(now_ms) == 0 && !blocked;
        (s.fingerprint == 0 || dead || !fresh(s.fingerprint)).then_some(p.tokens)
    }
}

/// Which owners of rule `g`'s pools (by tag) had demand in the last
/// `FRESH_MS`: a slot held by any other key may be taken for a key that
/// has no slot (its tokens are then counted as dropped).
fn fresh(owners: &FastMap<(u8, u32), u64>, g: u8, now_ms: u64) -> impl Fn(u32) -> bool + '_ {
    move |tag| {
        owners
            .get(&(g, tag))
            .is_some_and(|&t| now_ms.saturating_sub(t) < FRESH_MS)
    }
}

/// Reads a key's slots.
fn read_sites(store: &dyn Store, keys: &[String]) -> Option<Vec<Site>> {
    let mut sites = Vec::with_capacity(keys.len());
    for k in keys {
        let e = store.get(k).ok()?;
        sites.push(Site {
            cas: e.as_ref().and_then(|e| e.cas),
            slot: e.and_then(|e| crate::ratelimit::codec::Slot::decode(&e.bytes).ok()),
        });
    }
    Some(sites)
}

/// The tokens of the key's pool still good, or `None` if it has no pool
/// and no free slot for one (both slots hold other keys' live pools).
fn live_tokens(sites: &[Site], tag: u32, now_ms: u64, fresh: &dyn Fn(u32) -> bool) -> Option<u32> {
    if let Some(p) = sites.iter().find_map(|s| s.ours(tag)) {
        return Some(p.live(now_ms));
    }
    sites.iter().find_map(|s| s.free(now_ms, fresh)).map(|_| 0)
}

/// When tokens granted now stop being good: the end of the service's
/// window, as early as any of its hints puts it (the time to its reset;
/// its unit, windows aligned on the Unix epoch as envoyproxy/ratelimit
/// counts them), else the end of the rule's own window.
pub fn window_end(now_ms: u64, status: &proto::Status, window_ms: u64) -> u64 {
    let mut ends = Vec::with_capacity(2);
    if let Some(r) = status.reset_ms.filter(|&r| r > 0) {
        ends.push(now_ms.saturating_add(r));
    }
    if let Some((_, unit)) = status.limit.filter(|&(_, u)| u > 0) {
        ends.push((now_ms / unit + 1) * unit);
    }
    ends.into_iter().min().unwrap_or_else(|| {
        let w = window_ms.max(1);
        (now_ms / w + 1) * w
    })
}

/// The tokens of a pool whose window has ended (paid for, never spent).
fn expired(state: u128, now_ms: u64) -> u32 {
    let p = Pool::decode(state);
    if now_ms >= p.until_ms {
        p.tokens
    } else {
        0
    }
}

/// Rewrites a key's pool with CAS, in the slot it holds, or else in a free
/// one: `f` gets the key's pool (`None` for a new one) and returns the new
/// pool and the live tokens it dropped. Returns the tokens dropped (with
/// those of ours that expired unspent, and a dead pool's in a slot taken
/// over), or `None` if no slot could hold it (both hold other keys' live
/// pools) or the store failed.
fn update_pool(
    store: &dyn Store,
    (keys, tag): (&[String], u32),
    now_ms: u64,
    fresh: &dyn Fn(u32) -> bool,
    f: impl Fn(Option<Pool>) -> (Pool, u32),
) -> Option<u64> {
    use crate::ratelimit::codec::Slot;
    for _ in 0..16 {
        let sites = read_sites(store, keys)?;
        let mine = sites.iter().position(|s| s.ours(tag).is_some());
        let (at, old, dead) = match mine {
            Some(i) => {
                let s = sites.get(i)?;
                (i, s.ours(tag), s.slot.map_or(0, |s| expired(s.tat, now_ms)))
            }
            None => {
                let (i, dead) = sites
                    .iter()
                    .enumerate()
                    .find_map(|(i, s)| s.free(now_ms, fresh).map(|d| (i, d)))?;
                (i, None, dead)
            }
        };
        let (pool, dropped) = f(old);
        let new = Slot {
            fingerprint: tag,
            tat: pool.encode(),
        };
        match store.set(keys.get(at)?, &new.encode(), sites.get(at)?.cas) {
            Ok(()) => return Some(u64::from(dropped) + u64::from(dead)),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Unavailable) => return None,
        }
    }
    None
}

impl Service {
    /// A breaker on `cluster`, closed, with the rule's settings.
    pub fn new(config_domain: &str, spec: &GlobalSpec) -> Self {
        Service {
            cluster: spec.cluster.clone(),
            health_key: Coordinator::health_key(config_domain, &spec.cluster),
            health: Health::default(),
            failures: spec.failures,
            cooldown_ms: spec.cooldown_ms,
            timeout_ms: spec.timeout_ms,
        }
    }

    fn write(&mut self, store: &dyn Store, h: Health, i: usize, report: &mut Report) {
        if h.state != self.health.state {
            report.transitions.push((i, h.state));
        }
        self.health = h;
        let _ = store.set(&self.health_key, &h.encode(), None);
    }

    /// The leader's tick: an open breaker whose cool-down is over lets one
    /// probe through (returns true); a probe that never came back counts
    /// as failed.
    fn advance(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        i: usize,
        report: &mut Report,
    ) -> bool {
        if let Ok(Some(e)) = store.get(&self.health_key) {
            if let Ok(h) = Health::decode(&e.bytes) {
                self.health = h;
            }
        }
        let h = self.health;
        match h.state {
            HealthState::Open if now_ms >= h.until_ms => {
                let probe = Health {
                    state: HealthState::HalfOpen,
                    failures: h.failures,
                    until_ms: now_ms + self.timeout_ms + 1_000,
                };
                self.write(store, probe, i, report);
                true
            }
            HealthState::HalfOpen if now_ms >= h.until_ms => {
                let open = self.opened(now_ms, rng, h.failures);
                self.write(store, open, i, report);
                false
            }
            _ => false,
        }
    }

    fn opened(&self, now_ms: u64, rng: &mut SplitMix, failures: u32) -> Health {
        let jitter = rng.below(self.cooldown_ms / 5 + 1);
        Health {
            state: HealthState::Open,
            failures,
            until_ms: now_ms + self.cooldown_ms + jitter,
        }
    }

    /// A call's result: failures in a row open the breaker (a failed probe
    /// at once); a success closes it.
    fn record(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        ok: bool,
        i: usize,
        report: &mut Report,
    ) {
        let h = self.health;
        let next = if ok {
            Health::default()
        } else {
            let failures = h.failures.saturating_add(1);
            if h.state == HealthState::HalfOpen
                || (h.state == HealthState::Closed && failures >= self.failures)
            {
                self.opened(now_ms, rng, failures)
            } else {
                Health { failures, ..h }
            }
        };
        if next != h {
            self.write(store, next, i, report);
        }
    }
}
