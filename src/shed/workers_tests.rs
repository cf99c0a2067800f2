//! Shedders across workers: claims on the shared entry, wakes, leases,
//! conservation of slots, learning an adaptive limit together.

use super::codec::{decode_shared, Claim, CLAIM_REFRESH_MS, CLAIM_TTL_MS, MAX_CLAIMS};
use super::tests::*;
use super::*;
use crate::pipeline::telemetry::Registry;
use crate::store::memory::{views, MemoryStore};
use crate::wiring::parse;
use std::rc::Rc;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Two workers a and b over one store (`QUEUE`, 2 slots): b holds both
/// slots (critical requests 1 and 2, at T0); a's critical request 3 waits
/// since T0 + 1, then b's critical request 4 since T0 + 2.
fn two_workers_waiting() -> (Worker, Worker, MemoryStore) {
    let (mut a, store) = shedders(QUEUE);
    let (mut b, _) = shedders(QUEUE);
    for id in 1..=2 {
        b.arrive(&store, T0, 0, id, Class::Critical);
    }
    assert_eq!(
        a.arrive(&store, T0 + 1, 0, 3, Class::Critical),
        Arrival::Queue { evicted: None }
    );
    assert_eq!(
        b.arrive(&store, T0 + 2, 0, 4, Class::Critical),
        Arrival::Queue { evicted: None }
    );
    (a, b, store)
}

#[test]
fn a_freed_slot_goes_to_an_older_waiter_on_another_worker() {
    let (mut a, mut b, store) = two_workers_waiting();
    let _ = (a.take_wakes(), b.take_wakes());
    // b's request ends: b does not hand the slot to its own, younger waiter...
    b.release(&store, 0);
    assert_eq!(b.wake(&store, T0 + 3, 0), vec![]);
    // ...but wakes a at once (once), whose wake-up takes it.
    assert_eq!(b.take_wakes(), vec![a.worker()]);
    assert!(a.take_wakes().is_empty());
    assert_eq!(
        a.wake(&store, T0 + 4, 0),
        vec![Wake::Resume {
            id: 3,
            waited_ms: 3,
            slot: true
        }]
    );
    // Taking the slot left no other free: nobody to wake.
    assert!(a.take_wakes().is_empty());
    // The next slot that frees is b's waiter's: a wakes b.
    a.release(&store, 0);
    assert_eq!(a.take_wakes(), vec![b.worker()]);
    assert_eq!(
        b.wake(&store, T0 + 5, 0),
        vec![Wake::Resume {
            id: 4,
            waited_ms: 3,
            slot: true
        }]
    );
    assert_eq!(counters(&store), (2, 0));
    // Nobody waits: a release wakes nobody.
    b.release(&store, 0);
    assert!(a.take_wakes().is_empty() && b.take_wakes().is_empty());
}

#[test]
fn a_freed_slot_its_own_worker_takes_wakes_nobody() {
    let (mut a, store) = shedders(QUEUE);
    let (mut b, _) = shedders(QUEUE);
    for id in 1..=2 {
        b.arrive(&store, T0, 0, id, Class::Critical);
    }
    // b's waiter is older than a's: the slot b frees is b's own.
    b.arrive(&store, T0 + 1, 0, 3, Class::Critical);
    a.arrive(&store, T0 + 2, 0, 4, Class::Critical);
    b.release(&store, 0);
    assert!(matches!(
        b.wake(&store, T0 + 3, 0).as_slice(),
        [Wake::Resume { id: 3, .. }]
    ));
    assert!(b.take_wakes().is_empty() && a.take_wakes().is_empty());
}

#[test]
fn a_higher_class_waiting_on_another_worker_goes_first() {
    let (mut a, store) = shedders(QUEUE);
    let (mut b, _) = shedders(QUEUE);
    for id in 1..=2 {
        b.arrive(&store, T0, 0, id, Class::Default);
    }
    // b's default waiter is older than a's critical one.
    b.arrive(&store, T0 + 1, 0, 3, Class::Default);
    a.arrive(&store, T0 + 2, 0, 4, Class::Critical);
    b.release(&store, 0);
    assert_eq!(b.wake(&store, T0 + 3, 0), vec![]);
    assert!(matches!(
        a.wake(&store, T0 + 3, 0).as_slice(),
        [Wake::Resume { id: 4, .. }]
    ));
}

