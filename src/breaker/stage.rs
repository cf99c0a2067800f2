//! Circuit breakers in the pipeline: checks each request against the
//! matching breakers (failing fast when one is open), keeps the tickets of
//! the requests that passed until their response or their stream's end,
//! and merges batched successes on the tick.

use super::config::BreakerSpec;
use super::runtime::{Breakers, CallOutcome, Check, Event, Tickets};
use super::Transition;
use crate::config::{Common, ConfigError};
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::Declared;
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::{RequestView, ResponseView};
use crate::rng::SplitMix;
use crate::store::Store;
use log::info;

/// The metrics of circuit breakers.
pub const METRICS: &[Declared] = &[
    Declared {
        name: "sluice_cb_transitions_total",
        kind: Kind::Counter,
        labels: &["domain", "breaker", "transition"],
    },
    Declared {
        name: "sluice_cb_open_keys",
        kind: Kind::Gauge,
        labels: &["domain", "breaker"],
    },
    Declared {
        name: "sluice_cb_fast_failed_total",
        kind: Kind::Counter,
        labels: &["domain", "breaker"],
    },
    Declared {
        name: "sluice_cb_throttled_total",
        kind: Kind::Counter,
        labels: &["domain", "breaker"],
    },
    Declared {
        name: "sluice_cb_probes_total",
        kind: Kind::Counter,
        labels: &["domain", "breaker"],
    },
    Declared {
        name: "sluice_cb_store_failures_total",
        kind: Kind::Counter,
        labels: &["domain"],
    },
];

/// Metric ids of one breaker (labels `domain`, `breaker`).
#[derive(Default, Clone, Copy)]
struct OneBreaker {
    /// Keys not closed (open or half-open): the breaker's count in the
    /// store (+1 when one opens, -1 when one closes, by the VM that sees
    /// it), set at each transition and on the tick once a second.
    open_keys: MetricId,
    opened: MetricId,
    half_opened: MetricId,
    closed: MetricId,
    reopened: MetricId,
    fast_failed: MetricId,
    throttled: MetricId,
    probes: MetricId,
}

/// The breaker stage of one configuration.
pub struct BreakerStage {
    breakers: Breakers,
    jitter_ns: u64,
    metrics: Vec<OneBreaker>,
    store_failures: MetricId,
    /// The tickets of the streams that passed, until their response or
    /// end, and when each request started (ms).
    /// With when the call went upstream (`None` while it waits in a later
    /// stage: time spent in sluice is not the upstream's).
    tickets: FastMap<StreamId, (Option<u64>, Tickets)>,
    /// Whether any breaker counts slow calls (the tick then looks for them).
    slow_calls: bool,
    /// When the tick next sets the open-keys gauges from the store (ms).
    gauges_due_ms: u64,
}

/// The stage, if the configuration has breakers.
pub fn build(
    specs: &[BreakerSpec],
    common: &Common,
    seed: (u64, u64),
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if specs.is_empty() {
        return Ok(None);
    }
    let metrics = specs
        .iter()
        .map(|b| {
            let labels = [
                ("domain", common.domain.as_str()),
                ("breaker", b.name.as_str()),
            ];
            let [opened, half_opened, closed, reopened] = reg.variants(
                "sluice_cb_transitions_total",
                &labels,
                "transition",
                ["opened", "half_opened", "closed", "reopened"],
            );
            let mut m = |kind, name| reg.labelled(kind, name, &labels);
            OneBreaker {
                opened,
                half_opened,
                closed,
                reopened,
                open_keys: m(Kind::Gauge, "sluice_cb_open_keys"),
                fast_failed: m(Kind::Counter, "sluice_cb_fast_failed_total"),
                throttled: m(Kind::Counter, "sluice_cb_throttled_total"),
                probes: m(Kind::Counter, "sluice_cb_probes_total"),
            }
        })
        .collect();
    Ok(Some(Box::new(BreakerStage {
        breakers: Breakers::new(specs, common, seed)?,
        jitter_ns: common.response.retry_after_jitter_ns,
        metrics,
        store_failures: reg.labelled(
            Kind::Counter,
            "sluice_cb_store_failures_total",
            &[("domain", common.domain.as_str())],
        ),
        tickets: FastMap::default(),
        slow_calls: specs.iter().any(|b| b.failure.slow_ms.is_some()),
        gauges_due_ms: 0,
    })))
}

/// A call on the breakers: its result, and the store failures it met.
type Work<'a, R> =
    &'a mut dyn FnMut(&mut Breakers, &dyn Store, &mut SplitMix, &mut Vec<Event>) -> (R, u32);

