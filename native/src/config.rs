//! One filter configuration: sluice's validated configuration, the hash
//! seed every worker shares, one pipeline per Envoy worker (`worker`), as
//! the wasm build has one per VM (a VM per worker), and one on Envoy's
//! main thread (`main_thread`), as the wasm build's main-thread VM: the
//! same per-pipeline state, and the same shared state (the store) between
//! them.

use crate::abi::{ConfigEnvoyPtr, FilterPtr};
use crate::adapter::{self, Engine, Recorder, Role};
use crate::config_metrics::ConfigSink;
use crate::main_thread::MainThread;
use crate::metrics::{self, Ids};
use crate::store;
pub use crate::worker::{InHook, Slot, Worker, WorkerState};
use sluice::store::Store;
use sluice::wiring::Config;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Workers with a pipeline: a stream on a worker of a higher index passes
/// untouched (logged once).
pub const MAX_WORKERS: usize = 256;

/// A random number (std's per-process random keys, stepped per call).
pub fn random_u64() -> u64 {
    RandomState::new().hash_one(adapter::now_ns())
}

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
        let workers = (0..MAX_WORKERS as u32).map(Worker::new).collect();
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
            let Some(mut st) = w.lock_alone() else {
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
    /// use), from a hook of stream `me`. `None` if the state is in use by
    /// this thread already (a host call re-entered the module) or the
    /// pipeline could not be built; the main thread holding it is waited
    /// for.
    pub fn with<R>(
        &self,
        w: &Worker,
        me: u32,
        f: impl FnOnce(&mut Engine, &mut WorkerState) -> R,
    ) -> Option<R> {
        // A panic in an earlier call poisons the lock: its pipeline is
        // dropped and a new one built, as a wasm VM is restarted; the
        // streams it had paused are let go, but `me`, whose own hook this
        // is (its end, say: Envoy must not be told to continue it there).
        let mut state = w.lock_from_hook()?;
        let orphans = if state.panicked {
            state.state.orphans(w, me)
        } else {
            Vec::new()
        };
        let r = self.run(w, &mut state, f);
        drop(state);
        self.let_go(orphans);
        r
    }

    /// Runs `f` on a worker's state, its pipeline built if it has none.
    fn run<R>(
        &self,
        w: &Worker,
        state: &mut Slot,
        f: impl FnOnce(&mut Engine, &mut WorkerState) -> R,
    ) -> Option<R> {
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
        let engine = state.engine.as_mut()?;
        Some(f(engine, &mut state.state))
    }

    /// Streams a pipeline lost in a panic had paused go on, or, with
    /// `failure_mode_deny`, are answered 500: the failure policy of a
    /// panic, as in a request's own hook (with the state unlocked).
    fn let_go(&self, orphans: Vec<FilterPtr>) {
        for envoy in orphans {
            if self.deny {
                crate::reply::respond(envoy, 500, &[], "sluice: internal error\n");
            } else {
                // SAFETY: a paused stream's filter lives until its end,
                // which would have taken it out of `paused`.
                unsafe {
                    crate::abi::envoy_dynamic_module_callback_http_filter_continue_decoding(envoy)
                };
            }
        }
    }

    /// Runs `f` on worker `w`'s state from the main thread, if no hook of
    /// the worker runs and nothing else holds it (else `None`: the worker
    /// is busy, and ticks itself).
    pub fn with_idle<R>(
        &self,
        w: &Worker,
        f: impl FnOnce(&mut Engine, &mut WorkerState) -> R,
    ) -> Option<R> {
        let mut slot = w.lock_if_idle()?;
        let slot = &mut *slot;
        let engine = slot.engine.as_mut()?;
        Some(f(engine, &mut slot.state))
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
            if let Some(mut state) = w.lock_alone() {
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
