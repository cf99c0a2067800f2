//! This worker's ops on a shedder's shared entry, by compare-and-swap:
//! each op keeps this worker's claim (its best waiters) up to date, reads
//! the other workers' claims, and may leave a free slot to another
//! worker's waiter (a wake). The entry's transitions themselves are
//! `entry.rs`'s; this is what a worker does around them.

use super::codec::{decode_shared, encode_shared, Claim, Shared};
use super::entry::{self, Applied, Change, Op};
use super::local::{by_turn, Elsewhere};
use super::waiters::{self, line, Waiters};
use super::{ShedderId, Shedders};
use crate::pipeline::wait::Wait;
use crate::store::{update, Store, StoreError, Update};

/// The shared entry found (none yet: empty); one that does not decode is
/// counted and replaced by an empty one.
fn found_entry(found: Option<&crate::store::Entry>, failures: &mut u64) -> Shared {
    match found {
        Some(e) => decode_shared(&e.bytes).unwrap_or_else(|| {
            *failures += 1;
            Shared::default()
        }),
        None => Shared::default(),
    }
}

/// What an op read of the shared entry (see `apply_op`).
#[derive(Default)]
pub(super) struct EntryRead {
    /// Whether the last decision was a refusal that only wrote claims.
    refusal: bool,
    /// When the oldest waiter another worker claims arrived.
    oldest_other: Option<u64>,
    /// The most in flight seen.
    peak: u64,
    seen: Elsewhere,
    /// The count of admissions (`None`: the entry was not read).
    admitted: Option<u64>,
    /// The worker whose waiter a free slot is left to (see `to_wake`).
    wake: Option<u32>,
}

/// Applies `change` to the shared entry at `key` by CAS: the lease slots
/// it granted if it took effect (or the store's error), and what it read.
fn apply_op(
    store: &dyn Store,
    (key, max_retries): (&str, u32),
    failures: &mut u64,
    change: &Change,
) -> (Result<Option<u64>, StoreError>, EntryRead) {
    let mut read = EntryRead::default();
    let granted = update(store, key, max_retries, |found| {
        let old = found_entry(found, failures);
        read.peak = read.peak.max(old.inflight);
        read.seen = Elsewhere::of(&old, |c| change.live(c));
        read.admitted = Some(old.admitted);
        read.refusal = false;
        read.oldest_other = old
            .claims
            .iter()
            .filter(|c| change.live(c))
            .map(|c| c.since_ms)
            .min();
        match change.apply(&old) {
            Applied::Keep => {
                read.wake = None;
                Update::Keep(None)
            }
            Applied::Refused(next) => {
                read.refusal = true;
                read.wake = None;
                Update::Write(encode_shared(&next), None)
            }
            Applied::Done(next, granted) => {
                read.wake = to_wake(&next, change);
                Update::Write(encode_shared(&next), Some(granted))
            }
        }
    });
    (granted, read)
}

/// After an op done that may leave a slot free for a waiter (a release, a
/// return of leased slots, a waiter leaving or admitted), the worker whose
/// waiter the entry leaves a free slot to: the first claim, when a slot is
/// free and that claim is another worker's (live, for ops that come with
/// the time; any other worker's for those that do not, whose `now` may be
/// old: a fresh claim would look dated ahead). That worker is woken at
/// once (`Report::wakes`) instead of finding the slot on its next
/// 1 ms poll. Arrivals and refused admissions never wake anyone: arrivals
/// are the many, and the op that freed the slot woke its worker already.
fn to_wake(entry: &Shared, change: &Change) -> Option<u32> {
    if !matches!(
        change.op,
        Op::Release | Op::Return(_) | Op::Leave | Op::Admit
    ) || entry.inflight >= change.max
        || entry.waiting == 0
    {
        return None;
    }
    // Claims are kept in order, ours among them.
    let timely = change.op.timely();
    let first = entry
        .claims
        .iter()
        .find(|c| c.worker == change.me || !timely || change.live(c))?;
    (first.worker != change.me).then_some(first.worker)
}

