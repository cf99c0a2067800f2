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
//!
//! Where each part lives: this file holds the coordinator's state and
//! its tick, which runs the parts in turn; `demand.rs` what workers note
//! and report, and the leader takes in; `lease.rs` who leads; `plan.rs`
//! the leader's choice of the calls to make; `fill.rs` the keys' pools in
//! shared data and the calls' answers put into them; `health.rs` the
//! breaker on each service and the mode it sets for each rule.

pub mod codec;
pub mod config;
mod demand;
mod fill;
mod health;
mod lease;
mod plan;
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
use crate::pipeline::telemetry::MetricId;
use crate::rng::SplitMix;
use crate::store::Store;
use codec::{HealthState, Want};
use config::GlobalSpec;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

pub const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";
pub const METHOD: &str = "ShouldRateLimit";
/// How long a leader's lease lasts without renewal (renewed every tick).
pub const LEASE_MS: u64 = 1_000;
/// Most keys a VM notes between two reports (more wait for the next).
pub const MAX_LOCAL_KEYS: usize = 10_000;
/// Most keys the leader tracks.
pub const MAX_KEYS: usize = 50_000;
/// Most calls the leader starts per tick (the rest wait for the next).
pub const MAX_CALLS_PER_TICK: usize = 128;
/// The lease, leader and breaker work runs at most this often (ms): on
/// the slow tick, not on the fast ticks a starved key asks for.
const SLOW_WORK_MS: u64 = 90;
/// A starved key's demand is reported at most this often (ms).
const FAST_REPORT_MS: u64 = 10;
/// How soon a request refused for want of tokens (the key's pool is being
/// filled; not over its limit) is told to come back.
pub const STARVED_WAIT_NS: u64 = 1_000_000_000;

pub use crate::pipeline::stage::Call;
pub use fill::window_end;
pub use health::Service;

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

/// Whether a VM's global rules may lead: take the lease and call the
/// service. Every VM of the wasm build may; a host that can call out from
/// only some of its pipelines (the native build, from Envoy's main thread)
/// builds the others as followers, which report demand and follow the
/// breakers but never lead, nor say their configuration is the newest.
/// A pipeline built again after a crash of the one that could lead may
/// lead, but says nothing either: a newer configuration may have started
/// since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Leading {
    #[default]
    Allowed,
    Never,
    Rebuilt,
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    Ok,
    OverLimit,
    Error,
}

/// A global rule's id: its index among its coordinator's rules, which is
/// also the one-byte rule index its demand is reported with (see
/// [`codec::Want`]). Only the coordinator gives them out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleId(u8);

impl RuleId {
    /// Every id, in order: the first rule's, the second's, and so on.
    fn all() -> impl Iterator<Item = RuleId> {
        (0..=u8::MAX).map(RuleId)
    }
}

/// Tokens granted by the service, and dropped unspent.
#[derive(Debug, Clone, Copy)]
pub struct TokenMetrics {
    pub granted: MetricId,
    pub dropped: MetricId,
}

/// Metric ids of one global rule (labels `domain`, `rule`), declared by
/// the rate-limit stage.
#[derive(Debug, Clone, Copy)]
pub struct GlobalMetrics {
    pub mode: MetricId,
    /// Requests refused for want of tokens (the key's pool being filled).
    pub starved: MetricId,
    /// Calls: ok, over_limit, error.
    pub calls: [MetricId; 3],
    pub tokens: TokenMetrics,
}

/// A global rule: what it is, how this VM serves it now, and its metrics.
#[derive(Debug, Clone)]
pub struct GlobalRule {
    /// The rule's index in the configuration (the limiter's).
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
    /// How it is served now (set from its service's breaker, see
    /// `follow_health`).
    pub mode: Mode,
    pub metrics: GlobalMetrics,
}

/// What happened during a call into the coordinator, for metrics and the
/// limiter.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub calls: Vec<Call>,
    /// (global rule, tokens) granted by the service.
    pub granted: Vec<(RuleId, u64)>,
    /// (global rule, tokens) paid for and dropped unspent: their window
    /// ended, or another key took the slot.
    pub dropped: Vec<(RuleId, u64)>,
    /// (global rule, result) of finished calls.
    pub results: Vec<(RuleId, CallResult)>,
    /// Whether this VM became (true) or stopped being (false) the leader.
    pub leader: Option<bool>,
    /// Rules whose mode changed.
    pub modes: Vec<(RuleId, Mode)>,
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

