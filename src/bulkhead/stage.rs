//! Concurrency limits per key in the pipeline, after retry budgets and
//! before rate limits (a request refused here spends no token; one refused
//! by a rate limit gives its slot back at once): holds each admitted
//! stream's slots until the stream ends, however it ends. A request over a
//! limit with a `max_wait` waits, paused, for a place (see `wait.rs`); the
//! later stages see it only once it has every place.

use super::config::LimitSpec;
use super::queue::{Pending, Place, Queues};
use super::{Admission, Bulkheads};
use crate::config::{Common, ConfigError};
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::Declared;
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::RequestView;
use crate::time::Instant;

/// The metrics of concurrency limits.
pub const METRICS: &[Declared] = &[
    Declared {
        name: "sluice_bulkhead_requests_total",
        kind: Kind::Counter,
        labels: &["domain", "limit", "result"],
    },
    Declared {
        name: "sluice_bulkhead_in_flight",
        kind: Kind::Gauge,
        labels: &["domain", "limit"],
    },
    Declared {
        name: "sluice_bulkhead_queued",
        kind: Kind::Gauge,
        labels: &["domain", "limit"],
    },
    Declared {
        name: "sluice_bulkhead_store_failures_total",
        kind: Kind::Counter,
        labels: &["domain"],
    },
];

/// Metric ids of one limit (labels `domain`, `limit`).
#[derive(Clone, Copy)]
pub(super) struct OneLimit {
    pub admitted: MetricId,
    pub limited: MetricId,
    pub queued_admitted: MetricId,
    pub timed_out: MetricId,
    pub in_flight: MetricId,
    pub queued: MetricId,
}

/// The bulkhead stage of one configuration.
pub struct BulkheadStage {
    pub(super) bulkheads: Bulkheads,
    pub(super) jitter_ns: u64,
    pub(super) metrics: Vec<OneLimit>,
    pub(super) store_failures: MetricId,
    /// Slots held, by stream: (limit, slot).
    pub(super) held: FastMap<StreamId, Vec<Place>>,
    /// This worker's waiters.
    pub(super) queues: Queues,
}

/// A request's fate at one limit.
pub(super) enum Took {
    /// It has a place (or needs none).
    Yes,
    /// It must wait for one, and the line has room.
    Wait,
    /// Refused: full, and no waiting (or no room to wait).
    No,
}

/// The stage, if the configuration has concurrency limits.
pub fn build(
    specs: &[LimitSpec],
    common: &Common,
    seed: (u64, u64),
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if specs.is_empty() {
        return Ok(None);
    }
    let metrics = specs
        .iter()
        .map(|l| {
            let labels = [
                ("domain", common.domain.as_str()),
                ("limit", l.name.as_str()),
            ];
            let [admitted, limited, queued_admitted, timed_out] = reg.variants(
                "sluice_bulkhead_requests_total",
                &labels,
                "result",
                ["admitted", "limited", "queued_admitted", "timed_out"],
            );
            OneLimit {
                admitted,
                limited,
                queued_admitted,
                timed_out,
                in_flight: reg.labelled(Kind::Gauge, "sluice_bulkhead_in_flight", &labels),
                queued: reg.labelled(Kind::Gauge, "sluice_bulkhead_queued", &labels),
            }
        })
        .collect();
    Ok(Some(Box::new(BulkheadStage {
        bulkheads: Bulkheads::new(specs, common, seed)?,
        jitter_ns: common.response.retry_after_jitter_ns,
        metrics,
        store_failures: reg.labelled(
            Kind::Counter,
            "sluice_bulkhead_store_failures_total",
            &[("domain", common.domain.as_str())],
        ),
        held: FastMap::default(),
        queues: Queues::default(),
    })))
}

impl BulkheadStage {
    /// Adds `by` to the metric `which` picks among limit `b`'s (a limit
    /// not in the configuration has none to count).
    pub(super) fn count(
        &self,
        cx: &mut Cx<'_, '_>,
        b: usize,
        which: impl Fn(&OneLimit) -> MetricId,
        by: i64,
    ) {
        if let Some(m) = self.metrics.get(b) {
            cx.add(which(m), by);
        }
    }

    /// Counts the store failures a call on the limits met.
    pub(super) fn count_failures(&self, cx: &mut Cx<'_, '_>, n: u32) {
        if n > 0 {
            cx.add(self.store_failures, i64::from(n));
        }
    }

