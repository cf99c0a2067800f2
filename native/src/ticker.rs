//! The module's clock thread. Envoy 1.40 has no per-worker timer for HTTP
//! filters, so a module thread commits Envoy's schedulers, and Envoy runs
//! the scheduled hook on the thread the scheduler belongs to:
//!
//! - while a worker has paused streams, one of those streams' schedulers
//!   every millisecond (the core's fast tick): `on_http_filter_scheduled`
//!   on the worker ticks its pipeline (waits that time out, slots freed on
//!   other workers);
//! - each configuration's scheduler when its main-thread work is due
//!   (`main_thread`: its own pipeline, and the ticks of workers no hook
//!   ticks), and when a worker wakes the queue it listens on (a key
//!   starved of tokens: the leader calls at once).
//!
//! A scheduler is committed only under [`STATE`]'s lock, and is taken out
//! under the same lock before it is deleted (a stream's at its end, a
//! configuration's when it goes away), so no commit races its teardown;
//! the thread sleeps while there is nothing to commit.

use crate::abi::{self, ConfigSchedulerPtr, SchedulerPtr};
use crate::adapter::now_ms;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

/// The configuration scheduler's events (`on_http_filter_config_scheduled`).
pub const EVENT_TICK: u64 = 0;
pub const EVENT_WAKE: u64 = 1;

/// A main-thread event not handled within this long is taken as lost (an
/// Envoy that never ran it: `--mode validate`, say), and committed again.
const LOST_MS: u64 = 1_000;

/// A scheduler pointer, committed only from the ticker thread (or a
/// waker) under the lock.
#[derive(Clone, Copy)]
struct Sched(*mut std::ffi::c_void);

// SAFETY: Envoy's schedulers' `commit` is thread-safe (it posts to the
// owner's dispatcher); see the module comment for their lifetime.
unsafe impl Send for Sched {}

/// One configuration's main-thread schedule.
struct Main {
    sched: Sched,
    /// When its next tick is due (ms since the epoch), and since when one
    /// committed has not run (0: none).
    due_ms: u64,
    pending_ms: u64,
    /// Queues woken since its last wake event, and whether one is pending.
    woken: Vec<String>,
    wake_pending: bool,
}

#[derive(Default)]
struct State {
    /// The streams waiting, by worker (its address: an identity, never
    /// read): (stream id, its scheduler).
    waiting: HashMap<usize, Vec<(u32, Sched)>>,
    /// Configurations, by Envoy's configuration pointer (an identity).
    mains: HashMap<usize, Main>,
    /// Queue names, and the configuration listening on each (the last to
    /// listen).
    listeners: HashMap<String, usize>,
    /// When the waiting streams' workers were last committed (ms).
    workers_ms: u64,
}

struct Ticker {
    state: Mutex<State>,
    changed: Condvar,
}

fn ticker() -> &'static Ticker {
    static TICKER: OnceLock<Ticker> = OnceLock::new();
    TICKER.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("sluice-ticker".into())
            .spawn(run);
        if let Err(e) = spawned {
            log::error!("sluice: no ticker thread ({e}): nothing is ticked without traffic");
        }
        Ticker {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    })
}

/// The ticker's state, locked. Its lists stay whole whatever panicked
/// while they were locked (each change is one insert or removal): the
/// ticker goes on.
fn state() -> Option<MutexGuard<'static, State>> {
    Some(
        ticker()
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    )
}

/// Stream `id` of `worker` waits: tick that worker through its scheduler.
pub fn wait(worker: usize, id: u32, scheduler: SchedulerPtr) {
    if let Some(mut s) = state() {
        s.waiting
            .entry(worker)
            .or_default()
            .push((id, Sched(scheduler)));
        ticker().changed.notify_one();
    }
}

/// Stream `id` of `worker` no longer waits (resumed, answered or ended);
/// once this returns, its scheduler is never committed again.
pub fn done(worker: usize, id: u32) {
    if let Some(mut s) = state() {
        if let Some(list) = s.waiting.get_mut(&worker) {
            list.retain(|(i, _)| *i != id);
            if list.is_empty() {
                s.waiting.remove(&worker);
            }
        }
    }
}

/// Configuration `key` has main-thread work, through `scheduler`, due now.
pub fn add_main(key: usize, scheduler: ConfigSchedulerPtr) {
    if let Some(mut s) = state() {
        let main = Main {
            sched: Sched(scheduler),
            due_ms: 0,
            pending_ms: 0,
            woken: Vec::new(),
            wake_pending: false,
        };
        s.mains.insert(key, main);
        ticker().changed.notify_one();
    }
}