#[test]
fn a_claim_its_worker_stopped_rewriting_is_ignored_after_its_ttl() {
    let (a, mut b, store) = two_workers_waiting();
    // a is never heard of again (its VM is gone).
    drop(a);
    b.release(&store, 0);
    // Until the claim's TTL is over, b leaves the slot to a's waiter...
    assert_eq!(b.wake(&store, T0 + 3, 0), vec![]);
    assert_eq!(b.wake(&store, T0 + 1 + CLAIM_TTL_MS, 0), vec![]);
    // ...then takes it.
    assert_eq!(
        b.wake(&store, T0 + 2 + CLAIM_TTL_MS, 0),
        vec![Wake::Resume {
            id: 4,
            waited_ms: CLAIM_TTL_MS,
            slot: true
        }]
    );
    assert_eq!(shared(&store).claims, vec![]);
}

#[test]
fn a_live_worker_keeps_its_claim_alive_and_a_claim_dated_ahead_is_dead() {
    let (mut a, mut b, store) = two_workers_waiting();
    // a polls every millisecond while it waits: its claim is rewritten
    // every CLAIM_REFRESH_MS, not on every poll.
    let sets = store.sets.get();
    for t in 2..=200 {
        assert_eq!(a.wake(&store, T0 + t, 0), vec![]);
    }
    let writes = store.sets.get() - sets;
    assert!((19..=21).contains(&writes), "{writes} writes");
    b.release(&store, 0);
    assert_eq!(b.wake(&store, T0 + 200, 0), vec![]);
    assert!(matches!(
        a.wake(&store, T0 + 201, 0).as_slice(),
        [Wake::Resume { id: 3, .. }]
    ));
    // A claim written with a clock far ahead (or by someone hostile) is
    // not honoured either.
    let mut v = shared(&store);
    v.claims = vec![Claim {
        class: Class::Critical,
        since_ms: 0,
        worker: u32::MAX, // no test worker's tag
        seen_ms: T0 + 10_000,
        counts: [0, 0, 1],
        newest: [0, 0, 0],
    }];
    store.raw_set(&b.all[0].inflight_key, &encode_shared(&v));
    b.release(&store, 0);
    assert!(matches!(
        b.wake(&store, T0 + 202, 0).as_slice(),
        [Wake::Resume { id: 4, .. }]
    ));
}

#[test]
fn a_refused_waiter_whose_claim_cannot_be_written_stays_queued() {
    let (mut a, store) = shedders(QUEUE);
    for id in 1..=2 {
        a.arrive(&store, T0, 0, id, Class::Critical);
    }
    a.arrive(&store, T0, 0, 3, Class::Critical);
    // Its claim is due to be rewritten, and every write conflicts (another
    // writer each time): the waiter stays queued, not let in without a
    // slot as it would be when the store fails.
    *store.before_set.borrow_mut() = Some(Box::new(|s: &MemoryStore, key: &str| {
        let bytes = s.map.borrow().get(key).map(|(b, _)| b.clone());
        if let Some(b) = bytes {
            s.raw_set(key, &b);
        }
    }));
    assert_eq!(a.wake(&store, T0 + CLAIM_REFRESH_MS, 0), vec![]);
    *store.before_set.borrow_mut() = None;
    assert_eq!((a.queued(0), counters(&store)), (1, (2, 1)));
}