    /// Takes stream `id` a place at limit `b` (`slot`: where its key
    /// lives; `None`: it has no key there and needs no place), unless
    /// the limit is full, or others wait there on this worker (then it
    /// waits behind them, if the limit lets requests wait).
    pub(super) fn take(
        &mut self,
        cx: &mut Cx<'_, '_>,
        id: StreamId,
        b: usize,
        slot: Option<u32>,
    ) -> Took {
        let Some(slot) = slot else {
            // Keyless where the key is skipped: the limit does not apply,
            // and counts nothing.
            return Took::Yes;
        };
        let wait = self.bulkheads.rules.get(b).and_then(|r| r.spec.wait);
        let queued = match wait {
            Some(_) if !self.queues.is_empty() => self.queues.waiting_at(cx, (b, slot)),
            _ => 0,
        };
        let got = if queued > 0 {
            Admission::Full
        } else {
            let (got, failed) = self.bulkheads.take(cx.store(), b, slot);
            self.count_failures(cx, failed);
            got
        };
        match got {
            Admission::Holds { slot } => {
                self.held.entry(id).or_default().push((b, slot));
                self.count(cx, b, |m| m.admitted, 1);
                self.count(cx, b, |m| m.in_flight, 1);
                Took::Yes
            }
            Admission::Free => {
                self.count(cx, b, |m| m.admitted, 1);
                Took::Yes
            }
            Admission::Full => match wait {
                Some(w) if queued < w.queue as usize => Took::Wait,
                _ => {
                    self.count(cx, b, |m| m.limited, 1);
                    Took::No
                }
            },
        }
    }

    /// The answer to a request refused at limit `b` (over its limit, or
    /// its time to wait is up).
    pub(super) fn rejection(
        &self,
        cx: &mut Cx<'_, '_>,
        b: usize,
    ) -> Option<crate::reply::Rejection> {
        let spec = &self.bulkheads.rules.get(b)?.spec;
        Some(super::reply::rejection(
            &spec.name,
            spec.max,
            spec.status,
            self.jitter_ns,
            cx.rng,
        ))
    }

    /// Puts an arrival that must wait at limit `b` in line, with the
    /// places of the limits after it.
    fn wait(
        &mut self,
        cx: &mut Cx<'_, '_>,
        id: StreamId,
        (b, slot): (usize, Option<u32>),
        req: &dyn RequestView,
    ) {
        let mut places = vec![(b, slot)];
        for (c, rule) in self.bulkheads.rules.iter().enumerate().skip(b + 1) {
            if rule.spec.matcher.matches(req) {
                places.push((c, self.bulkheads.place_of(c, req)));
            }
        }
        let now = cx.now().as_ms();
        let max_wait = self
            .bulkheads
            .rules
            .get(b)
            .and_then(|r| r.spec.wait)
            .map_or(0, |w| w.max_wait_ms);
        let by_wait = now.saturating_add(max_wait);
        let by_deadline = cx
            .wait_until(id)
            .map(Instant::as_ms)
            .filter(|&at| at < by_wait);
        self.park(
            cx,
            id,
            Pending {
                places,
                at: 0,
                since_ms: now,
                until_ms: by_deadline.unwrap_or(by_wait),
                by_deadline: by_deadline.is_some(),
            },
        );
    }

    /// Puts a waiter in its place's line.
    pub(super) fn park(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, w: Pending) {
        if let Some((b, _)) = w.place() {
            self.count(cx, b, |m| m.queued, 1);
        }
        self.queues.push(cx, id, w);
        cx.tick_changed = true;
    }
}

impl Stage for BulkheadStage {
    fn start(&mut self, cx: &mut Cx<'_, '_>) -> Result<(), String> {
        self.bulkheads
            .create(cx.store())
            .map_err(|e| format!("could not create concurrency limits in shared data: {e:?}"))
    }

    fn request(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, req: &dyn RequestView) -> Decision {
        for b in 0..self.bulkheads.rules.len() {
            let Some(rule) = self.bulkheads.rules.get(b) else {
                continue;
            };
            if !rule.spec.matcher.matches(req) {
                continue;
            }
            let slot = self.bulkheads.place_of(b, req);
            match self.take(cx, id, b, slot) {
                Took::Yes => {}
                Took::Wait => {
                    self.wait(cx, id, (b, slot), req);
                    return Decision::of(Step::Pause, true);
                }
                Took::No => {
                    // Slots taken at earlier limits go back at once.
                    self.release(cx, id);
                    return match self.rejection(cx, b) {
                        Some(r) => Decision::of(Step::Reply(r), false),
                        None => Decision::pass(),
                    };
                }
            }
        }
        Decision::of(Step::Continue, self.held.contains_key(&id))
    }

    fn response(
        &mut self,
        _cx: &mut Cx<'_, '_>,
        id: StreamId,
        _resp: &dyn crate::request::ResponseView,
    ) -> bool {
        // A waiter answered while it waits (Envoy's own local reply, say)
        // still waits here: its end must take it out of line.
        self.held.contains_key(&id) || self.queues.contains(id)
    }

    fn end(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        if !self.queues.is_empty() {
            self.cancel(cx, id);
        }
        self.release(cx, id);
    }

    /// Waiters poll for a place freed on another worker (on the fast
    /// tick the pipeline keeps while anyone waits).
    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        self.bulkheads.retry_failed(cx.store());
        if !self.queues.is_empty() {
            self.wake(cx);
        }
    }

    /// A waiter's `max_wait` or deadline passed: it is answered, and the
    /// places it took at earlier limits go back.
    fn timed_out(
        &mut self,
        cx: &mut Cx<'_, '_>,
        id: StreamId,
        _waiter: crate::pipeline::wait::Wait,
    ) {
        if let Some(w) = self.queues.cancel(cx, id) {
            self.time_out(cx, id, w);
            self.release(cx, id);
        }
    }
}
