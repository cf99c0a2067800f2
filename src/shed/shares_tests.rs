//! Priority shares (and strict priority, LIFO): admissions split by class
//! under overload, on one worker or several, however a class is spread.

use super::tests::*;
use super::*;
use crate::pipeline::telemetry::Registry;
use crate::store::memory::MemoryStore;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

#[test]
fn shares_split_admissions_by_class_under_overload_across_two_workers() {
    let config = parse(
        br#"{"shedders":[{"name":"a","concurrency":{"max":4,"queue":5000,"max_wait":"1h"},
        "priority":{"shares":{"critical":50,"default":35,"sheddable":15}}}]}"#,
    )
    .expect("valid");
    let store = MemoryStore::default();
    let mut workers = [
        Worker::new(
            Shedders::new(
                &config.shedders,
                &config.common,
                (T0, 1),
                &mut Registry::default(),
            )
            .expect("builds"),
        ),
        Worker::new(
            Shedders::new(
                &config.shedders,
                &config.common,
                (T0, 2),
                &mut Registry::default(),
            )
            .expect("builds"),
        ),
    ];
    workers[0].create(&store).expect("created");
    let classes = [Class::Critical, Class::Default, Class::Sheddable];
    let class_of = |id: u32| classes[(id % 3) as usize];
    let mut held: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
    // Every class floods both workers at once.
    for id in 0..3000u32 {
        let w = (id / 3 % 2) as usize;
        if workers[w].arrive(&store, T0, 0, id, class_of(id)) == (Arrival::Admit { slot: true }) {
            held[w].push(id);
        }
    }
    let mut admitted = [0u32; 3];
    let mut now = T0;
    for i in 0..200 {
        now += 1;
        let w = i % 2;
        for _ in held[w].drain(..) {
            workers[w].release(&store, 0);
        }
        for wake in workers[w].wake(&store, now, 0) {
            if let Wake::Resume { id, .. } = wake {
                admitted[class_of(id) as usize] += 1;
                held[w].push(id);
            }
        }
    }
    let total: u32 = admitted.iter().sum();
    assert!(total > 200, "{admitted:?}");
    let share = |c: Class| f64::from(admitted[c as usize]) / f64::from(total);
    assert!((share(Class::Critical) - 0.50).abs() < 0.05, "{admitted:?}");
    assert!((share(Class::Default) - 0.35).abs() < 0.05, "{admitted:?}");
    assert!(
        (share(Class::Sheddable) - 0.15).abs() < 0.05,
        "{admitted:?}"
    );
}

#[test]
fn strict_priority_without_shares_serves_the_highest_class_first() {
    let config = parse(
        br#"{"shedders":[{"name":"a","concurrency":{"max":1,"queue":100,"max_wait":"1h"}}]}"#,
    )
    .expect("valid");
    let store = MemoryStore::default();
    let mut sh = Worker::new(
        Shedders::new(
            &config.shedders,
            &config.common,
            (T0, 1),
            &mut Registry::default(),
        )
        .expect("builds"),
    );
    sh.create(&store).expect("created");
    assert_eq!(
        sh.arrive(&store, T0, 0, 0, Class::Default),
        Arrival::Admit { slot: true }
    );
    for (id, class) in [
        (1, Class::Sheddable),
        (2, Class::Default),
        (3, Class::Critical),
    ] {
        assert!(matches!(
            sh.arrive(&store, T0, 0, id, class),
            Arrival::Queue { .. }
        ));
    }
    let mut order = Vec::new();
    for t in 1..4 {
        sh.release(&store, 0);
        for w in sh.wake(&store, T0 + t, 0) {
            if let Wake::Resume { id, .. } = w {
                order.push(id);
            }
        }
    }
    assert_eq!(order, vec![3, 2, 1]);
}

