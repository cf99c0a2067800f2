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
//! Never admitting too much rests on step 3: a rule's charge lands only by a
//! CAS on the slot its decision was based on, which linearises the decision.

pub mod algorithm;
pub mod bucket;
pub mod codec;
pub mod config;
pub mod global;
pub mod reply;
pub mod shaping;
pub mod stage;
#[cfg(test)]
mod tests;
pub mod window;

use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::keys::{place, MissingKey, Placement};
use crate::request::RequestView;
use crate::store::{Store, StoreError};
use algorithm::Algorithm;
use bucket::Outcome;
use codec::Slot;
use config::RuleSpec;

/// What happened to one matching rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleResult {
    /// Admitted and charged (or would have been, had another rule refused).
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
pub enum Verdict {
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
    pub verdict: Verdict,
    pub reports: Vec<RuleReport>,
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
    key: String,
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
    /// A global rule's two tables: its pools, and its local backstop.
    pub global: Option<GlobalTables>,
}

/// The tables of a global rule; `Rule::prefix` and `Rule::spec.algorithm`
/// are those of the one in use.
#[derive(Debug, Clone)]
pub struct GlobalTables {
    pub pool_prefix: String,
    pub pool: Algorithm,
    pub backstop_prefix: String,
    pub backstop: Algorithm,
}

/// The limiter for one configuration.
#[derive(Debug, Clone)]
pub struct Limiter {
    pub rules: Vec<Rule>,
    pub seed: (u64, u64),
    pub max_retries: u32,
    pub failure_mode_deny: bool,
}

/// One slot as read: its key, CAS token, and decoded (or recovered) state.
struct Read {
    key: String,
    cas: Option<u32>,
    slot: Slot,
    corrupt: bool,
    /// From the store's memory of this VM's last write (see
    /// `Store::get_for_update`): good for a CAS write, maybe out of date.
    remembered: bool,
}

struct Pending {
    ask: Ask,
    reads: Vec<Read>,
    decision: usize,
    outcome: Outcome,
    report: RuleReport,
    committed: Option<(Slot, Slot)>, // (before, after) of the decision slot
}

enum Commit {
    Done,
    Conflict,
    /// The decision slot's remembered value was out of date.
    Stale,
    Failed,
}

/// Most global rules in one configuration (their demand is reported with
/// a one-byte rule index).
pub const MAX_GLOBAL_RULES: usize = 255;

/// A stable 32-bit identifier of a rule's table: a changed rule gets a
/// fresh table; an unchanged one keeps its state across reconfiguration.
/// Short on purpose: slot keys such as `sl1f2e3d4c/12345` fit Envoy's
/// short-string buffer, which halves the memory of a slot.
fn table_id(domain: &str, spec: &RuleSpec) -> u32 {
    let mut id = StateId::new((0x736c_7569_6365, 0x7275_6c65), domain).text(&spec.name);
    id = match spec.algorithm {
        // As before windows existed: a bucket keeps its table on upgrade.
        Algorithm::Bucket(b) => id.num(b.rate).num(b.period_ns).num(b.burst),
        Algorithm::Window(w) => id.text("sliding_window").num(w.limit).num(w.window_ns),
        Algorithm::Pool(p) => {
            let g = spec.global.as_deref().map(|g| &g.service);
            let mut id = id
                .text("global")
                .num(p.quota)
                .num(p.window_ns)
                .text(g.map_or("", |g| g.cluster.as_str()))
                .text(g.and_then(|g| g.domain.as_deref()).unwrap_or(domain));
            // Tokens were paid for under these descriptor names.
            for k in g.map_or(&[][..], |g| g.descriptor_keys.as_slice()) {
                id = id.text(k);
            }
            id
        }
    };
    for part in &spec.key {
        id = id.text(part.encode());
    }
    let missing = match spec.on_missing_key {
        MissingKey::Skip => 0,
        MissingKey::Shared => 1,
    };
    id.num(missing).num(u64::from(spec.max_keys)).finish()
}

