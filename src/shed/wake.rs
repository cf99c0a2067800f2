//! Waiters leaving a shedder's queue: resumed when a slot frees (the
//! next class by priority or turn, oldest first or newest under LIFO),
//! shed past their wait limit or deadline, or gone with their stream; and
//! slots given back (a release, leased slots on every tick).

use super::entry::{lease_cap, Op};
use super::local::{by_turn, wait_limit, Queued};
use super::waiters::{self, line, Waiters};
use super::{Report, ShedderId, Shedders, Wake};
use crate::pipeline::wait::Wait;
use crate::store::Store;

impl Shedders {
    /// The class served next at shedder `s` here: the highest class
    /// waiting, or with shares the class whose first waiter has the
    /// earliest turn.
    pub(super) fn next_class(w: &impl Waiters, s: ShedderId, shares: bool) -> Option<usize> {
        let fronts = (0..3)
            .rev()
            .filter_map(|c| Some((c, w.each(line(s, c)).next()?.1)));
        if shares {
            fronts
                .min_by_key(|(_, x)| by_turn(x.key, waiters::class_of(x.line)))
                .map(|(c, _)| c)
        } else {
            fronts.map(|(c, _)| c).next()
        }
    }

    /// Takes the next waiter to admit out of this worker's line: of the
    /// class served next, the oldest, or the newest while overloaded with
    /// `lifo` (the requests still most likely to be wanted).
    pub(super) fn pop_next(&mut self, w: &mut impl Waiters, s: ShedderId) -> Option<(u32, Wait)> {
        let shares = self.shares(s).is_some();
        let lifo = self.get(s).is_some_and(|r| r.spec.lifo);
        let l = self.local(s)?;
        let c = Self::next_class(w, s, shares)?;
        let newest = lifo && l.codel.overloaded;
        let (id, _) = if newest {
            w.last(line(s, c))
        } else {
            w.each(line(s, c)).next()
        }?;
        Some((id, w.leave(id)?))
    }

    /// Takes out of the lines the waiters whose deadline passed or who
    /// waited their limit (`max_wait`, or less for their class while
    /// overloaded), each as a wake to answer.
    pub(super) fn drop_expired(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        (now_ms, s): (u64, ShedderId),
        max_wait: u64,
        out: &mut Vec<Wake>,
    ) {
        let shed_before = out.len();
        let by_class = self.get(s).is_some_and(|r| r.spec.shares.is_none());
        if let Some(l) = self.local(s) {
            for c in 0..3 {
                for x in w.each(line(s, c)) {
                    let waiter = waiters::queued(w, !by_class, x);
                    if waiter.deadline_ms.is_some_and(|d| now_ms >= d) {
                        out.push(Wake::Expired { waiter });
                        continue;
                    }
                    let limit = wait_limit(&l.codel, waiter.class, by_class, max_wait);
                    if now_ms.saturating_sub(waiter.since_ms) >= limit {
                        out.push(Wake::Shed { waiter });
                    }
                }
            }
        }
        for i in shed_before..out.len() {
            if let Some(Wake::Shed { waiter } | Wake::Expired { waiter }) = out.get(i) {
                w.leave(waiter.id);
            }
        }
        for i in shed_before..out.len() {
            if let Some(Wake::Shed { waiter } | Wake::Expired { waiter }) = out.get(i).copied() {
                if !by_class {
                    self.left(w, s, waiter, now_ms);
                }
            }
            self.note_shed(s, now_ms);
            self.try_op(w, store, s, Op::Leave);
        }
    }

    /// Sheds waiters past their limit and resumes as many as slots allow,
    /// highest class first, oldest first within a class.
    pub fn wake(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        now_ms: u64,
        s: ShedderId,
    ) -> (Vec<Wake>, Report) {
        let wakes = self.wakes(w, store, now_ms, s);
        (wakes, self.done())
    }