impl BreakerStage {
    /// Runs `f` on the breakers, then counts the store failures it met and
    /// reports transitions.
    fn run<R>(&mut self, cx: &mut Cx<'_, '_>, f: Work<'_, R>) -> R {
        let mut events = Vec::new();
        let (r, failed) = f(&mut self.breakers, cx.store(), cx.rng, &mut events);
        if failed > 0 {
            cx.add(self.store_failures, i64::from(failed));
        }
        for e in events {
            self.transition(cx, e);
        }
        r
    }

    /// Counts a transition, keeps the open-keys gauge, and logs it at
    /// info, naming the key.
    fn transition(&self, cx: &mut Cx<'_, '_>, e: Event) {
        let name = self
            .breakers
            .rules
            .get(e.breaker)
            .map_or("", |r| r.spec.name.as_str());
        let key = self.breakers.key_name(e.breaker, e.key);
        let Some(m) = self.metrics.get(e.breaker) else {
            return;
        };
        let (counter, open_keys) = match e.transition {
            Transition::Opened { open_ms } => {
                info!("sluice: circuit breaker `{name}` opened for `{key}` for {open_ms} ms");
                (m.opened, 1)
            }
            Transition::Reopened { open_ms } => {
                info!("sluice: circuit breaker `{name}`: a probe to `{key}` failed; open again for {open_ms} ms");
                (m.reopened, 0)
            }
            Transition::HalfOpened => {
                info!("sluice: circuit breaker `{name}` half-open for `{key}`: probing");
                (m.half_opened, 0)
            }
            Transition::Closed => {
                info!("sluice: circuit breaker `{name}` closed for `{key}`");
                (m.closed, -1)
            }
        };
        cx.add_now(counter, 1);
        if open_keys != 0 {
            match self.breakers.add_open(cx.store(), e.breaker, open_keys) {
                Ok(n) => cx.record(m.open_keys, n),
                Err(_) => cx.add(self.store_failures, 1),
            }
        }
    }

    /// Sets each breaker's open-keys gauge from its count in the store, once
    /// a second: a gauge left over from a state that is gone (Envoy keeps a
    /// gauge by its name when the module is loaded from another file, or
    /// the VM has another `vm_id`) comes back to what the store holds.
    fn open_keys_gauges(&mut self, cx: &mut Cx<'_, '_>, now: u64) {
        if now < self.gauges_due_ms {
            return;
        }
        self.gauges_due_ms = now.saturating_add(1000);
        for (b, m) in self.metrics.iter().enumerate() {
            match self.breakers.open_count(cx.store(), b) {
                Ok(n) => cx.record(m.open_keys, n),
                Err(_) => cx.add(self.store_failures, 1),
            }
        }
    }

    /// Whether a breaker the stream holds a ticket of counts gRPC errors.
    fn counts_grpc(&self, stream: StreamId) -> bool {
        self.tickets.get(&stream).is_some_and(|(_, tickets)| {
            tickets.iter().any(|t| {
                self.breakers
                    .rules
                    .get(t.breaker)
                    .is_some_and(|r| r.spec.failure.grpc_statuses != 0)
            })
        })
    }

    /// Refuses the request at `breaker` with the reply `reply` builds,
    /// counted as `throttled` (graded) or fast-failed.
    fn refuse(
        &self,
        cx: &mut Cx<'_, '_>,
        breaker: usize,
        throttled: bool,
        reply: &dyn Fn(
            &super::BreakerSpec,
            u64,
            &mut crate::rng::SplitMix,
        ) -> crate::reply::Rejection,
    ) -> Decision {
        let Some(spec) = self.breakers.rules.get(breaker).map(|r| r.spec.clone()) else {
            return Decision::pass();
        };
        let r = reply(&spec, self.jitter_ns, cx.rng);
        if let Some(m) = self.metrics.get(breaker) {
            cx.add(
                if throttled {
                    m.throttled
                } else {
                    m.fast_failed
                },
                1,
            );
        }
        Decision::of(Step::Reply(r), false)
    }

    /// Reports the outcome of every ticket the stream holds; `outcome`
    /// also gets how long the call took (ms).
    fn report(
        &mut self,
        cx: &mut Cx<'_, '_>,
        stream: StreamId,
        outcome: &dyn Fn(&super::FailureSpec, u64) -> CallOutcome,
    ) {
        let Some((start, tickets)) = self.tickets.remove(&stream) else {
            return;
        };
        let now = cx.now().as_ms();
        for t in tickets {
            let Some(spec) = self.breakers.rules.get(t.breaker).map(|r| r.spec.clone()) else {
                continue;
            };
            let o = outcome(&spec.failure, start.map_or(0, |s| now.saturating_sub(s)));
            self.run(cx, &mut |b, store, rng, ev| {
                ((), b.record(store, now, t, o, rng, ev))
            });
        }
    }

