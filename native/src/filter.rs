//! One HTTP stream: each hook calls its worker's pipeline and carries out
//! the answer (go on, a local reply, a paused stream; effects on the
//! worker's other paused streams; response headers).
//!
//! Every call into Envoy happens with the worker's state unlocked: a
//! callback may run this module's hooks again on this thread (a local
//! reply runs the response hooks, a resumed stream its later filters).

use crate::abi::{self, FilterPtr};
use crate::adapter::{Effect, Engine, Headers, HookClock, Outcome, Signal, Verdict};
use crate::config::{FilterConfig, InHook, Worker, WorkerState};
use crate::metrics::EnvoySink;
use crate::reply;
use crate::ticker;
use crate::views::{self, HostRequest, HostResponse};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Stream ids, unique among the streams alive in the process.
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// Where a stream's filter lives: the box whose address Envoy holds.
pub type Place = Option<Filter>;

/// Boxes a worker keeps for its next streams (at most [`MAX_SPARE`]):
/// a stream costs no allocation.
const MAX_SPARE: usize = 64;

thread_local! {
    // The boxes themselves are what is kept (Envoy holds their addresses).
    #[allow(clippy::vec_box)]
    static SPARE: RefCell<Vec<Box<Place>>> = const { RefCell::new(Vec::new()) };
}

/// A box holding `f`: a spare one of this thread's, or a new one.
pub fn boxed(f: Filter) -> Box<Place> {
    let spare = SPARE.try_with(|s| s.try_borrow_mut().ok()?.pop());
    match spare.ok().flatten() {
        Some(mut b) => {
            *b = Some(f);
            b
        }
        None => Box::new(Some(f)),
    }
}

/// Drops the filter in `b` (its stream's end), and keeps the box.
pub fn unboxed(mut b: Box<Place>) {
    // Taken out first: a hook Envoy runs while it is dropped finds none.
    drop(b.take());
    let _ = SPARE.try_with(move |s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            if s.len() < MAX_SPARE {
                s.push(b);
            }
        }
    });
}

pub struct Filter {
    config: Arc<FilterConfig>,
    envoy: FilterPtr,
    /// The worker's index, if the stream calls the pipeline.
    worker: Option<u32>,
    id: u32,
    // The fields a hook changes are cells: a hook may run inside another
    // of the same stream (a local reply runs the response hook), and both
    // reach the filter through shared references.
    /// The pipeline heard of the stream's end.
    ended: Cell<bool>,
    /// Whether the pipeline keeps anything of the stream (`Outcome::kept`;
    /// until its request is decided, it may): if not, the response and the
    /// end call nothing, and take no lock.
    kept: Cell<bool>,
    /// Headers for the response, from the request's decision
    /// (`Pipeline::handed_headers`).
    headers: Cell<Option<Headers>>,
    /// Made when the stream first waits (see `ticker`).
    scheduler: Cell<abi::SchedulerPtr>,
}

impl Filter {
    pub fn new(config: Arc<FilterConfig>, envoy: FilterPtr) -> Self {
        let worker = if config.empty {
            None
        } else {
            // SAFETY: `envoy` is the new stream's live Envoy filter.
            Some(unsafe { abi::envoy_dynamic_module_callback_http_filter_get_worker_index(envoy) })
        };
        Filter {
            config,
            envoy,
            worker,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ended: Cell::new(false),
            kept: Cell::new(true),
            headers: Cell::default(),
            scheduler: Cell::new(std::ptr::null_mut()),
        }
    }

