//! Load shedding by queue latency (CoDel), priority-aware, with an optional
//! concurrency limit and admission queue (a bulkhead).
//!
//! Two ways to measure queueing delay (see docs/configuration.md for when to use which):
//! 1. sluice's own queue: a global in-flight limit kept in shared data; a
//!    request over it waits, paused in the filter, in a bounded per-worker
//!    queue; the time it waited is the delay, measured exactly.
//! 2. latency over the floor: without a sluice queue, the delay is the
//!    upstream latency minus its no-load floor (the minimum over a longer
//!    window), or a queue time the upstream reports in a header.
//!
//! Invariants (tested): a concurrency slot is released exactly once per
//! admitted request; the queue never exceeds its bound and nobody waits past
//! `max_wait`; higher classes are admitted first and shed last.

pub mod adaptive;
#[cfg(test)]
mod adaptive_sim;
pub mod codec;
pub mod codel;
pub mod config;
mod early;
mod entry;
pub mod reply;
mod shares;
pub mod stage;
#[cfg(test)]
mod tests;

use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::request::RequestView;
use crate::store::{update, Store, StoreError, Update};
use adaptive::{Auto, Samples};
use codec::{decode_shared, encode_shared, Claim, Shared};
use codel::Codel;
pub use config::{Class, ShedderSpec};
use early::Rate;
pub use entry::lease_cap;
use entry::{Applied, Change, Op};
use shares::{Clocks, SCALE};
use std::collections::VecDeque;

/// The order of waiters by turn (with shares): the earliest turn first, a
/// higher class first on a tie.
fn by_turn(turn: u64, class: Class) -> (u64, usize) {
    (turn, 2 - class as usize)
}

/// A queued request: the host's stream id, its class, when it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    pub id: u32,
    pub class: Class,
    pub since_ms: u64,
    /// Its turn: with shares a virtual time (see `shares`), else `since_ms`.
    pub turn_ms: u64,
    /// When the caller's deadline passes (ms), if it sent one.
    pub deadline_ms: Option<u64>,
}

/// What to do with an arriving request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Let it through; `slot` says whether it holds a concurrency slot to release.
    Admit { slot: bool },
    /// Pause it in the queue; `evicted` (a lower-priority waiter) must be shed.
    Queue { evicted: Option<Waiter> },
    /// Shed it now.
    Shed,
    /// `shed_early`: it would wait past its deadline: answer it so now.
    Expired,
}

