//! The seam every mechanism plugs into: a [`Stage`] sees each request in
//! order, may keep per-stream state keyed by the stream's id, and answers
//! with values; [`Cx`] is what a stage may use (the store, the clock,
//! randomness, metrics, and effects on other streams).

use super::deadline::Budgets;
use super::telemetry::{MetricId, Sink};
use super::wait::{LineId, Wait, WaitList};
use crate::header::Headers;
use crate::reply::Rejection;
use crate::request::{RequestView, ResponseView};
use crate::rng::SplitMix;
use crate::store::Store;
use crate::time::{Duration, Instant};

/// The host's id of a stream (an HTTP context id, per VM): typed at every
/// interface; a mechanism's own state may keep the bare number (`.0`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u32);

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What the host lends the pipeline for one call.
pub struct Env<'a> {
    /// Shared data.
    pub store: &'a dyn Store,
    /// Now; read at most once per call.
    pub clock: &'a dyn Fn() -> Instant,
    /// Metrics.
    pub sink: &'a mut dyn Sink,
}

/// Something the host must do to another stream than the current one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Answer the stream (paused in a queue) with a local reply.
    Reply {
        stream: StreamId,
        rejection: Rejection,
    },
    /// The paused stream may go on: the host calls `Pipeline::resume` for
    /// it, so that the stages after the one that paused it decide on it,
    /// and carries out that verdict. If the host finds the stream gone, it
    /// must call `Pipeline::end` for it (it may hold a slot).
    Resume { stream: StreamId },
    /// The paused stream is decided on again by the stage that paused it,
    /// as on its arrival (what it waits for may have come: a global key's
    /// first tokens): the host calls `Pipeline::again` for it and carries
    /// out that verdict; a stream found gone, `Pipeline::end`.
    Again { stream: StreamId },
}

/// A call out of the filter (gRPC, unary) that a stage asks the host to
/// make from its tick; its end comes back through `Stage::call_done`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The stage's id for it.
    pub id: u64,
    /// The Envoy cluster (HTTP/2).
    pub cluster: String,
    pub service: &'static str,
    pub method: &'static str,
    /// The request message, encoded.
    pub message: Vec<u8>,
    pub timeout: Duration,
}

/// A word between this Envoy's VMs through a proxy-wasm shared queue: an
/// item put in a queue wakes the VM that listens on it, on its own
/// thread, at once (see `Stage::woken`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signal {
    /// This VM listens on the queue of this name from now on (the last VM
    /// to listen on a name is the one woken).
    Listen(String),
    /// Wake the VM listening on the queue of this name, if any.
    Wake(String),
}

/// A stage's decision on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Go on to the next stage (and the upstream).
    Continue,
    /// Answer the request now; nothing is spent elsewhere.
    Reply(Rejection),
    /// Hold the request (queued); the stage resumes or answers it later
    /// through an [`Effect`]. On a resume, the stages after this one
    /// decide on the request.
    Pause,
}

/// A stage's answer on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub step: Step,
    /// Whether the stage keeps state for this stream (it then hears of the
    /// response and of the stream's end, exactly once).
    pub held: bool,
    /// Headers to add to the response (if the request goes on).
    pub response_headers: Headers,
}

impl Decision {
    /// Go on, holding nothing.
    pub fn pass() -> Self {
        Decision {
            step: Step::Continue,
            held: false,
            response_headers: Headers::new(),
        }
    }

    /// A decision with no headers.
    pub fn of(step: Step, held: bool) -> Self {
        Decision {
            step,
            held,
            response_headers: Headers::new(),
        }
    }
}

/// What a stage may use during one call.
pub struct Cx<'a, 'e> {
    pub(super) env: &'a mut Env<'e>,
    pub(super) now: Option<Instant>,
    /// When the current request arrived, if it was paused since.
    pub(super) arrived: Option<Instant>,
    /// The streams' deadlines, with a `deadlines` section.
    pub(super) budgets: Option<&'a Budgets>,
    /// The streams waiting on this worker, and the stage being called.
    pub(super) waits: &'a mut WaitList,
    pub(super) stage: usize,
    /// The pipeline's random source (jitter).
    pub rng: &'a mut SplitMix,
    /// Effects on other streams, in order.
    pub effects: &'a mut Vec<Effect>,
    /// Calls out of the filter the host must start (from a tick only: the
    /// host starts them from the root context, which hears their end).
    pub calls: &'a mut Vec<Call>,
    /// Words to other VMs (see [`Signal`]).
    pub signals: &'a mut Vec<Signal>,
    /// Set by a stage whose need of the fast tick may have changed.
    pub tick_changed: bool,
}

