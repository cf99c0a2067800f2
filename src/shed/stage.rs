//! Load shedding in the pipeline: classifies each request, admits, queues
//! or sheds it at each matching shedder, holds concurrency slots by stream
//! until the stream ends (released exactly once: removal from `held` is
//! the release), resumes or sheds queued streams when slots free and on
//! ticks, and feeds response latencies to the latency-mode shedders.

use super::{Arrival, Class, ShedderSpec, Shedders, Wake};
use crate::config::{Common, ConfigError};
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Effect, Signal, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::reply::Rejection;
use crate::request::{RequestView, ResponseView};
use log::{debug, warn};

/// Metric ids of one shedder (labels `domain`, `shedder`).
#[derive(Default, Clone, Copy)]
struct OneShedder {
    in_flight: MetricId,
    queued: MetricId,
    queue_ms: MetricId,
    overloaded: MetricId,
    shed: [MetricId; 3],
    /// Adaptive limits only: the limit, and the latency floor (ms).
    adaptive: Option<(MetricId, MetricId)>,
}

/// The shedding stage of one configuration.
pub struct ShedStage {
    shedders: Shedders,
    jitter_ns: u64,
    metrics: Vec<OneShedder>,
    /// Concurrency slots held, by stream (shedder indices).
    held: FastMap<StreamId, Vec<usize>>,
    /// With an adaptive limit: when each stream holding a slot was admitted
    /// (ns), for its latency sample.
    admitted_ns: FastMap<StreamId, u64>,
    adaptive: bool,
    /// Latency-mode shedders to report a stream's response latency to, and
    /// when the request arrived (ms).
    watched: FastMap<StreamId, (Vec<usize>, u64)>,
    /// A queued stream that more shedders match: those, to pass once it
    /// leaves the queue it waits in.
    rest: FastMap<StreamId, Rest>,
    /// `wake` is running: a release meanwhile (a stream shed by a later
    /// shedder as it left a queue) asks for another round instead of a
    /// nested one.
    waking: bool,
    wake_again: bool,
    /// This worker's wake-up queue (see `queue_name`), and whether this VM
    /// listens on it yet (with a queue configured only).
    queue: String,
    listening: bool,
}

/// The shared queue a worker listens on to hear, at once, that a slot
/// another worker freed is left to one of its waiters (see `to_wake`).
fn queue_name(worker: u32) -> String {
    format!("sluice/shed/{worker:08x}")
}

/// The shedders a queued stream has still to pass.
struct Rest {
    classes: Vec<(usize, Class)>,
}

/// The stage, if the configuration has shedders. `worker` tags this VM's
/// claims in the shared queue entries.
pub fn build(
    specs: &[ShedderSpec],
    common: &Common,
    now_ms: u64,
    worker: u32,
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if specs.is_empty() {
        return Ok(None);
    }
    let metrics = specs
        .iter()
        .map(|s| shedder_metrics(reg, &common.domain, s))
        .collect();
    Ok(Some(Box::new(ShedStage {
        shedders: Shedders::new(specs, common, now_ms, worker)?,
        jitter_ns: common.response.retry_after_jitter_ns,
        metrics,
        held: FastMap::default(),
        admitted_ns: FastMap::default(),
        adaptive: specs
            .iter()
            .any(|s| s.concurrency.as_ref().is_some_and(|c| c.adaptive.is_some())),
        watched: FastMap::default(),
        rest: FastMap::default(),
        waking: false,
        wake_again: false,
        queue: queue_name(worker),
        // Nobody ever waits without a queue: nothing to hear.
        listening: !specs
            .iter()
            .any(|s| s.concurrency.as_ref().is_some_and(|c| c.queue > 0)),
    })))
}

/// The metrics of one shedder (labels `domain`, `shedder`).
fn shedder_metrics(reg: &mut Registry, domain: &str, s: &ShedderSpec) -> OneShedder {
    let labels = [("domain", domain), ("shedder", s.name.as_str())];
    // Indexed by `Class as usize`.
    let classes = [Class::Sheddable, Class::Default, Class::Critical].map(Class::name);
    let shed = reg.variants("sluice_shed_total", &labels, "priority", classes);
    let mut m = |kind, name| reg.labelled(kind, name, &labels);
    let adaptive = s.concurrency.as_ref().and_then(|c| c.adaptive).map(|_| {
        (
            m(Kind::Gauge, "sluice_shed_limit"),
            m(Kind::Gauge, "sluice_shed_latency_floor_ms"),
        )
    });
    OneShedder {
        in_flight: m(Kind::Gauge, "sluice_shed_in_flight"),
        queued: m(Kind::Gauge, "sluice_shed_queued"),
        queue_ms: m(Kind::Histogram, "sluice_shed_queue_ms"),
        overloaded: m(Kind::Gauge, "sluice_shed_overloaded_workers"),
        shed,
        adaptive,
    }
}

