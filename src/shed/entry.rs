//! The ops on a queue-mode shedder's shared entry, as a pure function from
//! the entry found to the entry to write: slots in flight, requests waiting
//! on all workers, and this worker's claim (see [`super::codec::Shared`]).

use super::codec::{Claim, Shared, CLAIM_REFRESH_MS, CLAIM_TTL_MS, MAX_CLAIMS};

/// A change to the shared (in-flight, waiting) counter pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Take a free slot on arrival (only if nobody waits anywhere).
    Direct,
    /// A request starts waiting.
    Enqueue,
    /// A waiter takes a free slot.
    Admit,
    /// A waiter leaves without a slot (shed, or its client went away).
    Leave,
    /// An admitted request ends.
    Release,
    /// A worker gives back `n` leased slots it did not use.
    Return(u64),
    /// A waiter replaced another (evicted): only the claim may change.
    Requeue,
}

/// Slots a worker may keep leased for a concurrency limit of `max`: a
/// thirty-second of it, at most 32; none below a limit of 64, where every
/// request goes through the shared counter.
pub fn lease_cap(max: u64) -> u64 {
    let cap = (max / 32).min(32);
    if cap >= 2 {
        cap
    } else {
        0
    }
}

/// Whether claim `c` is another worker's than `me`'s and live at `now`
/// (rewritten lately, and not dated ahead).
pub fn live(c: &Claim, me: u32, now: u64) -> bool {
    c.worker != me
        && c.seen_ms.saturating_add(CLAIM_TTL_MS) >= now
        && c.seen_ms <= now.saturating_add(CLAIM_TTL_MS)
}

/// One op on the entry, with what it needs to know of this worker.
#[derive(Debug, Clone, Copy)]
pub struct Change {
    pub op: Op,
    /// Waiters go in order of age across workers, whatever their class
    /// (shares: each worker's claim is already the class its turn is for).
    pub by_age: bool,
    /// The concurrency limit.
    pub max: u64,
    /// Slots this worker holds leased.
    pub lease: u64,
    /// This worker's best waiter now, and once the op is done.
    pub head: Option<Claim>,
    pub head_after: Option<Claim>,
    /// This worker's tag, and its latest time.
    pub me: u32,
    pub now: u64,
}

/// What an op does to the entry found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Nothing to write: the op is refused and the entry is as it should be.
    Keep,
    /// Refused, but this worker's claim must be (re)written.
    Refused(Shared),
    /// Done: write this entry; the lease slots granted (direct admissions).
    Done(Shared, u64),
}

impl Op {
    /// Arrivals and wakes come with the time; releases, cancels and
    /// returned leases do not (reading the clock costs), so `now` may be
    /// old then: those ops leave the other workers' claims as they are,
    /// and what they read is not dated. (Our own claim is exact either
    /// way: a worker with waiters polls every millisecond, so its `now` is
    /// fresh.)
    pub fn timely(self) -> bool {
        matches!(self, Op::Direct | Op::Enqueue | Op::Admit | Op::Requeue)
    }
}

impl Change {
    /// Whether another worker's claim `c` is live (see [`live`]).
    pub fn live(&self, c: &Claim) -> bool {
        live(c, self.me, self.now)
    }

    /// Whether claim `a`'s waiter goes before `b`'s.
    fn before(&self, a: &Claim, b: &Claim) -> bool {
        if self.by_age {
            a.since_ms < b.since_ms
        } else {
            a.before(b)
        }
    }

    /// The order claims are kept in.
    fn order(&self, a: &Claim, b: &Claim) -> std::cmp::Ordering {
        if self.by_age {
            (a.since_ms, a.worker).cmp(&(b.since_ms, b.worker))
        } else {
            a.order(b)
        }
    }

    /// Our claim, with the time it was last written unless that is due
    /// again (so that a refusal need not write every time).
    fn ours(&self, old: &Shared, m: Claim) -> Claim {
        let now = self.now;
        let fresh = |c: &&Claim| {
            c.same(&m) && c.seen_ms <= now && c.seen_ms.saturating_add(CLAIM_REFRESH_MS) > now
        };
        let seen_ms = old.claims.iter().find(fresh).map_or(now, |c| c.seen_ms);
        Claim { seen_ms, ..m }
    }

