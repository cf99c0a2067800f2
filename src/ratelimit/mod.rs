//! The rate limiter: evaluates every matching rule against its slots in the
//! store and commits the charges only if every enforcing rule admits the
//! request.
//!
//! Protocol per request (see docs/design.md):
//! 1. Read each matching rule's one or two slots (value + CAS token). A
//!    rule's state is the *lower* TAT of its slots (count-min sketch); the
//!    slot holding it is the rule's *decision slot*. A read may come from
//!    the store's memory of this VM's own last write (`get_for_update`):
//!    the CAS of step 3 then checks it; a refusal, which writes nothing,
//!    is decided again on a fresh read; and a remembered value that proves
//!    out of date is read again without counting as a conflict.
//! 2. If any enforcing rule refuses, answer with a refusal and write nothing:
//!    a refused request spends no token anywhere.
//! 3. Otherwise commit rule by rule: first raise the other slot to at least
//!    the new TAT (a monotone max-merge, retried on conflict without
//!    re-deciding, since raising it cannot change the decision), then write
//!    the decision slot with CAS. A conflict there means the state moved:
//!    re-read and re-decide that rule. If it now refuses, earlier rules'
//!    charges are refunded where untouched since, and the request is refused.
//! 4. Retries are bounded; past the bound the failure policy decides.
//!
//! A configuration of one local rule (not a pool, not shaping) whose key
//! has one slot takes the same steps without the transaction's lists: one
//! read, one CAS write (`Limiter::lone`); anything but an admission at the
//! first write goes on as the transaction's first read.
//!
//! Never admitting too much rests on step 3: a rule's charge lands only by a
//! CAS on the slot its decision was based on, which linearises the decision.
//!
//! Where each part lives: this file holds the limiter's types and the
//! state of one transaction; `tables.rs` the slot tables (their keys,
//! their creation, and the tag written with a key's state);
//! `evaluate.rs` step 1, reading and deciding each matching rule;
//! `commit.rs` steps 2 to 4, committing the charges or refusing, and
//! giving charges back.

pub mod algorithm;
pub mod bucket;
pub mod codec;
mod commit;
pub mod config;
mod evaluate;
pub mod global;
pub mod reply;
pub mod shaping;
pub mod stage;
mod tables;
#[cfg(test)]
mod tests;
pub mod window;

use crate::keys::Placement;
use crate::small::Small;
use crate::store::SlotKey;
use algorithm::Algorithm;
use bucket::BucketAnswer;
use codec::Slot;
use config::RuleSpec;

/// What happened to one matching rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RuleResult {
    /// Admitted and charged (or would have been, had another rule refused).
    /// (The default only fills unused places of a list.)
    #[default]
    Allowed,
    /// Refused the request.
    Limited,
    /// Would have refused, but the rule is in shadow mode.
    ShadowLimited,
    /// The store failed past the retry bound; the failure policy applied.
    StoreFailure,
    /// Admitted with its turn reserved: held `delay_ns` first (shaping).
    Delayed,
}

/// The per-rule details of one evaluation, for headers and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuleReport {
    pub rule: usize,
    pub result: RuleResult,
    pub cost: u64,
    pub remaining: u64,
    pub full_in_ns: u64,
    pub wait_ns: u64,
    /// Shaping: how long the request must be held for its turn.
    pub delay_ns: u64,
    pub cas_retries: u32,
    pub corrupt: bool,
    pub collision: bool,
}

/// The decision for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitVerdict {
    Allow,
    /// Refused by `rule`; the same request could pass in `wait_ns`.
    Deny {
        rule: usize,
        wait_ns: u64,
    },
}

/// A verdict and the reports of every matching rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub verdict: LimitVerdict,
    /// Kept inline for the first rules (no heap allocation per request).
    pub reports: Small<RuleReport, 1>,
    /// Admitted, but to be held this long first (the latest turn any
    /// shaping rule reserved); 0 for most requests.
    pub delay_ns: u64,
    /// For a held request: its charges, to give back if it leaves before
    /// its turn (see `Limiter::give_back`).
    pub reservations: Vec<Reservation>,
    /// The global rules that matched, with the key's hash: their demand.
    pub global_keys: Vec<(usize, u64)>,
}

/// A charge a held request made: the slot, its state before and after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    key: SlotKey,
    before: Slot,
    after: Slot,
}

