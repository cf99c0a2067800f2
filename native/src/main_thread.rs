//! A configuration's pipeline on Envoy's main thread, as the wasm build's
//! main-thread VM: the only one whose global rules lead, since it alone
//! can call out (a stream started from Envoy's configuration, `calls`).
//! Run from the configuration's scheduler, which the ticker commits when
//! its tick (or an idle worker's, `idle`) is due, and when a worker wakes
//! the leader's queue; the calls' streams report on the same thread.

use crate::abi::{self, ConfigEnvoyPtr, ConfigSchedulerPtr};
use crate::adapter::{now_ms, Engine, Outcome, Signal};
use crate::calls::{self, InFlight};
use crate::config_metrics::ConfigSink;
use crate::ticker;
use std::sync::{Mutex, MutexGuard};

/// The slow tick (ms), the period unless a pipeline asks for another.
pub const SLOW_MS: u64 = 100;

/// What the main thread's pipeline needs of its configuration.
pub trait Host {
    /// Metrics through Envoy's configuration.
    fn sink(&self) -> ConfigSink<'_>;
    /// Envoy's configuration (calls start from it).
    fn envoy(&self) -> ConfigEnvoyPtr;
    /// A new main-thread pipeline (after a panic took the last).
    fn rebuild(&self) -> Result<Engine, String>;
}

/// What the main thread keeps of a configuration.
struct MainState {
    /// Its pipeline (`None` after a panic, until built again).
    engine: Option<Engine>,
    calls: InFlight,
    next_tick_ms: u64,
    tick_ms: u64,
}

/// A configuration's main-thread pipeline and its scheduler.
pub struct MainThread {
    state: Mutex<MainState>,
    /// Envoy's scheduler of the configuration, and the ticker's key for it
    /// (none for an empty configuration, which has nothing to tick).
    scheduler: Option<(ConfigSchedulerPtr, usize)>,
}

// SAFETY: the pipeline (it holds `Rc`s) is used on Envoy's main thread only
// (its scheduled and stream hooks), and at the configuration's end, when no
// other thread uses it; the scheduler is Envoy's, thread-safe to commit.
unsafe impl Send for MainThread {}
// SAFETY: as above; the mutex orders the accesses.
unsafe impl Sync for MainThread {}

impl MainThread {
    pub fn new(engine: Engine) -> Self {
        MainThread {
            state: Mutex::new(MainState {
                engine: Some(engine),
                calls: InFlight::default(),
                next_tick_ms: 0,
                tick_ms: SLOW_MS,
            }),
            scheduler: None,
        }
    }