/// Closed-loop clients of every class on two workers (each client sends
/// again as soon as its request ends, 20 ms after admission): never more
/// in flight than the limit, and admissions split by the shares.
fn closed_loop(shares: &str) -> [u32; 3] {
    let json = format!(
        r#"{{"shedders":[{{"name":"a","concurrency":{{"max":4,"queue":200,"max_wait":"2s"}},
        "priority":{{{shares}}}}}]}}"#
    );
    let config = parse(json.as_bytes()).expect("valid");
    let store = MemoryStore::default();
    let mut workers = [
        Worker::new(
            Shedders::new(
                &config.shedders,
                &config.common,
                (T0, 1),
                &mut Registry::default(),
            )
            .expect("builds"),
        ),
        Worker::new(
            Shedders::new(
                &config.shedders,
                &config.common,
                (T0, 2),
                &mut Registry::default(),
            )
            .expect("builds"),
        ),
    ];
    workers[0].create(&store).expect("created");
    let classes = [Class::Critical, Class::Default, Class::Sheddable];
    let class_of = |c: u32| classes[(c / 2 % 3) as usize];
    // 48 clients: client c on worker c % 2.
    let mut inflight: Vec<(usize, u32, u64)> = Vec::new();
    let mut now = T0;
    let mut admitted = [0u32; 3];
    for c in 0..48u32 {
        let w = (c % 2) as usize;
        if workers[w].arrive(&store, now, 0, c, class_of(c)) == (Arrival::Admit { slot: true }) {
            inflight.push((w, c, now + 20));
        }
    }
    for _ in 0..4000 {
        now += 1;
        let (done, rest): (Vec<_>, Vec<_>) = inflight.into_iter().partition(|x| x.2 <= now);
        inflight = rest;
        for (w, c, _) in done {
            workers[w].release(&store, 0);
            admitted[class_of(c) as usize] += 1;
            if workers[w].arrive(&store, now, 0, c, class_of(c)) == (Arrival::Admit { slot: true })
            {
                inflight.push((w, c, now + 20));
            }
        }
        for (w, worker) in workers.iter_mut().enumerate() {
            for wake in worker.wake(&store, now, 0) {
                if let Wake::Resume { id, slot, .. } = wake {
                    assert!(slot, "admitted without a slot");
                    inflight.push((w, id, now + 20));
                }
            }
        }
        assert!(
            inflight.len() <= 4,
            "{} in flight at {}",
            inflight.len(),
            now - T0
        );
        assert_eq!(workers[0].store_failures + workers[1].store_failures, 0);
    }
    admitted
}

#[test]
fn closed_loop_clients_on_two_workers_get_their_shares_and_never_exceed_the_limit() {
    let got = closed_loop(r#""shares":{"critical":50,"default":35,"sheddable":15}"#);
    let total: u32 = got.iter().sum();
    let pct = |c: Class| 100 * got[c as usize] / total;
    assert!((47..=53).contains(&pct(Class::Critical)), "{got:?}");
    assert!((32..=38).contains(&pct(Class::Default)), "{got:?}");
    assert!((12..=18).contains(&pct(Class::Sheddable)), "{got:?}");
    // Strict priority, for contrast: the lower classes starve.
    let strict = closed_loop("");
    assert!(strict[Class::Sheddable as usize] == 0, "{strict:?}");
}

#[test]
fn lifo_serves_the_newest_waiter_of_a_class_while_overloaded_only() {
    let config = parse(
        br#"{"shedders":[{"name":"a","concurrency":{"max":1,"queue":100,"max_wait":"1h"},
        "priority":{"lifo":true}}]}"#,
    )
    .expect("valid");
    let store = MemoryStore::default();
    let mut sh = Worker::new(
        Shedders::new(
            &config.shedders,
            &config.common,
            (T0, 1),
            &mut Registry::default(),
        )
        .expect("builds"),
    );
    sh.create(&store).expect("created");
    assert_eq!(
        sh.arrive(&store, T0, 0, 0, Class::Default),
        Arrival::Admit { slot: true }
    );
    for id in 1..=4 {
        assert!(matches!(
            sh.arrive(&store, T0 + id as u64, 0, id, Class::Default),
            Arrival::Queue { .. }
        ));
    }
    let next = |sh: &mut Worker, t: u64| {
        sh.release(&store, 0);
        sh.wake(&store, T0 + t, 0).iter().find_map(|w| match w {
            Wake::Resume { id, .. } => Some(*id),
            _ => None,
        })
    };
    // Not overloaded: oldest first.
    assert_eq!(next(&mut sh, 5), Some(1));
    // Overloaded: newest first.
    sh.all[0].local.codel.overloaded = true;
    assert_eq!(next(&mut sh, 6), Some(4));
}

