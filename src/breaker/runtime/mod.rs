//! Breakers in one VM: a per-VM cache of each key's shared state, refreshed
//! at most every `SYNC_MS`, and compare-and-swap updates of the shared state.
//!
//! Cost per request is kept low on purpose: while closed, a request costs no
//! shared-data call at all except one read per `SYNC_MS` per key; successes
//! are counted locally and merged at most every `SYNC_MS` (or on the next
//! failure, or on a tick); a failure is merged at once, so a trip happens on
//! the failure that crosses the threshold. Every worker therefore sees a
//! trip within `SYNC_MS` (20 ms) of it.
//!
//! By role: this file holds the types (the breakers, their tickets and
//! verdicts, the per-key cache entry) and their building; `check.rs` the
//! verdict on a request; `probe.rs` the claim of a probe across the VMs;
//! `shared.rs` the cache of each key's shared state and its reads and
//! compare-and-swap writes; `outcomes.rs` the outcomes reported, merged
//! into the shared state, and the transitions they cause.

mod check;
mod outcomes;
mod probe;
mod shared;

pub use super::config::CallOutcome;
use super::{BreakerKey, BreakerSpec, State, Transition};
use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::hash::FastMap;
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ticket {
    pub breaker: usize,
    pub key: u64,
    pub probe: bool,
    /// The probe episode the claim belongs to.
    pub epoch: u32,
}

/// A request's tickets: the first inline (no allocation per request).
pub type Tickets = crate::small::Small<Ticket, 1>;

/// The breakers' verdict on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Go on; report each ticket's outcome later.
    Pass(Tickets),
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

/// A transition, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub breaker: usize,
    /// The breaker key (see `Breakers::key_name` for its value).
    pub key: u64,
    pub transition: Transition,
}

struct Cached {
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
    local: FastMap<(usize, u64), Cached>,
    tracked: Vec<u32>,
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
        })
    }

    /// The value of a tracked key (the cluster, route or header value it
    /// was seen with), for logs.
    pub fn key_name(&self, breaker: usize, key: u64) -> &str {
        self.local.get(&(breaker, key)).map_or("?", |l| &l.name)
    }

    /// The cached phase of a key (for tests and metrics).
    pub fn cached(&self, breaker: usize, key: u64) -> Option<State> {
        self.local.get(&(breaker, key)).map(|l| l.state)
    }
}