impl Shedders {
    /// This worker's two most deserving waiters of shedder `s`, as claims
    /// (with shares, a claim's `since_ms` is its waiter's turn).
    pub(super) fn heads(&self, w: &impl Waiters, s: ShedderId) -> (Option<Claim>, Option<Claim>) {
        let Some(l) = self.local(s) else {
            return (None, None);
        };
        let nobody = w.nobody();
        let count = |c: usize| if nobody { 0 } else { w.count(line(s, c)) };
        let counts: [u32; 3] = std::array::from_fn(|c| u32::try_from(count(c)).unwrap_or(u32::MAX));
        let shares = self.shares(s).is_some();
        // By class, the class's last turn here as `Clocks::next` counts
        // it: its newest waiter's (turns only grow along a class's line,
        // as `turn_of` reads it too), or its last admission's.
        let newest: [u64; 3] = std::array::from_fn(|c| {
            let waiting = if nobody {
                None
            } else {
                w.last(line(s, c)).map(|(_, b)| waiters::turn(shares, &b))
            };
            waiting.max(l.clocks.admitted(c, self.now_ms)).unwrap_or(0)
        });
        if nobody {
            return (None, None);
        }
        let claim = |x: &Wait| Claim {
            class: waiters::class_of(x.line),
            since_ms: waiters::turn(shares, x),
            worker: self.worker,
            seen_ms: self.now_ms,
            counts,
            newest,
        };
        let firsts = |c: usize| w.each(line(s, c)).take(2).map(|(_, x)| x);
        if !shares {
            let mut best = (0..3).rev().flat_map(firsts);
            return (
                best.next().map(|x| claim(&x)),
                best.next().map(|x| claim(&x)),
            );
        }
        let mut two: Vec<Wait> = (0..3).flat_map(firsts).collect();
        crate::sort::small_by_key(&mut two, |x| by_turn(x.key, waiters::class_of(x.line)));
        (two.first().map(claim), two.get(1).map(claim))
    }

    /// This worker's best waiter once an admission has taken one: the one
    /// after the head, or, under LIFO, the head itself (the newest of its
    /// class goes instead) unless it was alone in its class.
    pub(super) fn best_after_admit(
        &self,
        w: &impl Waiters,
        s: ShedderId,
        head: Option<Claim>,
        second: Option<Claim>,
    ) -> Option<Claim> {
        let lifo = self.get(s).is_some_and(|r| r.spec.lifo);
        let takes_newest = lifo
            && self.local(s).is_some_and(|l| {
                l.codel.overloaded && head.is_some_and(|h| w.count(line(s, h.class as usize)) > 1)
            });
        if takes_newest {
            head
        } else {
            second
        }
    }

    /// Applies `op` to the shared entry by CAS, and keeps this worker's
    /// claim up to date (see `Shared`). Returns whether the op took effect
    /// (admissions need a free slot, and no other worker's claim before
    /// the waiter).
    pub(super) fn counter(
        &mut self,
        w: &impl Waiters,
        store: &dyn Store,
        s: ShedderId,
        op: Op,
    ) -> Result<bool, StoreError> {
        let Some(rule) = self.get(s) else {
            return Ok(false);
        };
        let key = rule.inflight_key.clone();
        // This worker's best waiter now, and once the op is done.
        let (head, second) = self.heads(w, s);
        let after_admit = self.claim_after_admit(w, s, head, second);
        let change = Change {
            op,
            by_age: self.shares(s).is_some(),
            max: self.limit(s).unwrap_or(u32::MAX as u64),
            lease: self.local(s).map_or(0, |l| l.lease),
            head,
            head_after: if op == Op::Admit { after_admit } else { head },
            me: self.worker,
            now: self.now_ms,
        };
        let (granted, read) = apply_op(
            store,
            (&key, self.max_retries),
            &mut self.report.store_failures,
            &change,
        );
        if let Some(n) = read.admitted {
            self.read_entry(s, op.timely(), read.seen, n);
        }
        if let Some(w) = read.wake {
            if !self.report.wakes.contains(&w) {
                self.report.wakes.push(w);
            }
        }
        let granted = match granted {
            // A refusal whose claim could not be written is still a
            // refusal, not store trouble (which would let a waiter in
            // without a slot, over the limit).
            Err(_) if read.refusal => None,
            other => other?,
        };
        self.note_op(s, op, granted, read.peak);
        if matches!(op, Op::Enqueue | Op::Requeue) || (op == Op::Admit && granted.is_none()) {
            if self.shares(s).is_some() {
                self.observe_turns(w, s, read.oldest_other);
            } else {
                self.observe_global(s, read.oldest_other, head.map(|c| c.since_ms));
            }
        }
        Ok(granted.is_some())
    }

    /// This worker's claim once an admission has taken its head: the
    /// waiter after it, with the counts once the head is gone and its
    /// class's last turn (with shares, a claim's `since_ms` is its turn).
    pub(super) fn claim_after_admit(
        &self,
        w: &impl Waiters,
        s: ShedderId,
        head: Option<Claim>,
        second: Option<Claim>,
    ) -> Option<Claim> {
        self.best_after_admit(w, s, head, second).map(|mut c| {
            if let Some(h) = head {
                if let Some(n) = c.counts.get_mut(h.class as usize) {
                    *n = n.saturating_sub(1);
                }
                if let Some(t) = c.newest.get_mut(h.class as usize) {
                    *t = (*t).max(h.since_ms);
                }
            }
            c
        })
    }

