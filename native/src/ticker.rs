//! Ticks for workers with streams waiting. Envoy 1.40 has no per-worker
//! timer for HTTP filters: while a worker has paused streams, a module
//! thread commits one of those streams' schedulers every millisecond (the
//! core's fast tick), and Envoy runs `on_http_filter_scheduled` for it on
//! the worker, which ticks the worker's pipeline there (waits that time
//! out, slots freed on other workers). Otherwise a worker ticks from its
//! own hooks when a tick is due (`filter::tick_if_due`).
//!
//! A scheduler is committed only under [`WAKERS`]' lock, and a stream takes
//! its scheduler out under the same lock before it ends, so no commit races
//! the stream's teardown; the thread sleeps while no stream waits.

use crate::abi::{self, SchedulerPtr};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

/// The streams waiting, by worker (its address: an identity, never read):
/// (stream id, its scheduler).
#[derive(Default)]
struct Wakers(HashMap<usize, Vec<(u32, Sched)>>);

/// A scheduler pointer, committed only from the ticker thread under the lock.
#[derive(Clone, Copy)]
struct Sched(SchedulerPtr);

// SAFETY: Envoy's scheduler `commit` is thread-safe (it posts to the
// worker's dispatcher); see the module comment for its lifetime.
unsafe impl Send for Sched {}

struct Ticker {
    wakers: Mutex<Wakers>,
    waiting: Condvar,
}

fn ticker() -> &'static Ticker {
    static TICKER: OnceLock<Ticker> = OnceLock::new();
    TICKER.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("sluice-ticker".into())
            .spawn(run);
        if let Err(e) = spawned {
            log::error!("sluice: no ticker thread ({e}): waits end on the worker's traffic");
        }
        Ticker {
            wakers: Mutex::new(Wakers::default()),
            waiting: Condvar::new(),
        }
    })
}

/// Stream `id` of `worker` waits: tick that worker through its scheduler.
pub fn wait(worker: usize, id: u32, scheduler: SchedulerPtr) {
    let t = ticker();
    if let Ok(mut w) = t.wakers.lock() {
        w.0.entry(worker).or_default().push((id, Sched(scheduler)));
        t.waiting.notify_one();
    }
}

/// Stream `id` of `worker` no longer waits (resumed, answered or ended);
/// once this returns, its scheduler is never committed again.
pub fn done(worker: usize, id: u32) {
    if let Ok(mut w) = ticker().wakers.lock() {
        if let Some(list) = w.0.get_mut(&worker) {
            list.retain(|(i, _)| *i != id);
            if list.is_empty() {
                w.0.remove(&worker);
            }
        }
    }
}

/// The thread: every millisecond, one commit per worker with a stream waiting.
fn run() {
    let t = ticker();
    loop {
        let Ok(mut w) = t.wakers.lock() else {
            return;
        };
        while w.0.is_empty() {
            w = match t.waiting.wait(w) {
                Ok(w) => w,
                Err(_) => return,
            };
        }
        for list in w.0.values() {
            if let Some((_, s)) = list.first() {
                // SAFETY: the stream is alive: it takes its scheduler out
                // (under this lock) before it ends.
                unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(s.0, 0) };
            }
        }
        drop(w);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The streams in the ticker's lists (tests).
#[cfg(test)]
pub fn waiting_ids() -> Vec<u32> {
    ticker()
        .wakers
        .lock()
        .map(|w| w.0.values().flatten().map(|(i, _)| *i).collect())
        .unwrap_or_default()
}