#[test]
fn the_shared_entry_round_trips_and_rejects_what_does_not_decode() {
    let claim = |class, worker| Claim {
        class,
        since_ms: T0,
        worker,
        seen_ms: T0 + 5,
        counts: [1, 0, 700],
        newest: [T0, 0, T0 + 1],
    };
    let v = Shared {
        inflight: 7,
        waiting: 3,
        admitted: u64::MAX - 1,
        last: [T0, 0, T0 + 7],
        claims: vec![
            claim(Class::Critical, 1),
            claim(Class::Sheddable, 0xdead_beef),
        ],
    };
    assert_eq!(decode_shared(&encode_shared(&v)), Some(v.clone()));
    // Nobody waiting: the three counters alone.
    let idle = Shared {
        claims: Vec::new(),
        ..v.clone()
    };
    assert_eq!(encode_shared(&idle).len(), 48);
    assert_eq!(decode_shared(&encode_shared(&idle)), Some(idle));
    // A class byte out of range, a cut claim, claims out of order, too
    // many claims: corrupt.
    let mut bad = encode_shared(&v);
    bad[48] = 3;
    assert_eq!(decode_shared(&bad), None);
    let good = encode_shared(&v);
    assert_eq!(decode_shared(&good[..good.len() - 1]), None);
    assert_eq!(decode_shared(&good[..47]), None);
    let unsorted = Shared {
        claims: v.claims.iter().rev().copied().collect(),
        ..v.clone()
    };
    assert_eq!(decode_shared(&encode_shared(&unsorted)), None);
    let many = Shared {
        claims: vec![claim(Class::Default, 1); MAX_CLAIMS + 1],
        ..v.clone()
    };
    assert_eq!(decode_shared(&encode_shared(&many)), None);
    // Counts no shedder could reach (found by the `store` fuzz target: kept,
    // the next admission's count overflowed): corrupt; up to 2^32 - 1, read.
    for (inflight, waiting) in [(u64::MAX, 0), (0, u64::MAX), (1 << 32, 0)] {
        let huge = Shared {
            inflight,
            waiting,
            ..v.clone()
        };
        assert_eq!(
            decode_shared(&encode_shared(&huge)),
            None,
            "{inflight} {waiting}"
        );
    }
    let most = Shared {
        inflight: u64::from(u32::MAX),
        waiting: u64::from(u32::MAX),
        ..v
    };
    assert_eq!(decode_shared(&encode_shared(&most)), Some(most.clone()));
}

#[test]
fn property_every_client_gets_its_turn_whichever_worker_it_is_on() {
    // As in the end-to-end test: an upstream taking 20 ms, 2 slots, and
    // closed-loop clients of one class, 1 on worker a and 5 on worker b.
    // A request that ends is released on its worker, which then wakes its
    // own queue at once; every worker also wakes on its 1 ms tick. Every
    // request is admitted in turn: every client gets the same share,
    // whichever worker it is on. (Without the claims, each worker kept
    // the slots that ended on it: a's client got half of all.)
    const TWO: &str =
        r#"{"shedders":[{"name":"q","concurrency":{"max":2,"queue":8,"max_wait":"500ms"}}]}"#;
    for remembering in [false, true] {
        let (w0, store) = shedders(TWO);
        let (w1, _) = shedders(TWO);
        let mut workers = [w0, w1];
        let store = Rc::new(store);
        let views = views(&store, 2, remembering);
        let clients: [usize; 6] = [0, 1, 1, 1, 1, 1];
        // Per client: Some(done_at) while it holds a slot.
        let mut busy: Vec<Option<u64>> = vec![None; clients.len()];
        let mut served = [0u32; 6];
        let mut max_waited = 0;
        let ids = |c: usize, n: u32| n * 8 + c as u32;
        let mut n = 0u32;
        let start = |w: &mut Worker, view: &dyn Store, now: u64, c: usize, n: u32| {
            let got = w.arrive(view, now, 0, ids(c, n), Class::Critical);
            assert_ne!(got, Arrival::Shed);
            got
        };
        for (c, &w) in clients.iter().enumerate() {
            if start(&mut workers[w], &*views[w], T0, c, n) == (Arrival::Admit { slot: true }) {
                busy[c] = Some(T0 + 20);
            }
        }
        for now in T0 + 1..T0 + 5_000 {
            for w in 0..2 {
                // Requests ending on worker w: release, re-arrive, wake.
                let ending: Vec<usize> = (0..clients.len())
                    .filter(|&c| clients[c] == w && busy[c] == Some(now))
                    .collect();
                for c in ending {
                    busy[c] = None;
                    served[c] += 1;
                    n += 1;
                    workers[w].release(&*views[w], 0);
                    if start(&mut workers[w], &*views[w], now, c, n)
                        == (Arrival::Admit { slot: true })
                    {
                        busy[c] = Some(now + 20);
                    }
                }
                for wake in workers[w].wake(&*views[w], now, 0) {
                    match wake {
                        Wake::Resume {
                            id,
                            waited_ms,
                            slot,
                        } => {
                            assert!(slot);
                            max_waited = max_waited.max(waited_ms);
                            busy[(id % 8) as usize] = Some(now + 20);
                        }
                        Wake::Shed { waiter } | Wake::Expired { waiter } => {
                            panic!("shed {waiter:?}")
                        }
                    }
                }
            }
            assert!(busy.iter().filter(|b| b.is_some()).count() <= 2);
        }
        // 6 clients on 2 slots: each waits for the 2 ahead of it (40 ms),
        // and a tick at most for a slot that frees on the other worker.
        assert!(max_waited <= 42, "max waited {max_waited} ms");
        let total: u32 = served.iter().sum();
        assert!(total > 480, "served {total}");
        for &n in &served {
            assert!(
                n * 6 * 100 > total * 97 && n * 6 * 100 < total * 103,
                "shares {served:?}"
            );
        }
    }
}

