//! One filter configuration: sluice's validated configuration, the hash
//! seed every worker shares, and one pipeline per Envoy worker, as the wasm
//! build has one per VM (a VM per worker): the same per-worker state, and
//! the same shared state (the store) between workers.

use crate::abi::{ConfigEnvoyPtr, FilterPtr};
use crate::adapter::{self, Engine};
use crate::metrics::{self, Ids};
use crate::store;
use sluice::hash::FastMap;
use sluice::store::Store;
use sluice::wiring::Config;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, TryLockError};

/// Workers with a pipeline: a stream on a worker of a higher index passes
/// untouched (logged once).
pub const MAX_WORKERS: usize = 256;

/// A random number (std's per-process random keys, stepped per call).
pub fn random_u64() -> u64 {
    RandomState::new().hash_one(adapter::now_ns())
}

/// What one worker keeps of a configuration besides its pipeline.
#[derive(Default)]
pub struct WorkerState {
    /// The streams paused on this worker, by id: the effects of the
    /// pipeline name streams by id.
    pub paused: FastMap<u32, FilterPtr>,
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
}

/// A worker's pipeline and the rest of its state, under one lock.
#[derive(Default)]
struct Slot {
    /// Built on the worker's first stream.
    engine: Option<Engine>,
    /// Building the pipeline failed: the worker's streams pass.
    failed: bool,
    state: WorkerState,
}

/// One worker's share of a configuration.
#[derive(Default)]
pub struct Worker(Mutex<Slot>);

// SAFETY: a worker's state (its pipeline holds `Rc`s; the paused streams'
// Envoy pointers) is used only on the Envoy worker thread of its index,
// through `Worker::with`, and the values it hands out (verdicts, effects)
// stay on that thread. Other threads touch it only once no stream holds
// the configuration: dropping it (and closing its pipeline) at the end.
unsafe impl Send for Worker {}
// SAFETY: as above; the mutex orders the accesses.
unsafe impl Sync for Worker {}

/// A configuration, shared by Envoy's main thread and every worker.
pub struct FilterConfig {
    config: Config,
    seed: (u64, u64),
    /// `failure_mode_deny`: what a panic in a hook does to the request.
    pub deny: bool,
    pub reason_header: Option<String>,
    /// No mechanism configured: streams never call the pipeline.
    pub empty: bool,
    /// Envoy's ids of the pipelines' metrics (every worker's pipeline
    /// defines the same, in the same order).
    pub metrics: Ids,
    workers: Box<[Worker]>,
}

impl FilterConfig {
    /// Parses and checks `bytes` (sluice's JSON) and builds a pipeline of
    /// it once, so that a configuration the core refuses is refused here,
    /// at load; the error names the field.
    pub fn new(envoy: ConfigEnvoyPtr, bytes: &[u8]) -> Result<Self, String> {
        let config = adapter::parse(bytes)?;
        let seed = shared_seed(store::shared(), &config.common.domain)
            .ok_or("could not create the shared hash seed")?;
        let probe = Engine::build(&config, seed, random_u64() as u32, random_u64())?;
        let workers = (0..MAX_WORKERS).map(|_| Worker::default()).collect();
        Ok(FilterConfig {
            deny: config.common.failure_mode_deny,
            reason_header: probe.reason_header().map(str::to_string),
            empty: probe.is_empty(),
            metrics: metrics::define(envoy, probe.metric_defs()),
            config,
            seed,
            workers,
        })
    }

    /// The worker of this index, if it has a pipeline.
    pub fn worker(&self, index: u32) -> Option<&Worker> {
        let w = self.workers.get(index as usize);
        if w.is_none() {
            crate::log::once_worker_out_of_range(index);
        }
        w
    }

    /// Runs `f` on worker `w`'s state with its pipeline (built on first
    /// use). `None` if the state is in use (a host call re-entered the
    /// module on this thread) or the pipeline could not be built.
    pub fn with<R>(
        &self,
        w: &Worker,
        f: impl FnOnce(&mut Engine, &mut WorkerState) -> R,
    ) -> Option<R> {
        let mut guard = match w.0.try_lock() {
            Ok(g) => g,
            // A panic in an earlier call: its pipeline is dropped and a new
            // one built, as a wasm VM is restarted; the rest is whole.
            Err(TryLockError::Poisoned(p)) => {
                w.0.clear_poison();
                let mut g = p.into_inner();
                g.engine = None;
                g
            }
            Err(TryLockError::WouldBlock) => return None,
        };
        let slot = &mut *guard;
        if slot.engine.is_none() && !slot.failed {
            match Engine::build(&self.config, self.seed, random_u64() as u32, random_u64()) {
                Ok(e) => slot.engine = Some(e),
                Err(e) => {
                    log::error!("sluice: {e}");
                    slot.failed = true;
                }
            }
        }
        // In place: a pipeline is too large to move in and out per call.
        let engine = slot.engine.as_mut()?;
        Some(f(engine, &mut slot.state))
    }
}

/// A configuration going away gives back what its pipelines hold in the
/// store (leased concurrency slots), as the wasm build's does.
impl Drop for FilterConfig {
    fn drop(&mut self) {
        for w in self.workers.iter() {
            if let Ok(mut slot) = w.0.lock() {
                if let Some(e) = slot.engine.as_mut() {
                    // No stream is left to carry effects out on.
                    let _ = e.close();
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
