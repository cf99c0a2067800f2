//! Shedding tests: the fixtures every `*_tests.rs` of this folder shares
//! (shedders over a memory store, simulated workers and clients), the
//! admission queue on one worker, and the configuration of shedders.

use super::codec::decode_shared;
use super::*;
use crate::pipeline::telemetry::Registry;
use crate::pipeline::wait::WaitList;
use crate::request::fake::FakeRequest;
use crate::store::memory::MemoryStore;
use crate::store::Store;
use crate::wiring::parse;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

pub(super) const T0: u64 = 1_700_000_000_000;

/// A worker's shedders (each call a new worker tag) and a store for them.
pub(super) fn shedders(json: &str) -> (Worker, MemoryStore) {
    static WORKER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let worker = WORKER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let c = parse(json.as_bytes()).expect("valid");
    let s = Shedders::new(
        &c.shedders,
        &c.common,
        (T0, worker),
        &mut Registry::default(),
    )
    .expect("ok");
    let store = MemoryStore::default();
    s.create(&store).expect("created");
    (Worker::new(s), store)
}

/// The first shedder of a configuration.
pub(super) const S0: ShedderId = ShedderId(0);

/// A worker's shedders with the lines its waiters wait in (the pipeline's
/// in the stage, a list of their own here), and what their calls reported
/// (as the stage carries it out).
pub(super) struct Worker {
    pub(super) sh: Shedders,
    pub(super) lines: WaitList,
    /// Workers to wake, each once, since `take_wakes`.
    wakes: Vec<u32>,
    /// Store errors and corrupt entries met.
    pub(super) store_failures: u64,
}

impl std::ops::Deref for Worker {
    type Target = Shedders;
    fn deref(&self) -> &Shedders {
        &self.sh
    }
}

impl std::ops::DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut Shedders {
        &mut self.sh
    }
}

impl Worker {
    pub(super) fn new(sh: Shedders) -> Self {
        Worker {
            sh,
            lines: WaitList::default(),
            wakes: Vec::new(),
            store_failures: 0,
        }
    }

    /// Keeps what a call reported.
    fn note<T>(&mut self, (out, report): (T, Report)) -> T {
        for w in report.wakes {
            if !self.wakes.contains(&w) {
                self.wakes.push(w);
            }
        }
        self.store_failures += report.store_failures;
        out
    }

    /// The workers to wake since the last call, each once.
    pub(super) fn take_wakes(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.wakes)
    }

    pub(super) fn arrive(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        s: u32,
        id: u32,
        class: Class,
    ) -> Arrival {
        let got = self
            .sh
            .arrive(&mut self.lines, store, now_ms, ShedderId(s), id, class);
        self.note(got)
    }

    pub(super) fn arrive_until(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        s: u32,
        waiter: (u32, Class),
        deadline_ms: Option<u64>,
    ) -> Arrival {
        let lines = &mut self.lines;
        let got = self
            .sh
            .arrive_until(lines, store, now_ms, ShedderId(s), waiter, deadline_ms);
        self.note(got)
    }

    pub(super) fn wake(&mut self, store: &dyn Store, now_ms: u64, s: u32) -> Vec<Wake> {
        let got = self.sh.wake(&mut self.lines, store, now_ms, ShedderId(s));
        self.note(got)
    }

    pub(super) fn release(&mut self, store: &dyn Store, s: u32) {
        let got = self.sh.release(&self.lines, store, ShedderId(s));
        self.note(((), got));
    }

    pub(super) fn return_leases(&mut self, store: &dyn Store) {
        let got = self.sh.return_leases(&self.lines, store);
        self.note(((), got));
    }

    pub(super) fn cancel(&mut self, store: &dyn Store, s: u32, id: u32) -> bool {
        let got = self.sh.cancel(&mut self.lines, store, ShedderId(s), id);
        self.note(got)
    }

    pub(super) fn adapt(&mut self, store: &dyn Store, now_ms: u64) {
        let got = self.sh.adapt(store, now_ms);
        self.note(((), got));
    }

    pub(super) fn queued(&self, s: u32) -> usize {
        self.sh.queued(&self.lines, ShedderId(s))
    }

    /// The waiters of shedder `s`'s class `class` line, in order.
    pub(super) fn line(&self, s: u32, class: Class) -> Vec<Queued> {
        let s = ShedderId(s);
        let shares = self.sh.get(s).is_some_and(|r| r.spec.shares.is_some());
        let lines = &self.lines;
        lines
            .each_in(waiters::line(s, class as usize))
            .map(|x| waiters::queued(lines, shares, x))
            .collect()
    }
}