#[test]
fn shares_hold_with_the_default_queue_when_it_is_full() {
    const SHARES: &str = r#""shares":{"critical":50,"default":35,"sheddable":15}"#;
    // 48 clients on a limit of 4: the default queue (4 x max = 16) is full
    // all the time. A full queue sheds the waiter served last (the latest
    // turn), so each class keeps waiters in proportion to its share.
    let got = retrying_loop_on(r#""max_wait":"1s""#, SHARES, 1);
    assert!(got.shed_on_arrival > 1_000, "the queue is full: {got:?}");
    assert_shares(&got.admitted, [15, 35, 50]);
    // Across two workers each worker's queue is full on its own (see the
    // next test for two and four workers within 3 points).
    let got = retrying_loop_on(r#""max_wait":"1s""#, SHARES, 2);
    let total: u32 = got.admitted.iter().sum();
    let pct: Vec<u32> = got.admitted.iter().map(|a| 100 * a / total).collect();
    assert!((13..=20).contains(&pct[0]), "{got:?}");
    assert!(pct[1] + 10 >= 35 && pct[2] <= 60, "{got:?}");
}

/// `n` retrying clients (as `retrying_loop_on`'s: every class in turn,
/// spread evenly) on `workers` workers, a limit of 4 and the default queue
/// (4 x max, 16 per worker), `max_wait` 1 s: admissions by class, and how
/// many were refused on arrival and while waiting (evicted from a full
/// queue, as `max_wait` is long).
fn default_queue_run(workers: u32, n: u32) -> ([u32; 3], u32, u32) {
    let json = format!(
        r#"{{"shedders":[{{"name":"a","concurrency":{{"max":4,"max_wait":"1s"}},
        "priority":{{{R_SHARES}}}}}]}}"#
    );
    let classes = [Class::Critical, Class::Default, Class::Sheddable];
    let clients: Vec<RClient> = (0..n)
        .map(|c| {
            rclient(
                (c % workers) as usize,
                classes[(c / workers % 3) as usize],
                0,
            )
        })
        .collect();
    let out = sim(&json, workers as usize, &clients, (6_000, 4), &service);
    let mut admitted = [0; 3];
    for (c, a) in clients.iter().zip(&out.admitted) {
        admitted[c.class as usize] += a;
    }
    let sum = |v: &[u32]| v.iter().sum();
    (admitted, sum(&out.shed_arrival), sum(&out.shed_waiting))
}

#[test]
fn shares_hold_on_two_and_four_workers_when_each_default_queue_is_full() {
    // Each worker sheds from its own full queue while a class's turns run
    // across all of them: shedding a waiter whose class has a later turn
    // on another worker would skip its turn (shedding the latest turn here
    // whatever the others hold leaves sheddable 1.3% with 36 clients on
    // two workers). The tolerance, 3 points, is wide of one worker's error
    // (0.1 point).
    for (workers, clients) in [(2, 36), (2, 48), (4, 96)] {
        let (admitted, refused, evicted) = default_queue_run(workers, clients);
        assert!(
            refused > 1_000 && evicted > 100,
            "full: {refused}, {evicted}"
        );
        let total = f64::from(admitted.iter().sum::<u32>());
        for (a, share) in admitted.iter().zip([15.0, 35.0, 50.0]) {
            let pct = 100.0 * f64::from(*a) / total;
            assert!(
                (pct - share).abs() <= 3.0,
                "{workers} workers, {clients} clients: {admitted:?}"
            );
        }
    }
}

#[test]
fn a_full_queue_sheds_a_zero_share_waiter_first_wherever_its_class_waits() {
    // Share 0 has no sequence of turns: its waiter here goes first, even
    // with a later one of its class on the other worker.
    let json = r#"{"shedders":[{"name":"a","concurrency":{"max":1,"queue":2,"max_wait":"1h"},
        "priority":{"shares":{"critical":50,"default":50,"sheddable":0}}}]}"#;
    let (a, store) = shedders(json);
    let mut w = [a, shedders(json).0];
    assert_eq!(
        w[0].arrive(&store, T0, 0, 0, Class::Critical),
        Arrival::Admit { slot: true }
    );
    for (on, t, id, class) in [
        (0, T0, 1, Class::Sheddable),
        (1, T0 + 1, 2, Class::Sheddable),
        (0, T0 + 2, 3, Class::Default),
    ] {
        let got = w[on].arrive(&store, t, 0, id, class);
        assert_eq!(got, Arrival::Queue { evicted: None });
    }
    let got = w[0].arrive(&store, T0 + 3, 0, 4, Class::Critical);
    assert!(
        matches!(got, Arrival::Queue { evicted: Some(w) } if w.id == 1),
        "{got:?}"
    );
}

