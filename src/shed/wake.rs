//! Waiters leaving a shedder's queue: resumed when a slot frees (the
//! next class by priority or turn, oldest first or newest under LIFO),
//! shed past their wait limit or deadline, or gone with their stream; and
//! slots given back (a release, leased slots on every tick).

use super::entry::{lease_cap, Op};
use super::local::{by_turn, wait_limit, OnWorker, Queued};
use super::{Shedders, Wake};
use crate::store::Store;
use std::collections::VecDeque;

impl Shedders {
    /// The class served next here: the highest class waiting, or with
    /// shares the class whose oldest waiter has the earliest turn.
    pub(super) fn next_class(l: &OnWorker, shares: bool) -> Option<usize> {
        let fronts = (0..3)
            .rev()
            .filter_map(|c| Some((c, l.queues.get(c)?.front()?)));
        if shares {
            fronts
                .min_by_key(|(_, w)| by_turn(w.turn_ms, w.class))
                .map(|(c, _)| c)
        } else {
            fronts.map(|(c, _)| c).next()
        }
    }

    /// Takes the next waiter to admit out of this worker's queue: of the
    /// class served next, the oldest, or the newest while overloaded with
    /// `lifo` (the requests still most likely to be wanted).
    pub(super) fn pop_next(&mut self, s: usize) -> Option<Queued> {
        let shares = self.shares(s).is_some();
        let lifo = self.rules.get(s).is_some_and(|r| r.spec.lifo);
        let l = self.local.get_mut(s)?;
        let c = Self::next_class(l, shares)?;
        let newest = lifo && l.codel.overloaded;
        let q = l.queues.get_mut(c)?;
        if newest {
            q.pop_back()
        } else {
            q.pop_front()
        }
    }

    /// Takes out of the queue the waiters whose deadline passed or who
    /// waited their limit (`max_wait`, or less for their class while
    /// overloaded), each as a wake to answer.
    pub(super) fn drop_expired(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        s: usize,
        max_wait: u64,
        out: &mut Vec<Wake>,
    ) {
        let shed_before = out.len();
        let by_class = self.rules.get(s).is_some_and(|r| r.spec.shares.is_none());
        if let Some(l) = self.local.get_mut(s) {
            for q in l.queues.iter_mut() {
                q.retain(|w| {
                    if w.deadline_ms.is_some_and(|d| now_ms >= d) {
                        out.push(Wake::Expired { waiter: *w });
                        return false;
                    }
                    let limit = wait_limit(&l.codel, w.class, by_class, max_wait);
                    let keep = now_ms.saturating_sub(w.since_ms) < limit;
                    if !keep {
                        out.push(Wake::Shed { waiter: *w });
                    }
                    keep
                });
            }
        }
        for i in shed_before..out.len() {
            if let Some(Wake::Shed { waiter } | Wake::Expired { waiter }) = out.get(i).copied() {
                if !by_class {
                    self.left(s, waiter, now_ms);
                }
            }
            self.note_shed(s, now_ms);
            self.try_op(store, s, Op::Leave);
        }
    }

    /// Sheds waiters past their limit and resumes as many as slots allow,
    /// highest class first, oldest first within a class.
    pub fn wake(&mut self, store: &dyn Store, now_ms: u64, s: usize) -> Vec<Wake> {
        self.now_ms = self.now_ms.max(now_ms);
        self.roll(s, now_ms);
        if !self.retry.is_empty() {
            self.retry_failed(store);
        }
        let mut out = Vec::new();
        let Some(max_wait) = self
            .rules
            .get(s)
            .and_then(|r| r.spec.concurrency.as_ref())
            .map(|c| c.max_wait_ms)
        else {
            return out;
        };
        self.drop_expired(store, now_ms, s, max_wait, &mut out);
        while self.queued(s) > 0 {
            match self.try_op(store, s, Op::Admit) {
                Some(false) => break,
                got => {
                    let Some(w) = self.pop_next(s) else {
                        break;
                    };
                    let waited_ms = now_ms.saturating_sub(w.since_ms);
                    if got == Some(true) {
                        self.observe(s, now_ms, waited_ms);
                    }
                    self.admitted(s, now_ms, (w.class, w.turn_ms), true);
                    out.push(Wake::Resume {
                        id: w.id,
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
    pub fn release(&mut self, store: &dyn Store, s: usize) {
        let cap = lease_cap(self.limit(s).unwrap_or(0));
        if let Some(l) = self.local.get_mut(s) {
            // Kept for this worker's next arrival, unless someone waits here.
            if l.calm && l.lease < cap && l.queues.iter().all(VecDeque::is_empty) {
                l.lease += 1;
                return;
            }
        }
        self.try_op(store, s, Op::Release);
    }

    /// Gives every leased slot back to the shared counters (on every tick,
    /// and when the configuration goes away), so that a worker holds idle
    /// slots for one tick at most.
    pub fn return_leases(&mut self, store: &dyn Store) {
        for s in 0..self.local.len() {
            let Some(l) = self.local.get_mut(s) else {
                continue;
            };
            l.calm = false;
            let n = std::mem::take(&mut l.lease);
            if n > 0 {
                self.try_op(store, s, Op::Return(n));
            }
        }
    }

    /// With shares, waiter `w` left shedder `s` without being admitted:
    /// if its class has later turns (waiting here, or waiting or admitted
    /// on another worker as its claim last said), the turn is owed to one
    /// of the class's next arrivals here (see `Clocks::left`); if it was
    /// its class's newest, the class's next turn falls back to it anyway.
    pub(super) fn left(&mut self, s: usize, w: Queued, now_ms: u64) {
        let Some(l) = self.local.get_mut(s) else {
            return;
        };
        let c = w.class as usize;
        let here = l.queues.get(c).and_then(|q| q.back()).map(|b| b.turn_ms);
        let there = l.elsewhere.newest.get(c).copied();
        if here.max(there).is_some_and(|t| t > w.turn_ms) {
            l.clocks.left(c, w.turn_ms, now_ms);
        }
    }

    /// Removes a waiter whose stream ended (client gone). Returns whether it was queued.
    pub fn cancel(&mut self, store: &dyn Store, s: usize, id: u32) -> bool {
        let Some(l) = self.local.get_mut(s) else {
            return false;
        };
        let gone = l.queues.iter_mut().find_map(|q| {
            let i = q.iter().position(|w| w.id == id)?;
            q.remove(i)
        });
        let Some(w) = gone else {
            return false;
        };
        if self.shares(s).is_some() {
            self.left(s, w, self.now_ms);
        }
        self.try_op(store, s, Op::Leave);
        true
    }
}