impl Limiter {
    /// Prepares a limiter; `seed` must be the same in every VM. Fails only
    /// if two rules' table ids collide (about one chance in four billion
    /// per pair), naming the rule to rename.
    pub fn new(specs: &[RuleSpec], common: &Common, seed: (u64, u64)) -> Result<Self, ConfigError> {
        let mut rules: Vec<Rule> = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            let prefix = format!("sl{:08x}/", table_id(&common.domain, spec));
            let earlier = rules
                .iter()
                .map(|r| (r.prefix.as_str(), r.spec.name.as_str()));
            check_state_id("rate_limits", i, &prefix, earlier)?;
            let globals = rules.iter().filter(|r| r.global.is_some()).count();
            if spec.global.is_some() && globals >= MAX_GLOBAL_RULES {
                return Err(crate::config::fields::err(
                    format!("rate_limits[{i}].global"),
                    format!("at most {MAX_GLOBAL_RULES} global rules in one configuration"),
                ));
            }
            let global = spec.global.as_deref().map(|g| {
                let mut backstop = spec.clone();
                backstop.algorithm = g.backstop;
                backstop.name.push_str("/backstop");
                GlobalTables {
                    pool_prefix: prefix.clone(),
                    pool: spec.algorithm,
                    backstop_prefix: format!("sl{:08x}/", table_id(&common.domain, &backstop)),
                    backstop: g.backstop,
                }
            });
            rules.push(Rule {
                prefix,
                spec: spec.clone(),
                global,
            });
        }
        Ok(Limiter {
            rules,
            seed,
            max_retries: common.max_cas_retries,
            failure_mode_deny: common.failure_mode_deny,
        })
    }

    /// The shared-data key of a rule's slot.
    pub fn slot_key(&self, rule: usize, slot: u32) -> String {
        let prefix = self.rules.get(rule).map_or("", |r| r.prefix.as_str());
        crate::keys::slot_key(prefix, slot)
    }

    /// How many slots the rule's table really uses (1 for constant keys).
    pub fn table_len(&self, rule: usize) -> u32 {
        let Some(Rule { spec, .. }) = self.rules.get(rule) else {
            return 1;
        };
        if crate::keys::has_variable_parts(&spec.key) {
            spec.max_keys
        } else {
            1
        }
    }

    /// Creates every missing slot as a full bucket. Run at configuration in
    /// every VM; Envoy configures the main thread's VM before any worker
    /// serves a request, so workers only ever find slots already present.
    /// Returns how many slots this call created.
    pub fn create_tables(&self, store: &dyn Store) -> Result<u32, StoreError> {
        let mut created = 0;
        for (i, rule) in self.rules.iter().enumerate() {
            let len = self.table_len(i);
            created += Self::create_table(store, &rule.prefix, len)?;
            if let Some(g) = &rule.global {
                for prefix in [&g.pool_prefix, &g.backstop_prefix] {
                    if *prefix != rule.prefix {
                        created += Self::create_table(store, prefix, len)?;
                    }
                }
            }
        }
        Ok(created)
    }

    /// Serves global rule `rule` from its backstop (`true`) or from its
    /// pools (`false`).
    pub fn use_backstop(&mut self, rule: usize, on: bool) {
        let Some(r) = self.rules.get_mut(rule) else {
            return;
        };
        let Some(g) = &r.global else { return };
        let (prefix, algorithm) = if on {
            (&g.backstop_prefix, g.backstop)
        } else {
            (&g.pool_prefix, g.pool)
        };
        r.prefix.clone_from(prefix);
        r.spec.algorithm = algorithm;
    }

    /// Creates one rule's missing slots, unless its table is marked
    /// complete: then one read is all a configuration costs, whatever
    /// `max_keys` (every VM configures on every update, and a table of a
    /// million slots took seconds to check).
    fn create_table(store: &dyn Store, prefix: &str, len: u32) -> Result<u32, StoreError> {
        let marker_key = format!("{prefix}complete");
        let marker = codec::table_marker(len);
        if let Some(found) = store.get(&marker_key)? {
            if found.bytes == marker {
                return Ok(0);
            }
        }
        let empty = Slot {
            fingerprint: 0,
            tat: 0,
        }
        .encode();
        let mut created = 0;
        for slot in 0..len {
            let key = crate::keys::slot_key(prefix, slot);
            if store.get(&key)?.is_none() {
                store.set(&key, &empty, None)?;
                created += 1;
            }
        }
        store.set(&marker_key, &marker, None)?;
        Ok(created)
    }

    /// The request's cost for a rule: the header value if it is a positive
    /// decimal number (clamped to the maximum), else the default.
    fn cost(spec: &RuleSpec, req: &dyn RequestView) -> u64 {
        let Some(name) = &spec.cost.header else {
            return spec.cost.default;
        };
        // A decimal integer of up to 20 digits; one past u64 saturates and
        // is clamped like any other large cost.
        let parsed = req.header(name).and_then(|v| {
            let s = std::str::from_utf8(&v).ok()?.trim();
            (!s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u64>().unwrap_or(u64::MAX))
        });
        match parsed {
            Some(0) | None => spec.cost.default,
            Some(n) => n.min(spec.cost.max),
        }
    }

    /// Evaluates the request against every rule and commits its charges.
    pub fn evaluate(&self, store: &dyn Store, now_ns: u64, req: &dyn RequestView) -> Evaluation {
        self.evaluate_shaped(store, now_ns, req, &|_| 0)
    }

    /// As `evaluate`; a shaping rule (`on_limit: delay`) may hold the
    /// request up to the smaller of its `max_delay` and `cap(rule)` (what
    /// is left of the request's deadline, or 0 when this worker holds as
    /// many requests as the rule allows).
    pub fn evaluate_shaped(
        &self,
        store: &dyn Store,
        now_ns: u64,
        req: &dyn RequestView,
        cap: &dyn Fn(usize) -> u64,
    ) -> Evaluation {
        let mut pending = Vec::new();
        let mut reports = Vec::new();
        let mut global_keys = Vec::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let spec = &rule.spec;
            if !spec.matcher.matches(req) {
                continue;
            }
            let Some(placement) = place(
                &spec.key,
                spec.on_missing_key,
                self.seed,
                self.table_len(i),
                req,
            ) else {
                continue;
            };
            if rule.global.is_some() {
                global_keys.push((i, placement.fingerprint));
            }
            let cost = Self::cost(spec, req);
            let slack_ns = match spec.shaping {
                Some(sh) => sh.max_delay_ns.min(cap(i)),
                _ => 0,
            };
            let ask = Ask {
                rule: i,
                placement,
                cost,
                slack_ns,
            };
            match self.read(store, ask, now_ns, false) {
                Some(p) => pending.push(p),
                None => reports.push(self.failure_report(i, cost, 0)),
            }
        }
        let mut eval = self.settle(store, now_ns, pending, reports);
        eval.global_keys = global_keys;
        eval
    }

    fn failure_report(&self, rule: usize, cost: u64, cas_retries: u32) -> RuleReport {
        RuleReport {
            rule,
            result: RuleResult::StoreFailure,
            cost,
            remaining: 0,
            full_in_ns: 0,
            wait_ns: 0,
            delay_ns: 0,
            cas_retries,
            corrupt: false,
            collision: false,
        }
    }

    fn read(&self, store: &dyn Store, ask: Ask, now_ns: u64, fresh: bool) -> Option<Pending> {
        let Ask {
            rule,
            placement,
            cost,
            slack_ns,
        } = ask;
        let spec = &self.rules.get(rule)?.spec;
        let algorithm = &spec.algorithm;
        let pool = matches!(algorithm, Algorithm::Pool(_));
        let tag = Self::tag(algorithm, &placement);
        let pool_tag = pool.then_some(tag);
        let reads = self.read_slots(store, rule, &placement, pool_tag, now_ns, fresh)?;
        let decision = if pool {
            // A pool is one key's, in whichever of its slots it holds (the
            // reads stop there).
            reads
                .iter()
                .position(|r| r.slot.fingerprint == tag)
                .unwrap_or(0)
        } else {
            // The emptiest of the key's slots (count-min).
            reads
                .iter()
                .enumerate()
                .min_by_key(|(_, r)| algorithm.level(r.slot.tat, now_ns))
                .map_or(0, |(i, _)| i)
        };
        let state = reads.get(decision)?.slot;
        // Another key's pool is not ours.
        let tat = if pool && state.fingerprint != tag {
            0
        } else {
            state.tat
        };
        let outcome = algorithm.decide(tat, now_ns, cost, slack_ns);
        if !outcome.allowed() && reads.iter().any(|r| r.remembered) {
            // No write will check a remembered value behind a refusal.
            return self.read(store, ask, now_ns, true);
        }
        let collision =
            state.fingerprint != 0 && state.fingerprint != tag && algorithm.busy(state.tat, now_ns);
        let report = Self::report(rule, spec.shadow, cost, &outcome, &reads, collision);
        Some(Pending {
            ask,
            reads,
            decision,
            outcome,
            report,
            committed: None,
        })
    }

    /// Reads a key's slots, in order; with `pool_tag`, stops at the slot
    /// holding the key's pool (a pool found in the first slot, where the
    /// leader puts it when it can, needs no second read).
    fn read_slots(
        &self,
        store: &dyn Store,
        rule: usize,
        placement: &Placement,
        pool_tag: Option<u32>,
        now_ns: u64,
        fresh: bool,
    ) -> Option<Vec<Read>> {
        let mut reads = Vec::with_capacity(placement.count);
        for &slot in placement.slots() {
            let read = self.read_slot(store, rule, slot, now_ns, fresh)?;
            let found = pool_tag == Some(read.slot.fingerprint);
            reads.push(read);
            if found {
                break;
            }
        }
        Some(reads)
    }

    /// Reads one slot; a corrupt slot is rebuilt under the failure policy:
    /// a full bucket when failing open, an empty one when failing closed.
    fn read_slot(
        &self,
        store: &dyn Store,
        rule: usize,
        slot: u32,
        now_ns: u64,
        fresh: bool,
    ) -> Option<Read> {
        let spec = &self.rules.get(rule)?.spec;
        let key = self.slot_key(rule, slot);
        let entry = if fresh {
            store.get(&key)
        } else {
            store.get_for_update(&key)
        };
        let (cas, decoded, remembered) = match entry.ok()? {
            Some(e) => (e.cas, Slot::decode(&e.bytes).ok(), e.remembered),
            None => (
                None,
                Some(Slot {
                    fingerprint: 0,
                    tat: 0,
                }),
                false,
            ),
        };
        let corrupt = decoded.is_none();
        let slot = decoded.unwrap_or(Slot {
            fingerprint: 0,
            tat: if self.failure_mode_deny {
                spec.algorithm.exhausted(now_ns)
            } else {
                0
            },
        });
        Some(Read {
            key,
            cas,
            slot,
            corrupt,
            remembered,
        })
    }

    /// The report of a rule decided on `reads`.
    fn report(
        rule: usize,
        shadow: bool,
        cost: u64,
        outcome: &Outcome,
        reads: &[Read],
        collision: bool,
    ) -> RuleReport {
        let (result, wait_ns) = match *outcome {
            Outcome::Allow { delay_ns, .. } if delay_ns > 0 => (RuleResult::Delayed, 0),
            Outcome::Allow { .. } => (RuleResult::Allowed, 0),
            Outcome::Deny { wait_ns, .. } if shadow => (RuleResult::ShadowLimited, wait_ns),
            Outcome::Deny { wait_ns, .. } => (RuleResult::Limited, wait_ns),
        };
        RuleReport {
            rule,
            result,
            cost,
            remaining: outcome.remaining(),
            full_in_ns: outcome.full_in_ns(),
            wait_ns,
            delay_ns: match *outcome {
                Outcome::Allow { delay_ns, .. } => delay_ns,
                Outcome::Deny { .. } => 0,
            },
            cas_retries: 0,
            corrupt: reads.iter().any(|r| r.corrupt),
            collision,
        }
    }

    /// The rule whose store failure refuses the request, when failing
    /// closed (shadow rules never refuse).
    fn fail_closed(&self, reports: &[RuleReport]) -> Option<usize> {
        if !self.failure_mode_deny {
            return None;
        }
        let enforcing = |r: &&RuleReport| {
            r.result == RuleResult::StoreFailure
                && self.rules.get(r.rule).is_some_and(|rule| !rule.spec.shadow)
        };
        reports.iter().find(enforcing)?;
        // As before: the first store failure names the rule.
        reports
            .iter()
            .find(|r| r.result == RuleResult::StoreFailure)
            .map(|r| r.rule)
    }

    fn settle(
        &self,
        store: &dyn Store,
        now_ns: u64,
        mut pending: Vec<Pending>,
        mut reports: Vec<RuleReport>,
    ) -> Evaluation {
        let mut i = 0;
        loop {
            if let Some(deny) = Self::refusal(&pending) {
                return self.refuse(store, pending, reports, deny);
            }
            if let Some(rule) = self.fail_closed(&reports) {
                return self.refuse(store, pending, reports, Verdict::Deny { rule, wait_ns: 0 });
            }
            let Some(p) = pending.get_mut(i) else { break };
            if !p.outcome.allowed() {
                i += 1; // a shadow rule that would refuse is not charged
                continue;
            }
            let retry = match self.commit(store, p) {
                Commit::Done => {
                    i += 1;
                    continue;
                }
                // A remembered value out of date is not a conflict with a
                // concurrent request: read it and decide again, uncounted.
                Commit::Stale => Some(p.report.cas_retries),
                Commit::Conflict if p.report.cas_retries < self.max_retries => {
                    Some(p.report.cas_retries + 1)
                }
                Commit::Conflict | Commit::Failed => None,
            };
            let retries = retry.unwrap_or(p.report.cas_retries);
            let fresh = retry.and_then(|_| self.read(store, p.ask, now_ns, true));
            match fresh {
                Some(mut fresh) => {
                    fresh.report.cas_retries = retries;
                    *p = fresh;
                }
                None => {
                    let r = self.failure_report(p.ask.rule, p.ask.cost, retries);
                    reports.push(r);
                    pending.remove(i);
                }
            }
        }
        Self::admitted(&pending, reports)
    }

    /// The evaluation of a request every enforcing rule admitted; held for
    /// the latest turn a shaping rule reserved, if any.
    fn admitted(pending: &[Pending], mut reports: Vec<RuleReport>) -> Evaluation {
        let delay_ns = pending.iter().map(|p| p.report.delay_ns).max().unwrap_or(0);
        let reservations = if delay_ns > 0 {
            pending.iter().filter_map(Self::reservation).collect()
        } else {
            Vec::new()
        };
        reports.extend(pending.iter().map(|p| p.report));
        crate::sort::small_by_key(&mut reports, |r| r.rule);
        Evaluation {
            verdict: Verdict::Allow,
            reports,
            delay_ns,
            reservations,
            global_keys: Vec::new(),
        }
    }

    /// A committed charge that may be given back (single-slot rules only,
    /// as for refunds).
    fn reservation(p: &Pending) -> Option<Reservation> {
        let (before, after) = p.committed?;
        let read = p.reads.get(p.decision)?;
        (p.ask.placement.count == 1).then(|| Reservation {
            key: read.key.clone(),
            before,
            after,
        })
    }

    /// A held request left before its turn: each charge it made is undone
    /// where nothing was charged after it; a turn someone reserved later
    /// stays where it is (two requests never share a turn), so the freed
    /// turn goes unused rather than anyone going early.
    pub fn give_back(&self, store: &dyn Store, reservations: &[Reservation]) {
        for r in reservations {
            Self::restore(store, &r.key, r.before, r.after);
        }
    }

    /// The refusal with the longest wait among enforcing rules, if any.
    fn refusal(pending: &[Pending]) -> Option<Verdict> {
        pending
            .iter()
            .filter(|p| p.report.result == RuleResult::Limited)
            .max_by_key(|p| p.report.wait_ns)
            .map(|p| Verdict::Deny {
                rule: p.ask.rule,
                wait_ns: p.report.wait_ns,
            })
    }

    fn refuse(
        &self,
        store: &dyn Store,
        pending: Vec<Pending>,
        mut reports: Vec<RuleReport>,
        verdict: Verdict,
    ) -> Evaluation {
        for p in &pending {
            if let Some((before, after)) = p.committed {
                self.refund(store, p, before, after);
            }
        }
        reports.extend(pending.iter().map(|p| p.report));
        crate::sort::small_by_key(&mut reports, |r| r.rule);
        Evaluation {
            verdict,
            reports,
            delay_ns: 0,
            reservations: Vec::new(),
            global_keys: Vec::new(),
        }
    }

    /// Undoes a committed charge of a request that ends up refused, where
    /// that is safe: only for a single-slot rule whose slot nobody wrote
    /// since (a CAS still pending elsewhere then fails and re-reads). A
    /// two-slot rule's slot is never restored: another key may have left it
    /// as it was because our charge already covered its own (conservative
    /// update), and lowering it would let that key escape its limit. An
    /// unrefunded charge can only refuse more, never admit more.
    fn refund(&self, store: &dyn Store, p: &Pending, before: Slot, after: Slot) {
        let pool = self
            .rules
            .get(p.ask.rule)
            .is_some_and(|r| matches!(r.spec.algorithm, Algorithm::Pool(_)));
        // A pool's slot is only ever its key's: its refund is always safe.
        if p.ask.placement.count != 1 && !pool {
            return;
        }
        let Some(Read { key, .. }) = p.reads.get(p.decision) else {
            return;
        };
        Self::restore(store, key, before, after);
    }

    /// Puts `before` back into a slot still holding `after`.
    fn restore(store: &dyn Store, key: &str, before: Slot, after: Slot) {
        let Ok(Some(entry)) = store.get(key) else {
            return;
        };
        if Slot::decode(&entry.bytes) == Ok(after) {
            let _ = store.set(key, &before.encode(), entry.cas);
        }
    }

    /// The tag written with a key's state: a pool's comes from other bits
    /// of the hash than its first slot.
    fn tag(algorithm: &Algorithm, placement: &Placement) -> u32 {
        match algorithm {
            Algorithm::Pool(_) => placement.pool_tag(),
            _ => placement.tag(),
        }
    }

    fn commit(&self, store: &dyn Store, p: &mut Pending) -> Commit {
        let Outcome::Allow { new_tat, .. } = p.outcome else {
            return Commit::Done;
        };
        let Some(rule) = self.rules.get(p.ask.rule) else {
            return Commit::Failed;
        };
        let algorithm = &rule.spec.algorithm;
        let fingerprint = Self::tag(algorithm, &p.ask.placement);
        // A pool is spent in its one slot; the other is another key's.
        let pool = matches!(algorithm, Algorithm::Pool(_));
        for (j, read) in p.reads.iter().enumerate() {
            let covered = algorithm.merge(read.slot.tat, new_tat) == read.slot.tat;
            if pool || j == p.decision || (covered && !read.corrupt) {
                continue;
            }
            let new = Slot {
                fingerprint,
                tat: new_tat,
            };
            if !self.raise(store, read, new, algorithm, &mut p.report.cas_retries) {
                return Commit::Failed;
            }
        }
        let Some(read) = p.reads.get(p.decision) else {
            return Commit::Failed;
        };
        let after = Slot {
            fingerprint,
            tat: new_tat,
        };
        match store.set(&read.key, &after.encode(), read.cas) {
            Ok(()) => {
                p.committed = Some((read.slot, after));
                Commit::Done
            }
            Err(StoreError::CasMismatch) if read.remembered => Commit::Stale,
            Err(StoreError::CasMismatch) => Commit::Conflict,
            Err(StoreError::Unavailable) => Commit::Failed,
        }
    }

    /// Raises a slot's TAT to at least `tat`, retrying conflicts. (Slots of
    /// two-slot tables only ever rise, so a remembered TAT at least `tat`,
    /// which skipped this call, is a true lower bound too.)
    fn raise(
        &self,
        store: &dyn Store,
        read: &Read,
        new: Slot,
        algorithm: &Algorithm,
        retries: &mut u32,
    ) -> bool {
        let key = read.key.as_str();
        let mut cas = read.cas;
        let mut remembered = read.remembered;
        // The merge of what is there and the new state (for a bucket, the
        // later TAT); a corrupt slot is simply overwritten.
        let merged = |old: Option<Slot>| Slot {
            fingerprint: new.fingerprint,
            tat: old.map_or(new.tat, |o| algorithm.merge(o.tat, new.tat)),
        };
        let mut target = merged((!read.corrupt).then_some(read.slot));
        loop {
            match store.set(key, &target.encode(), cas) {
                Ok(()) => return true,
                Err(StoreError::Unavailable) => return false,
                Err(StoreError::CasMismatch) => {}
            }
            if !std::mem::take(&mut remembered) {
                *retries += 1;
                if *retries > self.max_retries {
                    return false;
                }
            }
            match store.get(key) {
                Ok(Some(e)) => match Slot::decode(&e.bytes) {
                    Ok(s) if algorithm.merge(s.tat, new.tat) == s.tat => return true,
                    s => {
                        target = merged(s.ok());
                        cas = e.cas;
                    }
                },
                Ok(None) => {
                    target = merged(None);
                    cas = None;
                }
                Err(_) => return false,
            }
        }
    }
}
