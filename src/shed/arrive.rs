//! An arriving request at a shedder: admitted at once (from this worker's
//! lease or a free shared slot), shed (CoDel, `shed_early`, a full queue),
//! or queued with its turn.

use super::config::{self, Class};
use super::entry::Op;
use super::local::{by_turn, wait_limit, Queued};
use super::shares::SCALE;
use super::waiters::{self, line, Waiters};
use super::{Arrival, Report, ShedderId, Shedders};
use crate::store::Store;

impl Shedders {
    /// Decides on an arriving request of `class` (stream `id`).
    pub fn arrive(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        now_ms: u64,
        s: ShedderId,
        id: u32,
        class: Class,
    ) -> (Arrival, Report) {
        self.arrive_until(w, store, now_ms, s, (id, class), None)
    }

    /// Like `arrive`, for a request whose caller gives up at `deadline_ms`:
    /// it never waits past it.
    pub fn arrive_until(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        now_ms: u64,
        s: ShedderId,
        waiter: (u32, Class),
        deadline_ms: Option<u64>,
    ) -> (Arrival, Report) {
        let arrival = self.arrival(w, store, (now_ms, s), waiter, deadline_ms);
        (arrival, self.done())
    }

    /// `arrive_until`'s decision.
    fn arrival(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        (now_ms, s): (u64, ShedderId),
        (id, class): (u32, Class),
        deadline_ms: Option<u64>,
    ) -> Arrival {
        self.now_ms = self.now_ms.max(now_ms);
        self.roll(s, now_ms);
        let Some(rule) = self.get(s) else {
            return Arrival::Admit { slot: false };
        };
        let Some(conc) = rule.spec.concurrency.clone() else {
            return self.latency_arrival(s, now_ms, class);
        };
        let shares = rule.spec.shares.is_some();
        // Waiters of a higher or equal class go first (with shares, every
        // waiter: the arrival's class may not be the one served next).
        let skip = if shares { 0 } else { class as usize };
        let ahead = if w.nobody() {
            0
        } else {
            (skip..3).map(|c| w.count(line(s, c))).sum::<usize>()
        };
        if ahead > 0 && shares {
            self.look(store, s, now_ms);
        }
        let mut turn_ms = self.turn_of(w, s, class, now_ms);
        if ahead == 0 {
            if let Some(admitted) = self.admit_at_once(w, store, now_ms, s, (class, turn_ms)) {
                return admitted;
            }
            // Its op read the entry: the turn by what it said.
            turn_ms = self.turn_of(w, s, class, now_ms);
        }
        if conc.shed_early {
            let places = self.places(w, s, class, turn_ms, now_ms);
            let early = self.sheds_early(w, s, (class, places), &conc, (now_ms, deadline_ms));
            if let Some(early) = early {
                return early;
            }
        }
        let waiter = Queued {
            id,
            class,
            since_ms: now_ms,
            turn_ms,
            deadline_ms,
        };
        self.enqueue(w, store, s, waiter, &conc)
    }

    /// Latency mode (no concurrency limit): CoDel alone decides.
    pub(super) fn latency_arrival(&mut self, s: ShedderId, now_ms: u64, class: Class) -> Arrival {
        let shed = self
            .local_mut(s)
            .is_some_and(|l| l.codel.shed_on_arrival(now_ms, class));
        if shed {
            Arrival::Shed
        } else {
            Arrival::Admit { slot: false }
        }
    }

    /// The turn of an arrival of `class` (with shares; else `now_ms`).
    pub(super) fn turn_of(&self, w: &impl Waiters, s: ShedderId, class: Class, now_ms: u64) -> u64 {
        let (Some(sh), Some(l)) = (self.shares(s), self.local(s)) else {
            return now_ms;
        };
        // One step after the class's newest waiter on any worker (as this
        // worker last read the others' claims): a class waiting on two
        // workers gets one sequence of turns, not one on each.
        let c = class as usize;
        let here = w.last(line(s, c)).map(|(_, b)| b.key);
        let base = l.clocks.base(now_ms);
        let waiting = l.elsewhere.newest.get(c).copied().filter(|&t| t > 0);
        // And after its last admission on any worker, counted up to the
        // turn being served, as `Clocks::next` counts this worker's own.
        let admitted = l
            .elsewhere
            .last
            .get(c)
            .copied()
            .filter(|&t| t > 0)
            .map(|t| t.min(base));
        l.clocks
            .next(sh, c, now_ms, here.max(waiting).max(admitted))
    }

