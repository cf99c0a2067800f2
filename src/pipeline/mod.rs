//! The request pipeline: what happens to a request from its headers to the
//! end of its stream, as pure code. It runs the stages it is given in their
//! order (`src/wiring/` says which and in which order) and owns the
//! per-stream state, by stream id (which stages hold something for a
//! stream, which one paused it; the host keeps only the response headers
//! of a stream no stage holds), the exactly-once release on every way a
//! stream ends, the streams' deadlines (`deadline.rs`), the one list of
//! streams waiting on this worker (`wait.rs`), and the tick.
//!
//! The host calls it from each hook with what it read and carries out what
//! it answers: a verdict on the current request, effects on other streams,
//! a new tick period.
//!
//! Invariants (property-tested in `tests.rs`): a stage that holds something
//! for a stream hears of the stream's end exactly once, whichever way it
//! ends (success, upstream error, reset, local reply, client abort while
//! queued or in flight, a configuration replaced mid-stream); a request
//! refused by one stage spends nothing in the others.

#[cfg(test)]
mod chain_tests;
pub mod deadline;
mod flow;
pub mod stage;
pub mod telemetry;
#[cfg(test)]
mod tests;
pub mod wait;

pub use stage::{Call, Cx, Decision, Effect, Env, Signal, Stage, Step, StreamId};

use crate::config::ResponseSpec;
use crate::hash::FastMap;
use crate::header::Headers;
use crate::request::{RequestView, ResponseView};
use crate::rng::SplitMix;
use crate::time::{Duration, Instant};
use deadline::Budgets;
pub use flow::Verdict;
use flow::{each, release, run, try_each, StreamState};
use telemetry::Registry;
use wait::WaitList;

/// The tick period while no stage has to act sooner.
pub const SLOW_TICK: Duration = Duration::from_ms(100);
/// The tick period while anyone waits (a slot freed on another worker is
/// used within about a millisecond) or a stage has to act sooner
/// (`Stage::wants_fast_tick`: an update to retry, an adaptive limit's
/// samples to merge).
pub const FAST_TICK: Duration = Duration::from_ms(1);

/// What the host must carry out after a call.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Effects on other streams, in order.
    pub effects: Vec<Effect>,
    /// A new tick period, if it changed.
    pub tick: Option<Duration>,
    /// Calls to start (asked for from a tick).
    pub calls: Vec<Call>,
    /// Words to other VMs, in order.
    pub signals: Vec<Signal>,
    /// Request headers the host sets on the decided request before it goes
    /// on after a wait: every deadline header it carries, reduced by the
    /// wait (`deadlines.propagate`).
    pub request_headers: Vec<(String, String)>,
    /// From `request` only: whether the pipeline keeps anything of the
    /// stream (a stage holds something, or it is paused; its deadline is
    /// kept only then). When it does not, `response` and `end` for that
    /// stream do nothing, and the host may skip both calls.
    pub kept: bool,
}

/// One configuration's pipeline, in one VM.
pub struct Pipeline {
    stages: Vec<Box<dyn Stage>>,
    rng: SplitMix,
    fast_tick: bool,
    response: ResponseSpec,
    /// The `deadlines` section's budgets of the streams alive.
    budgets: Option<Budgets>,
    /// The streams waiting on this worker, whichever stage paused them.
    waits: WaitList,
    /// The streams it keeps something of (see [`StreamState`]), by id: a
    /// stage holds something for them or they are paused (and, after a
    /// wait, their response headers).
    streams: FastMap<StreamId, StreamState>,
    /// The response headers of the last stream decided, if no stage holds
    /// it and it is not paused (see `handed_headers`).
    handed: Headers,
    /// The metrics every stage defined.
    pub metrics: Registry,
}