/// What is asked of one rule for one request.
#[derive(Debug, Clone, Copy)]
struct Ask {
    rule: usize,
    placement: Placement,
    cost: u64,
    /// How long the request may wait for its turn (0: refuse instead).
    slack_ns: u64,
}

/// A rule prepared for evaluation: its spec and the shared-data key prefix
/// of its slot table.
#[derive(Debug, Clone)]
pub struct Rule {
    pub spec: RuleSpec,
    pub prefix: String,
    /// The id of the table `prefix` names.
    pub table: u32,
    /// Where its key lives if the key has no variable part (then it is the
    /// same for every request).
    pub fixed: Option<Placement>,
    /// A global rule's two tables: its pools, and its local backstop.
    pub global: Option<GlobalTables>,
}

/// The tables of a global rule; `Rule::prefix` and `Rule::spec.algorithm`
/// are those of the one in use.
#[derive(Debug, Clone)]
pub struct GlobalTables {
    pub pool_prefix: String,
    pub pool_table: u32,
    pub pool: Algorithm,
    pub backstop_prefix: String,
    pub backstop_table: u32,
    pub backstop: Algorithm,
}

/// The limiter for one configuration.
#[derive(Debug, Clone)]
pub struct Limiter {
    pub rules: Vec<Rule>,
    pub seed: (u64, u64),
    pub max_retries: u32,
    pub failure_mode_deny: bool,
    /// One local rule, not a pool, not shaping: a request's one read of a
    /// single-slot key and its one write need no transaction
    /// (`Limiter::lone`).
    pub lone: bool,
}

/// One slot as read: its key, CAS token, and decoded (or recovered) state.
#[derive(Clone, Copy)]
struct SlotRead {
    key: SlotKey,
    cas: Option<u32>,
    slot: Slot,
    corrupt: bool,
    /// From the store's memory of this VM's last write (see
    /// `Store::get_for_update`): good for a CAS write, maybe out of date.
    remembered: bool,
}

/// A rule's reads, in order: one or two slots (as a placement has), kept
/// inline.
#[derive(Clone, Copy, Default)]
struct Reads {
    len: usize,
    items: [Option<SlotRead>; 2],
}

impl Reads {
    /// The one read of a single-slot key.
    fn of(r: SlotRead) -> Self {
        Reads {
            len: 1,
            items: [Some(r), None],
        }
    }

    fn push(&mut self, r: SlotRead) {
        if let Some(item) = self.items.get_mut(self.len) {
            *item = Some(r);
            self.len += 1;
        }
    }

    fn get(&self, i: usize) -> Option<&SlotRead> {
        self.items.get(i)?.as_ref()
    }

    fn iter(&self) -> impl Iterator<Item = &SlotRead> {
        self.items.iter().flatten()
    }
}

#[derive(Clone, Copy)]
struct Pending {
    ask: Ask,
    reads: Reads,
    decision: usize,
    outcome: BucketAnswer,
    report: RuleReport,
    committed: Option<(Slot, Slot)>, // (before, after) of the decision slot
}

/// What `Limiter::lone` did with a request. (Returned once per request:
/// a box for the large variant would be an allocation per request.)
#[allow(clippy::large_enum_variant)]
enum Lone {
    /// Admitted and charged: the rule's report.
    Charged(RuleReport),
    /// Left to the transaction: the rule as read and decided (none if the
    /// store failed).
    Read(Option<Pending>),
    /// The store failed, after these retries.
    Failed(u32),
}

/// The rules being settled, the first ones inline.
type Pendings = Small<Pending, 1>;

/// (Only fills unused places of [`Pendings`].)
impl Default for Pending {
    fn default() -> Self {
        Pending {
            ask: Ask {
                rule: 0,
                placement: crate::keys::placement(0, false, 1),
                cost: 0,
                slack_ns: 0,
            },
            reads: Reads::default(),
            decision: 0,
            outcome: BucketAnswer::Deny {
                wait_ns: 0,
                remaining: 0,
                full_in_ns: 0,
            },
            report: RuleReport::default(),
            committed: None,
        }
    }
}

/// Most global rules in one configuration (their demand is reported with
/// a one-byte rule index).
pub const MAX_GLOBAL_RULES: usize = 255;