    /// `shed_early`: how many admissions, on every worker, an arrival of
    /// `class` with `turn` waits for, its own included: the waiters that go
    /// before it (here, and on the other workers as their claims count
    /// them) or, with shares, the more of those here and of the turns
    /// between the turn being served and its own of every class waiting
    /// anywhere (its own included), which counts the waiters still to come
    /// that will go first.
    pub(super) fn places(
        &self,
        w: &impl Waiters,
        s: ShedderId,
        class: Class,
        turn: u64,
        now_ms: u64,
    ) -> u64 {
        let (Some(rule), Some(l)) = (self.get(s), self.local(s)) else {
            return 1;
        };
        let me = by_turn(turn, class);
        let count =
            |c: usize| w.count(line(s, c)) as u64 + l.elsewhere.counts.get(c).copied().unwrap_or(0);
        let ahead = match rule.spec.shares {
            // A share-0 turn is not a place in line: it goes when nobody
            // else waits.
            Some(sh) if sh.get(class as usize).is_some_and(|&x| x > 0) => {
                let here = (0..3)
                    .flat_map(|c| w.each(line(s, c)))
                    .filter(|(_, x)| by_turn(x.key, waiters::class_of(x.line)) < me)
                    .count() as u64;
                let gap = turn.saturating_sub(l.clocks.base(now_ms));
                let waiting: u64 = (0..3)
                    .filter(|&c| c == class as usize || count(c) > 0)
                    .map(|c| u64::from(sh.get(c).copied().unwrap_or(0)))
                    .sum();
                // `gap / step` per class, rounded once, to the nearest
                // (per class, 35 x 2,857 is 99,995: one turn short).
                here.max(gap.saturating_mul(waiting).saturating_add(SCALE / 2) / SCALE)
            }
            // A share-0 arrival: every waiter on every worker goes first.
            Some(_) => (0..3).map(count).sum(),
            // Under LIFO while overloaded, an arrival goes before the
            // older waiters of its class.
            None => {
                let skip = class as usize + usize::from(rule.spec.lifo && l.codel.overloaded);
                (skip..3).map(count).sum()
            }
        };
        ahead.saturating_add(1)
    }

    /// `shed_early`: whether an arrival with `places` admissions to wait
    /// for would wait past its limit (`Shed`) or its deadline (`Expired`),
    /// whichever comes first, at the rate this worker admitted requests
    /// lately.
    /// Never while this worker has no waiter: its rate may say little of
    /// what it would get (a worker that admitted little lately would
    /// otherwise refuse everything, and go on admitting little).
    pub(super) fn sheds_early(
        &mut self,
        w: &impl Waiters,
        s: ShedderId,
        (class, places): (Class, u64),
        conc: &config::ConcurrencySpec,
        (now_ms, deadline_ms): (u64, Option<u64>),
    ) -> Option<Arrival> {
        let rule = self.get(s)?;
        let (by_class, window_ms) = (rule.spec.shares.is_none(), rule.spec.interval_ms);
        if waiters::waiting(w, s) == 0 {
            return None;
        }
        let l = self.local_mut(s)?;
        let limit = wait_limit(&l.codel, class, by_class, conc.max_wait_ms);
        let expected = l.rate.expected_wait_ms(now_ms, window_ms, places)?;
        // Answered as the queue would have: by whichever comes first, the
        // deadline or the limit.
        let left = deadline_ms.map(|d| d.saturating_sub(now_ms));
        let early = match left {
            Some(left) if left <= limit && expected >= left => Arrival::Expired,
            _ if expected >= limit => Arrival::Shed,
            _ => return None,
        };
        l.codel.shed(now_ms);
        Some(early)
    }

    /// Admits an arrival from this worker's lease or a free shared slot;
    /// `None` when there is none (the arrival then queues).
    pub(super) fn admit_at_once(
        &mut self,
        w: &impl Waiters,
        store: &dyn Store,
        now_ms: u64,
        s: ShedderId,
        (class, turn): (Class, u64),
    ) -> Option<Arrival> {
        if let Some(l) = self.local_mut(s).filter(|l| l.lease > 0) {
            l.lease -= 1;
            self.observe(s, now_ms, 0);
            self.admitted(s, now_ms, (class, turn), false);
            return Some(Arrival::Admit { slot: true });
        }
        let admitted = match self.try_op(w, store, s, Op::Direct) {
            Some(true) => {
                self.observe(s, now_ms, 0);
                Arrival::Admit { slot: true }
            }
            None => Arrival::Admit { slot: false },
            Some(false) => return None,
        };
        self.admitted(s, now_ms, (class, turn), false);
        Some(admitted)
    }

    /// Counts an admission at shedder `s` in this worker's recent rate
    /// (with `shed_early`, the only reader).
    /// With shares, an admission takes its class's turn, whether it waited
    /// for it (`queued`: the turn being served moves to it) or found a
    /// free place while nobody waited (its class's next turn comes after
    /// it, within a step of the turn being served).
    pub(super) fn admitted(
        &mut self,
        s: ShedderId,
        now_ms: u64,
        (class, turn): (Class, u64),
        queued: bool,
    ) {
        let Some(rule) = self.get(s) else {
            return;
        };
        let shares = rule.spec.shares.is_some();
        if let Some(l) = self.local_mut(s) {
            match (shares, queued) {
                (false, _) => {}
                (true, true) => l.clocks.served(class as usize, turn, now_ms),
                (true, false) => l.clocks.took(class as usize, turn, now_ms),
            }
        }
    }