/// Three simulated workers over one store, and what the test driving
/// them knows: the streams holding a slot and the streams waiting, by worker.
struct Sim {
    workers: [Worker; 3],
    store: Rc<MemoryStore>,
    /// Each worker's access to the store: the store itself, or its own
    /// `Remembering` layer over it (as each Envoy worker VM has).
    views: Vec<Rc<dyn Store>>,
    held: Vec<(usize, u32)>,
    queued: Vec<(usize, u32)>,
    /// The latest time the test drove any worker at.
    now: u64,
    /// When each worker was last driven.
    driven: [u64; 3],
}

impl Sim {
    fn new(json: &str, remembering: bool) -> Self {
        let (w0, store) = shedders(json);
        let (w1, _) = shedders(json);
        let (w2, _) = shedders(json);
        let store = Rc::new(store);
        let views = views(&store, 3, remembering);
        Sim {
            workers: [w0, w1, w2],
            store,
            views,
            held: Vec::new(),
            queued: Vec::new(),
            now: T0,
            driven: [T0; 3],
        }
    }

    fn arrive(&mut self, w: usize, now: u64, id: u32, class: Class) {
        self.now = now;
        self.driven[w] = now;
        match self.workers[w].arrive(&*self.views[w], now, 0, id, class) {
            Arrival::Admit { slot: true } => self.held.push((w, id)),
            Arrival::Queue { evicted } => {
                self.queued.push((w, id));
                if let Some(e) = evicted {
                    self.queued.retain(|q| q.1 != e.id);
                }
            }
            _ => {}
        }
    }

    fn release(&mut self, i: usize) {
        let (hw, _) = self.held.remove(i);
        self.driven[hw] = self.now;
        self.workers[hw].release(&*self.views[hw], 0);
    }

    fn cancel(&mut self, i: usize) {
        let (qw, qid) = self.queued.remove(i);
        self.driven[qw] = self.now;
        assert!(self.workers[qw].cancel(&*self.views[qw], 0, qid));
    }

    fn wake(&mut self, w: usize, now: u64) {
        self.now = now;
        self.driven[w] = now;
        for wake in self.workers[w].wake(&*self.views[w], now, 0) {
            match wake {
                Wake::Resume { id, slot, .. } => {
                    assert!(slot);
                    self.queued.retain(|q| q.1 != id);
                    self.held.push((w, id));
                }
                Wake::Shed { waiter } | Wake::Expired { waiter } => {
                    self.queued.retain(|q| q.1 != waiter.id)
                }
            }
        }
    }

    fn leased(&self) -> u64 {
        self.workers.iter().map(|x| x.leased(S0)).sum()
    }
}

#[test]
fn property_slots_are_conserved_across_random_workers() {
    // Random arrivals, completions, cancellations and wakes on 3 workers:
    // the shared counter always equals the slots held, never exceeds max.
    // With each worker remembering its writes, the same holds, on fewer
    // reads.
    let reads = slots_are_conserved(false);
    assert!(slots_are_conserved(true) < reads * 95 / 100);
}