impl Pipeline {
    /// A pipeline of `stages`, in request order (`src/wiring/` builds
    /// them from the configuration), with the `deadlines` section's
    /// `budgets` if it has one; `metrics` holds what they defined; `rng`
    /// seeds jitter.
    pub fn new(
        stages: Vec<Box<dyn Stage>>,
        response: ResponseSpec,
        budgets: Option<Budgets>,
        metrics: Registry,
        rng: u64,
    ) -> Self {
        Pipeline {
            stages,
            rng: SplitMix(rng),
            fast_tick: false,
            response,
            budgets,
            waits: WaitList::default(),
            streams: FastMap::default(),
            handed: Headers::new(),
            metrics,
        }
    }

    /// Whether any mechanism is configured (else nothing needs a tick).
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// The header naming the mechanism of a refusal, if configured.
    pub fn reason_header(&self) -> Option<&str> {
        self.response.reason_header.as_deref()
    }

    /// Runs `f` with a context over `env`.
    fn with_cx<R>(
        &mut self,
        env: &mut Env<'_>,
        f: impl FnOnce(&mut Vec<Box<dyn Stage>>, &mut Cx<'_, '_>) -> R,
    ) -> (R, Outcome) {
        self.with_cx_since(env, None, None, f)
    }

    /// `with_cx` for a request that arrived at `arrived` (a resumed one),
    /// at `now` if the time was read already.
    fn with_cx_since<R>(
        &mut self,
        env: &mut Env<'_>,
        arrived: Option<Instant>,
        now: Option<Instant>,
        f: impl FnOnce(&mut Vec<Box<dyn Stage>>, &mut Cx<'_, '_>) -> R,
    ) -> (R, Outcome) {
        let mut effects = Vec::new();
        let mut calls = Vec::new();
        let mut signals = Vec::new();
        let mut cx = Cx {
            env,
            now,
            arrived,
            budgets: self.budgets.as_ref(),
            waits: &mut self.waits,
            stage: 0,
            rng: &mut self.rng,
            effects: &mut effects,
            calls: &mut calls,
            signals: &mut signals,
            tick_changed: false,
        };
        let r = f(&mut self.stages, &mut cx);
        let changed = cx.tick_changed;
        let tick = if changed { self.retick() } else { None };
        (
            r,
            Outcome {
                effects,
                tick,
                calls,
                signals,
                request_headers: Vec::new(),
                kept: false,
            },
        )
    }

    /// The new tick period, if the stages' need of the fast tick changed.
    fn retick(&mut self) -> Option<Duration> {
        let fast = !self.waits.is_empty() || self.stages.iter().any(|s| s.wants_fast_tick());
        if fast == self.fast_tick {
            return None;
        }
        self.fast_tick = fast;
        Some(if fast { FAST_TICK } else { SLOW_TICK })
    }

    /// Creates what the stages need in shared data (at configuration).
    pub fn start(&mut self, env: &mut Env<'_>) -> Result<(), String> {
        let (r, _) = self.with_cx(env, |stages, cx| try_each(stages, cx, |s, cx| s.start(cx)));
        r
    }

    /// Decides on a request's headers, stage by stage. A refusal releases
    /// what earlier stages hold for the stream at once.
    pub fn request(
        &mut self,
        env: &mut Env<'_>,
        id: StreamId,
        req: &dyn RequestView,
    ) -> (Verdict, Outcome) {
        let mut stream = StreamState::new(id);
        // The deadline is read once, on arrival; it is kept only while the
        // stream is (below).
        let now = self.budgets.as_mut().map(|b| {
            let now = (env.clock)();
            b.arrive(id.0, req, now);
            now
        });
        let (verdict, mut out) = self.with_cx_since(env, None, now, |stages, cx| {
            run(stages, cx, &mut stream, req, 0)
        });
        // Its response headers go to the host unless a stage holds it or it
        // is paused: then the stream is kept, and so are they. Its deadline
        // is kept only for a wait: a stream not kept needs it no more.
        let held = stream.holds != 0 || stream.paused_at.is_some();
        out.kept = held;
        if held {
            self.streams.insert(id, stream);
            if !self.handed.is_empty() {
                // An earlier stream's, never taken: not this one's.
                self.handed = Headers::new();
            }
        } else {
            if let Some(b) = &mut self.budgets {
                b.end(id.0);
            }
            self.handed = stream.response_headers;
        }
        (verdict, out)
    }