pub(super) const QUEUE: &str = r#"{"shedders":[{"name":"q","concurrency":{"max":2,"queue":3,"max_wait":"500ms"},
    "priority":{"header":"x-priority"}}]}"#;

pub(super) fn shared(store: &MemoryStore) -> Shared {
    let map = store.map.borrow();
    let (bytes, _) = map.values().next().expect("counter");
    decode_shared(bytes).expect("decodes")
}

pub(super) fn counters(store: &MemoryStore) -> (u64, u64) {
    let shared = shared(store);
    (shared.inflight, shared.waiting)
}

pub(super) fn inflight(store: &MemoryStore) -> u64 {
    counters(store).0
}

#[test]
fn the_limit_is_global_and_waiters_resume_in_priority_order() {
    let (mut a, store) = shedders(QUEUE);
    let (mut b, _) = shedders(QUEUE); // a second worker on the same store
    assert_eq!(
        a.arrive(&store, T0, 0, 1, Class::Default),
        Arrival::Admit { slot: true }
    );
    assert_eq!(
        b.arrive(&store, T0, 0, 2, Class::Default),
        Arrival::Admit { slot: true }
    );
    assert_eq!(inflight(&store), 2);
    assert_eq!(
        a.arrive(&store, T0, 0, 3, Class::Sheddable),
        Arrival::Queue { evicted: None }
    );
    assert_eq!(
        a.arrive(&store, T0 + 1, 0, 4, Class::Default),
        Arrival::Queue { evicted: None }
    );
    assert_eq!(
        a.arrive(&store, T0 + 2, 0, 5, Class::Critical),
        Arrival::Queue { evicted: None }
    );
    // Full: a critical arrival evicts the newest lowest-class waiter.
    let full = a.arrive(&store, T0 + 3, 0, 6, Class::Critical);
    assert_eq!(
        full,
        Arrival::Queue {
            evicted: Some(Queued {
                id: 3,
                class: Class::Sheddable,
                since_ms: T0,
                turn_ms: T0,
                deadline_ms: None,
            })
        }
    );
    // A sheddable arrival into a full queue of higher classes is shed.
    assert_eq!(
        a.arrive(&store, T0 + 3, 0, 7, Class::Sheddable),
        Arrival::Shed
    );
    // Nobody may jump the queue on another worker while a waits.
    assert_eq!(
        b.arrive(&store, T0 + 3, 0, 8, Class::Critical),
        Arrival::Queue { evicted: None }
    );
    assert!(b.cancel(&store, 0, 8));
    // Worker b finishes a request: a slot frees; a's next wake takes it for the oldest critical.
    b.release(&store, 0);
    assert_eq!(
        a.wake(&store, T0 + 4, 0),
        vec![Wake::Resume {
            id: 5,
            waited_ms: 2,
            slot: true
        }]
    );
    a.release(&store, 0);
    assert_eq!(
        a.wake(&store, T0 + 5, 0),
        vec![Wake::Resume {
            id: 6,
            waited_ms: 2,
            slot: true
        }]
    );
    assert_eq!(a.queued(0), 1);
    assert_eq!(inflight(&store), 2);
}

