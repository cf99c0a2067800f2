//! The one place this crate calls the core's pipeline and wiring: a change
//! of their interface (the time the host passes in, say) is an edit here.
//!
//! Core APIs used: `wiring::parse`, `wiring::pipeline`, `wiring::shared_seed`, `Pipeline::{start,
//! request, resume, again, response, end, gone, tick, close, is_empty,
//! reason_header}`, `pipeline::{Env, Outcome, Effect, Verdict}`,
//! `telemetry::{Sink, MetricId, MetricDef}`, `store::Store`,
//! `reply::Rejection`.

use crate::store;
use sluice::header::Headers;
use sluice::pipeline::stage::StreamId;
use sluice::pipeline::telemetry::{MetricDef, MetricId, Sink};
use sluice::pipeline::{Env, Pipeline};
use sluice::request::{RequestView, ResponseView};
use sluice::time::Instant;
use sluice::wiring::{self, Config};
use std::cell::Cell;

pub use sluice::pipeline::{Effect, Outcome, Verdict};
pub use sluice::reply::Rejection;

/// Nanoseconds since the Unix epoch, from the system clock (0 before it),
/// read directly: `SystemTime`'s checks cost ten times the read.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is ours to write; CLOCK_REALTIME always exists.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) } != 0 {
        return 0;
    }
    let (Ok(s), Ok(ns)) = (u64::try_from(ts.tv_sec), u64::try_from(ts.tv_nsec)) else {
        return 0;
    };
    s.saturating_mul(1_000_000_000).saturating_add(ns)
}

/// Now, as the core takes it.
fn now() -> Instant {
    Instant::from_ns(now_ns())
}

/// The time of one hook: the system clock, read once, when first asked
/// (the hook's tick check and its pipeline call see the same instant).
#[derive(Default)]
pub struct HookClock(Cell<Option<Instant>>);

impl HookClock {
    pub fn now(&self) -> Instant {
        match self.0.get() {
            Some(t) => t,
            None => {
                let t = now();
                self.0.set(Some(t));
                t
            }
        }
    }
}

/// Metrics that go nowhere: at configuration, before any stream.
pub struct NoMetrics;

impl Sink for NoMetrics {
    fn add(&mut self, _m: MetricId, _by: i64) {}
    fn add_now(&mut self, _m: MetricId, _by: i64) {}
    fn record(&mut self, _m: MetricId, _value: u64) {}
}

/// The table-hash seed every worker shares (`wiring::shared_seed`).
pub fn shared_seed(
    store: &dyn sluice::store::Store,
    domain: &str,
    fresh: [u8; 16],
) -> Option<(u64, u64)> {
    wiring::shared_seed(store, domain, fresh)
}

/// Parses and validates sluice's JSON configuration; the error names the
/// field.
pub fn parse(bytes: &[u8]) -> Result<Config, String> {
    wiring::parse(bytes).map_err(|e| e.to_string())
}

/// One configuration's pipeline on one worker.
pub struct Engine {
    pipeline: Pipeline,
}

/// Runs `f` with the process store, the hook's clock and `sink`.
fn with_env<R>(sink: &mut dyn Sink, clock: &HookClock, f: impl FnOnce(&mut Env<'_>) -> R) -> R {
    let mut env = Env {
        store: store::shared(),
        clock: &|| clock.now(),
        sink,
    };
    f(&mut env)
}

impl Engine {
    /// Builds and starts a pipeline of `config` (`seed`: the hash seed
    /// every worker shares; `tag`: this worker's random tag; `rng`: seeds
    /// jitter).
    pub fn build(config: &Config, seed: (u64, u64), tag: u32, rng: u64) -> Result<Self, String> {
        let mut pipeline =
            wiring::pipeline(config, seed, tag, now(), rng).map_err(|e| e.to_string())?;
        with_env(&mut NoMetrics, &HookClock::default(), |env| {
            pipeline.start(env)
        })?;
        Ok(Engine { pipeline })
    }

    /// The metrics the pipeline defined, in the order of its ids.
    pub fn metric_defs(&self) -> &[MetricDef] {
        &self.pipeline.metrics.defs
    }

    /// Whether no mechanism is configured.
    pub fn is_empty(&self) -> bool {
        self.pipeline.is_empty()
    }

    /// The header naming the mechanism of a refusal, if configured.
    pub fn reason_header(&self) -> Option<&str> {
        self.pipeline.reason_header()
    }

    pub fn request(
        &mut self,
        m: &mut dyn Sink,
        clock: &HookClock,
        id: u32,
        req: &dyn RequestView,
    ) -> (Verdict, Outcome) {
        with_env(m, clock, |env| {
            self.pipeline.request(env, StreamId(id), req)
        })
    }

    /// A paused stream goes on (`again`: decided again by the stage that
    /// paused it).
    pub fn go_on(
        &mut self,
        m: &mut dyn Sink,
        clock: &HookClock,
        id: u32,
        req: &dyn RequestView,
        again: bool,
    ) -> (Verdict, Outcome) {
        with_env(m, clock, |env| {
            if again {
                self.pipeline.again(env, StreamId(id), req)
            } else {
                self.pipeline.resume(env, StreamId(id), req)
            }
        })
    }

    pub fn response(
        &mut self,
        m: &mut dyn Sink,
        clock: &HookClock,
        id: u32,
        resp: &dyn ResponseView,
    ) -> (Headers, Outcome) {
        with_env(m, clock, |env| {
            self.pipeline.response(env, StreamId(id), resp)
        })
    }

    pub fn end(&mut self, m: &mut dyn Sink, clock: &HookClock, id: u32) -> Outcome {
        with_env(m, clock, |env| self.pipeline.end(env, StreamId(id)))
    }

    /// A stream an effect named is gone.
    pub fn gone(&mut self, m: &mut dyn Sink, clock: &HookClock, id: u32) -> Outcome {
        with_env(m, clock, |env| self.pipeline.gone(env, StreamId(id)))
    }

    pub fn tick(&mut self, m: &mut dyn Sink, clock: &HookClock) -> Outcome {
        with_env(m, clock, |env| self.pipeline.tick(env))
    }

    /// The configuration is going away.
    pub fn close(&mut self) -> Outcome {
        with_env(&mut NoMetrics, &HookClock::default(), |env| {
            self.pipeline.close(env)
        })
    }
}