/// Shares 50/50 (sheddable 0), a limit of 2, 20 ms requests, `max_wait`
/// long enough that nobody is shed: clients of each class spread over two
/// workers as given, `(on worker 1, on worker 2)`. Returns the critical
/// and default admissions after the first half second.
fn spread_run(critical: (usize, usize), default: (usize, usize)) -> (u32, u32) {
    let json = r#"{"shedders":[{"name":"a","concurrency":{"max":2,"queue":100,"max_wait":"2s"},
        "priority":{"shares":{"critical":50,"default":50,"sheddable":0}}}]}"#;
    let mut clients = Vec::new();
    let mut classes = Vec::new();
    for (class, (a, b)) in [(Class::Critical, critical), (Class::Default, default)] {
        for (worker, n) in [(0, a), (1, b)] {
            for _ in 0..n {
                clients.push(rclient(worker, class, 0));
                classes.push(class);
            }
        }
    }
    let early = rsim(json, 2, &clients, 500, 2);
    let all = rsim(json, 2, &clients, 3_000, 2);
    let mut got = (0, 0);
    for (i, class) in classes.iter().enumerate() {
        let n = all.admitted[i] - early.admitted[i];
        match class {
            Class::Critical => got.0 += n,
            _ => got.1 += n,
        }
    }
    got
}

#[test]
fn shares_hold_however_a_class_is_spread_over_the_workers() {
    // A class waiting on both workers must not get twice the turns of a
    // class waiting on one (67/33 for shares of 50/50, were each worker to
    // keep its own turns).
    for (critical, default) in [
        ((2, 2), (2, 0)),
        ((4, 0), (1, 1)),
        ((3, 3), (3, 0)),
        ((2, 2), (1, 1)),
    ] {
        let (c, d) = spread_run(critical, default);
        let pct = c * 100 / (c + d);
        assert!(
            (42..=58).contains(&pct),
            "critical {critical:?}, default {default:?}: {c} / {d} admitted ({pct}% critical)"
        );
    }
}

#[test]
fn shares_hold_on_one_worker_or_two_with_a_short_or_longer_max_wait() {
    // Waiters reach max_wait before their turn (the rate they were
    // judged by dipped); each leaves its turn to its class, so no class
    // loses more of its share than another. Before: 51.5 / 32.9 / 15.6%
    // on one worker at 60 ms, 56.4 / 30.4 / 13.2% on two.
    for (workers, max_wait, early) in [(1, "30ms", true), (2, "60ms", true), (2, "60ms", false)] {
        let c = format!(r#""queue":200,"max_wait":"{max_wait}","shed_early":{early}"#);
        let got = retrying_loop_on(&c, R_SHARES, workers);
        assert_shares(&got.admitted, [15, 35, 50]);
    }
}

#[test]
fn a_waiter_that_leaves_before_its_turn_leaves_it_to_its_class() {
    let (mut sh, store) = shedders(
        r#"{"shedders":[{"name":"a","concurrency":{"max":1,"queue":10,"max_wait":"50ms"},
        "priority":{"shares":{"critical":50,"default":50,"sheddable":0}}}]}"#,
    );
    assert_eq!(
        sh.arrive(&store, T0, 0, 0, Class::Critical),
        Arrival::Admit { slot: true }
    );
    let ids =
        |sh: &Worker| -> Vec<u32> { sh.line(0, Class::Default).iter().map(|w| w.id).collect() };
    let turn = |sh: &Worker, id: u32| {
        let q = sh.line(0, Class::Default);
        q.iter().find(|w| w.id == id).map(|w| w.turn_ms)
    };
    for id in 1..=3 {
        sh.arrive(&store, T0 + 10 * u64::from(id), 0, id, Class::Default);
    }
    let (t2, t3) = (turn(&sh, 2), turn(&sh, 3));
    // The first default waiter's client goes before its turn: the next
    // default arrival takes that turn (or the turn being served, if it
    // has come round), ahead of the two still waiting.
    assert!(sh.cancel(&store, 0, 1));
    sh.arrive(&store, T0 + 40, 0, 4, Class::Default);
    assert_eq!(ids(&sh), [4, 2, 3]);
    assert!(turn(&sh, 4) < t2);
    // The newest leaving is not owed: the class's next turn falls back to
    // it anyway.
    assert!(sh.cancel(&store, 0, 3));
    sh.arrive(&store, T0 + 45, 0, 5, Class::Default);
    assert_eq!(ids(&sh), [4, 2, 5]);
    assert_eq!(turn(&sh, 5), t3);
    // Waiting max_wait out is the same: 2 (since +20) waits its limit
    // out at +70, while 5 waits on with a later turn.
    let shed = sh.wake(&store, T0 + 70, 0);
    assert!(
        matches!(shed[..], [Wake::Shed { waiter }] if waiter.id == 2),
        "{shed:?}"
    );
    sh.arrive(&store, T0 + 71, 0, 6, Class::Default);
    assert_eq!(ids(&sh), [4, 6, 5]);
    assert_eq!(turn(&sh, 6), t2);
    // Paid: the next one queues after them all.
    sh.arrive(&store, T0 + 72, 0, 7, Class::Default);
    assert_eq!(ids(&sh), [4, 6, 5, 7]);
}