/// Configuration `key` goes away: once this returns, its scheduler is
/// never committed again, and the queues it listened on have no listener.
pub fn remove_main(key: usize) {
    if let Some(mut s) = state() {
        s.mains.remove(&key);
        s.listeners.retain(|_, k| *k != key);
    }
}

/// Configuration `key`'s tick ran; its next is due at `due_ms`.
pub fn main_ran(key: usize, due_ms: u64) {
    if let Some(mut s) = state() {
        if let Some(m) = s.mains.get_mut(&key) {
            m.pending_ms = 0;
            m.due_ms = due_ms;
        }
        ticker().changed.notify_one();
    }
}

/// Configuration `key`'s next tick is due by `due_ms` at the latest (a
/// worker's pipeline asked for the fast tick).
pub fn main_soon(key: usize, due_ms: u64) {
    if let Some(mut s) = state() {
        if let Some(m) = s.mains.get_mut(&key) {
            if due_ms < m.due_ms {
                m.due_ms = due_ms;
                ticker().changed.notify_one();
            }
        }
    }
}

/// Configuration `key` listens on queue `name` (the last to listen is the
/// one woken).
pub fn listen(name: &str, key: usize) {
    if let Some(mut s) = state() {
        if s.listeners.get(name) != Some(&key) {
            s.listeners.insert(name.to_string(), key);
        }
    }
}

/// Wakes the configuration listening on queue `name`, if any, on the main
/// thread (its wake event). Several wake-ups before it runs are one.
pub fn wake(name: &str) {
    let Some(mut s) = state() else {
        return;
    };
    let Some(&key) = s.listeners.get(name) else {
        return;
    };
    let Some(m) = s.mains.get_mut(&key) else {
        return;
    };
    if !m.woken.iter().any(|n| n == name) {
        m.woken.push(name.to_string());
    }
    if !std::mem::replace(&mut m.wake_pending, true) {
        // SAFETY: the configuration's scheduler, alive while it is listed
        // (see the module comment).
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                m.sched.0, EVENT_WAKE,
            )
        };
    }
}

/// The queues configuration `key` was woken through since its last wake
/// event (its wake event runs).
pub fn take_woken(key: usize) -> Vec<String> {
    let Some(mut s) = state() else {
        return Vec::new();
    };
    let Some(m) = s.mains.get_mut(&key) else {
        return Vec::new();
    };
    m.wake_pending = false;
    std::mem::take(&mut m.woken)
}

/// Commits what is due; how long to sleep then (`None`: until told).
fn commit_due(s: &mut State, now: u64) -> Option<u64> {
    if now != s.workers_ms {
        s.workers_ms = now;
        for list in s.waiting.values() {
            if let Some((_, sched)) = list.first() {
                // SAFETY: the stream is alive: it takes its scheduler out
                // (under this lock) before it ends.
                unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(sched.0, 0)
                };
            }
        }
    }
    let mut next: Option<u64> = (!s.waiting.is_empty()).then_some(1);
    for m in s.mains.values_mut() {
        if m.pending_ms != 0 && now < m.pending_ms + LOST_MS {
            // Committed: `main_ran` tells when it ran, or it is lost.
            let lost = m.pending_ms + LOST_MS - now;
            next = Some(next.map_or(lost, |n| n.min(lost)));
            continue;
        }
        if m.due_ms <= now {
            m.pending_ms = now.max(1);
            // SAFETY: as in `wake`.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                    m.sched.0, EVENT_TICK,
                )
            };
            next = Some(next.map_or(LOST_MS, |n| n.min(LOST_MS)));
        } else {
            let wait = m.due_ms - now;
            next = Some(next.map_or(wait, |n| n.min(wait)));
        }
    }
    next
}

/// The thread: commits what is due, then sleeps until the next thing is.
fn run() {
    let t = ticker();
    let mut s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        let sleep = commit_due(&mut s, now_ms());
        s = match sleep {
            None => t.changed.wait(s).unwrap_or_else(PoisonError::into_inner),
            Some(ms) => {
                let d = Duration::from_millis(ms.max(1));
                t.changed
                    .wait_timeout(s, d)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        };
    }
}

/// The streams in the ticker's lists (tests).
#[cfg(test)]
pub fn waiting_ids() -> Vec<u32> {
    state()
        .map(|s| s.waiting.values().flatten().map(|(i, _)| *i).collect())
        .unwrap_or_default()
}