/// The global rules of one configuration, in one VM.
pub struct Coordinator {
    /// Its rules, each at the index its id names.
    rules: Vec<GlobalRule>,
    pub services: Vec<Service>,
    me: u64,
    /// The version of this VM's configuration (`Config::version`).
    config: u64,
    leading: Leading,
    leader: bool,
    lease_key: String,
    /// The version of the newest configuration started with these rules.
    newest_key: String,
    want_key: String,
    /// The name of the shared queue the leader listens on (see `hurry`).
    pub queue: String,
    /// Demand noted by this VM since its last report, by (rule, key hash).
    local: FastMap<(RuleId, u64), Want>,
    keys: FastMap<(RuleId, u64), Key>,
    /// Calls out: (rule, key hash, hits, when it started).
    calls: FastMap<u64, (RuleId, u64, u32, u64)>,
    next_call: u64,
    last_tick_ms: u64,
    /// When the lease, leader and breaker work last ran.
    last_slow_ms: u64,
    /// When this VM last reported its demand.
    last_report_ms: u64,
    /// The leader's keys by (rule, pool tag): when each last had demand.
    owners: FastMap<(RuleId, u32), u64>,
    /// Starved keys were noted since the last report.
    cold: bool,
    /// Keys forgotten while their pool still held live tokens, by when
    /// its window ends (the soonest first): what is left unspent then is
    /// counted as dropped ([`Coordinator::settle_ended`]). At most
    /// [`MAX_KEYS`].
    ending: BinaryHeap<Reverse<(u64, RuleId, u64)>>,
    /// Keys evicted from a full table, to be forgotten on the next tick
    /// (with the store at hand).
    evicted: Vec<(RuleId, u64)>,
}

/// Keys by the time given with each, the oldest first (one sort for both
/// the tick's calls and the evictions: each sort's code is kilobytes).
fn oldest_first(v: &mut [((RuleId, u64), u64)]) {
    v.sort_unstable_by_key(|&(_, t)| t);
}

impl Coordinator {
    /// `me`: a random id of this VM; `config`: its configuration's version;
    /// `leading`: whether it may lead. Rules past the last id (256; the
    /// limiter refuses more than `MAX_GLOBAL_RULES`) are dropped.
    pub fn new(
        config_domain: &str,
        mut rules: Vec<GlobalRule>,
        services: Vec<Service>,
        (me, config, leading): (u64, u64, Leading),
    ) -> Self {
        rules.truncate(usize::from(u8::MAX) + 1);
        let mut id = StateId::new((0x676c_6f62_616c, 0x006c_6561_7365), config_domain);
        for r in &rules {
            id = id.text(&r.pool_prefix);
        }
        let id = id.finish();
        Coordinator {
            rules,
            services,
            me,
            config,
            leading,
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
            ending: BinaryHeap::new(),
            evicted: Vec::new(),
        }
    }

    /// Whether this VM is the leader.
    pub fn is_leader(&self) -> bool {
        self.leader
    }

    /// Global rule `id` (every id this coordinator gave out names one).
    pub fn rule(&self, id: RuleId) -> Option<&GlobalRule> {
        self.rules.get(usize::from(id.0))
    }

    /// Its rules, with their ids.
    pub fn rules(&self) -> impl Iterator<Item = (RuleId, &GlobalRule)> {
        RuleId::all().zip(&self.rules)
    }

    /// The current mode of global rule `id`.
    pub fn mode(&self, id: RuleId) -> Mode {
        self.rule(id).map_or(Mode::Service, |r| r.mode)
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
        self.leader = self.leading != Leading::Never && self.hold_lease(store, now_ms);
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

    /// The configuration is going away.
    pub fn close(&mut self, store: &dyn Store, now_ms: u64) {
        self.resign(store, now_ms);
    }
}