    /// Metrics through the filter of stream `envoy` (of this configuration).
    fn sink(&self, envoy: FilterPtr) -> EnvoySink<'_> {
        EnvoySink {
            ids: &self.config.metrics,
            filter: envoy,
        }
    }

    fn worker(&self) -> Option<&Worker> {
        self.config.worker(self.worker?)
    }

    #[cfg(test)]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Whether a panic in a hook refuses the request (`failure_mode_deny`).
    pub fn deny_on_failure(&self) -> bool {
        self.config.deny
    }

    /// The request's headers: the pipeline's verdict, after the worker's
    /// tick if one is due.
    pub fn request_headers(&self) -> u32 {
        let Some(w) = self.worker() else {
            return abi::CONTINUE;
        };
        let _hook = InHook::enter(w);
        let req = HostRequest(self.envoy);
        let (id, envoy) = (self.id, self.envoy);
        let m = &mut self.sink(envoy);
        let clock = HookClock::default();
        let decided = self.config.with(w, self.id, |e, st| {
            let ticked = tick_if_due(e, st, m, &clock);
            let (verdict, out) = e.request(m, &clock, id, &req);
            // Set before any call into Envoy, which may run this stream's
            // response hook (a local reply).
            self.kept.set(out.kept);
            if let Some(headers) = e.handed_headers() {
                self.headers.set(Some(headers));
            }
            if verdict == Verdict::Pause {
                // Paused and ticked together (the ticker ticks the worker
                // while it waits), before any effect is carried out.
                st.paused.insert(id, envoy);
                st.in_hook.push(id);
                self.wait(w);
            }
            (ticked, verdict, out)
        });
        let Some((ticked, verdict, out)) = decided else {
            return abi::CONTINUE;
        };
        if let Some(ticked) = ticked {
            self.carry_out(w, &clock, ticked);
        }
        self.carry_out(w, &clock, out);
        match verdict {
            Verdict::Continue => abi::CONTINUE,
            // Resumed or answered later through an effect, maybe from a
            // tick; or already, by the effects just carried out.
            Verdict::Pause => {
                let left = self.config.with(w, self.id, |_, st| {
                    st.in_hook.retain(|&s| s != id);
                    let went_on = st.went_on.contains(&id);
                    st.went_on.retain(|&s| s != id);
                    went_on
                });
                if left == Some(true) {
                    abi::CONTINUE
                } else {
                    abi::STOP_ITERATION
                }
            }
            Verdict::Reply(r) => {
                reply::send(self.envoy, &r, self.config.reason_header.as_deref());
                abi::STOP_ITERATION
            }
        }
    }

    /// The response's headers: the stages holding something see them;
    /// their headers are added.
    pub fn response_headers(&self) -> u32 {
        // The headers come from the decision or from the pipeline, never both.
        let mut headers = self.headers.take();
        if self.kept.get() {
            let kept = self.pipeline_response();
            match &mut headers {
                Some(h) => h.extend(kept),
                None => headers = Some(kept),
            }
        }
        let Some(headers) = headers else {
            return abi::CONTINUE;
        };
        for (name, value) in headers.iter() {
            views::add_header(self.envoy, abi::RESPONSE_HEADERS, name, value.as_bytes());
        }
        abi::CONTINUE
    }

    /// The pipeline's part of the response (of a stream it keeps something
    /// of): its stages see the response; returns the headers it kept.
    fn pipeline_response(&self) -> Headers {
        let Some(w) = self.worker() else {
            return Headers::new();
        };
        let _hook = InHook::enter(w);
        let resp = HostResponse(self.envoy);
        let id = self.id;
        let m = &mut self.sink(self.envoy);
        let clock = HookClock::default();
        let Some((headers, out)) = self
            .config
            .with(w, self.id, |e, _| e.response(m, &clock, id, &resp))
        else {
            return Headers::new();
        };
        self.carry_out(w, &clock, out);
        headers
    }

    /// The stream ended, however it did (once; `stream_complete`, or the
    /// filter's destruction if Envoy skipped that).
    pub fn end(&self) {
        if self.ended.replace(true) || !self.kept.get() {
            return;
        }
        let Some(w) = self.worker() else {
            return;
        };
        let _hook = InHook::enter(w);
        let id = self.id;
        let m = &mut self.sink(self.envoy);
        let clock = HookClock::default();
        let done = self.config.with(w, self.id, |e, st| {
            unpause(w, st, id);
            (e.end(m, &clock, id), tick_if_due(e, st, m, &clock))
        });
        if let Some((out, ticked)) = done {
            self.carry_out(w, &clock, out);
            if let Some(ticked) = ticked {
                self.carry_out(w, &clock, ticked);
            }
        }
    }

    /// Carries out the effects on the worker's other streams, a new tick
    /// period (the main thread ticks the worker by then if no hook does)
    /// and wake-ups of the leader (`ticker::wake`). A worker's pipeline
    /// makes no calls (it never leads); it listens on no queue: what a
    /// wake-up of a worker would do, its 1 ms tick does while streams
    /// wait on it.
    fn carry_out(&self, w: &Worker, clock: &HookClock, out: Outcome) {
        crate::calls::not_started(&out.calls, "a worker's pipeline");
        if out.effects.is_empty() && out.tick.is_none() && out.signals.is_empty() {
            return;
        }
        if let Some(tick) = out.tick {
            let now = clock.now().as_ms();
            let next = self.config.with(w, self.id, |_, st| {
                st.set_period(tick.as_ms(), now);
                st.next_tick_ms
            });
            if let (Some(next), Some(key)) = (next, self.config.main.key()) {
                ticker::main_soon(key, next);
            }
        }
        for s in &out.signals {
            if let Signal::Wake(name) = s {
                ticker::wake(name);
            }
        }
        for e in out.effects {
            let (stream, again) = match e {
                Effect::Resume { stream } => (stream.0, false),
                Effect::Again { stream } => (stream.0, true),
                Effect::Reply { stream, rejection } => {
                    let found = self
                        .config
                        .with(w, self.id, |_, st| unpause(w, st, stream.0));
                    if let Some(Some(envoy)) = found {
                        reply::send(envoy, &rejection, self.config.reason_header.as_deref());
                    }
                    continue;
                }
            };
            self.go_on(w, clock, stream, again);
        }
    }

    /// A paused stream of this worker may go on: the later stages (or,
    /// `again`, the one that paused it) decide on it.
    fn go_on(&self, w: &Worker, clock: &HookClock, stream: u32, again: bool) {
        let found = self
            .config
            .with(w, self.id, |_, st| st.paused.get(&stream).copied());
        let Some(Some(envoy)) = found else {
            let m = &mut self.sink(self.envoy);
            if let Some(out) = self
                .config
                .with(w, self.id, |e, _| e.gone(m, clock, stream))
            {
                self.carry_out(w, clock, out);
            }
            return;
        };
        let req = HostRequest(envoy);
        let m = &mut self.sink(envoy);
        let decided = self.config.with(w, self.id, |e, st| {
            let (verdict, out) = e.go_on(m, clock, stream, &req, again);
            // Let go inside its own request hook: the hook goes on.
            let in_hook = st.in_hook.contains(&stream);
            if verdict != Verdict::Pause {
                unpause(w, st, stream);
                if in_hook && verdict == Verdict::Continue {
                    st.went_on.push(stream);
                }
            }
            (verdict, out, in_hook)
        });
        let Some((verdict, out, in_hook)) = decided else {
            // SAFETY: a paused stream's filter lives until its end, which
            // takes it out of `paused`.
            unsafe { abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy) };
            return;
        };
        match verdict {
            Verdict::Continue => {
                // Its deadline headers, reduced by its wait.
                for (name, value) in &out.request_headers {
                    views::set_header(envoy, abi::REQUEST_HEADERS, name, value);
                }
                if !in_hook {
                    // SAFETY: as above.
                    unsafe {
                        abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy)
                    };
                }
            }
            Verdict::Pause => {}
            Verdict::Reply(r) => reply::send(envoy, &r, self.config.reason_header.as_deref()),
        }
        self.carry_out(
            w,
            clock,
            Outcome {
                request_headers: Vec::new(),
                ..out
            },
        );
    }
}

