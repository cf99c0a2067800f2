//! One filter configuration: sluice's validated configuration, the hash
//! seed every worker shares, one pipeline per Envoy worker, as the wasm
//! build has one per VM (a VM per worker), and one on Envoy's main thread
//! (`main_thread`), as the wasm build's main-thread VM: the same
//! per-pipeline state, and the same shared state (the store) between them.
//!
//! A worker's state is used by one thread at a time, under its lock: its
//! own worker's, from that worker's hooks; or the main thread's, which
//! ticks a worker no hook ticks, and only while none of that worker's
//! hooks runs (`Worker::depth`), so nothing the pipeline handed out (a
//! reply holds an `Rc`) is in use elsewhere.

use crate::abi::{ConfigEnvoyPtr, FilterPtr};
use crate::adapter::{self, Effect, Engine, Recorder, Role};
use crate::config_metrics::ConfigSink;
use crate::main_thread::MainThread;
use crate::metrics::{self, Ids};
use crate::store;
use sluice::store::Store;
use sluice::wiring::Config;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// Workers with a pipeline: a stream on a worker of a higher index passes
/// untouched (logged once).
pub const MAX_WORKERS: usize = 256;

/// A random number (std's per-process random keys, stepped per call).
pub fn random_u64() -> u64 {
    RandomState::new().hash_one(adapter::now_ns())
}

/// A token of the calling thread (the address of a thread-local): who
/// holds a worker's lock.
fn this_thread() -> usize {
    thread_local!(static TOKEN: u8 = const { 0 });
    TOKEN.with(|t| std::ptr::from_ref(t) as usize)
}

/// What one worker keeps of a configuration.
#[derive(Default)]
pub struct WorkerState {
    /// Built on the worker's first stream.
    pub engine: Option<Engine>,
    /// The streams paused on this worker, by id: the effects of the
    /// pipeline name streams by id.
    pub paused: HashMap<u32, FilterPtr>,
    /// Paused streams whose own request hook is still running (a stream
    /// let go from inside it must not be continued by a call into Envoy:
    /// its hook returns `Continue` instead).
    pub in_hook: Vec<u32>,
    /// Streams of `in_hook` let go meanwhile.
    pub went_on: Vec<u32>,
    /// When the pipeline's next tick is due (ms since the epoch).
    pub next_tick_ms: u64,
    /// The tick period asked for (ms).
    pub tick_ms: u64,
    /// Effects of a tick the main thread ran on the worker's behalf, for
    /// the worker to carry out (none in practice: the main thread ticks a
    /// worker only while no stream waits on it).
    pub deferred: Vec<Effect>,
    /// Building the pipeline failed: the worker's streams pass.
    failed: bool,
}

impl WorkerState {
    /// The pipeline asked for the tick period `ms`: its next tick comes no
    /// later than that from `now` (ms).
    pub fn set_period(&mut self, ms: u64, now: u64) {
        self.tick_ms = ms.max(1);
        self.next_tick_ms = self.next_tick_ms.min(now + self.tick_ms);
    }
}

/// One worker's share of a configuration.
#[derive(Default)]
pub struct Worker {
    state: Mutex<WorkerState>,
    /// Its index (Envoy's).
    index: u32,
    /// The thread holding `state`'s lock (see `this_thread`; 0: none).
    holder: AtomicUsize,
    /// This worker's hooks running (nested ones included): while any
    /// does, values the pipeline handed out may be in use on the worker.
    pub depth: AtomicU32,
}

// SAFETY: a worker's state (its pipeline holds `Rc`s; the paused streams'
// Envoy pointers) is used by one thread at a time under its lock, and the
// values it hands out stay on the thread that asked for them: its
// worker's, which holds them only while one of its hooks runs (`depth`);
// the main thread takes the lock only while no such hook runs, and lets
// nothing of the pipeline out of it; the paused streams' pointers are
// used on their worker only. At the end (dropping the configuration) no
// stream holds it.
unsafe impl Send for Worker {}
// SAFETY: as above; the mutex orders the accesses.
unsafe impl Sync for Worker {}

/// Envoy's configuration object: its metric callbacks are thread-safe,
/// its stream and scheduler callbacks are used on the main thread only.
#[derive(Clone, Copy)]
pub struct EnvoyConfig(pub ConfigEnvoyPtr);

// SAFETY: see the type's comment; Envoy destroys the module's configuration
// before its own.
unsafe impl Send for EnvoyConfig {}
// SAFETY: as above.
unsafe impl Sync for EnvoyConfig {}

