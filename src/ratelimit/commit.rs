//! Steps 2 to 4 of the transaction: a refusal, or the charges committed
//! rule by rule with CAS (re-read and decided again on conflict, within
//! the retry bound), earlier charges refunded when a later rule refuses,
//! and a held request's charges given back. Its own file because every
//! write the limiter makes on the request path is here.

use super::algorithm::Algorithm;
use super::bucket::BucketAnswer;
use super::codec::Slot;
use super::{
    Evaluation, LimitVerdict, Limiter, Pending, Pendings, Reservation, RuleReport, RuleResult,
    SlotRead,
};
use crate::small::Small;
use crate::store::{SlotKey, Store, StoreError};

pub(super) enum Commit {
    Done,
    Conflict,
    /// The decision slot's remembered value was out of date.
    Stale,
    Failed,
}

impl Limiter {
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
        // The first store failure (shadow or not) names the rule.
        reports
            .iter()
            .find(|r| r.result == RuleResult::StoreFailure)
            .map(|r| r.rule)
    }

    pub(super) fn settle(
        &self,
        store: &dyn Store,
        now_ns: u64,
        pending: &mut Pendings,
        reports: Small<RuleReport, 1>,
    ) -> Evaluation {
        let mut reports = reports;
        let mut i = 0;
        loop {
            if let Some(deny) = Self::refusal(pending) {
                return self.refuse(store, pending, reports, deny);
            }
            if let Some(rule) = self.fail_closed(&reports) {
                return self.refuse(
                    store,
                    pending,
                    reports,
                    LimitVerdict::Deny { rule, wait_ns: 0 },
                );
            }
            let Some(p) = pending.get_mut(i) else { break };
            if !p.outcome.allowed() {
                i += 1; // a shadow rule that would refuse is not charged
                continue;
            }
            let commit = self.commit(store, p);
            if matches!(commit, Commit::Done) {
                i += 1;
                continue;
            }
            match self.again(store, p, commit, now_ns) {
                Ok(fresh) => *p = fresh,
                Err(retries) => {
                    let r = self.failure_report(p.ask.rule, p.ask.cost, retries);
                    reports.push(r);
                    pending.remove(i);
                }
            }
        }
        Self::admitted(pending, reports)
    }

    /// After a commit of `p` that did not land: the rule read and decided
    /// again, or, past the retry bound or on a store failure, the retries
    /// it took.
    pub(super) fn again(
        &self,
        store: &dyn Store,
        p: &Pending,
        commit: Commit,
        now_ns: u64,
    ) -> Result<Pending, u32> {
        let retries = p.report.cas_retries;
        let retry = match commit {
            Commit::Done => return Ok(*p),
            // A remembered value out of date is not a conflict with a
            // concurrent request: read it and decide again, uncounted.
            Commit::Stale => retries,
            Commit::Conflict if retries < self.max_retries => retries + 1,
            Commit::Conflict | Commit::Failed => return Err(retries),
        };
        let mut fresh = self.read(store, p.ask, now_ns, true).ok_or(retry)?;
        fresh.report.cas_retries = retry;
        Ok(fresh)
    }

    /// The evaluation of a request every enforcing rule admitted; held for
    /// the latest turn a shaping rule reserved, if any.
    fn admitted(pending: &[Pending], mut reports: Small<RuleReport, 1>) -> Evaluation {
        let delay_ns = pending.iter().map(|p| p.report.delay_ns).max().unwrap_or(0);
        let reservations = if delay_ns > 0 {
            pending.iter().filter_map(Self::reservation).collect()
        } else {
            Vec::new()
        };
        reports.extend(pending.iter().map(|p| p.report));
        crate::sort::small_by_key(&mut reports, |r| r.rule);
        Evaluation {
            verdict: LimitVerdict::Allow,
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
        (p.ask.placement.count == 1).then_some(Reservation {
            key: read.key,
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
            Self::restore(store, r.key, r.before, r.after);
        }
    }

    /// The refusal with the longest wait among enforcing rules, if any.
    fn refusal(pending: &[Pending]) -> Option<LimitVerdict> {
        pending
            .iter()
            .filter(|p| p.report.result == RuleResult::Limited)
            .max_by_key(|p| p.report.wait_ns)
            .map(|p| LimitVerdict::Deny {
                rule: p.ask.rule,
                wait_ns: p.report.wait_ns,
            })
    }

    fn refuse(
        &self,
        store: &dyn Store,
        pending: &Pendings,
        mut reports: Small<RuleReport, 1>,
        verdict: LimitVerdict,
    ) -> Evaluation {
        for p in pending.iter() {
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
        let Some(SlotRead { key, .. }) = p.reads.get(p.decision) else {
            return;
        };
        Self::restore(store, *key, before, after);
    }

    /// Puts `before` back into a slot still holding `after`.
    fn restore(store: &dyn Store, key: SlotKey, before: Slot, after: Slot) {
        let Ok(Some(entry)) = store.get_slot(key, true) else {
            return;
        };
        if Slot::decode(entry.bytes().unwrap_or_default()) == Ok(after) {
            let _ = store.set_slot(key, &before.encode(), entry.cas);
        }
    }

    pub(super) fn commit(&self, store: &dyn Store, p: &mut Pending) -> Commit {
        let BucketAnswer::Allow { new_tat, .. } = p.outcome else {
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
        match store.set_slot(read.key, &after.encode(), read.cas) {
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
        read: &SlotRead,
        new: Slot,
        algorithm: &Algorithm,
        retries: &mut u32,
    ) -> bool {
        let key = read.key;
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
            match store.set_slot(key, &target.encode(), cas) {
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
            match store.get_slot(key, true) {
                Ok(Some(e)) => match Slot::decode(e.bytes().unwrap_or_default()) {
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