/// Returns the reads the workers made.
fn slots_are_conserved(remembering: bool) -> u32 {
    let mut rng = crate::rng::SplitMix(3);
    let mut sim = Sim::new(QUEUE, remembering);
    let mut now = T0;
    for id in 0..3000u32 {
        now += rng.below(5);
        let w = rng.below(3) as usize;
        match rng.below(4) {
            0 => {
                let class =
                    [Class::Sheddable, Class::Default, Class::Critical][rng.below(3) as usize];
                sim.arrive(w, now, id, class);
            }
            1 if !sim.held.is_empty() => sim.release(rng.below(sim.held.len() as u64) as usize),
            2 if !sim.queued.is_empty() => sim.cancel(rng.below(sim.queued.len() as u64) as usize),
            _ => sim.wake(w, now),
        }
        assert_eq!(
            counters(&sim.store),
            (sim.held.len() as u64, sim.queued.len() as u64)
        );
        assert_eq!(sim.leased(), 0); // a limit of 2: no leases
                                     // Each worker's claim is its best waiter, while the worker is
                                     // driven often enough for its claim to live.
        let shared = shared(&sim.store);
        for (w, last) in sim.workers.iter().zip(sim.driven) {
            let mine: Vec<_> = shared
                .claims
                .iter()
                .filter(|c| c.worker == w.worker)
                .collect();
            match w.sh.heads(&w.lines, S0).0 {
                Some(h) if last + CLAIM_TTL_MS - CLAIM_REFRESH_MS > now => {
                    assert!(matches!(mine.as_slice(), [c] if c.same(&h)))
                }
                Some(h) => assert!(mine.iter().all(|c| c.same(&h))),
                None => assert!(mine.is_empty()),
            }
        }
        // No slot is left free while someone waits once every worker polls.
        if id % 50 == 0 {
            for _ in 0..3 {
                for w in 0..3 {
                    sim.wake(w, now);
                }
            }
            assert!(sim.held.len() == 2 || sim.queued.is_empty());
        }
        assert!(sim.held.len() <= 2);
        assert!(sim.workers.iter().all(|x| x.queued(0) <= 3));
    }
    sim.store.gets.get()
}

const LEASED: &str =
    r#"{"shedders":[{"name":"q","concurrency":{"max":128,"queue":8,"max_wait":"500ms"}}]}"#;

#[test]
fn a_worker_leases_slots_while_far_from_the_limit_and_returns_them_on_a_tick() {
    assert_eq!(lease_cap(63), 0);
    assert_eq!(lease_cap(64), 2);
    assert_eq!(lease_cap(128), 4);
    assert_eq!(lease_cap(100_000), 32);
    let (mut w, store) = shedders(LEASED);
    // The first arrival takes its slot and a lease of 4 in one write.
    assert_eq!(
        w.arrive(&store, T0, 0, 1, Class::Default),
        Arrival::Admit { slot: true }
    );
    assert_eq!((inflight(&store), w.leased(S0)), (5, 4));
    let sets = store.sets.get();
    // The next four use the lease; their releases refill it: no store writes.
    for id in 2..6 {
        assert_eq!(
            w.arrive(&store, T0, 0, id, Class::Default),
            Arrival::Admit { slot: true }
        );
    }
    assert_eq!(w.leased(S0), 0);
    for _ in 0..4 {
        w.release(&store, 0);
    }
    assert_eq!(
        (store.sets.get(), w.leased(S0), inflight(&store)),
        (sets, 4, 5)
    );
    // A full lease: the next release goes to the shared counter.
    w.release(&store, 0);
    assert_eq!((inflight(&store), w.leased(S0)), (4, 4));
    // The tick gives the lease back.
    w.return_leases(&store);
    assert_eq!((inflight(&store), w.leased(S0)), (0, 0));
    // Near the limit (over three quarters in flight) no lease is taken.
    store.raw_set(
        &w.all[0].inflight_key,
        &super::encode_shared(&Shared {
            inflight: 100,
            ..Shared::default()
        }),
    );
    assert_eq!(
        w.arrive(&store, T0, 0, 7, Class::Default),
        Arrival::Admit { slot: true }
    );
    assert_eq!((inflight(&store), w.leased(S0)), (101, 0));
    w.release(&store, 0);
    assert_eq!(inflight(&store), 100);
}

#[test]
fn property_leases_never_let_more_than_max_in_and_all_come_back() {
    // Like the property above, with a limit large enough for leases: the
    // counter equals the slots held plus the slots leased, what is held
    // never exceeds max, and once everything ends and every worker ticks,
    // the counter is back to zero.
    leases_come_back(false);
    leases_come_back(true);
}