#[test]
fn turns_owed_to_a_class_are_each_given_once() {
    // From a review: with two owed, both arrivals got the earliest, and
    // the class then held more turns than it had waiters.
    let (mut sh, store) = shedders(
        r#"{"shedders":[{"name":"a","concurrency":{"max":1,"queue":10,"max_wait":"1h"},
        "priority":{"shares":{"critical":50,"default":50,"sheddable":0}}}]}"#,
    );
    sh.arrive(&store, T0, 0, 0, Class::Critical);
    let turns = |sh: &Worker| -> Vec<u64> {
        sh.line(0, Class::Default)
            .iter()
            .map(|w| w.turn_ms)
            .collect()
    };
    for id in 1..=5 {
        sh.arrive(&store, T0, 0, id, Class::Default);
    }
    let before = turns(&sh);
    assert!(sh.cancel(&store, 0, 2) && sh.cancel(&store, 0, 3));
    sh.arrive(&store, T0, 0, 6, Class::Default);
    sh.arrive(&store, T0, 0, 7, Class::Default);
    assert_eq!(turns(&sh), before);
    // The newest leaving owes nothing: the next turns follow the back.
    assert!(sh.cancel(&store, 0, 5) && sh.cancel(&store, 0, 4));
    for id in 8..=10 {
        sh.arrive(&store, T0, 0, id, Class::Default);
    }
    let after = turns(&sh);
    assert_eq!(after[..5], before[..]);
    assert!(after.windows(2).all(|w| w[0] < w[1]), "{after:?}");
}

#[test]
fn shares_hold_when_most_of_a_class_waits_on_one_worker() {
    // 16 clients per class; sheddable's 14 on one worker and 2 on the
    // other. Most of its waiters there wait their 60 ms out before their
    // turn (its turns are 33 ms apart) and leave their turns to its next
    // arrivals. At most 4 owed turns kept, the rest were lost: 12.0%
    // (13.0% for 12 / 4; 8% once in a real Envoy).
    let json = r#"{"shedders":[{"name":"a","concurrency":{"max":4,"queue":200,"max_wait":"60ms","shed_early":false},
        "priority":{"shares":{"critical":50,"default":35,"sheddable":15}}}]}"#;
    for sheddable_on_first in [14, 12, 2] {
        let clients: Vec<RClient> = (0..48u32)
            .map(|c| {
                let (class, k) = match c / 16 {
                    0 => (Class::Critical, c % 16),
                    1 => (Class::Default, c % 16),
                    _ => (Class::Sheddable, c % 16),
                };
                let first = match class {
                    Class::Sheddable => k < sheddable_on_first,
                    _ => k % 2 == 0,
                };
                rclient(usize::from(!first), class, 0)
            })
            .collect();
        let out = sim(json, 2, &clients, (6_000, 4), &service);
        let mut admitted = [0u32; 3];
        for (c, n) in clients.iter().zip(&out.admitted) {
            admitted[c.class as usize] += n;
        }
        assert_shares(&admitted, [15, 35, 50]);
    }
}