impl ShedStage {
    fn m(&self, s: usize) -> OneShedder {
        self.metrics.get(s).copied().unwrap_or_default()
    }

    /// Reports the overload changes the shedders noted.
    fn changes(&mut self, cx: &mut Cx<'_, '_>) {
        for (s, overloaded) in std::mem::take(&mut self.shedders.changes) {
            let name = self
                .shedders
                .rules
                .get(s)
                .map_or("", |x| x.spec.name.as_str());
            cx.add(self.m(s).overloaded, if overloaded { 1 } else { -1 });
            if overloaded {
                warn!("sluice: shedder `{name}`: queue delay above target, shedding");
            } else {
                debug!("sluice: shedder `{name}`: queue delay back under target");
            }
        }
    }

    /// The shed answer for a request of `class` at shedder `s`, counted.
    fn answer(&self, cx: &mut Cx<'_, '_>, s: usize, class: Class) -> Option<Rejection> {
        let spec = &self.shedders.rules.get(s)?.spec;
        let r = super::reply::rejection(
            &spec.name,
            class.name(),
            spec.status,
            self.jitter_ns,
            cx.rng,
        );
        if let Some(&id) = self.m(s).shed.get(class as usize) {
            cx.add(id, 1);
        }
        Some(r)
    }

    /// Answers another (queued) stream with the shed reply.
    fn shed_other(&self, cx: &mut Cx<'_, '_>, s: usize, class: Class, stream: StreamId) {
        if let Some(rejection) = self.answer(cx, s, class) {
            cx.effects.push(Effect::Reply { stream, rejection });
        }
    }

    fn hold(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, s: usize) {
        self.held.entry(id).or_default().push(s);
        cx.add(self.m(s).in_flight, 1);
        if self.adaptive {
            let now = cx.now_ns();
            self.admitted_ns.entry(id).or_insert(now);
        }
    }

    /// Adaptive limits: a response's latency since admission is a sample
    /// for each adaptive shedder whose slot the stream holds.
    fn sample(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        let Some(since) = self.admitted_ns.remove(&id) else {
            return;
        };
        let now_ns = cx.now_ns();
        let latency_us = now_ns.saturating_sub(since) / 1_000;
        for &s in self.held.get(&id).map_or(&[][..], Vec::as_slice) {
            self.shedders.sample(s, latency_us, now_ns / 1_000_000);
        }
    }

    /// An adaptive limit's samples to merge soon ([`Shedders::merge_soon`])
    /// need the fast tick: asked after every arrival, response and end
    /// (an op on the shared entry may have found the limit in full use, a
    /// response adds a sample); the pipeline changes the tick only if
    /// that changes what its stages want.
    fn ask_merge_soon(&self, cx: &mut Cx<'_, '_>) {
        if self.adaptive && self.shedders.merge_soon() {
            cx.tick_changed = true;
        }
    }

    /// Adaptive limits (on the tick): shares this worker's samples, reads
    /// the limits back, and reports them.
    fn adapt(&mut self, cx: &mut Cx<'_, '_>) {
        if !self.adaptive {
            return;
        }
        let now = cx.now_ms();
        self.shedders.adapt(cx.store(), now);
        for s in 0..self.shedders.rules.len() {
            if let Some((limit, floor)) = self.m(s).adaptive {
                cx.record(limit, self.shedders.limit(s).unwrap_or(0));
                if let Some(f) = self.shedders.floor_us(s) {
                    cx.record(floor, f / 1_000);
                }
            }
        }
    }

    /// Resumes or sheds queued streams (after a release, and on ticks).
    fn wake(&mut self, cx: &mut Cx<'_, '_>) {
        if self.waking {
            self.wake_again = true;
            return;
        }
        self.waking = true;
        loop {
            self.wake_round(cx);
            if !std::mem::take(&mut self.wake_again) {
                break;
            }
        }
        self.waking = false;
        for w in self.shedders.take_wakes() {
            cx.signals.push(Signal::Wake(queue_name(w)));
        }
    }