#[test]
fn nobody_waits_past_max_wait_and_cancelled_waiters_leave_the_queue() {
    let (mut a, store) = shedders(QUEUE);
    for id in 1..=2 {
        a.arrive(&store, T0, 0, id, Class::Default);
    }
    a.arrive(&store, T0, 0, 3, Class::Default);
    a.arrive(&store, T0 + 100, 0, 4, Class::Critical);
    assert!(a.cancel(&store, 0, 3));
    assert!(!a.cancel(&store, 0, 3));
    assert_eq!(a.wake(&store, T0 + 499, 0), vec![]);
    let shed = a.wake(&store, T0 + 600, 0);
    assert_eq!(
        shed,
        vec![Wake::Shed {
            waiter: Queued {
                id: 4,
                class: Class::Critical,
                since_ms: T0 + 100,
                turn_ms: T0 + 100,
                deadline_ms: None,
            }
        }]
    );
    assert_eq!(a.queued(0), 0);
}

#[test]
fn under_overload_sheddable_work_goes_first_and_critical_last() {
    let (mut a, store) = shedders(QUEUE);
    a.arrive(&store, T0, 0, 1, Class::Default);
    a.arrive(&store, T0, 0, 2, Class::Default);
    // A standing queue: every admission in an interval waited 30 ms.
    for i in 0..5u32 {
        let t = T0 + 110 + 20 * i as u64;
        a.arrive(&store, t - 30, 0, 100 + i, Class::Default);
        a.release(&store, 0);
        assert!(matches!(
            a.wake(&store, t, 0).as_slice(),
            [Wake::Resume { .. }]
        ));
    }
    a.wake(&store, T0 + 201, 0);
    assert!(a.overloaded(S0));
    assert_eq!(
        a.arrive(&store, T0 + 202, 0, 7, Class::Sheddable),
        Arrival::Shed
    );
    assert_eq!(
        a.arrive(&store, T0 + 202, 0, 8, Class::Default),
        Arrival::Queue { evicted: None }
    );
    assert_eq!(
        a.arrive(&store, T0 + 202, 0, 9, Class::Critical),
        Arrival::Queue { evicted: None }
    );
    // Default waiters are shed after twice the target (10 ms); critical ones wait on.
    let woken = a.wake(&store, T0 + 213, 0);
    assert_eq!(
        woken,
        vec![Wake::Shed {
            waiter: Queued {
                id: 8,
                class: Class::Default,
                since_ms: T0 + 202,
                turn_ms: T0 + 202,
                deadline_ms: None,
            }
        }]
    );
    assert_eq!(a.queued(0), 1);
}

#[test]
fn classes_come_from_rules_then_the_header_then_the_default() {
    let (sh, _) = shedders(
        r#"{"shedders":[{"name":"q","concurrency":{"max":1},"priority":{"header":"x-priority","default":"sheddable",
        "classes":[{"match":{"path_prefix":"/admin"},"class":"critical"}]}}]}"#,
    );
    let class = |r: FakeRequest| sh.classify(&r)[0].1;
    assert_eq!(
        class(FakeRequest::new("GET", "/admin/x").with_header("x-priority", b"sheddable")),
        Class::Critical
    );
    assert_eq!(
        class(FakeRequest::new("GET", "/").with_header("x-priority", b"DEFAULT")),
        Class::Default
    );
    assert_eq!(
        class(FakeRequest::new("GET", "/").with_header("x-priority", b"\xffbogus")),
        Class::Sheddable
    );
    assert_eq!(class(FakeRequest::new("GET", "/")), Class::Sheddable);
}

#[test]
fn shedder_configs_validate_with_clear_fields_and_clamped_defaults() {
    let c = parse(br#"{"shedders":[{"name":"s","concurrency":{"max":100000}}]}"#).expect("valid");
    let conc = c.shedders[0].concurrency.clone().expect("queue mode");
    assert_eq!(
        (conc.max, conc.queue, conc.max_wait_ms),
        (100_000, 100_000, 1000)
    );
    assert_eq!(
        (c.shedders[0].target_ms, c.shedders[0].interval_ms),
        (5, 100)
    );
    for (json, field) in [
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":0}}]}"#,
            "shedders[0].concurrency.max",
        ),
        (
            r#"{"shedders":[{"name":"s","concurrency":{"max":1,"queue":-1}}]}"#,
            "shedders[0].concurrency.queue",
        ),
        (
            r#"{"shedders":[{"name":"s","target":"200ms"}]}"#,
            "shedders[0].interval",
        ),
        (
            r#"{"shedders":[{"name":"s","priority":{"default":"vip"}}]}"#,
            "shedders[0].priority.default",
        ),
        (
            r#"{"shedders":[{"name":"s"},{"name":"s"}]}"#,
            "shedders[1].name",
        ),
        (
            r#"{"shedders":[{"name":"s","status":302}]}"#,
            "shedders[0].status",
        ),
    ] {
        let e = parse(json.as_bytes()).expect_err(json);
        assert_eq!(e.field, field, "{json}: {e}");
    }
}

