//! One worker's share of a configuration: its pipeline and its paused
//! streams, and the lock they are used under.
//!
//! A worker's state is used by one thread at a time, under its lock: its
//! own worker's, from that worker's hooks; or the main thread's, which
//! ticks a worker no hook ticks (`idle`), and only while none of that
//! worker's hooks runs (`Worker::depth`), so nothing the pipeline handed
//! out (a reply holds an `Rc`) is in use elsewhere. The lock records which
//! thread holds it: a hook that finds it taken by its own thread (a host
//! call re-entered the module) gives up, one that finds it taken by the
//! main thread waits for it.

use crate::abi::FilterPtr;
use crate::adapter::{Effect, Engine};
use sluice::hash::FastMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// A token of the calling thread (the address of a thread-local).
fn this_thread() -> usize {
    thread_local!(static TOKEN: u8 = const { 0 });
    TOKEN.with(|t| std::ptr::from_ref(t) as usize)
}

/// What one worker keeps of a configuration: its pipeline, and the rest
/// apart, so that a hook uses both in place (a pipeline is too large to
/// move in and out of the lock on every call).
#[derive(Default)]
pub struct Slot {
    /// Built at load (or on the worker's first stream).
    pub engine: Option<Engine>,
    /// Building the pipeline failed: the worker's streams pass.
    pub failed: bool,
    pub state: WorkerState,
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
    /// Effects of a tick the main thread ran on the worker's behalf, for
    /// the worker to carry out (none in practice: the main thread ticks a
    /// worker only while no stream waits on it).
    pub deferred: Vec<Effect>,
}

impl WorkerState {
    /// The tick period in force (ms): the one asked for, or the slow tick.
    pub fn period(&self) -> u64 {
        if self.tick_ms == 0 {
            crate::main_thread::SLOW_MS
        } else {
            self.tick_ms
        }
    }

    /// The pipeline asked for the tick period `ms`: its next tick comes no
    /// later than that from `now` (ms).
    pub fn set_period(&mut self, ms: u64, now: u64) {
        self.tick_ms = ms.max(1);
        self.next_tick_ms = self.next_tick_ms.min(now + self.tick_ms);
    }

    /// The streams paused by a pipeline a panic took, but those whose own
    /// request hook panicked (its failure policy answered for them) and
    /// `me`, whose hook runs now: out of every list, to be let go.
    pub fn orphans(&mut self, w: &Worker, me: u32) -> Vec<FilterPtr> {
        let in_hook = std::mem::take(&mut self.in_hook);
        self.went_on.clear();
        let mut out = Vec::new();
        for (id, envoy) in self.paused.drain() {
            crate::ticker::done(w.key(), id);
            if id != me && !in_hook.contains(&id) {
                out.push(envoy);
            }
        }
        out
    }
}

/// One worker's share of a configuration.
#[derive(Default)]
pub struct Worker {
    state: Mutex<Slot>,
    /// Its index (Envoy's).
    pub index: u32,
    /// The thread holding `state`'s lock (see `this_thread`; 0: none).
    holder: AtomicUsize,
    /// This worker's hooks running (nested ones included): while any
    /// does, values the pipeline handed out may be in use on the worker.
    depth: AtomicU32,
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

/// A worker's state, locked: the lock says who holds it until dropped.
pub struct Locked<'a> {
    // Dropped first: the holder is cleared before the lock is released.
    _held: Held<'a>,
    guard: MutexGuard<'a, Slot>,
    /// An earlier holder panicked (its pipeline is gone).
    pub panicked: bool,
}

impl Deref for Locked<'_> {
    type Target = Slot;
    fn deref(&self) -> &Slot {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Slot {
        &mut self.guard
    }
}

impl Worker {
    pub fn new(index: u32) -> Self {
        Worker {
            index,
            ..Worker::default()
        }
    }

    /// Its identity for the ticker (its address, never read).
    pub fn key(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    fn locked<'a>(&'a self, guard: MutexGuard<'a, Slot>, panicked: bool) -> Locked<'a> {
        Locked {
            _held: Held::new(self, this_thread()),
            guard,
            panicked,
        }
    }

    /// Locks the state from one of the worker's hooks; `None` if this
    /// thread holds it already (a re-entered hook). The main thread
    /// holding it is waited for.
    pub fn lock_from_hook(&self) -> Option<Locked<'_>> {
        let (guard, panicked) = match self.state.try_lock() {
            Ok(g) => (g, false),
            Err(TryLockError::Poisoned(p)) => (self.recover(p.into_inner()), true),
            Err(TryLockError::WouldBlock)
                if self.holder.load(Ordering::Relaxed) == this_thread() =>
            {
                return None;
            }
            Err(TryLockError::WouldBlock) => match self.state.lock() {
                Ok(g) => (g, false),
                Err(p) => (self.recover(p.into_inner()), true),
            },
        };
        Some(self.locked(guard, panicked))
    }

    /// Locks the state from the main thread if no hook of the worker runs
    /// and nothing holds it (else `None`: the worker is busy).
    pub fn lock_if_idle(&self) -> Option<Locked<'_>> {
        let guard = self.state.try_lock().ok()?;
        // Read under the lock: a hook that starts now waits for it.
        if self.depth.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(self.locked(guard, false))
    }

    /// Locks the state when no stream can use it (the configuration is
    /// made or goes away).
    pub fn lock_alone(&self) -> Option<Locked<'_>> {
        let (guard, panicked) = match self.state.lock() {
            Ok(g) => (g, false),
            Err(p) => (self.recover(p.into_inner()), true),
        };
        Some(self.locked(guard, panicked))
    }

    /// The lock of the state after a panic: the pipeline it was in goes
    /// (a new one is built, as a wasm VM is restarted).
    fn recover<'a>(&self, mut g: MutexGuard<'a, Slot>) -> MutexGuard<'a, Slot> {
        self.state.clear_poison();
        g.engine = None;
        g
    }
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