fn leases_come_back(remembering: bool) {
    let mut rng = crate::rng::SplitMix(11);
    let mut sim = Sim::new(LEASED, remembering);
    let mut now = T0;
    for id in 0..20_000u32 {
        now += rng.below(2);
        let w = rng.below(3) as usize;
        // Phases of rising and falling load, so that leases form and the
        // limit is reached in turn.
        let arrive_bias = if (id / 2000) % 2 == 0 { 6 } else { 3 };
        match rng.below(10) {
            x if x < arrive_bias => sim.arrive(w, now, id, Class::Default),
            6..=8 if !sim.held.is_empty() => sim.release(rng.below(sim.held.len() as u64) as usize),
            9 if rng.below(20) == 0 => sim.workers[w].return_leases(&*sim.views[w]),
            _ => sim.wake(w, now),
        }
        assert_eq!(
            counters(&sim.store),
            (
                sim.held.len() as u64 + sim.leased(),
                sim.queued.len() as u64
            )
        );
        assert!(sim.held.len() <= 128);
    }
    while !sim.held.is_empty() {
        sim.release(0);
    }
    while !sim.queued.is_empty() {
        sim.cancel(0);
    }
    for (w, view) in sim.workers.iter_mut().zip(&sim.views) {
        w.return_leases(&**view);
    }
    assert_eq!(counters(&sim.store), (0, 0));
}

#[test]
fn a_quiet_worker_sheds_sheddable_waiters_while_the_shared_queue_stands() {
    // QUEUE: max 2, target 5 ms, interval 100 ms, max_wait 500 ms.
    let (mut quiet, store) = shedders(QUEUE);
    let (mut busy, _) = shedders(QUEUE);
    // The busy worker holds both slots and has critical waiters.
    for id in 1..=2 {
        busy.arrive(&store, T0, 0, id, Class::Critical);
    }
    for id in 3..=5 {
        let got = busy.arrive(&store, T0, 0, id, Class::Critical);
        assert_eq!(got, Arrival::Queue { evicted: None });
    }
    // A sheddable request lands on the quiet worker while those wait.
    let mut now = T0 + 300;
    assert_eq!(
        quiet.arrive(&store, now, 0, 7, Class::Sheddable),
        Arrival::Queue { evicted: None }
    );
    let since = now;
    let shed_at = loop {
        now += 1;
        busy.wake(&store, now, 0); // keeps its claim alive; no slot frees
        let wakes = quiet.wake(&store, now, 0);
        if wakes.iter().any(|w| matches!(w, Wake::Shed { .. })) {
            break now;
        }
        assert!(
            now < since + 500,
            "the sheddable waiter waited out max_wait"
        );
    };
    // Within two intervals of the quiet worker's CoDel, not max_wait.
    assert!(shed_at - since <= 200, "shed after {} ms", shed_at - since);
}

#[test]
fn an_adaptive_limit_is_learned_by_all_workers_from_everyones_samples() {
    let config = parse(
        br#"{"shedders":[{"name":"a","concurrency":{"max":"auto","queue":100,
        "adaptive":{"min":1,"max":50,"initial":3,"interval":"100ms"}}}]}"#,
    )
    .expect("valid");
    let store = MemoryStore::default();
    let mut a = Worker::new(
        Shedders::new(
            &config.shedders,
            &config.common,
            (T0, 1),
            &mut Registry::default(),
        )
        .expect("builds"),
    );
    let mut b = Worker::new(
        Shedders::new(
            &config.shedders,
            &config.common,
            (T0, 2),
            &mut Registry::default(),
        )
        .expect("builds"),
    );
    a.create(&store).expect("created");
    assert_eq!(a.limit(S0), Some(3));
    // Three admitted at the initial limit; the fourth waits.
    for id in 0..3 {
        assert_eq!(
            a.arrive(&store, T0, 0, id, Class::Default),
            Arrival::Admit { slot: true }
        );
    }
    assert!(matches!(
        a.arrive(&store, T0, 0, 3, Class::Default),
        Arrival::Queue { .. }
    ));
    // Both workers see latency at the floor with the limit in use: each
    // interval the limit grows, and both read the same one.
    let mut now = T0;
    for _ in 0..5 {
        now += 100;
        for w in [&mut a, &mut b] {
            for _ in 0..5 {
                w.sample(S0, 20_000, 0);
            }
            w.adapt(&store, now);
        }
    }
    let grown = a.limit(S0).expect("a limit");
    assert!(grown > 3, "{grown}");
    b.adapt(&store, now + 1);
    assert_eq!(b.limit(S0), Some(grown));
    assert_eq!(a.floor_us(S0), Some(20_000));
    // The queued request now gets a slot.
    assert!(a
        .wake(&store, now, 0)
        .iter()
        .any(|w| matches!(w, Wake::Resume { id: 3, .. })));
    // Queueing latency (twice the floor, over the 1.25 tolerance): the
    // limit falls.
    for _ in 0..5 {
        now += 100;
        a.sample(S0, 40_000, 0);
        a.adapt(&store, now);
    }
    assert!(a.limit(S0).expect("a limit") < grown);
    // A new configuration of the same shedder keeps what was learned.
    let mut c = Worker::new(
        Shedders::new(
            &config.shedders,
            &config.common,
            (now, 3),
            &mut Registry::default(),
        )
        .expect("builds"),
    );
    c.read_limits(&store);
    assert_eq!(c.limit(S0), a.limit(S0));
}