/// What a closed loop of retrying clients got (see `retrying_loop`).
#[derive(Debug)]
pub(super) struct LoopStats {
    pub(super) admitted: [u32; 3],
    /// How long each admitted request waited (ms).
    pub(super) waits: Vec<u64>,
    pub(super) shed_on_arrival: u32,
    pub(super) shed_waiting: u32,
}

/// 48 closed-loop clients of every class on two workers, against a limit
/// of 4 and a 20 ms upstream; a client refused (at once or after waiting)
/// sends again 1 ms later, as a client told 503 would. Never more in
/// flight than the limit.
pub(super) fn retrying_loop(concurrency: &str, priority: &str) -> LoopStats {
    retrying_loop_on(concurrency, priority, 2)
}

/// An upstream's time for a request: 15 to 25 ms, as a function of who
/// sent it and when (so that completions do not all come together).
pub(super) fn service(client: u32, now: u64) -> u64 {
    let h = (u64::from(client) ^ now).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    15 + (h >> 59) % 11
}

pub(super) fn retrying_loop_on(concurrency: &str, priority: &str, n_workers: u32) -> LoopStats {
    let json = format!(
        r#"{{"shedders":[{{"name":"a","concurrency":{{"max":4,{concurrency}}},
        "priority":{{{priority}}}}}]}}"#
    );
    let classes = [Class::Critical, Class::Default, Class::Sheddable];
    let clients: Vec<RClient> = (0..48u32)
        .map(|c| rclient((c % n_workers) as usize, classes[(c / 2 % 3) as usize], 0))
        .collect();
    let out = sim(&json, n_workers as usize, &clients, (6_000, 4), &service);
    let mut admitted = [0; 3];
    for (c, n) in clients.iter().zip(&out.admitted) {
        admitted[c.class as usize] += n;
    }
    LoopStats {
        admitted,
        waits: out.waits,
        shed_on_arrival: out.shed_arrival.iter().sum(),
        shed_waiting: out.shed_waiting.iter().sum(),
    }
}

pub(super) fn p99(waits: &mut [u64]) -> u64 {
    waits.sort_unstable();
    waits[waits.len() * 99 / 100]
}

/// Admissions by class (sheddable, default, critical) within 2 points of
/// `shares` (percent).
pub(super) fn assert_shares(admitted: &[u32; 3], shares: [u32; 3]) {
    let total: u32 = admitted.iter().sum();
    for (a, s) in admitted.iter().zip(shares) {
        let pct = 100 * a / total;
        assert!(pct + 2 >= s && pct <= s + 2, "{admitted:?} for {shares:?}");
    }
}

/// A closed-loop client of the simulations: on `worker`, of `class`,
/// sending from `start` (once only if `once`), served in `service` ms
/// (unless the simulation is given an upstream of its own), resending 1 ms
/// after a refusal.
#[derive(Clone, Copy)]
pub(super) struct RClient {
    pub(super) worker: usize,
    pub(super) class: Class,
    pub(super) start: u64,
    pub(super) service: u64,
    pub(super) once: bool,
}

#[derive(Debug, Default)]
pub(super) struct ROut {
    /// Per client: admissions, refusals on arrival, refusals while waiting.
    pub(super) admitted: Vec<u32>,
    pub(super) shed_arrival: Vec<u32>,
    pub(super) shed_waiting: Vec<u32>,
    /// How long each admitted request waited (ms; 0: admitted at once).
    pub(super) waits: Vec<u64>,
    pub(super) max_wait: u64,
}