impl<'e> Cx<'_, 'e> {
    /// The store.
    pub fn store(&self) -> &'e dyn Store {
        self.env.store
    }

    /// Now (read from the host once per call, and only if a stage asks).
    pub fn now(&mut self) -> Instant {
        match self.now {
            Some(n) => n,
            None => {
                let n = (self.env.clock)();
                self.now = Some(n);
                n
            }
        }
    }

    /// How long the current request has waited in earlier stages: zero on
    /// its arrival, its wait so far when a resume goes on with it.
    pub fn waited(&mut self) -> Duration {
        match self.arrived {
            Some(a) => self.now().since(a),
            None => Duration::ZERO,
        }
    }

    /// Until when stream `id` may wait in sluice (a whole millisecond):
    /// `min_remaining` before its caller's deadline; `None` without one
    /// (or without a `deadlines` section).
    pub fn wait_until(&self, id: StreamId) -> Option<Instant> {
        self.budgets?.until(id.0)
    }

    /// The time stream `id` still has before its caller's deadline (whole
    /// milliseconds).
    pub fn deadline_left(&mut self, id: StreamId) -> Option<Duration> {
        let budgets = self.budgets?;
        let now = self.now();
        budgets.left(id.0, now)
    }

    /// The answer to stream `id`, whose deadline cannot be met (or, having
    /// waited, passed): the `deadlines` status, gRPC DEADLINE_EXCEEDED and
    /// the time it truly has left; `by` names what refused it. Counted in
    /// `sluice_deadline_refused_total`.
    pub fn deadline_answer(&mut self, id: StreamId, by: &str) -> Rejection {
        let now = self.now();
        match self.budgets {
            Some(b) => {
                let (rejection, refused) = b.answer(id.0, by, now);
                self.env.sink.add(refused, 1);
                rejection
            }
            None => super::deadline::rejection(by, 504, 0),
        }
    }

    /// Stream `stream` waits in this stage's `line`, in order of `key`
    /// (then of arrival), until `until` if given, when the pipeline takes
    /// it out and calls `Stage::timed_out`; the stage then answers
    /// `Step::Pause`. False if the stream waits already.
    pub fn wait(
        &mut self,
        stream: StreamId,
        line: LineId,
        key: u64,
        until: Option<Instant>,
    ) -> bool {
        let since = self.now();
        let waiter = Wait {
            line,
            key,
            since,
            until,
        };
        self.waits.push(self.stage, stream.0, waiter)
    }

    /// How stream `stream` waits in this stage, if it does.
    pub fn waiter(&self, stream: StreamId) -> Option<Wait> {
        let (stage, w) = self.waits.get(stream.0)?;
        (stage == self.stage).then_some(w)
    }

    /// Takes stream `stream` out of this stage's lines, if it waits there
    /// (exactly once: a second call finds nothing).
    pub fn leave(&mut self, stream: StreamId) -> Option<Wait> {
        self.waiter(stream)?;
        self.waits.remove(stream.0).map(|(_, w)| w)
    }

    /// The streams waiting in this stage's `line`, in order.
    pub fn in_line(&self, line: LineId) -> Vec<(StreamId, Wait)> {
        let line = self.waits.line(self.stage, line);
        line.map(|(s, w)| (StreamId(s), w)).collect()
    }

    /// The first stream waiting in this stage's `line`.
    pub fn first_in(&self, line: LineId) -> Option<(StreamId, Wait)> {
        let (s, w) = self.waits.line(self.stage, line).next()?;
        Some((StreamId(s), w))
    }

    /// The streams waiting in this stage's `line`, in order (nothing
    /// collected).
    pub fn each_in(&self, line: LineId) -> impl Iterator<Item = (StreamId, Wait)> + '_ {
        let line = self.waits.line(self.stage, line);
        line.map(|(s, w)| (StreamId(s), w))
    }

    /// The last stream waiting in this stage's `line` (the greatest key,
    /// the newest among equal ones).
    pub fn last_in(&self, line: LineId) -> Option<(StreamId, Wait)> {
        let (s, w) = self.waits.last(self.stage, line)?;
        Some((StreamId(s), w))
    }

    /// Whether nobody waits on this worker, in any stage.
    pub fn nobody_waits(&self) -> bool {
        self.waits.is_empty()
    }

    /// How many streams wait in this stage's `line`.
    pub fn count_in(&self, line: LineId) -> usize {
        self.waits.count(self.stage, line)
    }

    /// This stage's lines where someone waits, in order of their ids.
    pub fn lines(&self) -> Vec<LineId> {
        self.waits.lines_of(self.stage)
    }

    /// Adds to a counter or gauge (handed to the host in batches).
    pub fn add(&mut self, m: MetricId, by: i64) {
        self.env.sink.add(m, by);
    }

    /// Adds to a counter at once (rare events: breaker transitions).
    pub fn add_now(&mut self, m: MetricId, by: i64) {
        self.env.sink.add_now(m, by);
    }

    /// Sets a gauge, or records a histogram value, at once.
    pub fn record(&mut self, m: MetricId, value: u64) {
        self.env.sink.record(m, value);
    }
}