    /// Takes the response headers of the stream `request` just decided,
    /// unless a stage holds it or it is paused (then none: `response`
    /// gives them): the host adds them to that stream's response. The host
    /// takes them after every `request`, whatever `Outcome::kept` says.
    /// Apart from `request`'s answer, which every call moves about, to keep
    /// that small.
    pub fn handed_headers(&mut self) -> Option<Headers> {
        if self.handed.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut self.handed))
    }

    /// Forgets stream `id` if nothing of it is left to keep.
    fn forget_unless_worth_keeping(&mut self, id: StreamId) {
        if self.streams.get(&id).is_some_and(|s| !s.worth_keeping()) {
            self.streams.remove(&id);
        }
    }

    /// Keeps what is left of a stream until its next call.
    fn keep(&mut self, stream: StreamState) {
        if stream.worth_keeping() {
            self.streams.insert(stream.id, stream);
        }
    }

    /// A stream paused by a stage was resumed by it (`Effect::Resume`; the
    /// host has set the effect's headers): the stages after that one decide
    /// on it now, as they would have on its arrival. A stream not paused
    /// goes on unchanged.
    pub fn resume(
        &mut self,
        env: &mut Env<'_>,
        id: StreamId,
        req: &dyn RequestView,
    ) -> (Verdict, Outcome) {
        self.go_on(env, id, req, 1)
    }

    /// A stream paused by a stage is decided on again from that stage
    /// (`Effect::Again`). A stream not paused goes on unchanged.
    pub fn again(
        &mut self,
        env: &mut Env<'_>,
        id: StreamId,
        req: &dyn RequestView,
    ) -> (Verdict, Outcome) {
        self.go_on(env, id, req, 0)
    }

    /// A paused stream goes on from `after` stages past the one that
    /// paused it (1: the next; 0: that one again).
    fn go_on(
        &mut self,
        env: &mut Env<'_>,
        id: StreamId,
        req: &dyn RequestView,
        after: usize,
    ) -> (Verdict, Outcome) {
        let Some(mut stream) = self.streams.remove(&id) else {
            return (Verdict::Continue, Outcome::default());
        };
        let Some(at) = stream.paused_at.take() else {
            self.keep(stream);
            return (Verdict::Continue, Outcome::default());
        };
        let arrived = stream.arrived;
        let ((verdict, headers), mut out) = self.with_cx_since(env, arrived, None, |stages, cx| {
            let verdict = run(stages, cx, &mut stream, req, at + after);
            // It goes on after a wait: its deadline headers, reduced.
            let headers = match (&verdict, cx.budgets) {
                (Verdict::Continue, Some(b)) => b.headers_after_wait(id.0, cx.now()),
                _ => Vec::new(),
            };
            (verdict, headers)
        });
        out.request_headers = headers;
        self.keep(stream);
        (verdict, out)
    }

    /// The response headers: the stages holding something for the stream
    /// see them; returns the headers to add.
    pub fn response(
        &mut self,
        env: &mut Env<'_>,
        id: StreamId,
        resp: &dyn ResponseView,
    ) -> (Headers, Outcome) {
        // Looked at in place: most streams stay until their end.
        let Some(stream) = self.streams.get_mut(&id) else {
            return (Headers::new(), Outcome::default());
        };
        let headers = std::mem::take(&mut stream.response_headers);
        if stream.holds == 0 {
            self.forget_unless_worth_keeping(id);
            return (headers, Outcome::default());
        }
        // A stream answered while paused (Envoy's own local reply, say)
        // still waits in the stage that paused it: that stage keeps its
        // hold, and hears of the stream's end.
        let (paused, mut holds) = (stream.paused_at, stream.holds);
        let ((), out) = self.with_cx(env, |stages, cx| {
            for (i, stage) in stages.iter_mut().enumerate() {
                cx.stage = i;
                if holds & (1 << i) != 0 && !stage.response(cx, id, resp) && paused != Some(i) {
                    holds &= !(1 << i);
                }
            }
        });
        if let Some(stream) = self.streams.get_mut(&id) {
            stream.holds = holds;
        }
        self.forget_unless_worth_keeping(id);
        (headers, out)
    }

    /// The stream ended, however it ended: every stage holding something
    /// for it releases it, exactly once.
    pub fn end(&mut self, env: &mut Env<'_>, id: StreamId) -> Outcome {
        if let Some(b) = &mut self.budgets {
            b.end(id.0);
        }
        let Some(mut stream) = self.streams.remove(&id) else {
            self.forget_waiter(id);
            return Outcome::default();
        };
        if stream.holds == 0 {
            self.forget_waiter(id);
            return Outcome::default();
        }
        let ((), out) = self.with_cx(env, |stages, cx| release(stages, cx, &mut stream));
        // Out of any line, whether or not its stage took it out.
        self.forget_waiter(id);
        out
    }

    /// A stream an effect named is gone from the host (its context could
    /// not be set): it ends; if the pipeline no longer knows what it holds,
    /// every stage releases whatever it may hold for it (a stage's `end`
    /// for a stream it holds nothing for does nothing).
    pub fn gone(&mut self, env: &mut Env<'_>, id: StreamId) -> Outcome {
        if self.streams.contains_key(&id) {
            return self.end(env, id);
        }
        if let Some(b) = &mut self.budgets {
            b.end(id.0);
        }
        let mut stream = StreamState::new(id);
        stream.holds = u64::MAX;
        let ((), out) = self.with_cx(env, |stages, cx| release(stages, cx, &mut stream));
        self.forget_waiter(id);
        out
    }

    /// Takes stream `id` out of the wait list, if it is there.
    fn forget_waiter(&mut self, id: StreamId) {
        if !self.waits.is_empty() {
            self.waits.remove(id.0);
        }
    }

    /// The streams the pipeline keeps something of (bounded by the streams
    /// alive: each is forgotten at its end).
    pub fn streams_kept(&self) -> usize {
        self.streams.len() + self.budgets.as_ref().map_or(0, Budgets::kept) + self.waits.len()
    }

    /// Whether any stage holds something for stream `id`.
    pub fn holds(&self, id: StreamId) -> bool {
        self.streams.get(&id).is_some_and(|s| s.holds != 0)
    }

    /// Periodic work of every stage; back to the slow tick once no stage
    /// needs the fast one.
    pub fn tick(&mut self, env: &mut Env<'_>) -> Outcome {
        let ((), out) = self.with_cx(env, |stages, cx| {
            // Those whose time is up first: their stages answer them.
            let now = cx.now();
            for (i, stream, waiter) in cx.waits.expired(now) {
                if let Some(stage) = stages.get_mut(i) {
                    cx.stage = i;
                    stage.timed_out(cx, StreamId(stream), waiter);
                }
            }
            each(stages, cx, |s, cx| s.tick(cx));
            cx.tick_changed = true;
        });
        out
    }

    /// A call asked for by a stage ended (`body`: the response, or `None`).
    pub fn call_done(&mut self, env: &mut Env<'_>, id: u64, body: Option<&[u8]>) -> Outcome {
        let ((), out) = self.with_cx(env, |stages, cx| {
            each(stages, cx, |s, cx| s.call_done(cx, id, body));
        });
        out
    }

    /// Another VM woke this one through `queue`, a queue it listens on.
    pub fn woken(&mut self, env: &mut Env<'_>, queue: &str) -> Outcome {
        let ((), out) = self.with_cx(env, |stages, cx| {
            each(stages, cx, |s, cx| s.woken(cx, queue));
        });
        out
    }

    /// The configuration is going away: stages give back what they can.
    pub fn close(&mut self, env: &mut Env<'_>) -> Outcome {
        let ((), out) = self.with_cx(env, |stages, cx| {
            each(stages, cx, |s, cx| s.close(cx));
        });
        out
    }
}