    /// With `max: "auto"`, a request that has to wait before the limit has
    /// learned a floor (no response in the floor's window: a new shedder,
    /// or one idle that long) puts this worker's CoDel in overload at once.
    /// The limit is still its initial guess, and a queue behind a guess is
    /// no burst to let drain: under a steady demand over the limit, CoDel
    /// would judge it only at the end of its first full interval, 100 to
    /// 200 ms of queue at the start of every run (the steady cell of
    /// `bench/adaptive_matrix.py`: a p99 of 62 ms against 48 ms after the
    /// first second). Overload then ends as usual: after an interval that
    /// admits a request without waiting and sheds none.
    fn overload_while_learning(&mut self, s: ShedderId, now_ms: u64) {
        let Some(l) = self.local_mut(s) else {
            return;
        };
        // `auto` is there with `max: "auto"` only.
        if l.auto.as_ref().is_none_or(|a| a.floor_us().is_some()) {
            return;
        }
        if let Some(state) = l.codel.overload(now_ms) {
            self.report.changes.push((s, state));
        }
    }

    /// Queues a waiter, or sheds it (or, when the queue is full, another
    /// waiter to make room: see `full_queue_victim`).
    pub(super) fn enqueue(
        &mut self,
        w: &mut impl Waiters,
        store: &dyn Store,
        s: ShedderId,
        q: Queued,
        conc: &config::ConcurrencySpec,
    ) -> Arrival {
        self.overload_while_learning(s, q.since_ms);
        let shares = self.shares(s);
        let by_class = shares.is_none();
        let Some(l) = self.local_mut(s) else {
            return Arrival::Shed;
        };
        // With shares, CoDel's thresholds by class do not apply (they would
        // shed a class before its share comes round): max_wait bounds waits.
        if (by_class && l.codel.threshold(q.class) == Some(0)) || conc.queue == 0 {
            l.codel.shed(q.since_ms);
            return Arrival::Shed;
        }
        let mut evicted = None;
        if waiters::waiting(w, s) >= conc.queue as usize {
            l.codel.shed(q.since_ms);
            let shares = shares.map(|sh| (sh, l.elsewhere.newest));
            match full_queue_victim(w, s, &q, shares) {
                Some(v) => evicted = Some(v),
                None => return Arrival::Shed,
            }
        }
        // With shares, in order of turns (a class's turns only grow along
        // its line, but for a turn owed by a waiter that left).
        let key = waiters::key(shares.is_some(), q.turn_ms);
        w.join(
            q.id,
            line(s, q.class as usize),
            key,
            (q.since_ms, q.deadline_ms),
        );
        l.clocks.paid(q.class as usize, q.turn_ms);
        // An eviction leaves the count as it is; either way the new
        // waiter may now be this worker's best (its claim).
        let op = if evicted.is_none() {
            Op::Enqueue
        } else {
            Op::Requeue
        };
        self.try_op(w, store, s, op);
        Arrival::Queue { evicted }
    }
}

/// Makes room in shedder `s`'s full queue for `q`: takes out and returns
/// the waiter to shed in its place, or `None` when `q` itself is the one to
/// shed.
/// By priority (no `shares`): the newest waiter of the lowest class below
/// `q`'s. With shares: the waiter that would be served last, the latest
/// turn (a class's last, as its line is in order of turns), unless `q`'s
/// own turn is as late; but only a class's newest turn on any worker: its
/// line's last here, unless the other workers' claims (`there`, their
/// newest turn waiting or admitted by class, as last read) say later (a
/// class with share 0 has no sequence of turns: its last always counts).
/// Shedding by turn keeps each class's waiters in proportion to its share
/// (shedding the lowest class first would keep it out of a full queue, and
/// below its share); shedding only a class's newest keeps its turns
/// without a gap: the turn goes to its next arrival, where one shed below
/// a later turn of its class on another worker would be skipped, lost to
/// the class.
fn full_queue_victim(
    w: &mut impl Waiters,
    s: ShedderId,
    q: &Queued,
    shares: Option<([u32; 3], [u64; 3])>,
) -> Option<Queued> {
    let lasts = (0..3).filter_map(|c| w.last(line(s, c)));
    let victim = if let Some((sh, there)) = shares {
        let newest_here =
            |c: usize, turn: u64| sh.get(c) == Some(&0) || there.get(c).is_none_or(|&t| turn >= t);
        lasts
            .filter(|(_, b)| {
                b.key > q.turn_ms && newest_here(waiters::class_of(b.line) as usize, b.key)
            })
            .max_by_key(|(_, b)| b.key)
    } else {
        lasts
            .take_while(|(_, b)| (waiters::class_of(b.line) as usize) < q.class as usize)
            .next()
    };
    let victim = waiters::queued(w, shares.is_some(), victim?);
    w.leave(victim.id);
    Some(victim)
}