/// A configuration, shared by Envoy's main thread and every worker.
pub struct FilterConfig {
    pub config: Config,
    pub seed: (u64, u64),
    /// `failure_mode_deny`: what a panic in a hook does to the request.
    pub deny: bool,
    pub reason_header: Option<String>,
    /// No mechanism configured: streams never call the pipeline.
    pub empty: bool,
    /// Envoy's ids of the pipelines' metrics (every pipeline defines the
    /// same, in the same order).
    pub metrics: Ids,
    pub envoy: EnvoyConfig,
    /// The pipeline on Envoy's main thread.
    pub main: MainThread,
    pub workers: Box<[Worker]>,
    /// Workers up to this index have built a pipeline.
    built: AtomicUsize,
}

impl FilterConfig {
    /// Parses and checks `bytes` (sluice's JSON) and builds its main-thread
    /// pipeline, so that a configuration the core refuses is refused here,
    /// at load; the error names the field.
    pub fn new(envoy: ConfigEnvoyPtr, bytes: &[u8]) -> Result<Self, String> {
        let config = adapter::parse(bytes)?;
        let seed = shared_seed(store::shared(), &config.common.domain)
            .ok_or("could not create the shared hash seed")?;
        // Its start's metric changes, made once Envoy's metrics are defined.
        let mut started = Recorder::default();
        let tags = (random_u64() as u32, random_u64());
        let main = Engine::build(&config, seed, tags, (Role::Main, &mut started))?;
        let reason_header = main.reason_header().map(str::to_string);
        let metrics = metrics::define(envoy, main.metric_defs());
        started.replay(&mut ConfigSink {
            ids: &metrics,
            config: envoy,
        });
        let empty = main.is_empty();
        let mut main = MainThread::new(main);
        if !empty {
            main.start(envoy);
        }
        let workers = (0..MAX_WORKERS as u32)
            .map(|index| Worker {
                index,
                ..Worker::default()
            })
            .collect();
        let c = FilterConfig {
            deny: config.common.failure_mode_deny,
            reason_header,
            empty,
            metrics,
            envoy: EnvoyConfig(envoy),
            main,
            config,
            seed,
            workers,
            built: AtomicUsize::new(0),
        };
        if !c.empty {
            c.build_workers();
        }
        log::info!(
            "sluice: configured {} rate-limit rule(s), {} circuit breaker(s), {} shedder(s)",
            c.config.rules.len(),
            c.config.breakers.len(),
            c.config.shedders.len()
        );
        Ok(c)
    }

    /// Builds every worker's pipeline now, at load, as the wasm build
    /// configures a VM per worker: creating what a pipeline needs in the
    /// store (checking every slot of a large table, say) is not left to
    /// a worker's first request. A worker Envoy does not count builds its
    /// own on its first stream.
    fn build_workers(&self) {
        // SAFETY: a plain query, on the main thread (`config_new`'s).
        let n = unsafe { crate::abi::envoy_dynamic_module_callback_get_concurrency() } as usize;
        for w in self.workers.iter().take(n) {
            let Ok(mut st) = w.state.lock() else {
                continue;
            };
            match self.build(Role::Worker) {
                Ok(e) => st.engine = Some(e),
                Err(e) => log::error!("sluice: {e}"),
            }
        }
        self.built
            .fetch_max(n.min(self.workers.len()), Ordering::AcqRel);
    }

    /// The worker of this index, if it has a pipeline.
    pub fn worker(&self, index: u32) -> Option<&Worker> {
        let w = self.workers.get(index as usize);
        if w.is_none() {
            crate::log::once_worker_out_of_range(index);
        }
        w
    }

    /// The workers that have built a pipeline (and the ones between).
    pub fn built_workers(&self) -> &[Worker] {
        let n = self.built.load(Ordering::Acquire).min(self.workers.len());
        self.workers.get(..n).unwrap_or_default()
    }

    /// Builds a pipeline of a role (a worker's, or the main thread's again
    /// after a panic).
    pub fn build(&self, role: Role) -> Result<Engine, String> {
        let tags = (random_u64() as u32, random_u64());
        let sink = &mut self.config_sink();
        Engine::build(&self.config, self.seed, tags, (role, sink))
    }

