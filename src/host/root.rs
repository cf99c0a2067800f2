//! The root context: parses the configuration, agrees on the hash seed with
//! the other VMs, builds the pipeline, ticks it, and hands each HTTP stream
//! the configuration's per-VM state.

use super::plugin::Plugin;
use super::store::{self, SharedData};
use super::stream::HttpStream;
use super::views::now;
use crate::hash::FastMap;
use crate::pipeline::{Call, Outcome, Signal, SLOW_TICK};
use crate::wiring;
use log::{error, info};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};
use std::rc::Rc;
use std::time::Duration;

#[derive(Default)]
pub struct Root {
    plugin: Option<Rc<Plugin>>,
    /// Calls out (global rules' token requests): Envoy's token to the
    /// pipeline's call id.
    calls: FastMap<u32, u64>,
    /// The shared queues this VM listens on: their names, by token.
    listening: FastMap<u32, String>,
}

impl Context for Root {
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let Some(id) = self.calls.remove(&token) else {
            return;
        };
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        let body = if status == 0 {
            self.get_grpc_call_response_body(0, size)
        } else {
            None
        };
        if let Some(out) = plugin.call(|p, env| p.call_done(env, id, body.as_deref())) {
            self.carry_out(plugin, out);
        }
    }
}

impl Root {
    /// Carries out an outcome from the root context: calls out first (only
    /// a call started here is answered here), then the rest.
    fn carry_out(&mut self, plugin: Rc<Plugin>, mut out: Outcome) {
        let calls = std::mem::take(&mut out.calls);
        // Before the effects, which make their streams the effective
        // context: a queue is listened on by the context that registers it.
        out.signals.retain(|s| match s {
            Signal::Listen(name) => {
                self.listen(name.clone());
                false
            }
            Signal::Wake(_) => true,
        });
        plugin.apply(out, None);
        for c in calls {
            self.start(&plugin, c);
        }
    }

    /// Listens on a shared queue (a VM hears a queue in the context that
    /// registers it: here, the root). Best effort: what a wake-up would
    /// have done is done on the next tick instead.
    fn listen(&mut self, name: String) {
        match hostcalls::register_shared_queue(&name) {
            Ok(token) => {
                self.listening.retain(|_, n| *n != name);
                self.listening.insert(token, name);
            }
            Err(e) => log::debug!("sluice: could not listen on queue {name}: {e:?}"),
        }
    }

    fn start(&mut self, plugin: &Plugin, c: Call) {
        let started = self.dispatch_grpc_call(
            &c.cluster,
            c.service,
            c.method,
            Vec::new(),
            Some(&c.message),
            c.timeout.into(),
        );
        match started {
            Ok(token) => {
                self.calls.insert(token, c.id);
            }
            Err(e) => {
                log::debug!("sluice: could not call cluster {}: {e:?}", c.cluster);
                if let Some(out) = plugin.call(|p, env| p.call_done(env, c.id, None)) {
                    // A failed start asks for nothing more.
                    plugin.apply(out, None);
                }
            }
        }
    }
}

/// The table-hash seed every VM of this Envoy shares (per vm_id and
/// domain): `wiring::shared_seed` over shared data.
fn shared_seed(domain: &str) -> Option<(u64, u64)> {
    let mut fresh = [0u8; 16];
    getrandom::fill(&mut fresh).ok()?;
    wiring::shared_seed(&SharedData, domain, fresh)
}

fn random_u64() -> u64 {
    getrandom::u64().unwrap_or(0x5eed_5eed_5eed_5eed)
}

/// Builds and starts the plugin of a configuration; the error is the log line.
fn configure(bytes: &[u8]) -> Result<Plugin, String> {
    let config = wiring::parse(bytes).map_err(|e| e.to_string())?;
    store::forget();
    let seed = shared_seed(&config.common.domain)
        .ok_or("could not create the shared hash seed in shared data")?;
    let pipeline = wiring::pipeline(&config, seed, random_u64() as u32, now(), random_u64())
        .map_err(|e| e.to_string())?;
    let plugin = Plugin::new(pipeline);
    plugin.call(|p, env| p.start(env)).unwrap_or(Ok(()))?;
    info!(
        "sluice: configured {} rate-limit rule(s), {} circuit breaker(s), {} shedder(s)",
        config.rules.len(),
        config.breakers.len(),
        config.shedders.len()
    );
    Ok(plugin)
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        super::sync_log_level();
        let bytes =
            proxy_wasm::hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
                .ok()
                .flatten()
                .unwrap_or_default();
        match configure(&bytes) {
            Ok(plugin) => {
                // Answers to the old configuration's calls are not its.
                self.calls.clear();
                // Nor are its queues: the new one listens on its own.
                self.listening.clear();
                // The old configuration's last streams leave the tick to
                // this one.
                let replaced = self.plugin.is_some();
                if let Some(old) = &self.plugin {
                    old.retire();
                }
                // The slow tick hands batched metric changes to Envoy and
                // runs the stages' periodic work; the pipeline asks for the
                // fast tick while it has to act sooner (requests waiting in
                // a sluice queue, say). An empty configuration has none:
                // no tick, as if it had come first.
                if !plugin.is_empty() {
                    self.set_tick_period(SLOW_TICK.into());
                } else if replaced {
                    self.set_tick_period(Duration::ZERO);
                }
                self.plugin = Some(Rc::new(plugin));
                true
            }
            Err(e) => {
                error!("sluice: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(plugin) = self.plugin.clone() {
            if let Some(out) = plugin.call(|p, env| p.tick(env)) {
                self.carry_out(plugin.clone(), out);
            }
            // The tick bounds how long a version is remembered (see
            // `store::age`).
            plugin.store_metrics.record(store::take_counts());
            store::age();
            super::metrics::flush();
        }
    }

    /// Woken through a queue this VM listens on: everything queued is one
    /// wake-up.
    fn on_queue_ready(&mut self, queue_id: u32) {
        let mut words = 0;
        while words < 1024 && matches!(hostcalls::dequeue_shared_queue(queue_id), Ok(Some(_))) {
            words += 1;
        }
        // Each word posts its own call: the first took them all.
        if words == 0 {
            return;
        }
        let Some(name) = self.listening.get(&queue_id).cloned() else {
            return;
        };
        if let Some(plugin) = self.plugin.clone() {
            if let Some(out) = plugin.call(|p, env| p.woken(env, &name)) {
                self.carry_out(plugin, out);
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(HttpStream::new(context_id, self.plugin.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