    fn wake_round(&mut self, cx: &mut Cx<'_, '_>) {
        for s in 0..self.shedders.rules.len() {
            let sh = &self.shedders;
            if sh.queued(s) == 0 && !sh.overloaded(s) && !sh.has_retries() {
                continue;
            }
            let now = cx.now_ms();
            let wakes = self.shedders.wake(cx.store(), now, s);
            self.changes(cx);
            let m = self.m(s);
            for w in wakes {
                cx.add(m.queued, -1);
                match w {
                    Wake::Resume {
                        id,
                        waited_ms,
                        slot,
                    } => {
                        cx.record(m.queue_ms, waited_ms);
                        if slot {
                            self.hold(cx, id, s);
                        }
                        match self.rest.remove(&id) {
                            Some(rest) => self.pass_rest(cx, id, rest),
                            None => self.go_on(cx, id),
                        }
                    }
                    Wake::Shed { waiter } => self.shed_other(cx, s, waiter.class, waiter.id),
                    Wake::Expired { waiter } => self.expired(cx, s, waiter.id),
                }
            }
        }
        cx.tick_changed = true;
    }

    /// A stream out of one shedder's queue goes through the later shedders
    /// that match it, as it would have on arrival: each may admit it, queue
    /// it (again) or shed it. Admitted by all, it goes on.
    fn pass_rest(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, rest: Rest) {
        let now = cx.now_ms();
        let until = cx.wait_until_ms(id);
        let mut watched = Vec::new();
        match self.arrive(cx, (id, now), rest.classes, until, &mut watched) {
            None => {
                self.watch(id, watched, now);
                self.go_on(cx, id);
            }
            Some(Step::Reply(rejection)) => {
                for s in watched {
                    self.shedders.abandoned(s);
                }
                cx.effects.push(Effect::Reply {
                    stream: id,
                    rejection,
                });
            }
            // Queued again, at a later shedder.
            Some(_) => self.watch(id, watched, now),
        }
    }

    /// A stream that waited goes on now (the pipeline reduces its
    /// deadline headers by the wait); an adaptive limit's latency sample
    /// starts here, not at a slot taken before a wait at another shedder.
    fn go_on(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        if self.adaptive && self.held.contains_key(&id) {
            let now_ns = cx.now_ns();
            self.admitted_ns.insert(id, now_ns);
        }
        cx.effects.push(Effect::Resume { stream: id });
    }

    /// Let through with no slot: a latency-mode shedder watches its answer.
    fn let_through(&mut self, s: usize, watched: &mut Vec<usize>) {
        let latency = self
            .shedders
            .rules
            .get(s)
            .is_some_and(|r| r.spec.concurrency.is_none());
        if latency {
            self.shedders.started(s);
            watched.push(s);
        }
    }

    /// Latency-mode shedders that let a stream through watch its response.
    fn watch(&mut self, id: StreamId, watched: Vec<usize>, now: u64) {
        if !watched.is_empty() {
            self.watched
                .entry(id)
                .or_insert_with(|| (Vec::new(), now))
                .0
                .extend(watched);
        }
    }

    /// Answers a queued stream whose deadline passed while it waited.
    fn expired(&mut self, cx: &mut Cx<'_, '_>, s: usize, id: StreamId) {
        let rejection = self.deadline_answer(cx, s, id);
        cx.effects.push(Effect::Reply {
            stream: id,
            rejection,
        });
    }

    /// The answer to stream `id`, whose deadline passes (or, with
    /// `shed_early`, would pass) in shedder `s`'s queue, counted: the
    /// answer says how much time it truly has left.
    fn deadline_answer(&self, cx: &mut Cx<'_, '_>, s: usize, id: StreamId) -> Rejection {
        let name = self
            .shedders
            .rules
            .get(s)
            .map_or("", |r| r.spec.name.as_str());
        cx.deadline_answer(id, &format!("shed/{name}"))
    }

    /// Releases the stream's slots and takes it out of any queue, then
    /// lets waiters in.
    fn finish(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        self.rest.remove(&id);
        if self.adaptive {
            self.admitted_ns.remove(&id);
        }
        let slots = self.held.remove(&id).unwrap_or_default();
        for &s in &slots {
            self.shedders.release(cx.store(), s);
            cx.add(self.m(s).in_flight, -1);
        }
        let mut cancelled = false;
        for s in 0..self.shedders.rules.len() {
            if self.shedders.cancel(cx.store(), s, id) {
                cancelled = true;
                cx.add(self.m(s).queued, -1);
            }
        }
        if !slots.is_empty() || cancelled {
            self.wake(cx);
        }
    }

