//! Load shedding in the pipeline: classifies each request, admits, queues
//! or sheds it at each matching shedder, holds concurrency slots by stream
//! until the stream ends (released exactly once: removal from `held` is
//! the release), resumes or sheds queued streams when slots free and on
//! ticks, and feeds response latencies to the latency-mode shedders.
//!
//! By role: this file holds the stage proper (its state, its building,
//! its answers to the pipeline, and what each call on the shedders
//! reports); `admission.rs` runs a request through its shedders and
//! releases what a stream held; `wake.rs` resumes, sheds or expires queued
//! streams; `adaptive.rs` feeds and reads back the adaptive limits. The
//! queued streams wait in the pipeline's wait list (`Cx` is the shedders'
//! `Waiters`).

mod adaptive;
mod admission;
mod wake;

pub use super::METRICS;
use super::{Class, Report, ShedMetrics, ShedderId, ShedderSpec, Shedders};
use crate::config::{Common, ConfigError};
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Signal, Stage, Step, StreamId};
use crate::pipeline::telemetry::Registry;
use crate::request::{RequestView, ResponseView};
use crate::small::Small;
use crate::time::Instant;
use log::{debug, warn};

/// The shedding stage of one configuration.
pub struct ShedStage {
    shedders: Shedders,
    jitter_ns: u64,
    /// Concurrency slots held, by stream (their shedders).
    held: FastMap<StreamId, Small<ShedderId, 1>>,
    /// With an adaptive limit: when each stream holding a slot was admitted
    /// (ns), for its latency sample.
    admitted_ns: FastMap<StreamId, u64>,
    adaptive: bool,
    /// Latency-mode shedders to report a stream's response latency to, and
    /// when the request arrived (ms).
    watched: FastMap<StreamId, (Vec<ShedderId>, u64)>,
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
    classes: Vec<(ShedderId, Class)>,
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
    Ok(Some(Box::new(ShedStage {
        shedders: Shedders::new(specs, common, (now_ms, worker), reg)?,
        jitter_ns: common.response.retry_after_jitter_ns,
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

impl ShedStage {
    /// Shedder `s`'s metric ids (every shedder's: `s` comes from the
    /// shedders).
    fn metrics(&self, s: ShedderId) -> Option<ShedMetrics> {
        self.shedders.get(s).map(|x| x.metrics)
    }

    /// Carries out what a call on the shedders did: overload changes are
    /// counted and logged, and the workers a free slot is left to are
    /// woken, each once per pipeline call (store failures have no metric
    /// of their own here).
    fn report(&self, cx: &mut Cx<'_, '_>, report: Report) {
        for w in report.wakes {
            let wake = Signal::Wake(queue_name(w));
            if !cx.signals.contains(&wake) {
                cx.signals.push(wake);
            }
        }
        for (s, overloaded) in report.changes {
            let Some(x) = self.shedders.get(s) else {
                continue;
            };
            let name = x.spec.name.as_str();
            cx.add(x.metrics.overloaded, if overloaded { 1 } else { -1 });
            if overloaded {
                warn!("sluice: shedder `{name}`: queue delay above target, shedding");
            } else {
                debug!("sluice: shedder `{name}`: queue delay back under target");
            }
        }
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
        let now = cx.now().as_ms();
        let classes = self.shedders.classify(req);
        let mut watched = Vec::new();
        let until = cx.wait_until(id).map(Instant::as_ms);
        let step = self.arrive(cx, (id, now), &classes, until, &mut watched);
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
            let now = cx.now().as_ms();
            for s in watched {
                let reported_ms = self
                    .shedders
                    .get(s)
                    .and_then(|r| r.spec.latency.queue_time_header.as_deref())
                    .and_then(|h| resp.header(h))
                    .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
                let report =
                    self.shedders
                        .response(now, s, now.saturating_sub(start_ms), reported_ms);
                self.report(cx, report);
            }
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
        let store = cx.store();
        let report = self.shedders.return_leases(cx, store);
        self.report(cx, report);
        self.adapt(cx);
        self.wake(cx);
    }

    /// A worker that freed a slot left it to a waiter here.
    fn woken(&mut self, cx: &mut Cx<'_, '_>, queue: &str) {
        if queue == self.queue {
            self.wake(cx);
        }
    }

    /// Failed decrements to retry, and an adaptive limit's samples to
    /// merge soon ([`Shedders::merge_soon`]), need the fast tick (waiting
    /// requests have it from the pipeline, whose list they wait in).
    fn wants_fast_tick(&self) -> bool {
        self.shedders.has_retries() || self.shedders.merge_soon()
    }

    /// Leased slots go back; nobody is woken for them (the others' waiters
    /// find them on their next poll).
    fn close(&mut self, cx: &mut Cx<'_, '_>) {
        let store = cx.store();
        let _woken_by_polls = self.shedders.return_leases(cx, store);
    }
}
