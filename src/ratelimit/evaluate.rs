//! Step 1 of the transaction: for each matching rule, the request's
//! cost, the reads of its key's slots, and the decision on them, with
//! the report of each rule. Its own file because it only reads: every
//! write is in `commit.rs`.

use super::algorithm::Algorithm;
use super::bucket::BucketAnswer;
use super::codec::Slot;
use super::commit::Commit;
use super::config::RuleSpec;
use super::{
    Ask, Evaluation, LimitVerdict, Limiter, Lone, Pending, Pendings, Reads, RuleReport, RuleResult,
    SlotRead,
};
use crate::keys::{place, Placement};
use crate::request::RequestView;
use crate::small::Small;
use crate::store::Store;

impl Limiter {
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
        let mut pending = Pendings::new();
        let mut reports = Small::new();
        let mut global_keys = Vec::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let spec = &rule.spec;
            if !spec.matcher.matches(req) {
                continue;
            }
            let placement = rule.fixed.or_else(|| {
                let len = self.table_len(i);
                place(&spec.key, spec.on_missing_key, self.seed, len, req)
            });
            let Some(placement) = placement else {
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
            let read = if self.lone {
                match self.lone(store, ask, now_ns) {
                    Lone::Charged(report) => return Self::charged(report, global_keys),
                    Lone::Read(p) => p,
                    Lone::Failed(retries) => {
                        reports.push(self.failure_report(i, cost, retries));
                        continue;
                    }
                }
            } else {
                self.read(store, ask, now_ns, false)
            };
            match read {
                Some(p) => pending.push(p),
                None => reports.push(self.failure_report(i, cost, 0)),
            }
        }
        let mut eval = self.settle(store, now_ns, &mut pending, reports);
        eval.global_keys = global_keys;
        eval
    }

    /// The limiter's one rule, when `Limiter::lone` says it may be
    /// decided alone: read, decided and, if admitted, charged by one CAS
    /// write, without the transaction's lists. A refusal, a conflict, a
    /// slot corrupt or remembered, or a store failure goes on as the
    /// transaction's first read (nothing was written).
    fn lone(&self, store: &dyn Store, ask: Ask, now_ns: u64) -> Lone {
        let Some(spec) = self.rules.get(ask.rule).map(|r| &r.spec) else {
            return Lone::Read(None);
        };
        let [slot, _] = ask.placement.slots;
        if ask.placement.count != 1 || ask.slack_ns != 0 {
            return Lone::Read(self.read(store, ask, now_ns, false));
        }
        let Some(read) = self.read_slot(store, ask.rule, slot, now_ns, false) else {
            return Lone::Read(None);
        };
        let outcome = spec.algorithm.decide(read.slot.tat, now_ns, ask.cost, 0);
        if !outcome.allowed() && read.remembered {
            // As `read`: no write will check it behind a refusal.
            return Lone::Read(self.read(store, ask, now_ns, true));
        }
        let Some(mut p) = self.pending(ask, Reads::of(read), 0, outcome, now_ns) else {
            return Lone::Read(None);
        };
        if !outcome.allowed() || read.corrupt {
            // The transaction refuses it, or writes it, the corrupt slot
            // counted.
            return Lone::Read(Some(p));
        }
        let written = self.commit(store, &mut p);
        if matches!(written, Commit::Done) {
            return Lone::Charged(p.report);
        }
        match self.again(store, &p, written, now_ns) {
            Ok(fresh) => Lone::Read(Some(fresh)),
            Err(retries) => Lone::Failed(retries),
        }
    }

    /// The evaluation of a request its one rule admitted and charged.
    fn charged(report: RuleReport, global_keys: Vec<(usize, u64)>) -> Evaluation {
        let mut reports = Small::new();
        reports.push(report);
        Evaluation {
            verdict: LimitVerdict::Allow,
            reports,
            delay_ns: 0,
            reservations: Vec::new(),
            global_keys,
        }
    }

    pub(super) fn failure_report(&self, rule: usize, cost: u64, cas_retries: u32) -> RuleReport {
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

    pub(super) fn read(
        &self,
        store: &dyn Store,
        ask: Ask,
        now_ns: u64,
        fresh: bool,
    ) -> Option<Pending> {
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
        self.pending(ask, reads, decision, outcome, now_ns)
    }

    /// A rule decided on `reads` (its decision slot `decision`), with its
    /// report.
    fn pending(
        &self,
        ask: Ask,
        reads: Reads,
        decision: usize,
        outcome: BucketAnswer,
        now_ns: u64,
    ) -> Option<Pending> {
        let spec = &self.rules.get(ask.rule)?.spec;
        let algorithm = &spec.algorithm;
        let tag = Self::tag(algorithm, &ask.placement);
        let state = reads.get(decision)?.slot;
        let collision =
            state.fingerprint != 0 && state.fingerprint != tag && algorithm.busy(state.tat, now_ns);
        let report = Self::report(ask.rule, spec.shadow, ask.cost, &outcome, &reads, collision);
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
    ) -> Option<Reads> {
        let mut reads = Reads::default();
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
    ) -> Option<SlotRead> {
        let spec = &self.rules.get(rule)?.spec;
        let key = self.slot(rule, slot);
        let (cas, decoded, remembered) = match store.get_slot(key, fresh).ok()? {
            // A value too long for a slot is as corrupt as any other.
            Some(e) => (
                e.cas,
                Slot::decode(e.bytes().unwrap_or_default()).ok(),
                e.remembered,
            ),
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
        Some(SlotRead {
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
        outcome: &BucketAnswer,
        reads: &Reads,
        collision: bool,
    ) -> RuleReport {
        let (result, wait_ns) = match *outcome {
            BucketAnswer::Allow { delay_ns, .. } if delay_ns > 0 => (RuleResult::Delayed, 0),
            BucketAnswer::Allow { .. } => (RuleResult::Allowed, 0),
            BucketAnswer::Deny { wait_ns, .. } if shadow => (RuleResult::ShadowLimited, wait_ns),
            BucketAnswer::Deny { wait_ns, .. } => (RuleResult::Limited, wait_ns),
        };
        RuleReport {
            rule,
            result,
            cost,
            remaining: outcome.remaining(),
            full_in_ns: outcome.full_in_ns(),
            wait_ns,
            delay_ns: match *outcome {
                BucketAnswer::Allow { delay_ns, .. } => delay_ns,
                BucketAnswer::Deny { .. } => 0,
            },
            cas_retries: 0,
            corrupt: reads.iter().any(|r| r.corrupt),
            collision,
        }
    }
}