    /// Runs the request's shedders; `Some(step)` when one sheds or queues
    /// it. `watched` gets the latency-mode shedders that let it through.
    fn arrive(
        &mut self,
        cx: &mut Cx<'_, '_>,
        (id, now): (StreamId, u64),
        classes: Vec<(usize, Class)>,
        until: Option<u64>,
        watched: &mut Vec<usize>,
    ) -> Option<Step> {
        for (k, &(s, class)) in classes.iter().enumerate() {
            let arrival = self
                .shedders
                .arrive_until(cx.store(), now, s, (id, class), until);
            self.changes(cx);
            match arrival {
                Arrival::Admit { slot: true } => self.hold(cx, id, s),
                Arrival::Admit { slot: false } => self.let_through(s, watched),
                Arrival::Shed => {
                    self.finish(cx, id);
                    let r = self.answer(cx, s, class)?;
                    return Some(Step::Reply(r));
                }
                Arrival::Expired => {
                    self.finish(cx, id);
                    return Some(Step::Reply(self.deadline_answer(cx, s, id)));
                }
                Arrival::Queue { evicted } => {
                    cx.add(self.m(s).queued, 1);
                    cx.tick_changed = true;
                    if let Some(w) = evicted {
                        cx.add(self.m(s).queued, -1);
                        self.shed_other(cx, s, w.class, w.id);
                    }
                    // The shedders after this one see it when it leaves
                    // the queue (`pass_rest`).
                    if let Some(more) = classes.get(k + 1..).filter(|m| !m.is_empty()) {
                        let rest = Rest {
                            classes: more.to_vec(),
                        };
                        self.rest.insert(id, rest);
                    }
                    return Some(Step::Pause);
                }
            }
        }
        None
    }
}

impl Stage for ShedStage {
    fn start(&mut self, cx: &mut Cx<'_, '_>) -> Result<(), String> {
        self.shedders.read_limits(cx.store());
        self.shedders
            .create(cx.store())
            .map_err(|e| format!("could not create shedder counters in shared data: {e:?}"))
    }

    fn request(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, req: &dyn RequestView) -> Decision {
        let now = cx.now_ms();
        let classes = self.shedders.classify(req);
        let mut watched = Vec::new();
        let until = cx.wait_until_ms(id);
        let step = self.arrive(cx, (id, now), classes, until, &mut watched);
        self.ask_merge_soon(cx);
        if let Some(Step::Reply(r)) = step {
            for s in watched {
                self.shedders.abandoned(s);
            }
            return Decision::of(Step::Reply(r), false);
        }
        if !watched.is_empty() {
            self.watched.insert(id, (watched, now));
        }
        let queued = step.is_some();
        let held = queued || self.held.contains_key(&id) || self.watched.contains_key(&id);
        Decision::of(step.unwrap_or(Step::Continue), held)
    }

    /// Latency mode: feeds the response's latency (or the queue time the
    /// upstream reports in a header) to the shedders that watch it.
    fn response(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, resp: &dyn ResponseView) -> bool {
        if self.adaptive {
            self.sample(cx, id);
            self.ask_merge_soon(cx);
        }
        if let Some((watched, start_ms)) = self.watched.remove(&id) {
            let now = cx.now_ms();
            for s in watched {
                let reported_ms = self
                    .shedders
                    .rules
                    .get(s)
                    .and_then(|r| r.spec.latency.queue_time_header.as_deref())
                    .and_then(|h| resp.header(h))
                    .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
                self.shedders
                    .response(now, s, now.saturating_sub(start_ms), reported_ms);
            }
            self.changes(cx);
        }
        self.held.contains_key(&id)
    }

    fn end(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        // Let through but never answered: no sample, no longer in flight.
        if let Some((watched, _)) = self.watched.remove(&id) {
            for s in watched {
                self.shedders.abandoned(s);
            }
        }
        self.finish(cx, id);
        self.ask_merge_soon(cx);
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        if !self.listening {
            self.listening = true;
            cx.signals.push(Signal::Listen(self.queue.clone()));
        }
        self.shedders.return_leases(cx.store());
        self.adapt(cx);
        self.wake(cx);
    }

    /// A worker that freed a slot left it to a waiter here.
    fn woken(&mut self, cx: &mut Cx<'_, '_>, queue: &str) {
        if queue == self.queue {
            self.wake(cx);
        }
    }

    /// Waiting requests, failed decrements to retry, and an adaptive
    /// limit's samples to merge soon ([`Shedders::merge_soon`]) need the
    /// fast tick.
    fn wants_fast_tick(&self) -> bool {
        self.shedders.has_retries()
            || (0..self.shedders.rules.len()).any(|s| self.shedders.queued(s) > 0)
            || self.shedders.merge_soon()
    }

    fn close(&mut self, cx: &mut Cx<'_, '_>) {
        self.shedders.return_leases(cx.store());
    }
}
