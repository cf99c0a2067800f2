//! One configuration in one VM: its pipeline, the Envoy ids of its metrics,
//! and how the pipeline's answers are carried out on other streams.

use super::metrics::{self, HostSink, StoreMetrics};
use super::reply;
use super::store::SharedData;
use super::views::{now, HostRequest};
use crate::hash::FastMap;
use crate::pipeline::{Effect, Env, Outcome, Pipeline, Signal, StreamId, Verdict};
use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;
use std::cell::{Cell, RefCell};

pub struct Plugin {
    pipeline: RefCell<Pipeline>,
    /// Envoy's metric ids, indexed by the core's.
    ids: Vec<u32>,
    pub store_metrics: StoreMetrics,
    reason_header: Option<String>,
    empty: bool,
    /// Shared queues this VM wakes others through, by name (resolved on
    /// first use: a queue exists once some VM listens on it).
    queues: RefCell<FastMap<String, u32>>,
    /// Replaced by a newer configuration: the VM's tick is the newer
    /// one's (only it is ticked), so this one's last streams no longer
    /// change its period (they left a VM on the 1 ms tick for good, or
    /// slowed the newer one's queue to 100 ms).
    retired: Cell<bool>,
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
            queues: RefCell::default(),
            retired: Cell::new(false),
        }
    }

    /// A newer configuration replaces this one (see `retired`).
    pub fn retire(&self) {
        self.retired.set(true);
    }

    /// Wakes the VM listening on the queue `name`, if any. Best effort:
    /// what it would have done is done on its next tick instead.
    pub fn wake(&self, name: String) {
        let Ok(mut queues) = self.queues.try_borrow_mut() else {
            return;
        };
        let token = match queues.get(&name) {
            Some(&t) => Some(t),
            None => {
                vm_id().and_then(|vm| hostcalls::resolve_shared_queue(&vm, &name).ok().flatten())
            }
        };
        let Some(token) = token else {
            return;
        };
        if hostcalls::enqueue_shared_queue(token, Some(b"w")).is_ok() {
            // Bounded: the names of a few workers' and leaders' queues
            // (a reconfiguration names them afresh).
            if queues.len() >= 64 {
                queues.clear();
            }
            queues.insert(name, token);
        } else {
            queues.remove(&name);
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
            clock: &now,
            sink: &mut sink,
        };
        Some(f(&mut pipeline, &mut env))
    }

    /// Carries out an outcome: a new tick period, then the effects on other
    /// streams, then makes `current` the effective stream again.
    pub fn apply(&self, out: Outcome, current: Option<StreamId>) {
        if let Some(period) = out.tick.filter(|_| !self.retired.get()) {
            let _ = hostcalls::set_tick_period(period.into());
        }
        // Listening is the root context's (it hears the queue), and
        // `Root::carry_out` takes those out first.
        for s in out.signals {
            if let Signal::Wake(name) = s {
                self.wake(name);
            }
        }
        if out.effects.is_empty() {
            return;
        }
        for e in out.effects {
            match e {
                Effect::Resume { stream } => {
                    if hostcalls::set_effective_context(stream.0).is_ok() {
                        self.go_on(stream, false);
                    } else {
                        self.lost(stream);
                    }
                }
                Effect::Again { stream } => {
                    if hostcalls::set_effective_context(stream.0).is_ok() {
                        self.go_on(stream, true);
                    } else {
                        self.lost(stream);
                    }
                }
                Effect::Reply { stream, rejection } => {
                    if hostcalls::set_effective_context(stream.0).is_ok() {
                        reply::send(&rejection, self.reason_header());
                    }
                }
            }
        }
        if let Some(id) = current {
            let _ = hostcalls::set_effective_context(id.0);
        }
    }
}

impl Plugin {
    /// A paused stream that is gone: give back what it may hold.
    fn lost(&self, stream: StreamId) {
        if let Some(out) = self.call(|p, env| p.gone(env, stream)) {
            self.apply(out, None);
        }
    }

    /// A paused stream (now the effective context) was resumed by the stage
    /// that paused it: the later stages decide on it (`again`: that stage
    /// too), then it goes on, is answered, or waits again.
    fn go_on(&self, stream: StreamId, again: bool) {
        let req = HostRequest::default();
        let decided = self.call(|p, env| {
            if again {
                p.again(env, stream, &req)
            } else {
                p.resume(env, stream, &req)
            }
        });
        let Some((verdict, out)) = decided else {
            let _ = hostcalls::resume_http_request();
            return;
        };
        match verdict {
            Verdict::Continue => {
                // Its deadline headers, reduced by its wait.
                for (name, value) in &out.request_headers {
                    let _ =
                        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
                }
                let _ = hostcalls::resume_http_request();
            }
            Verdict::Pause => {}
            Verdict::Reply(r) => reply::send(&r, self.reason_header()),
        }
        self.apply(out, None);
    }
}

/// A configuration going away (replaced, or the plugin removed) gives its
/// leased concurrency slots back (the next configuration may share them),
/// hands its last metric changes to Envoy and sets the gauges no other
/// configuration defines to 0.
impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(out) = self.call(|p, env| p.close(env)) {
            self.apply(out, None);
        }
        metrics::flush();
        if let Ok(p) = self.pipeline.try_borrow() {
            metrics::release(&p.metrics, &self.ids);
        }
    }
}

/// This VM's `vm_id` (a queue is named within it). An empty one (Istio's)
/// comes back as no value.
fn vm_id() -> Option<String> {
    let bytes = hostcalls::get_property(vec!["plugin_vm_id"])
        .ok()?
        .unwrap_or_default();
    String::from_utf8(bytes).ok()
}