/// `max: "auto"` starting at a limit of 3 (`min` 1), CoDel's target 5 ms.
const AUTO: &str = r#"{"shedders":[{"name":"a","concurrency":{"max":"auto","queue":100,
    "adaptive":{"min":1,"max":50,"initial":3,"interval":"100ms"}}}]}"#;

#[test]
fn a_queue_behind_an_adaptive_limit_that_learned_nothing_is_overload_at_once() {
    let (mut a, store) = shedders(AUTO);
    for id in 0..3 {
        assert_eq!(
            a.arrive(&store, T0, 0, id, Class::Default),
            Arrival::Admit { slot: true }
        );
    }
    assert!(!a.overloaded(S0));
    // The fourth waits behind the initial guess: overload now, not at the
    // end of CoDel's first full interval.
    let got = a.arrive(&store, T0 + 1, 0, 3, Class::Default);
    assert_eq!(got, Arrival::Queue { evicted: None });
    assert!(a.overloaded(S0));
    // A sheddable arrival is shed at once, a default waiter after
    // 2 x target of waiting.
    assert_eq!(
        a.arrive(&store, T0 + 1, 0, 4, Class::Sheddable),
        Arrival::Shed
    );
    assert!(a.wake(&store, T0 + 10, 0).is_empty());
    assert!(a
        .wake(&store, T0 + 12, 0)
        .iter()
        .any(|w| matches!(w, Wake::Shed { waiter } if waiter.id == 3)));
    // The slots free, the queue is empty: an interval that admits without
    // waiting and sheds nothing ends the overload.
    for _ in 0..3 {
        a.release(&store, 0);
    }
    let mut now = T0 + 300;
    for id in 10..13 {
        a.arrive(&store, now, 0, id, Class::Default);
        a.release(&store, 0);
        now += 50;
    }
    a.wake(&store, now + 100, 0);
    assert!(!a.overloaded(S0));
}

#[test]
fn once_the_limit_has_a_floor_a_queue_waits_for_codel_to_judge_it() {
    let (mut a, store) = shedders(AUTO);
    // Responses at 20 ms learned on the tick: the limit has a floor.
    for _ in 0..5 {
        a.sample(S0, 20_000, T0);
    }
    a.adapt(&store, T0 + 1);
    assert_eq!(a.floor_us(S0), Some(20_000));
    let limit = a.limit(S0).expect("a limit");
    for id in 0..limit as u32 {
        assert_eq!(
            a.arrive(&store, T0 + 2, 0, id, Class::Default),
            Arrival::Admit { slot: true }
        );
    }
    let got = a.arrive(&store, T0 + 2, 0, 99, Class::Default);
    assert_eq!(got, Arrival::Queue { evicted: None });
    assert!(!a.overloaded(S0));
    // A default waiter waits past 2 x target: CoDel has not judged yet.
    assert!(!a
        .wake(&store, T0 + 20, 0)
        .iter()
        .any(|w| matches!(w, Wake::Shed { .. })));
}

#[test]
fn a_release_on_a_worker_whose_clock_is_old_still_wakes_the_waiters_worker() {
    // A release comes without the time: a's clock is from its last
    // arrival, 200 ms before b's waiter came (a fresh claim then looks
    // dated ahead, and was not woken).
    let (mut a, store) = shedders(QUEUE);
    let (mut b, _) = shedders(QUEUE);
    for id in 1..=2 {
        a.arrive(&store, T0, 0, id, Class::Critical);
    }
    b.arrive(&store, T0 + 200, 0, 3, Class::Critical);
    a.release(&store, 0);
    assert_eq!(a.take_wakes(), vec![b.worker()]);
}
