//! One configuration in one VM: its pipeline, the Envoy ids of its metrics,
//! and how the pipeline's answers are carried out on other streams.

use super::metrics::{self, HostSink, StoreMetrics};
use super::reply;
use super::store::SharedData;
use super::views::{now_ns, HostRequest};
use crate::pipeline::{Effect, Env, Outcome, Pipeline, Verdict};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;
use std::cell::RefCell;

pub struct Plugin {
    pipeline: RefCell<Pipeline>,
    /// Envoy's metric ids, indexed by the core's.
    ids: Vec<u32>,
    pub store_metrics: StoreMetrics,
    reason_header: Option<String>,
    empty: bool,
}

impl Plugin {
    pub fn new(pipeline: Pipeline) -> Self {
        let ids = metrics::define(&pipeline.metrics);
        let empty = pipeline.is_empty();
        Plugin {
            reason_header: pipeline.reason_header().map(str::to_string),
            store_metrics: if empty {
                StoreMetrics::default()
            } else {
                StoreMetrics::define()
            },
            pipeline: RefCell::new(pipeline),
            ids,
            empty,
        }
    }

    /// Whether no mechanism is configured.
    pub fn is_empty(&self) -> bool {
        self.empty
    }

    /// The header naming the mechanism of a refusal, if configured.
    pub fn reason_header(&self) -> Option<&str> {
        self.reason_header.as_deref()
    }

    /// Calls the pipeline with the host's store, clock and metrics. `None`
    /// only if the pipeline is busy (a host call re-entered the VM).
    pub fn call<R>(&self, f: impl FnOnce(&mut Pipeline, &mut Env<'_>) -> R) -> Option<R> {
        let mut pipeline = self.pipeline.try_borrow_mut().ok()?;
        let mut sink = HostSink(&self.ids);
        let mut env = Env {
            store: &SharedData,
            clock: &now_ns,
            sink: &mut sink,
        };
        Some(f(&mut pipeline, &mut env))
    }

    /// Carries out an outcome: a new tick period, then the effects on other
    /// streams, then makes `current` the effective stream again.
    pub fn apply(&self, out: Outcome, current: Option<u32>) {
        if let Some(period) = out.tick {
            let _ = hostcalls::set_tick_period(period);
        }
        if out.effects.is_empty() {
            return;
        }
        for e in out.effects {
            match e {
                Effect::Resume {
                    stream,
                    set_headers,
                } => {
                    if self.enter(stream, &set_headers) {
                        let _ = hostcalls::resume_http_request();
                    }
                }
                Effect::Continue {
                    stream,
                    set_headers,
                } => {
                    if self.enter(stream, &set_headers) {
                        self.go_on(stream);
                    }
                }
                Effect::Reply { stream, rejection } => {
                    if hostcalls::set_effective_context(stream).is_ok() {
                        reply::send(&rejection, self.reason_header());
                    }
                }
            }
        }
        if let Some(id) = current {
            let _ = hostcalls::set_effective_context(id);
        }
    }
}

impl Plugin {
    /// Makes a paused stream current and sets these request headers on it;
    /// false if it is gone (then what it may hold is given back).
    fn enter(&self, stream: u32, set_headers: &[(String, String)]) -> bool {
        if hostcalls::set_effective_context(stream).is_err() {
            if let Some(out) = self.call(|p, env| p.gone(env, stream)) {
                self.apply(out, None);
            }
            return false;
        }
        for (name, value) in set_headers {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
        }
        true
    }

    /// The later stages decide on a parked stream (current now), and their
    /// verdict is carried out as in `on_http_request_headers`.
    fn go_on(&self, stream: u32) {
        let req = HostRequest::default();
        let Some((verdict, out)) = self.call(|p, env| p.resume(env, stream, &req)) else {
            let _ = hostcalls::resume_http_request();
            return;
        };
        self.apply(out, Some(stream));
        match verdict {
            Verdict::Continue => {
                let _ = hostcalls::resume_http_request();
            }
            Verdict::Reply(r) => reply::send(&r, self.reason_header()),
            Verdict::Pause => {}
        }
    }
}

/// A configuration going away (replaced, or the plugin removed) gives its
/// leased concurrency slots back (the next configuration may share them)
/// and hands its last metric changes to Envoy.
impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(out) = self.call(|p, env| p.close(env)) {
            self.apply(out, None);
        }
        metrics::flush();
    }
}