    /// Calls in flight for longer than their breaker's `slow_call` count as
    /// failures now, without waiting for their answer (which then counts
    /// nothing more for that breaker).
    fn slow_calls(&mut self, cx: &mut Cx<'_, '_>, now: u64) {
        let mut slow = Vec::new();
        for (start, tickets) in self.tickets.values_mut() {
            let Some(start) = *start else {
                continue;
            };
            let elapsed = now.saturating_sub(start);
            let rules = &self.breakers.rules;
            tickets.retain(|t| {
                let late = rules
                    .get(t.breaker)
                    .and_then(|r| r.spec.failure.slow_ms)
                    .is_some_and(|s| elapsed >= s);
                if late {
                    slow.push(*t);
                }
                !late
            });
        }
        for t in slow {
            self.run(cx, &mut |b, store, rng, ev| {
                ((), b.record(store, now, t, CallOutcome::Failure, rng, ev))
            });
        }
    }
}

impl Stage for BreakerStage {
    fn request(
        &mut self,
        cx: &mut Cx<'_, '_>,
        stream: StreamId,
        req: &dyn RequestView,
    ) -> Decision {
        let now = cx.now().as_ms();
        let check = self.run(cx, &mut |b, store, rng, ev| {
            b.check(store, now, req, rng, ev)
        });
        match check {
            Check::Pass(tickets) if tickets.is_empty() => Decision::pass(),
            Check::Pass(tickets) => {
                for t in tickets.iter().filter(|t| t.probe) {
                    if let Some(m) = self.metrics.get(t.breaker) {
                        cx.add(m.probes, 1);
                    }
                }
                self.tickets.insert(stream, (Some(now), tickets));
                Decision::of(Step::Continue, true)
            }
            Check::Throttle {
                breaker,
                reject_permille,
            } => self.refuse(cx, breaker, true, &|spec, jitter, rng| {
                super::reply::throttled(&spec.name, spec.status, reject_permille, jitter, rng)
            }),
            Check::FailFast {
                breaker,
                retry_after_ms,
                half_open,
            } => self.refuse(cx, breaker, false, &|spec, jitter, rng| {
                super::reply::rejection(
                    &spec.name,
                    spec.status,
                    retry_after_ms,
                    half_open,
                    jitter,
                    rng,
                )
            }),
        }
    }

    fn response(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId, resp: &dyn ResponseView) -> bool {
        // Whatever the status, an upstream's answer is told apart from a
        // local reply by Envoy or a later filter (a redirect, an authz
        // denial, a filter's own 200), which says nothing about the
        // upstream: by the router's mark, read with the status, or else (a
        // local reply, or a router told not to mark) by Envoy's response
        // code details.
        let (status, marked) = resp.status_and_upstream_mark();
        let read = if marked { None } else { resp.code_details() };
        let details = if marked {
            Some(&b"via_upstream"[..])
        } else {
            read.as_deref()
        };
        // A gRPC error without a message comes in a 200's headers
        // (trailers-only); read only where a breaker of the stream counts one.
        let grpc = (status == Some(200) && self.counts_grpc(stream))
            .then(|| resp.header(super::config::GRPC_STATUS))
            .flatten();
        self.report(
            cx,
            stream,
            &|f, took_ms| match f.classify(status, details, grpc.as_deref()) {
                CallOutcome::Success if f.slow_ms.is_some_and(|s| took_ms >= s) => {
                    CallOutcome::Failure
                }
                o => o,
            },
        );
        false
    }

    /// A stream that ended without a response (client gone, reset, refused
    /// by a later stage) gives its probe claims back without a verdict.
    fn end(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId) {
        self.report(cx, stream, &|_, _| CallOutcome::Ignored);
    }

    fn waiting(&mut self, _cx: &mut Cx<'_, '_>, stream: StreamId) {
        if let Some(t) = self.tickets.get_mut(&stream) {
            t.0 = None;
        }
    }

    /// `slow_call` counts from here: the call's time at the upstream.
    fn departed(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId) {
        if let Some(t) = self.tickets.get_mut(&stream) {
            t.0 = Some(cx.now().as_ms());
        }
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        let now = cx.now().as_ms();
        if self.slow_calls {
            self.slow_calls(cx, now);
        }
        self.open_keys_gauges(cx, now);
        self.run(cx, &mut |b, store, rng, ev| {
            ((), b.flush(store, now, rng, ev))
        });
    }
}