    /// The entry after an op: the counts, the other (live) claims, and ours.
    fn write(&self, old: &Shared, inflight: u64, waiting: u64, mine: Option<Claim>) -> Shared {
        // A direct admission's lease slots are counted too, as admitted
        // when granted: they are spent without touching the entry.
        let admitted = match self.op {
            Op::Direct | Op::Admit if inflight > old.inflight => {
                old.admitted.wrapping_add(inflight - old.inflight)
            }
            _ => old.admitted,
        };
        // With shares, a waiter admitted is its class's last turn (a
        // claim's `since_ms` is its waiter's turn).
        let mut last = old.last;
        if let (Op::Admit, true, true, Some(h)) =
            (self.op, self.by_age, inflight > old.inflight, self.head)
        {
            if let Some(t) = last.get_mut(h.class as usize) {
                *t = (*t).max(h.since_ms);
            }
        }
        let mut claims = Vec::new();
        if waiting > 0 {
            // Kept sorted: the others' stay in order, ours goes in its place.
            let timely = self.op.timely();
            let others = |c: &&Claim| {
                if timely {
                    self.live(c)
                } else {
                    c.worker != self.me
                }
            };
            claims.extend(old.claims.iter().filter(others).copied());
            claims.extend(mine.map(|m| self.ours(old, m)));
            // Sorted in this writer's order whatever order they came in, so
            // the entry always decodes.
            crate::sort::small_by(&mut claims, |a, b| self.order(a, b).is_lt());
            claims.truncate(MAX_CLAIMS);
        }
        Shared {
            inflight,
            waiting,
            admitted,
            last,
            claims,
        }
    }

    /// Applies the op to the entry found.
    pub fn apply(&self, old: &Shared) -> Applied {
        let (inflight, waiting, head) = (old.inflight, old.waiting, self.head);
        let done = |next: Shared| Applied::Done(next, 0);
        match self.op {
            // A new request may take a free slot only if nobody waits
            // on any worker: the queue is global in effect.
            Op::Direct if inflight >= self.max || waiting > 0 => Applied::Keep,
            Op::Direct => {
                // A direct admission also tops up this worker's lease while
                // the counter is well under the limit (three quarters) and
                // nobody waits.
                let want = lease_cap(self.max).saturating_sub(self.lease);
                let calm = want > 0 && inflight + 1 + want <= self.max - self.max / 4;
                let granted = if calm { want } else { 0 };
                Applied::Done(
                    self.write(old, inflight + 1 + granted, waiting, head),
                    granted,
                )
            }
            Op::Enqueue => done(self.write(old, inflight, waiting.saturating_add(1), head)),
            Op::Admit => self.admit(old),
            Op::Leave => done(self.write(old, inflight, waiting.saturating_sub(1), head)),
            Op::Release => done(self.write(old, inflight.saturating_sub(1), waiting, head)),
            Op::Return(n) => done(self.write(old, inflight.saturating_sub(n), waiting, head)),
            Op::Requeue => done(self.write(old, inflight, waiting, head)),
        }
    }

    /// A waiter takes a free slot, unless there is none or another
    /// worker's waiter goes first (the slot is left to it): refused, and
    /// our claim is rewritten when due, or mended after a failed write.
    fn admit(&self, old: &Shared) -> Applied {
        let Some(w) = self.head else {
            return Applied::Keep;
        };
        let first = old.claims.iter().find(|c| self.live(c));
        if old.inflight >= self.max || first.is_some_and(|t| self.before(t, &w)) {
            let next = self.write(old, old.inflight, old.waiting, self.head);
            return if next == *old {
                Applied::Keep
            } else {
                Applied::Refused(next)
            };
        }
        let next = self.write(
            old,
            old.inflight + 1,
            old.waiting.saturating_sub(1),
            self.head_after,
        );
        Applied::Done(next, 0)
    }
}