    /// Metrics through Envoy's configuration (no stream at hand).
    pub fn config_sink(&self) -> ConfigSink<'_> {
        ConfigSink {
            ids: &self.metrics,
            config: self.envoy.0,
        }
    }

    /// Runs `f` on worker `w`'s state with its pipeline (built on first
    /// use), from one of its hooks. `None` if the state is in use by this
    /// thread already (a host call re-entered the module) or the pipeline
    /// could not be built; the main thread holding it is waited for.
    pub fn with<R>(
        &self,
        w: &Worker,
        f: impl FnOnce(&mut Engine, &mut WorkerState) -> R,
    ) -> Option<R> {
        let me = this_thread();
        let mut guard = match w.state.try_lock() {
            Ok(g) => g,
            // A panic in an earlier call: its pipeline was dropped by the
            // unwinding (it is taken out while in use), so a new one is
            // built, as a wasm VM is restarted; the rest is whole.
            Err(TryLockError::Poisoned(p)) => recover(p.into_inner(), w),
            Err(TryLockError::WouldBlock) if w.holder.load(Ordering::Relaxed) == me => {
                return None;
            }
            // The main thread ticking it: a moment.
            Err(TryLockError::WouldBlock) => match w.state.lock() {
                Ok(g) => g,
                Err(p) => recover(p.into_inner(), w),
            },
        };
        let held = Held::new(w, me);
        let state = &mut *guard;
        if state.engine.is_none() && !state.failed {
            match self.build(Role::Worker) {
                Ok(e) => {
                    state.engine = Some(e);
                    self.built.fetch_max(w.index as usize + 1, Ordering::AcqRel);
                }
                Err(e) => {
                    log::error!("sluice: {e}");
                    state.failed = true;
                }
            }
        }
        let mut engine = state.engine.take()?;
        let r = f(&mut engine, state);
        state.engine = Some(engine);
        drop(held);
        Some(r)
    }

    /// Runs `f` on worker `w`'s state from the main thread, if no hook of
    /// the worker runs and nothing else holds it (else `None`: the worker
    /// is busy, and ticks itself).
    pub fn with_idle<R>(
        &self,
        w: &Worker,
        f: impl FnOnce(&mut Engine, &mut WorkerState) -> R,
    ) -> Option<R> {
        let mut guard = w.state.try_lock().ok()?;
        // Read under the lock: a hook that starts now waits for it.
        if w.depth.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let held = Held::new(w, this_thread());
        let state = &mut *guard;
        let mut engine = state.engine.take()?;
        let r = f(&mut engine, state);
        state.engine = Some(engine);
        drop(held);
        Some(r)
    }
}

/// The lock of a worker's state after a panic.
fn recover<'a>(g: MutexGuard<'a, WorkerState>, w: &Worker) -> MutexGuard<'a, WorkerState> {
    w.state.clear_poison();
    g
}

/// Says which thread holds a worker's lock, for as long as it lives (also
/// when a panic unwinds).
struct Held<'a>(&'a Worker);

impl<'a> Held<'a> {
    fn new(w: &'a Worker, me: usize) -> Self {
        w.holder.store(me, Ordering::Relaxed);
        Held(w)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.holder.store(0, Ordering::Relaxed);
    }
}

/// A hook of a worker runs (see `Worker::depth`) while this lives.
pub struct InHook<'a>(&'a Worker);

impl<'a> InHook<'a> {
    pub fn enter(w: &'a Worker) -> Self {
        w.depth.fetch_add(1, Ordering::SeqCst);
        InHook(w)
    }
}

impl Drop for InHook<'_> {
    fn drop(&mut self) {
        self.0.depth.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A configuration going away gives back what its pipelines hold in the
/// store (leased slots, the global rules' lease) and takes its gauges
/// back, as the wasm build's does; nothing is ticked for it any more.
impl Drop for FilterConfig {
    fn drop(&mut self) {
        self.main.stop();
        let sink = &mut ConfigSink {
            ids: &self.metrics,
            config: self.envoy.0,
        };
        self.main.close(sink);
        for w in self.workers.iter() {
            if let Ok(mut state) = w.state.lock() {
                if let Some(e) = state.engine.as_mut() {
                    // No stream is left to carry effects out on.
                    let _ = e.close(sink);
                }
            }
        }
    }
}

/// The table-hash seed every worker shares (per process and domain), as
/// the wasm build keeps it in shared data: `wiring::shared_seed` over the
/// process store.
fn shared_seed(store: &dyn Store, domain: &str) -> Option<(u64, u64)> {
    let fresh = (u128::from(random_u64()) << 64 | u128::from(random_u64())).to_le_bytes();
    adapter::shared_seed(store, domain, fresh)
}