/// What to do with a queued request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Resume it; it waited `waited_ms` and holds a slot if `slot` (not
    /// when the store failed and it was let through without one).
    Resume { id: u32, waited_ms: u64, slot: bool },
    /// Answer it with a shed response.
    Shed { waiter: Waiter },
    /// Its deadline passed while it waited: answer it so.
    Expired { waiter: Waiter },
}

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
struct Read {
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
) -> (Result<Option<u64>, StoreError>, Read) {
    let mut read = Read::default();
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
/// once (`Shedders::take_wakes`) instead of finding the slot on its next
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

/// How long a waiter of `class` may wait: `max_wait`, or less for its
/// class while CoDel says overloaded (strict priority only: with shares,
/// a shorter wait would shed a class before its share comes round).
fn wait_limit(codel: &Codel, class: Class, by_class: bool, max_wait: u64) -> u64 {
    match codel.threshold(class) {
        Some(t) if by_class => t.min(max_wait),
        _ => max_wait,
    }
    .max(1)
}

/// A shedder and its shared in-flight counter key.
#[derive(Debug, Clone)]
pub struct Shedder {
    pub spec: ShedderSpec,
    pub inflight_key: String,
    /// The adaptive limit's shared entry, with `max: "auto"`.
    pub auto_key: Option<String>,
}

/// Per-worker state of one shedder.
struct Local {
    codel: Codel,
    /// One FIFO per class, indexed by `Class as usize`.
    queues: [VecDeque<Waiter>; 3],
    floor_current: Option<u64>,
    floor_previous: Option<u64>,
    floor_rotated_ms: u64,
    /// Free slots this worker took from the shared counter ahead of need
    /// (counted there as in flight): used and refilled without a store
    /// round trip, given back on every tick.
    lease: u64,
    /// Whether the shared counter looked far from the limit, with nobody
    /// waiting, when last seen: only then may released slots be kept.
    calm: bool,
    /// Adaptive limit: latency samples since the last tick, and the limit
    /// and floor last read from the shared entry.
    samples: Samples,
    /// When the first of those samples came (ms; none: no sample yet).
    first_sample_ms: Option<u64>,
    /// Whether an op on the shared entry since the last merge found the
    /// adaptive limit in full use ([`Shedders::merge_soon`]).
    full: bool,
    auto: Option<Auto>,
    /// Turns by class, with shares.
    clocks: Clocks,
    /// The shared count of admissions (every worker's) as this worker saw
    /// it lately (for `shed_early`).
    rate: Rate,
    /// The other workers' waiters, as their claims said when this worker
    /// last read the entry (shares: see `turn_of` and `places`).
    elsewhere: Elsewhere,
}

impl Local {
    fn new(spec: &config::ShedderSpec, now_ms: u64) -> Self {
        Local {
            codel: Codel::new(
                spec.target_ms,
                spec.interval_ms,
                now_ms,
                spec.concurrency.is_some(),
            ),
            queues: Default::default(),
            floor_current: None,
            floor_previous: None,
            floor_rotated_ms: now_ms,
            lease: 0,
            calm: false,
            samples: Samples::default(),
            first_sample_ms: None,
            full: false,
            auto: spec
                .concurrency
                .as_ref()
                .and_then(|c| c.adaptive)
                .map(|a| Auto::new(&a, now_ms)),
            clocks: Clocks::default(),
            rate: Rate::new(now_ms),
            elsewhere: Elsewhere::default(),
        }
    }
}

/// What the shared entry says of the other workers' waiters, by class
/// (`Class as usize`): how many and the newest one's turn (0: none), from
/// their live claims; and, with shares, the turn of the class's last
/// admission on any worker.
#[derive(Debug, Clone, Copy, Default)]
struct Elsewhere {
    counts: [u64; 3],
    newest: [u64; 3],
    last: [u64; 3],
}

impl Elsewhere {
    fn of(entry: &Shared, live: impl Fn(&Claim) -> bool) -> Self {
        let mut e = Elsewhere {
            last: entry.last,
            ..Elsewhere::default()
        };
        for c in entry.claims.iter().filter(|c| live(c)) {
            for (n, m) in e.counts.iter_mut().zip(c.counts) {
                *n += u64::from(m);
            }
            for (t, u) in e.newest.iter_mut().zip(c.newest) {
                *t = (*t).max(u);
            }
        }
        e
    }
}

/// All shedders of one configuration, in one worker.
pub struct Shedders {
    pub rules: Vec<Shedder>,
    local: Vec<Local>,
    max_retries: u32,
    /// Store errors and corrupt counters seen (for metrics).
    pub store_failures: u64,
    /// Overload state changes: (shedder, now overloaded).
    pub changes: Vec<(usize, bool)>,
    /// Counter decrements that failed, to retry (see `try_op`).
    retry: Vec<(usize, Op)>,
    /// This worker's tag in claims (see `Shared`).
    worker: u32,
    /// The latest time this worker saw (for the age of claims).
    now_ms: u64,
    /// Workers to wake: a free slot is left to their waiter (see `to_wake`).
    wakes: Vec<u32>,
}

/// The shedder's state id: its name and its concurrency settings.
fn table_id(domain: &str, spec: &ShedderSpec) -> u32 {
    let id = StateId::new((0x7368_6564, 0x646572), domain).text(&spec.name);
    match &spec.concurrency {
        None => id.num(0),
        Some(c) => {
            let id = id
                .num(1)
                .num(u64::from(c.max))
                .num(u64::from(c.queue))
                .num(c.max_wait_ms);
            let id = match &c.adaptive {
                // As before adaptive limits existed: a fixed limit keeps its entry.
                None => id,
                Some(a) => id
                    .text("auto")
                    .num(u64::from(a.min))
                    .num(u64::from(a.initial))
                    .num(u64::from(a.tolerance_pct))
                    .num(a.interval_ms)
                    .num(a.floor_window_ms),
            };
            // Shares order the claims by turn, not by class: a configuration
            // that turns them on or off gets an entry of its own, never one
            // whose claims another configuration keeps in the other order.
            match &spec.shares {
                None => id,
                Some(sh) => sh
                    .iter()
                    .fold(id.text("shares"), |id, &x| id.num(u64::from(x))),
            }
        }
    }
    .finish()
}

impl Shedders {
    /// `worker` tags this worker's claims: random per worker VM.
    pub fn new(
        specs: &[ShedderSpec],
        common: &Common,
        now_ms: u64,
        worker: u32,
    ) -> Result<Self, ConfigError> {
        let mut rules: Vec<Shedder> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            // `/q3`: the entry with claims that count their worker's
            // waiters. An older sluice (`/q2`: claims without counts;
            // `/inflight`: 16 bytes) sharing the VM id while it drains
            // keeps its own.
            let id = table_id(&common.domain, spec);
            let inflight_key = format!("sh{id:08x}/q3");
            let auto_key = spec
                .concurrency
                .as_ref()
                .and_then(|c| c.adaptive)
                .map(|_| format!("sh{id:08x}/auto5"));
            let earlier = rules
                .iter()
                .map(|r| (r.inflight_key.as_str(), r.spec.name.as_str()));
            check_state_id("shedders", i, &inflight_key, earlier)?;
            rules.push(Shedder {
                spec: spec.clone(),
                inflight_key,
                auto_key,
            });
        }
        let local = rules.iter().map(|r| Local::new(&r.spec, now_ms)).collect();
        Ok(Shedders {
            rules,
            local,
            max_retries: common.max_cas_retries,
            store_failures: 0,
            changes: Vec::new(),
            retry: Vec::new(),
            worker,
            now_ms,
            wakes: Vec::new(),
        })
    }

    /// This worker's tag (its claims', and its wake-up queue's).
    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// The workers to wake since the last call, each once.
    pub fn take_wakes(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.wakes)
    }

    /// The shedders matching a request, with the request's class in each.
    pub fn classify(&self, req: &dyn RequestView) -> Vec<(usize, Class)> {
        let mut out = Vec::new();
        for (i, r) in self.rules.iter().enumerate() {
            if !r.spec.matcher.matches(req) {
                continue;
            }
            let by_rule = r
                .spec
                .classes
                .iter()
                .find(|(m, _)| m.matches(req))
                .map(|(_, c)| *c);
            let by_header = || {
                r.spec
                    .priority_header
                    .as_ref()
                    .and_then(|h| req.header(h))
                    .and_then(|v| Class::parse(&v))
            };
            out.push((
                i,
                by_rule.or_else(by_header).unwrap_or(r.spec.default_class),
            ));
        }
        out
    }

    fn roll(&mut self, s: usize, now_ms: u64) {
        if let Some(l) = self.local.get_mut(s) {
            if let Some(state) = l.codel.roll(now_ms) {
                self.changes.push((s, state));
            }
        }
    }

    fn note_shed(&mut self, s: usize, now_ms: u64) {
        if let Some(l) = self.local.get_mut(s) {
            if let Some(state) = l.codel.shed(now_ms) {
                self.changes.push((s, state));
            }
        }
    }

    fn observe(&mut self, s: usize, now_ms: u64, delay_ms: u64) {
        if let Some(l) = self.local.get_mut(s) {
            if let Some(state) = l.codel.observe(now_ms, delay_ms) {
                self.changes.push((s, state));
            }
        }
    }

    /// A waiter joined or stayed in the queue: the oldest waiter anywhere
    /// (this worker's, or another worker's claim) tells how long the global
    /// queue has been standing. A sample of its age lets a worker with
    /// little traffic of its own see the overload its waiters are part of.
    fn observe_global(&mut self, s: usize, other: Option<u64>, own: Option<u64>) {
        let now = self.now_ms;
        if let Some(since) = other.into_iter().chain(own).min() {
            let age = now.saturating_sub(since);
            if age > 0 {
                self.observe(s, now, age);
            }
        }
    }

    /// Whether the shedder is overloaded in this worker.
    pub fn overloaded(&self, s: usize) -> bool {
        self.local.get(s).is_some_and(|l| l.codel.overloaded)
    }

    /// Requests waiting in this worker's queue of shedder `s`.
    pub fn queued(&self, s: usize) -> usize {
        self.local
            .get(s)
            .map_or(0, |l| l.queues.iter().map(VecDeque::len).sum())
    }

    /// Shedder `s`'s concurrency limit, if it has one (queue mode): the
    /// fixed one, or the adaptive one as last read.
    pub fn limit(&self, s: usize) -> Option<u64> {
        let conc = self.rules.get(s)?.spec.concurrency.as_ref()?;
        match self.local.get(s).and_then(|l| l.auto.as_ref()) {
            Some(a) => Some(a.limit()),
            None => Some(conc.max as u64),
        }
    }

    /// The adaptive limit's floor estimate (µs), as last read.
    pub fn floor_us(&self, s: usize) -> Option<u64> {
        self.local.get(s)?.auto.as_ref()?.floor_us()
    }

    /// Adaptive limit: the latency of a request admitted at shedder `s`,
    /// from its admission (after any wait) to its response.
    /// While its floor is measured, the latency also counts towards the
    /// measurement if the request was admitted under the held limit.
    pub fn sample(&mut self, s: usize, latency_us: u64, now_ms: u64) {
        let spec = self
            .rules
            .get(s)
            .and_then(|r| r.spec.concurrency.as_ref())
            .and_then(|c| c.adaptive);
        let Some(l) = self.local.get_mut(s) else {
            return;
        };
        let (Some(auto), Some(spec)) = (l.auto.as_ref(), spec) else {
            return;
        };
        l.first_sample_ms.get_or_insert(now_ms);
        let admitted_ms = now_ms.saturating_sub(latency_us / 1000);
        if auto
            .measured_from_ms(&spec)
            .is_some_and(|from| admitted_ms >= from)
        {
            l.samples.add_measured(latency_us);
        }
        l.samples.add(latency_us);
    }

    /// Adaptive limits (on the tick): adds this worker's samples to each
    /// shared entry, which computes the next limit once an interval is
    /// over, and reads the limit back.
    pub fn adapt(&mut self, store: &dyn Store, now_ms: u64) {
        for s in 0..self.rules.len() {
            let Some(rule) = self.rules.get(s) else {
                continue;
            };
            let (Some(key), Some(spec)) = (
                rule.auto_key.clone(),
                rule.spec.concurrency.as_ref().and_then(|c| c.adaptive),
            ) else {
                continue;
            };
            let Some(l) = self.local.get_mut(s) else {
                continue;
            };
            l.full = false;
            let samples = Samples {
                span_ms: l
                    .first_sample_ms
                    .take()
                    .map_or(0, |first| now_ms.saturating_sub(first)),
                ..std::mem::take(&mut l.samples)
            };
            let failures = &mut self.store_failures;
            let merged = update(store, &key, self.max_retries, |found| {
                let old = match found.map(|e| Auto::decode(&e.bytes)) {
                    Some(Ok(a)) => a,
                    Some(Err(_)) => {
                        *failures += 1;
                        Auto::new(&spec, now_ms)
                    }
                    None => Auto::new(&spec, now_ms),
                };
                let next = old.merge(&spec, &samples, now_ms);
                Update::Write(next.encode(), next)
            });
            match merged {
                Ok(a) => l.auto = Some(a),
                Err(_) => self.store_failures += 1,
            }
        }
    }

    /// Shedder `s`'s shares, if it has them.
    fn shares(&self, s: usize) -> Option<[u32; 3]> {
        self.rules.get(s)?.spec.shares
    }

    /// The class served next here: the highest class waiting, or with
    /// shares the class whose oldest waiter has the earliest turn.
    fn next_class(l: &Local, shares: bool) -> Option<usize> {
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

    /// This worker's two most deserving waiters of shedder `s`, as claims
    /// (with shares, a claim's `since_ms` is its waiter's turn).
    fn heads(&self, s: usize) -> (Option<Claim>, Option<Claim>) {
        let Some(l) = self.local.get(s) else {
            return (None, None);
        };
        let counts = l
            .queues
            .each_ref()
            .map(|q| u32::try_from(q.len()).unwrap_or(u32::MAX));
        // By class, the class's last turn here as `Clocks::next` counts
        // it: its newest waiter's (turns only grow along a class's queue,
        // as `turn_of` reads it too), or its last admission's.
        let newest: [u64; 3] = std::array::from_fn(|c| {
            let waiting = l.queues.get(c).and_then(|q| q.back()).map(|w| w.turn_ms);
            waiting.max(l.clocks.admitted(c, self.now_ms)).unwrap_or(0)
        });
        let claim = |w: &Waiter| Claim {
            class: w.class,
            since_ms: w.turn_ms,
            worker: self.worker,
            seen_ms: self.now_ms,
            counts,
            newest,
        };
        if self.shares(s).is_none() {
            let mut best = l.queues.iter().rev().flat_map(|q| q.iter().take(2));
            return (best.next().map(claim), best.next().map(claim));
        }
        let mut two: Vec<&Waiter> = l.queues.iter().flat_map(|q| q.iter().take(2)).collect();
        crate::sort::small_by_key(&mut two, |w| by_turn(w.turn_ms, w.class));
        (two.first().map(|w| claim(w)), two.get(1).map(|w| claim(w)))
    }

    /// This worker's best waiter once an admission has taken one: the one
    /// after the head, or, under LIFO, the head itself (the newest of its
    /// class goes instead) unless it was alone in its class.
    fn best_after_admit(
        &self,
        s: usize,
        head: Option<Claim>,
        second: Option<Claim>,
    ) -> Option<Claim> {
        let lifo = self.rules.get(s).is_some_and(|r| r.spec.lifo);
        let takes_newest = lifo
            && self.local.get(s).is_some_and(|l| {
                l.codel.overloaded
                    && head.is_some_and(|h| {
                        l.queues.get(h.class as usize).is_some_and(|q| q.len() > 1)
                    })
            });
        if takes_newest {
            head
        } else {
            second
        }
    }

    /// Takes the next waiter to admit out of this worker's queue: of the
    /// class served next, the oldest, or the newest while overloaded with
    /// `lifo` (the requests still most likely to be wanted).
    fn pop_next(&mut self, s: usize) -> Option<Waiter> {
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

    /// Applies `op` to the shared entry by CAS, and keeps this worker's
    /// claim up to date (see `Shared`). Returns whether the op took effect
    /// (admissions need a free slot, and no other worker's claim before
    /// the waiter).
    fn counter(&mut self, store: &dyn Store, s: usize, op: Op) -> Result<bool, StoreError> {
        let Some(rule) = self.rules.get(s) else {
            return Ok(false);
        };
        let key = rule.inflight_key.clone();
        // This worker's best waiter now, and once the op is done.
        let (head, second) = self.heads(s);
        let after_admit = self.claim_after_admit(s, head, second);
        let change = Change {
            op,
            by_age: self.shares(s).is_some(),
            max: self.limit(s).unwrap_or(u32::MAX as u64),
            lease: self.local.get(s).map_or(0, |l| l.lease),
            head,
            head_after: if op == Op::Admit { after_admit } else { head },
            me: self.worker,
            now: self.now_ms,
        };
        let (granted, read) = apply_op(
            store,
            (&key, self.max_retries),
            &mut self.store_failures,
            &change,
        );
        if let Some(n) = read.admitted {
            self.read_entry(s, op.timely(), read.seen, n);
        }
        if let Some(w) = read.wake {
            if !self.wakes.contains(&w) {
                self.wakes.push(w);
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
                self.observe_turns(s, read.oldest_other);
            } else {
                self.observe_global(s, read.oldest_other, head.map(|c| c.since_ms));
            }
        }
        Ok(granted.is_some())
    }

    /// This worker's claim once an admission has taken its head: the
    /// waiter after it, with the counts once the head is gone and its
    /// class's last turn (with shares, a claim's `since_ms` is its turn).
    fn claim_after_admit(
        &self,
        s: usize,
        head: Option<Claim>,
        second: Option<Claim>,
    ) -> Option<Claim> {
        self.best_after_admit(s, head, second).map(|mut c| {
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
    fn read_entry(&mut self, s: usize, timely: bool, seen: Elsewhere, admitted: u64) {
        let (early, window_ms) = self.early(s);
        if let Some(l) = self.local.get_mut(s) {
            l.elsewhere = seen;
            if early && timely {
                l.rate.saw(self.now_ms, admitted, window_ms);
            }
        }
    }

    /// With shares, claims carry turns, not arrival times: the earliest
    /// turn another worker claims keeps this worker's clock in step with
    /// theirs, and only this worker's own waiters tell how long the queue
    /// has stood.
    fn observe_turns(&mut self, s: usize, other_turn: Option<u64>) {
        if let (Some(t), Some(l)) = (other_turn, self.local.get_mut(s)) {
            let mine = l
                .queues
                .iter()
                .filter_map(|q| q.front())
                .map(|w| w.turn_ms)
                .min();
            l.clocks.seen(mine.map_or(t, |m| m.min(t)), self.now_ms);
        }
        // The oldest waiter here, wherever it stands: a class's queue is in
        // order of turns, and an owed turn puts a new arrival before older
        // waiters of its class.
        let own = self
            .local
            .get(s)
            .and_then(|l| l.queues.iter().flatten().map(|w| w.since_ms).min());
        self.observe_global(s, None, own);
    }

    /// What a worker keeps of an op on the shared entry: the most in
    /// flight it saw (for the adaptive limit), and a direct admission's
    /// lease top-up.
    fn note_op(&mut self, s: usize, op: Op, granted: Option<u64>, inflight_seen: u64) {
        let Some(l) = self.local.get_mut(s) else {
            return;
        };
        l.samples.peak_inflight = l.samples.peak_inflight.max(inflight_seen + 1);
        // In full use: what was in flight before the op, or after it for
        // an admission that took a slot (a release counts the request it
        // ends).
        let took = matches!(op, Op::Direct | Op::Admit) && granted.is_some();
        let in_use = inflight_seen + u64::from(took);
        l.full |= l.auto.as_ref().is_some_and(|a| in_use >= a.limit());
        if op == Op::Direct {
            // Calm while a direct admission is granted a lease top-up; a
            // refused one (`None`: at the limit, or waiters) is not calm.
            l.calm = granted.is_some_and(|g| g > 0);
            l.lease += granted.unwrap_or(0);
        }
    }

    /// Creates the shared counters (at configuration).
    pub fn create(&self, store: &dyn Store) -> Result<(), StoreError> {
        for r in self.rules.iter().filter(|r| r.spec.concurrency.is_some()) {
            if store.get(&r.inflight_key)?.is_none() {
                store.set(&r.inflight_key, &encode_shared(&Shared::default()), None)?;
            }
        }
        Ok(())
    }

    /// Reads each adaptive limit's shared entry (at configuration: an
    /// unchanged shedder keeps what it learned).
    pub fn read_limits(&mut self, store: &dyn Store) {
        for (r, l) in self.rules.iter().zip(self.local.iter_mut()) {
            let Some(key) = &r.auto_key else { continue };
            if let Ok(Some(e)) = store.get(key) {
                if let Ok(a) = Auto::decode(&e.bytes) {
                    l.auto = Some(a);
                }
            }
        }
    }

    /// `Some(true)`: done; `Some(false)`: no slot; `None`: store trouble
    /// (the request is then let through without a slot: fail open).
    fn try_op(&mut self, store: &dyn Store, s: usize, op: Op) -> Option<bool> {
        match self.counter(store, s, op) {
            Ok(done) => Some(done),
            Err(_) => {
                self.store_failures += 1;
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

    /// Whether decrements that failed are waiting to be retried.
    pub fn has_retries(&self) -> bool {
        !self.retry.is_empty()
    }

    /// Whether latency samples gathered here should be merged on the next
    /// millisecond rather than the slow tick: once an op on the shared
    /// entry since the last merge found the limit in full use, as
    /// under overload, where the rate of responses decides how far the
    /// limit grows after a rise in capacity and how far it shrinks after
    /// a fall. A batch merged on the slow tick may span up to 100 ms, and
    /// an interval with such a batch cannot count the rate
    /// (`adaptive::RATE_SPANS`): its latency alone, which lags the limit,
    /// then decides. Merged on the slow tick, about a fifth of the
    /// intervals of `bench/overload.py` would go so, in some rounds nearly
    /// all: the limit shrinks from 13 to 7 on 8 slots, and floor
    /// measurements started from such intervals hold 6 on 8 slots. Not
    /// while the limit is partly used: a worker serving one request at a
    /// time would then pay a tick per response (+24% instructions per
    /// request in `rl_shed_auto`).
    pub fn merge_soon(&self) -> bool {
        self.local.iter().any(|l| l.full && l.samples.count > 0)
    }

    fn retry_failed(&mut self, store: &dyn Store) {
        for (s, op) in std::mem::take(&mut self.retry) {
            if self.counter(store, s, op).is_err() {
                self.retry.push((s, op));
            }
        }
    }

    /// Decides on an arriving request of `class` (stream `id`).
    pub fn arrive(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        s: usize,
        id: u32,
        class: Class,
    ) -> Arrival {
        self.arrive_until(store, now_ms, s, (id, class), None)
    }

    /// Like `arrive`, for a request whose caller gives up at `deadline_ms`:
    /// it never waits past it.
    pub fn arrive_until(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        s: usize,
        (id, class): (u32, Class),
        deadline_ms: Option<u64>,
    ) -> Arrival {
        self.now_ms = self.now_ms.max(now_ms);
        self.roll(s, now_ms);
        let Some(rule) = self.rules.get(s) else {
            return Arrival::Admit { slot: false };
        };
        let Some(conc) = rule.spec.concurrency.clone() else {
            return self.latency_arrival(s, now_ms, class);
        };
        let shares = rule.spec.shares.is_some();
        // Waiters of a higher or equal class go first (with shares, every
        // waiter: the arrival's class may not be the one served next).
        let skip = if shares { 0 } else { class as usize };
        let ahead = self.local.get(s).map_or(0, |l| {
            l.queues.iter().skip(skip).map(VecDeque::len).sum::<usize>()
        });
        if ahead > 0 && shares {
            self.look(store, s, now_ms);
        }
        let mut turn_ms = self.turn_of(s, class, now_ms);
        if ahead == 0 {
            if let Some(admitted) = self.admit_at_once(store, now_ms, s, (class, turn_ms)) {
                return admitted;
            }
            // Its op read the entry: the turn by what it said.
            turn_ms = self.turn_of(s, class, now_ms);
        }
        if conc.shed_early {
            let places = self.places(s, class, turn_ms, now_ms);
            if let Some(early) = self.sheds_early(s, (class, places), &conc, now_ms, deadline_ms) {
                return early;
            }
        }
        let waiter = Waiter {
            id,
            class,
            since_ms: now_ms,
            turn_ms,
            deadline_ms,
        };
        self.enqueue(store, s, waiter, &conc)
    }

    /// Latency mode (no concurrency limit): CoDel alone decides.
    fn latency_arrival(&mut self, s: usize, now_ms: u64, class: Class) -> Arrival {
        let shed = self
            .local
            .get_mut(s)
            .is_some_and(|l| l.codel.shed_on_arrival(now_ms, class));
        if shed {
            Arrival::Shed
        } else {
            Arrival::Admit { slot: false }
        }
    }

    /// With shares, before an arrival on a worker that has waiters takes
    /// its turn (no op of its own has read the entry then): reads the
    /// other workers' claims afresh, so that its class's next turn follows
    /// their newest (a view some arrivals old gives two workers the same
    /// turns, and a class waiting on both more than its share).
    fn look(&mut self, store: &dyn Store, s: usize, now_ms: u64) {
        let Some(rule) = self.rules.get(s) else {
            return;
        };
        let me = self.worker;
        let entry = store.get(&rule.inflight_key).ok().flatten();
        if let Some(entry) = entry.and_then(|e| decode_shared(&e.bytes)) {
            let seen = Elsewhere::of(&entry, |c| entry::live(c, me, now_ms));
            self.read_entry(s, true, seen, entry.admitted);
        }
    }

    /// Whether shedder `s` sheds early, and its interval (ms).
    fn early(&self, s: usize) -> (bool, u64) {
        self.rules.get(s).map_or((false, 0), |r| {
            let early = r.spec.concurrency.as_ref().is_some_and(|c| c.shed_early);
            (early, r.spec.interval_ms)
        })
    }

    /// The turn of an arrival of `class` (with shares; else `now_ms`).
    fn turn_of(&self, s: usize, class: Class, now_ms: u64) -> u64 {
        let (Some(sh), Some(l)) = (self.shares(s), self.local.get(s)) else {
            return now_ms;
        };
        // One step after the class's newest waiter on any worker (as this
        // worker last read the others' claims): a class waiting on two
        // workers gets one sequence of turns, not one on each.
        let here = l
            .queues
            .get(class as usize)
            .and_then(|q| q.back())
            .map(|w| w.turn_ms);
        let c = class as usize;
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
    fn places(&self, s: usize, class: Class, turn: u64, now_ms: u64) -> u64 {
        let (Some(rule), Some(l)) = (self.rules.get(s), self.local.get(s)) else {
            return 1;
        };
        let me = by_turn(turn, class);
        let count = |c: usize| {
            l.queues.get(c).map_or(0, |q| q.len() as u64)
                + l.elsewhere.counts.get(c).copied().unwrap_or(0)
        };
        let ahead = match rule.spec.shares {
            // A share-0 turn is not a place in line: it goes when nobody
            // else waits.
            Some(sh) if sh.get(class as usize).is_some_and(|&x| x > 0) => {
                let here = l
                    .queues
                    .iter()
                    .flatten()
                    .filter(|w| by_turn(w.turn_ms, w.class) < me)
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
    fn sheds_early(
        &mut self,
        s: usize,
        (class, places): (Class, u64),
        conc: &config::ConcurrencySpec,
        now_ms: u64,
        deadline_ms: Option<u64>,
    ) -> Option<Arrival> {
        let rule = self.rules.get(s)?;
        let (by_class, window_ms) = (rule.spec.shares.is_none(), rule.spec.interval_ms);
        let l = self.local.get_mut(s)?;
        if l.queues.iter().all(VecDeque::is_empty) {
            return None;
        }
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
    fn admit_at_once(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        s: usize,
        (class, turn): (Class, u64),
    ) -> Option<Arrival> {
        if let Some(l) = self.local.get_mut(s).filter(|l| l.lease > 0) {
            l.lease -= 1;
            self.observe(s, now_ms, 0);
            self.admitted(s, now_ms, (class, turn), false);
            return Some(Arrival::Admit { slot: true });
        }
        let admitted = match self.try_op(store, s, Op::Direct) {
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
    fn admitted(&mut self, s: usize, now_ms: u64, (class, turn): (Class, u64), queued: bool) {
        let Some(rule) = self.rules.get(s) else {
            return;
        };
        let shares = rule.spec.shares.is_some();
        if let Some(l) = self.local.get_mut(s) {
            match (shares, queued) {
                (false, _) => {}
                (true, true) => l.clocks.served(class as usize, turn, now_ms),
                (true, false) => l.clocks.took(class as usize, turn, now_ms),
            }
        }
    }

    /// Queues a waiter, or sheds it (or, when the queue is full, the newest
    /// waiter of a lower class to make room).
    fn enqueue(
        &mut self,
        store: &dyn Store,
        s: usize,
        w: Waiter,
        conc: &config::ConcurrencySpec,
    ) -> Arrival {
        let shares = self.shares(s);
        let by_class = shares.is_none();
        let Some(l) = self.local.get_mut(s) else {
            return Arrival::Shed;
        };
        // With shares, CoDel's thresholds by class do not apply (they would
        // shed a class before its share comes round): max_wait bounds waits.
        if (by_class && l.codel.threshold(w.class) == Some(0)) || conc.queue == 0 {
            l.codel.shed(w.since_ms);
            return Arrival::Shed;
        }
        let mut evicted = None;
        if l.queues.iter().map(VecDeque::len).sum::<usize>() >= conc.queue as usize {
            l.codel.shed(w.since_ms);
            match full_queue_victim(&mut l.queues, &w, shares) {
                Some(v) => evicted = Some(v),
                None => return Arrival::Shed,
            }
        }
        if let Some(q) = l.queues.get_mut(w.class as usize) {
            // With shares, in order of turns (a class's turns only grow
            // along its queue, but for a turn owed by a waiter that left).
            let at = q
                .iter()
                .rposition(|o| by_class || o.turn_ms <= w.turn_ms)
                .map_or(0, |i| i + 1);
            q.insert(at, w);
        }
        l.clocks.paid(w.class as usize, w.turn_ms);
        // An eviction leaves the count as it is; either way the new
        // waiter may now be this worker's best (its claim).
        let op = if evicted.is_none() {
            Op::Enqueue
        } else {
            Op::Requeue
        };
        self.try_op(store, s, op);
        Arrival::Queue { evicted }
    }

    /// Takes out of the queue the waiters whose deadline passed or who
    /// waited their limit (`max_wait`, or less for their class while
    /// overloaded), each as a wake to answer.
    fn drop_expired(
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

    /// Slots leased by this worker for shedder `s` (for tests and metrics).
    pub fn leased(&self, s: usize) -> u64 {
        self.local.get(s).map_or(0, |l| l.lease)
    }

    /// With shares, waiter `w` left shedder `s` without being admitted:
    /// if its class has later turns (waiting here, or waiting or admitted
    /// on another worker as its claim last said), the turn is owed to one
    /// of the class's next arrivals here (see `Clocks::left`); if it was
    /// its class's newest, the class's next turn falls back to it anyway.
    fn left(&mut self, s: usize, w: Waiter, now_ms: u64) {
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

    /// Latency mode: a request was let through at shedder `s` (its answer
    /// will be a sample).
    pub fn started(&mut self, s: usize) {
        if let Some(l) = self.local.get_mut(s) {
            l.codel.started();
        }
    }

    /// Latency mode: a request let through at shedder `s` ended without an
    /// answer (reset, client gone, refused later).
    pub fn abandoned(&mut self, s: usize) {
        if let Some(l) = self.local.get_mut(s) {
            l.codel.finished();
        }
    }

    /// Latency mode: records a response's upstream latency (or the queue
    /// time the upstream reported) as a delay sample.
    pub fn response(&mut self, now_ms: u64, s: usize, latency_ms: u64, reported_ms: Option<u64>) {
        let Some(window) = self.rules.get(s).map(|r| r.spec.latency.floor_window_ms) else {
            return;
        };
        let Some(l) = self.local.get_mut(s) else {
            return;
        };
        l.codel.finished();
        // The floor is the minimum over the last one to two half-windows.
        if now_ms.saturating_sub(l.floor_rotated_ms) >= window / 2 {
            l.floor_previous = l.floor_current.take();
            l.floor_rotated_ms = now_ms;
        }
        l.floor_current = Some(l.floor_current.map_or(latency_ms, |m| m.min(latency_ms)));
        let floor = l
            .floor_current
            .into_iter()
            .chain(l.floor_previous)
            .min()
            .unwrap_or(latency_ms);
        let delay = reported_ms.unwrap_or(latency_ms.saturating_sub(floor));
        self.observe(s, now_ms, delay);
    }
}

/// Makes room in a full queue for `w`: takes out and returns the waiter to
/// shed in its place, or `None` when `w` itself is the one to shed.
/// By priority (no `shares`): the newest waiter of the lowest class below
/// `w`'s. With shares: the waiter that would be served last, the latest
/// turn (a class's newest, as turns grow along its queue), unless `w`'s
/// own turn is as late. Shedding by turn keeps each class's waiters in
/// proportion to its share; shedding the lowest class first would keep it
/// out of a full queue, and below its share.
fn full_queue_victim(
    queues: &mut [VecDeque<Waiter>; 3],
    w: &Waiter,
    shares: Option<[u32; 3]>,
) -> Option<Waiter> {
    let victim = if shares.is_some() {
        queues
            .iter_mut()
            .filter(|q| q.back().is_some_and(|b| b.turn_ms > w.turn_ms))
            .max_by_key(|q| q.back().map(|b| b.turn_ms))
    } else {
        let mut lower = queues.iter_mut().take(w.class as usize);
        lower.find(|q| !q.is_empty())
    };
    victim.and_then(VecDeque::pop_back)
}