/// One mechanism in the request pipeline. A new mechanism is a folder with
/// a type implementing this, registered in `wiring::pipeline` (src/wiring/mod.rs).
///
/// Contract: a stage that answers `held: true` for a stream hears of it
/// again through `response` (unless it said it holds nothing more) and
/// then `end`, exactly once, however the stream ends; it must release
/// everything it keeps for the stream in `end`.
pub trait Stage {
    /// Creates what the stage needs in shared data (at configuration).
    fn start(&mut self, _cx: &mut Cx<'_, '_>) -> Result<(), String> {
        Ok(())
    }

    /// Decides on a request's headers.
    fn request(&mut self, cx: &mut Cx<'_, '_>, stream: StreamId, req: &dyn RequestView)
        -> Decision;

    /// The response headers of a stream this stage holds. Returns whether
    /// the stage still holds something for it (the stage a stream is
    /// paused at, answered meanwhile by Envoy, keeps its hold whatever it
    /// returns: it hears of the stream's end).
    fn response(
        &mut self,
        _cx: &mut Cx<'_, '_>,
        _stream: StreamId,
        _resp: &dyn ResponseView,
    ) -> bool {
        true
    }

    /// The stream ended, whichever way (or a later stage refused it):
    /// release what it holds.
    fn end(&mut self, _cx: &mut Cx<'_, '_>, _stream: StreamId) {}

    /// A stream this stage let through (and holds something for) waits in
    /// a later stage: it has not gone upstream yet.
    fn waiting(&mut self, _cx: &mut Cx<'_, '_>, _stream: StreamId) {}

    /// A stream this stage holds something for went on upstream after
    /// waiting in a later stage. (One that never waited goes on in the
    /// call that let it through, and is not told.)
    fn departed(&mut self, _cx: &mut Cx<'_, '_>, _stream: StreamId) {}

    /// Periodic work (every tick).
    fn tick(&mut self, _cx: &mut Cx<'_, '_>) {}

    /// A stream this stage put in a line with a time limit (`Cx::wait`)
    /// is still there at that time: the pipeline took it out; the stage
    /// answers it (`Effect::Reply`) or lets it go on (`Effect::Resume`).
    fn timed_out(&mut self, _cx: &mut Cx<'_, '_>, _stream: StreamId, _waiter: Wait) {}

    /// A call the stage asked for ended: `body` is the response, `None` on
    /// an error or timeout.
    fn call_done(&mut self, _cx: &mut Cx<'_, '_>, _id: u64, _body: Option<&[u8]>) {}

    /// Another VM (or this one) woke this one through `queue`, a queue it
    /// listens on (see [`Signal`]).
    fn woken(&mut self, _cx: &mut Cx<'_, '_>, _queue: &str) {}

    /// Whether the stage needs the fast (1 ms) tick now.
    fn wants_fast_tick(&self) -> bool {
        false
    }

    /// The configuration is going away: give back what can be given back.
    fn close(&mut self, _cx: &mut Cx<'_, '_>) {}
}