    /// Ticks from now on, through a scheduler of Envoy's configuration
    /// `config` (on the main thread, while the configuration is made).
    pub fn start(&mut self, config: ConfigEnvoyPtr) {
        // SAFETY: Envoy's configuration being made, on the main thread.
        let s =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(config) };
        if s.is_null() {
            log::error!(
                "sluice: no scheduler: global rules cannot lead, idle workers are not ticked"
            );
            return;
        }
        // An identity for the ticker (Envoy's pointer is null in tests).
        static NEXT_KEY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let key = NEXT_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.scheduler = Some((s, key));
        ticker::add_main(key, s);
    }

    /// Nothing is ticked any more (the configuration goes away).
    pub fn stop(&mut self) {
        if let Some((s, key)) = self.scheduler.take() {
            ticker::remove_main(key);
            // SAFETY: made by `scheduler_new`, no longer committed.
            unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(s) };
        }
    }

    /// Its state. After a panic in a call the pipeline is gone (taken out
    /// while in use) and built again by the next (`run`); the rest is whole.
    fn state(&self) -> MutexGuard<'_, MainState> {
        self.state.lock().unwrap_or_else(|p| {
            self.state.clear_poison();
            p.into_inner()
        })
    }

    /// The ticker's key of this configuration.
    pub fn key(&self) -> Option<usize> {
        self.scheduler.map(|(_, k)| k)
    }

    /// The pipeline gives back what it holds (its lease, say).
    pub fn close(&self, sink: &mut ConfigSink<'_>) {
        if let Some(e) = self.state().engine.as_mut() {
            let _ = e.close(sink);
        }
    }

    /// Ticks the pipeline if due; when its next tick is due (ms).
    pub fn tick(&self, h: &dyn Host, now: u64) -> u64 {
        let out = {
            let mut st = self.state();
            if now < st.next_tick_ms {
                return st.next_tick_ms;
            }
            st.next_tick_ms = now + st.tick_ms;
            run(&mut st, h, |e, sink| {
                e.tick(sink, &crate::adapter::HookClock::default())
            })
        };
        if let Some(out) = out {
            self.carry_out(h, out, true);
        }
        self.state().next_tick_ms
    }

    /// Woken through the queues it listens on.
    pub fn woken(&self, h: &dyn Host) {
        let Some(key) = self.key() else {
            return;
        };
        for name in ticker::take_woken(key) {
            let out = run(&mut self.state(), h, |e, sink| e.woken(sink, &name));
            if let Some(out) = out {
                self.carry_out(h, out, true);
            }
        }
    }

    /// What has come back of a call: headers, or (`trailers`) trailers.
    pub fn call_headers(&self, stream: u64, headers: &[(Vec<u8>, Vec<u8>)], trailers: bool) {
        let mut st = self.state();
        if trailers {
            st.calls.trailers(stream, headers);
        } else {
            st.calls.headers(stream, headers);
        }
    }

    /// A piece of a call's answer.
    pub fn call_data(&self, stream: u64, bytes: &[u8]) {
        self.state().calls.data(stream, bytes);
    }

    /// A call's stream ended (`complete`) or was reset: the pipeline hears
    /// how the call went.
    pub fn call_end(&self, h: &dyn Host, stream: u64, complete: bool) {
        let out = {
            let mut st = self.state();
            match st.calls.end(stream, complete) {
                Some((id, body)) => {
                    run(&mut st, h, |e, sink| e.call_done(sink, id, body.as_deref()))
                }
                None => None,
            }
        };
        if let Some(out) = out {
            self.carry_out(h, out, true);
        }
    }

    /// Carries out what the pipeline asked for (with its state unlocked:
    /// Envoy may run the module's hooks again): its tick period, the
    /// queues it listens on and wakes, and its calls (not those a failed
    /// start's answer asks for: the next tick's).
    fn carry_out(&self, h: &dyn Host, out: Outcome, start_calls: bool) {
        if let Some(period) = out.tick {
            let next = {
                let mut st = self.state();
                st.tick_ms = period.as_ms().max(1);
                st.next_tick_ms = st.next_tick_ms.min(now_ms() + st.tick_ms);
                st.next_tick_ms
            };
            if let Some(key) = self.key() {
                ticker::main_soon(key, next);
            }
        }
        for s in &out.signals {
            match (s, self.key()) {
                (Signal::Listen(name), Some(key)) => ticker::listen(name, key),
                (Signal::Wake(name), _) => ticker::wake(name),
                _ => {}
            }
        }
        if !out.effects.is_empty() {
            log::debug!(
                "sluice: effects of the main thread's pipeline dropped (it has no streams)"
            );
        }
        if !start_calls {
            calls::not_started(&out.calls, "the answer to a call");
            return;
        }
        for c in out.calls {
            self.state().calls.begin(c.id);
            // (Envoy may run the call's stream hooks before it returns.)
            let stream = calls::start(h.envoy(), &c);
            if stream.is_none() {
                log::debug!("sluice: could not call cluster {}", c.cluster);
            }
            let Some((id, body)) = self.state().calls.started(stream) else {
                continue;
            };
            let out = run(&mut self.state(), h, |e, sink| {
                e.call_done(sink, id, body.as_deref())
            });
            if let Some(out) = out {
                self.carry_out(h, out, false);
            }
        }
    }
}

/// Its scheduler goes with it, however it goes (a configuration refused
/// halfway through `config_new` included): never committed after.
impl Drop for MainThread {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `f` on the pipeline (built again if a panic took it), with metrics
/// through the configuration.
fn run<R>(
    st: &mut MainState,
    h: &dyn Host,
    f: impl FnOnce(&mut Engine, &mut ConfigSink<'_>) -> R,
) -> Option<R> {
    if st.engine.is_none() {
        st.engine = h.rebuild().map_err(|e| log::error!("sluice: {e}")).ok();
    }
    let mut engine = st.engine.take()?;
    let r = f(&mut engine, &mut h.sink());
    st.engine = Some(engine);
    Some(r)
}
