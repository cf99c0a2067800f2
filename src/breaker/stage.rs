//! Circuit breakers in the pipeline: checks each request against the
//! matching breakers (failing fast when one is open), keeps the tickets of
//! the requests that passed until their response or their stream's end,
//! and merges batched successes on the tick.

use super::runtime::{Breakers, Check, Event, Outcome, Ticket};
use super::Transition;
use crate::config::{Config, ConfigError};
use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::{RequestView, ResponseView};
use crate::rng::SplitMix;
use crate::store::Store;
use log::{info, warn};

/// Metric ids of one breaker (`sluice_cb_<what>.breaker.<name>`).
#[derive(Default, Clone, Copy)]
struct OneBreaker {
    state: MetricId,
    opened: MetricId,
    half_opened: MetricId,
    closed: MetricId,
    reopened: MetricId,
    fast_failed: MetricId,
    probes: MetricId,
}

/// The breaker stage of one configuration.
pub struct BreakerStage {
    breakers: Breakers,
    jitter_ns: u64,
    metrics: Vec<OneBreaker>,
    store_failures: MetricId,
    /// The tickets of the streams that passed, until their response or end.
    tickets: FastMap<StreamId, Vec<Ticket>>,
}

/// The stage, if the configuration has breakers.
pub fn build(
    config: &Config,
    seed: (u64, u64),
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    if config.breakers.is_empty() {
        return Ok(None);
    }
    let metrics = config
        .breakers
        .iter()
        .map(|b| {
            let mut m = |kind, what| reg.tagged(kind, "cb_", what, "breaker", &b.name);
            OneBreaker {
                state: m(Kind::Gauge, "state"),
                opened: m(Kind::Counter, "opened"),
                half_opened: m(Kind::Counter, "half_opened"),
                closed: m(Kind::Counter, "closed"),
                reopened: m(Kind::Counter, "reopened"),
                fast_failed: m(Kind::Counter, "fast_failed"),
                probes: m(Kind::Counter, "probes"),
            }
        })
        .collect();
    Ok(Some(Box::new(BreakerStage {
        breakers: Breakers::new(config, seed)?,
        jitter_ns: config.response.retry_after_jitter_ns,
        metrics,
        store_failures: reg.untagged(Kind::Counter, "sluice_cb_store_failures"),
        tickets: FastMap::default(),
    })))
}

type Work<'a, R> =
    &'a mut dyn FnMut(&mut Breakers, &dyn Store, &mut SplitMix, &mut Vec<Event>) -> R;

impl BreakerStage {
    /// Runs `f` on the breakers, then counts store failures and reports
    /// transitions.
    fn run<R>(&mut self, cx: &mut Cx<'_, '_>, f: Work<'_, R>) -> R {
        let failures_before = self.breakers.store_failures;
        let mut events = Vec::new();
        let r = f(&mut self.breakers, cx.store(), cx.rng, &mut events);
        let failed = self.breakers.store_failures - failures_before;
        if failed > 0 {
            cx.add(
                self.store_failures,
                i64::try_from(failed).unwrap_or(i64::MAX),
            );
        }
        for e in events {
            self.transition(cx, e);
        }
        r
    }

    /// Counts a transition, sets the state gauge (0 closed, 1 open, 2
    /// half-open) and logs it.
    fn transition(&self, cx: &mut Cx<'_, '_>, e: Event) {
        let name = self
            .breakers
            .rules
            .get(e.breaker)
            .map_or("", |r| r.spec.name.as_str());
        let Some(m) = self.metrics.get(e.breaker) else {
            return;
        };
        let (counter, state) = match e.transition {
            Transition::Opened { open_ms } => {
                warn!("sluice: circuit breaker `{name}` opened for {open_ms} ms");
                (m.opened, 1)
            }
            Transition::Reopened { open_ms } => {
                warn!("sluice: circuit breaker `{name}` probe failed; open again for {open_ms} ms");
                (m.reopened, 1)
            }
            Transition::HalfOpened => {
                info!("sluice: circuit breaker `{name}` half-open: probing");
                (m.half_opened, 2)
            }
            Transition::Closed => {
                info!("sluice: circuit breaker `{name}` closed");
                (m.closed, 0)
            }
        };
        cx.add_now(counter, 1);
        cx.record(m.state, state);
    }

    /// Reports the outcome of every ticket the stream holds.
    fn report(
        &mut self,
        cx: &mut Cx<'_, '_>,
        stream: StreamId,
        outcome: &dyn Fn(&super::FailureSpec) -> Outcome,
    ) {
        let Some(tickets) = self.tickets.remove(&stream) else {
            return;
        };
        let now = cx.now_ms();
        for t in tickets {
            let Some(spec) = self.breakers.rules.get(t.breaker).map(|r| r.spec.clone()) else {
                continue;
            };
            let o = outcome(&spec.failure);
            self.run(cx, &mut |b, store, rng, ev| {
                b.record(store, now, t, o, rng, ev)
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
        let now = cx.now_ms();
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
                self.tickets.insert(stream, tickets);
                Decision::of(Step::Continue, true)
            }
            Check::FailFast {
                breaker,
                retry_after_ms,
                half_open,
            } => {
                let Some(spec) = self.breakers.rules.get(breaker).map(|r| r.spec.clone()) else {
                    return Decision::pass();
                };
                if let Some(m) = self.metrics.get(breaker) {
                    cx.add(m.fast_failed, 1);
                }
                let r = super::reply::rejection(
                    &spec.name,
                    spec.status,
                    retry_after_ms,
                    half_open,
                    self.jitter_ns,
                    cx.rng,
                );
                Decision::of(Step::Reply(r), false)
            }
        }
    }

    fn response(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId, resp: &dyn ResponseView) -> bool {
        let status = resp.status();
        // Only an error status needs telling apart an upstream answer from
        // an Envoy or filter local reply: skip the host call otherwise.
        let details = match status {
            Some(s) if s < 400 => None,
            _ => resp.code_details(),
        };
        self.report(cx, stream, &|f| f.classify(status, details.as_deref()));
        false
    }

    /// A stream that ended without a response (client gone, reset, refused
    /// by a later stage) gives its probe claims back without a verdict.
    fn end(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId) {
        self.report(cx, stream, &|_| Outcome::Ignored);
    }

    fn tick(&mut self, cx: &mut Cx<'_, '_>) {
        let now = cx.now_ms();
        self.run(cx, &mut |b, store, rng, ev| b.flush(store, now, rng, ev));
    }
}