impl Filter {
    /// The stream waits: its scheduler lets the ticker tick its worker.
    fn wait(&self, w: &Worker) {
        let mut scheduler = self.scheduler.get();
        if scheduler.is_null() {
            // SAFETY: the stream's live Envoy filter, on its worker.
            scheduler =
                unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(self.envoy) };
            self.scheduler.set(scheduler);
        }
        if !scheduler.is_null() {
            ticker::wait(w.key(), self.id, scheduler);
        }
    }

    /// The ticker's event, on this stream's worker: the worker's tick.
    pub fn scheduled(&self) {
        let Some(w) = self.worker() else {
            return;
        };
        let _hook = InHook::enter(w);
        let m = &mut self.sink(self.envoy);
        let clock = HookClock::default();
        let ticked = self.config.with(w, self.id, |e, st| {
            st.next_tick_ms = 0;
            tick_if_due(e, st, m, &clock)
        });
        if let Some(Some(out)) = ticked {
            self.carry_out(w, &clock, out);
        }
    }
}

/// The stream's end: the pipeline hears of it, and its scheduler goes.
impl Drop for Filter {
    fn drop(&mut self) {
        self.end();
        let s = self.scheduler.replace(std::ptr::null_mut());
        if !s.is_null() {
            // Out of the ticker's list whatever happened before (`end`
            // does it for a stream still paused).
            if let Some(w) = self.worker() {
                ticker::done(w.key(), self.id);
            }
            // SAFETY: made by `scheduler_new` for this stream, deleted once,
            // after `end` took it out of the ticker's list.
            unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(s) };
        }
    }
}

/// Stream `id` no longer waits on worker `w`: its Envoy filter, if it did.
fn unpause(w: &Worker, st: &mut WorkerState, id: u32) -> Option<FilterPtr> {
    if st.paused.is_empty() {
        return None;
    }
    let found = st.paused.remove(&id);
    if found.is_some() {
        ticker::done(w.key(), id);
    }
    found
}

/// The worker's tick, if due: the pipeline's periodic work, run from the
/// worker's own hooks (the main thread runs it when no hook does), with
/// what a tick the main thread ran for the worker left to it first.
fn tick_if_due(
    e: &mut Engine,
    st: &mut WorkerState,
    m: &mut EnvoySink<'_>,
    clock: &HookClock,
) -> Option<Outcome> {
    let deferred = std::mem::take(&mut st.deferred);
    let now_ms = clock.now().as_ms();
    if now_ms < st.next_tick_ms {
        return (!deferred.is_empty()).then(|| Outcome {
            effects: deferred,
            ..Outcome::default()
        });
    }
    st.next_tick_ms = now_ms.saturating_add(st.period());
    let mut out = e.tick(m, clock);
    if !deferred.is_empty() {
        let mut effects = deferred;
        effects.append(&mut out.effects);
        out.effects = effects;
    }
    Some(out)
}
