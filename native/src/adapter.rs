//! The one place this crate calls the core's pipeline and wiring: a change
//! of their interface (the time the host passes in, say) is an edit here.
//!
//! Core APIs used: `wiring::{parse, pipeline, rebuilt, follower, shared_seed}`,
//! `Pipeline::{start, request, handed_headers, resume, again, response,
//! end, gone, tick, call_done, woken, close, is_empty, reason_header}`,
//! `pipeline::{Env, Outcome, Effect, Verdict, Signal, Call}`,
//! `telemetry::{Sink, MetricId, MetricDef}`, `store::Store`,
//! `reply::Rejection`, `header::Headers`.

use crate::store;
pub use sluice::header::Headers;
use sluice::pipeline::stage::StreamId;
use sluice::pipeline::telemetry::{MetricDef, MetricId, Sink};
use sluice::pipeline::{Env, Pipeline};
use sluice::request::{RequestView, ResponseView};
use sluice::time::Instant;
use sluice::wiring::{self, Config};
use std::cell::Cell;

pub use sluice::pipeline::{Call, Effect, Outcome, Signal, Verdict};
pub use sluice::reply::Rejection;

/// Milliseconds since the Unix epoch, from [`now_ns`].
pub fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

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

/// Metrics kept for later: a pipeline's first changes (its start's), made
/// before Envoy has its metrics defined, which are defined from it.
#[derive(Default)]
pub struct Recorder(Vec<(MetricId, Change)>);

enum Change {
    Add(i64),
    Record(u64),
}

impl Sink for Recorder {
    fn add(&mut self, m: MetricId, by: i64) {
        self.0.push((m, Change::Add(by)));
    }
    fn add_now(&mut self, m: MetricId, by: i64) {
        self.0.push((m, Change::Add(by)));
    }
    fn record(&mut self, m: MetricId, value: u64) {
        self.0.push((m, Change::Record(value)));
    }
}

impl Recorder {
    /// Makes the changes kept, in order.
    pub fn replay(self, to: &mut dyn Sink) {
        for (m, c) in self.0 {
            match c {
                Change::Add(by) => to.add(m, by),
                Change::Record(v) => to.record(m, v),
            }
        }
    }
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

/// Which pipeline of a configuration: the one on Envoy's main thread,
/// whose global rules lead (the only one that can call out), the same
/// built again after a panic (it leads, but does not say its configuration
/// is the newest: a newer one may have started since), or a worker's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Main,
    MainAgain,
    Worker,
}

impl Engine {
    /// Builds and starts a pipeline of `config` (`seed`: the hash seed
    /// every worker shares; `tag`: this pipeline's random tag; `rng`: seeds
    /// jitter), its start's metric changes to `sink`.
    pub fn build(
        config: &Config,
        seed: (u64, u64),
        (tag, rng): (u32, u64),
        (role, sink): (Role, &mut dyn Sink),
    ) -> Result<Self, String> {
        let build = match role {
            Role::Main => wiring::pipeline,
            Role::MainAgain => wiring::rebuilt,
            Role::Worker => wiring::follower,
        };
        let mut pipeline = build(config, seed, tag, now(), rng).map_err(|e| e.to_string())?;
        with_env(sink, &HookClock::default(), |env| pipeline.start(env))?;
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

    /// The response headers of the stream just decided, unless a stage
    /// holds it or it is paused (`Pipeline::handed_headers`).
    pub fn handed_headers(&mut self) -> Option<Headers> {
        self.pipeline.handed_headers()
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

    /// A call it asked for ended (`body`: the answer; `None`: it failed).
    pub fn call_done(&mut self, m: &mut dyn Sink, id: u64, body: Option<&[u8]>) -> Outcome {
        with_env(m, &HookClock::default(), |env| {
            self.pipeline.call_done(env, id, body)
        })
    }

    /// Woken through queue `name`, which it listens on.
    pub fn woken(&mut self, m: &mut dyn Sink, name: &str) -> Outcome {
        with_env(m, &HookClock::default(), |env| {
            self.pipeline.woken(env, name)
        })
    }

    /// The configuration is going away.
    pub fn close(&mut self, m: &mut dyn Sink) -> Outcome {
        with_env(m, &HookClock::default(), |env| self.pipeline.close(env))
    }
}