    /// `wake`'s waiters.
    fn wakes(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        now_ms: u64,
        s: ShedderId,
    ) -> Vec<Wake> {
        self.now_ms = self.now_ms.max(now_ms);
        self.roll(s, now_ms);
        if !self.retry.is_empty() {
            self.retry_failed(w, store);
        }
        let mut out = Vec::new();
        let Some(max_wait) = self
            .get(s)
            .and_then(|r| r.spec.concurrency.as_ref())
            .map(|c| c.max_wait_ms)
        else {
            return out;
        };
        let shares = self.shares(s).is_some();
        self.drop_expired(w, store, (now_ms, s), max_wait, &mut out);
        while waiters::waiting(w, s) > 0 {
            match self.try_op(w, store, s, Op::Admit) {
                Some(false) => break,
                got => {
                    let Some((id, x)) = self.pop_next(w, s) else {
                        break;
                    };
                    let waited_ms = now_ms.saturating_sub(x.since.as_ms());
                    if got == Some(true) {
                        self.observe(s, now_ms, waited_ms);
                    }
                    let turn = waiters::turn(shares, &x);
                    self.admitted(s, now_ms, (waiters::class_of(x.line), turn), true);
                    out.push(Wake::Resume {
                        id,
                        waited_ms,
                        slot: got == Some(true),
                    });
                }
            }
        }
        out
    }

    /// Releases a concurrency slot (exactly once per admitted request: the
    /// caller holds the `slot` flag and clears it).
    pub fn release(&mut self, w: &impl Waiters, store: &dyn Store, s: ShedderId) -> Report {
        let cap = lease_cap(self.limit(s).unwrap_or(0));
        if let Some(l) = self.local_mut(s) {
            // Kept for this worker's next arrival, unless someone waits here.
            if l.calm && l.lease < cap && waiters::waiting(w, s) == 0 {
                l.lease += 1;
                return self.done();
            }
        }
        self.try_op(w, store, s, Op::Release);
        self.done()
    }

    /// Gives every leased slot back to the shared counters (on every tick,
    /// and when the configuration goes away), so that a worker holds idle
    /// slots for one tick at most.
    pub fn return_leases(&mut self, w: &impl Waiters, store: &dyn Store) -> Report {
        for s in self.ids() {
            let Some(l) = self.local_mut(s) else {
                continue;
            };
            l.calm = false;
            let n = std::mem::take(&mut l.lease);
            if n > 0 {
                self.try_op(w, store, s, Op::Return(n));
            }
        }
        self.done()
    }

    /// With shares, waiter `q` left shedder `s` without being admitted:
    /// if its class has later turns (waiting here, or waiting or admitted
    /// on another worker as its claim last said), the turn is owed to one
    /// of the class's next arrivals here (see `Clocks::left`); if it was
    /// its class's newest, the class's next turn falls back to it anyway.
    pub(super) fn left(&mut self, w: &impl Waiters, s: ShedderId, q: Queued, now_ms: u64) {
        let c = q.class as usize;
        let here = w.last(line(s, c)).map(|(_, b)| b.key);
        let Some(l) = self.local_mut(s) else {
            return;
        };
        let there = l.elsewhere.newest.get(c).copied();
        if here.max(there).is_some_and(|t| t > q.turn_ms) {
            l.clocks.left(c, q.turn_ms, now_ms);
        }
    }

    /// Takes stream `id` out of shedder `s`'s lines, its stream gone
    /// (client gone). Returns whether it waited there.
    pub fn cancel(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        s: ShedderId,
        id: u32,
    ) -> (bool, Report) {
        let Some(x) = w.waiter(id).filter(|x| waiters::shedder_of(x.line) == s) else {
            return (false, self.done());
        };
        w.leave(id);
        let shares = self.shares(s).is_some();
        if shares {
            let q = waiters::queued(w, shares, (id, x));
            self.left(w, s, q, self.now_ms);
        }
        self.try_op(w, store, s, Op::Leave);
        (true, self.done())
    }
}