    /// Keeps what a read of the entry said: the other workers' waiters
    /// and, with `shed_early`, the count of admissions (when the read is
    /// dated: `timely`, see `Op::timely`).
    pub(super) fn read_entry(
        &mut self,
        s: ShedderId,
        timely: bool,
        seen: Elsewhere,
        admitted: u64,
    ) {
        let (early, window_ms) = self.early(s);
        let now = self.now_ms;
        if let Some(l) = self.local_mut(s) {
            l.elsewhere = seen;
            if early && timely {
                l.rate.saw(now, admitted, window_ms);
            }
        }
    }

    /// With shares, claims carry turns, not arrival times: the earliest
    /// turn another worker claims keeps this worker's clock in step with
    /// theirs, and only this worker's own waiters tell how long the queue
    /// has stood.
    pub(super) fn observe_turns(
        &mut self,
        w: &impl Waiters,
        s: ShedderId,
        other_turn: Option<u64>,
    ) {
        let now = self.now_ms;
        if let (Some(t), Some(l)) = (other_turn, self.local_mut(s)) {
            let mine = (0..3)
                .filter_map(|c| w.each(line(s, c)).next())
                .map(|(_, x)| x.key)
                .min();
            l.clocks.seen(mine.map_or(t, |m| m.min(t)), now);
        }
        // The oldest waiter here, wherever it stands: a class's line is in
        // order of turns, and an owed turn puts a new arrival before older
        // waiters of its class.
        let own = (0..3)
            .flat_map(|c| w.each(line(s, c)))
            .map(|(_, x)| x.since.as_ms())
            .min();
        self.observe_global(s, None, own);
    }

    /// What a worker keeps of an op on the shared entry: the most in
    /// flight it saw (for the adaptive limit), and a direct admission's
    /// lease top-up.
    pub(super) fn note_op(
        &mut self,
        s: ShedderId,
        op: Op,
        granted: Option<u64>,
        inflight_seen: u64,
    ) {
        let Some(l) = self.local_mut(s) else {
            return;
        };
        l.samples.peak_inflight = l.samples.peak_inflight.max(inflight_seen.saturating_add(1));
        // In full use: what was in flight before the op, or after it for
        // an admission that took a slot (a release counts the request it
        // ends).
        let took = matches!(op, Op::Direct | Op::Admit) && granted.is_some();
        let in_use = inflight_seen.saturating_add(u64::from(took));
        l.full |= l.auto.as_ref().is_some_and(|a| in_use >= a.limit());
        if op == Op::Direct {
            // Calm while a direct admission is granted a lease top-up; a
            // refused one (`None`: at the limit, or waiters) is not calm.
            l.calm = granted.is_some_and(|g| g > 0);
            l.lease += granted.unwrap_or(0);
        }
    }

    /// `Some(true)`: done; `Some(false)`: no slot; `None`: store trouble
    /// (the request is then let through without a slot: fail open).
    pub(super) fn try_op(
        &mut self,
        w: &impl Waiters,
        store: &dyn Store,
        s: ShedderId,
        op: Op,
    ) -> Option<bool> {
        match self.counter(w, store, s, op) {
            Ok(done) => Some(done),
            Err(_) => {
                self.report.store_failures += 1;
                // A lost decrement would shrink the limit (or block direct
                // admission) for good: keep it and retry on the next wake.
                match op {
                    Op::Release | Op::Leave | Op::Return(_) => self.retry.push((s, op)),
                    // Admitted without a slot: the waiter still left the queue.
                    Op::Admit => self.retry.push((s, Op::Leave)),
                    Op::Direct | Op::Enqueue | Op::Requeue => {}
                }
                None
            }
        }
    }

    pub(super) fn retry_failed(&mut self, w: &impl Waiters, store: &dyn Store) {
        for (s, op) in std::mem::take(&mut self.retry) {
            if self.counter(w, store, s, op).is_err() {
                self.retry.push((s, op));
            }
        }
    }

    /// With shares, before an arrival on a worker that has waiters takes
    /// its turn (no op of its own has read the entry then): reads the
    /// other workers' claims afresh, so that its class's next turn follows
    /// their newest (a view some arrivals old gives two workers the same
    /// turns, and a class waiting on both more than its share).
    pub(super) fn look(&mut self, store: &dyn Store, s: ShedderId, now_ms: u64) {
        let Some(rule) = self.get(s) else {
            return;
        };
        let me = self.worker;
        let entry = store.get(&rule.inflight_key).ok().flatten();
        if let Some(entry) = entry.and_then(|e| decode_shared(&e.bytes)) {
            let seen = Elsewhere::of(&entry, |c| entry::live(c, me, now_ms));
            self.read_entry(s, true, seen, entry.admitted);
        }
    }
}