/// `clients` against the shedder of `json` on `n_workers` workers, for
/// `ms` milliseconds; never more than `limit` in flight, never a store
/// failure. Each client's requests take `clients[i].service` ms.
pub(super) fn rsim(
    json: &str,
    n_workers: usize,
    clients: &[RClient],
    ms: u64,
    limit: usize,
) -> ROut {
    sim(json, n_workers, clients, (ms, limit), &|c, _| {
        clients[c as usize].service
    })
}

/// `rsim` with the upstream's time per request given by `service(client,
/// now)`.
pub(super) fn sim(
    json: &str,
    n_workers: usize,
    clients: &[RClient],
    (ms, limit): (u64, usize),
    service: &dyn Fn(u32, u64) -> u64,
) -> ROut {
    let config = parse(json.as_bytes()).expect("valid");
    let store = MemoryStore::default();
    let mut workers: Vec<Worker> = (1..=n_workers as u32)
        .map(|w| {
            Worker::new(
                Shedders::new(
                    &config.shedders,
                    &config.common,
                    (T0, w),
                    &mut Registry::default(),
                )
                .expect("builds"),
            )
        })
        .collect();
    workers[0].create(&store).expect("created");
    let n = clients.len();
    let mut out = ROut {
        admitted: vec![0; n],
        shed_arrival: vec![0; n],
        shed_waiting: vec![0; n],
        ..ROut::default()
    };
    let mut inflight: Vec<(usize, u32, u64)> = Vec::new();
    let mut sending: Vec<(u32, u64)> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| (i as u32, T0 + c.start))
        .collect();
    for now in T0..T0 + ms {
        let (done, rest): (Vec<_>, Vec<_>) = inflight.into_iter().partition(|x| x.2 <= now);
        inflight = rest;
        for (w, c, _) in done {
            workers[w].release(&store, 0);
            out.admitted[c as usize] += 1;
            if !clients[c as usize].once {
                sending.push((c, now));
            }
        }
        let (due, later): (Vec<_>, Vec<_>) = sending.into_iter().partition(|x| x.1 <= now);
        sending = later;
        for (c, _) in due {
            let cl = clients[c as usize];
            match workers[cl.worker].arrive(&store, now, 0, c, cl.class) {
                Arrival::Admit { slot } => {
                    assert!(slot, "admitted without a slot");
                    out.waits.push(0);
                    inflight.push((cl.worker, c, now + service(c, now)));
                }
                Arrival::Queue { evicted } => {
                    if let Some(v) = evicted {
                        out.shed_waiting[v.id as usize] += 1;
                        sending.push((v.id, now + 1));
                    }
                }
                Arrival::Shed | Arrival::Expired => {
                    out.shed_arrival[c as usize] += 1;
                    sending.push((c, now + 1));
                }
            }
        }
        for (w, worker) in workers.iter_mut().enumerate() {
            for wake in worker.wake(&store, now, 0) {
                match wake {
                    Wake::Resume {
                        id,
                        slot,
                        waited_ms,
                    } => {
                        assert!(slot, "admitted without a slot");
                        out.waits.push(waited_ms);
                        out.max_wait = out.max_wait.max(waited_ms);
                        inflight.push((w, id, now + service(id, now)));
                    }
                    Wake::Shed { waiter } | Wake::Expired { waiter } => {
                        out.shed_waiting[waiter.id as usize] += 1;
                        sending.push((waiter.id, now + 1));
                    }
                }
            }
        }
        assert!(inflight.len() <= limit, "{} in flight", inflight.len());
        assert_eq!(workers.iter().map(|w| w.store_failures).sum::<u64>(), 0);
    }
    out
}

// Regression tests from an independent review of shed_early and start tags.
pub(super) fn rclient(worker: usize, class: Class, start: u64) -> RClient {
    RClient {
        worker,
        class,
        start,
        service: 20,
        once: false,
    }
}

pub(super) fn sum_of(v: &[u32], range: std::ops::Range<usize>) -> u32 {
    v[range].iter().sum()
}

pub(super) const R_SHARES: &str = r#""shares":{"critical":50,"default":35,"sheddable":15}"#;
