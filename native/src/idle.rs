//! The main thread's tick of a configuration: the workers no hook ticked
//! in time, then its own pipeline (`main_thread`).
//!
//! A worker ticks itself from its own hooks while it has traffic, and is
//! ticked through a waiting stream's scheduler while streams wait on it;
//! otherwise the main thread ticks its pipeline for it when its tick is
//! due (demand reported, slot leases returned, breaker and budget counts
//! merged, slow calls found, retries of failed updates), with no stream
//! to act on: what such a tick asks of streams (none while none waits) is
//! left to the worker's next hook.

use crate::adapter::{now_ms, Engine, Outcome, Role, Signal};
use crate::config::{FilterConfig, Worker, WorkerState};
use crate::config_metrics::ConfigSink;
use crate::main_thread::{Host, SLOW_MS};
use crate::ticker;

impl Host for FilterConfig {
    fn sink(&self) -> ConfigSink<'_> {
        self.config_sink()
    }

    fn envoy(&self) -> crate::abi::ConfigEnvoyPtr {
        self.envoy.0
    }

    fn rebuild(&self) -> Result<Engine, String> {
        self.build(Role::MainAgain)
    }
}

impl FilterConfig {
    /// The main thread's tick; returns when the next is due (ms).
    pub fn main_tick(&self) -> u64 {
        let now = now_ms();
        let mut due = now + SLOW_MS;
        for w in self.built_workers() {
            if let Some(next) = self.tick_idle(w, now) {
                due = due.min(next);
            }
        }
        due.min(self.main.tick(self, now))
    }

    /// Ticks worker `w` for it if it is due and idle (no hook running, no
    /// stream waiting); when its next tick is due, if the main thread is
    /// to run it.
    fn tick_idle(&self, w: &Worker, now: u64) -> Option<u64> {
        let sink = &mut self.config_sink();
        self.with_idle(w, |e, st| {
            if !st.paused.is_empty() {
                return None;
            }
            if now < st.next_tick_ms {
                return Some(st.next_tick_ms);
            }
            st.next_tick_ms = now + st.period();
            let out = e.tick(sink, &crate::adapter::HookClock::default());
            // Carried out here, under the worker's lock: nothing of it
            // leaves the main thread's call.
            keep(st, out, now);
            Some(st.next_tick_ms)
        })?
    }
}

/// Carries out, for a worker, a tick the main thread ran for it: its tick
/// period, the queues it wakes; effects on streams wait for its next hook.
fn keep(st: &mut WorkerState, out: Outcome, now: u64) {
    if let Some(period) = out.tick {
        st.set_period(period.as_ms(), now);
    }
    for s in &out.signals {
        if let Signal::Wake(name) = s {
            ticker::wake(name);
        }
    }
    st.deferred.extend(out.effects);
    crate::calls::not_started(&out.calls, "a worker's pipeline");
}
