//! Glue between streams and the core's shedders: pausing and resuming
//! streams by context id, answering shed streams, releasing concurrency
//! slots exactly once, and the shedding metrics.
//!
//! Slots are tracked per stream id in `held`: a slot is added when a stream
//! is admitted (at once or from the queue) and removed (and released) when
//! the stream ends, whichever way it ends. Removal from the map is what
//! makes the release happen exactly once.

use super::http::{now_ns, reject};
use super::metrics;
use super::plugin::Plugin;
use super::store::SharedData;
use crate::response::shed_rejection;
use crate::shed::{Arrival, Class, Wake};
use log::{debug, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, MetricType};

/// The request was shed (and already answered).
pub struct Shed;

/// Metric ids of one shedder (`sluice_shed_<what>.shedder.<name>`).
#[derive(Default, Clone, Copy)]
struct OneShedder {
    in_flight: u32,
    queued: u32,
    queue_ms: u32,
    overloaded: u32,
    shed: [u32; 3],
}

/// All shedders' metrics.
#[derive(Default)]
pub struct ShedMetrics {
    shedders: Vec<OneShedder>,
}

fn define(kind: MetricType, what: &str, name: &str) -> u32 {
    metrics::define(kind, "shed_", what, "shedder", name)
}

fn bump(id: u32, by: i64) {
    metrics::add(id, by);
}

impl ShedMetrics {
    pub fn define(names: &[&str]) -> Self {
        let shedders = names
            .iter()
            .map(|n| OneShedder {
                in_flight: define(MetricType::Gauge, "in_flight", n),
                queued: define(MetricType::Gauge, "queued", n),
                queue_ms: define(MetricType::Histogram, "queue_ms", n),
                overloaded: define(MetricType::Gauge, "overloaded_workers", n),
                shed: [
                    define(MetricType::Counter, "shed_sheddable", n),
                    define(MetricType::Counter, "shed_default", n),
                    define(MetricType::Counter, "shed_critical", n),
                ],
            })
            .collect();
        ShedMetrics { shedders }
    }

    fn get(&self, s: usize) -> OneShedder {
        self.shedders.get(s).copied().unwrap_or_default()
    }
}

impl Plugin {
    pub fn has_shedders(&self) -> bool {
        !self.config.shedders.is_empty()
    }

    fn shed_changes(&self) {
        let Ok(mut sh) = self.shedders.try_borrow_mut() else {
            return;
        };
        for (s, overloaded) in std::mem::take(&mut sh.changes) {
            let name = self.config.shedders.get(s).map_or("", |x| x.name.as_str());
            bump(
                self.shed_metrics.get(s).overloaded,
                if overloaded { 1 } else { -1 },
            );
            if overloaded {
                warn!("sluice: shedder `{name}`: queue delay above target, shedding");
            } else {
                debug!("sluice: shedder `{name}`: queue delay back under target");
            }
        }
    }

    /// Sends the shed answer on stream `id` (which may not be the current one).
    pub fn shed_answer(&self, s: usize, class: Class, id: Option<u32>) {
        let Some(spec) = self.config.shedders.get(s) else {
            return;
        };
        let Ok(mut rng) = self.rng.try_borrow_mut() else {
            return;
        };
        let r = shed_rejection(
            &spec.name,
            class.name(),
            spec.status,
            self.config.response.retry_after_jitter_ns,
            &mut rng,
        );
        drop(rng);
        if let Some(&id) = self.shed_metrics.get(s).shed.get(class as usize) {
            bump(id, 1);
        }
        if let Some(id) = id {
            if hostcalls::set_effective_context(id).is_err() {
                return; // the stream is gone
            }
        }
        reject(&r, self.config.response.reason_header.as_deref());
    }

    fn hold(&self, id: u32, s: usize) {
        if let Ok(mut held) = self.held.try_borrow_mut() {
            held.entry(id).or_default().push(s);
        }
        bump(self.shed_metrics.get(s).in_flight, 1);
    }

    /// Runs the request's shedders. `Ok((true, watched))`: continue, and
    /// report the response latency to the `watched` latency-mode shedders;
    /// `Ok((false, _))`: the stream is paused in a queue; `Err(Shed)`: it
    /// was shed (answered).
    pub fn shed_arrive(
        &self,
        id: u32,
        now: u64,
        req: &dyn crate::request::RequestView,
    ) -> Result<(bool, Vec<usize>), Shed> {
        let classes = match self.shedders.try_borrow() {
            Ok(sh) => sh.classify(req),
            Err(_) => return Ok((true, Vec::new())),
        };
        let watched = classes
            .iter()
            .filter(|(s, _)| {
                self.config
                    .shedders
                    .get(*s)
                    .is_some_and(|x| x.concurrency.is_none())
            })
            .map(|(s, _)| *s)
            .collect();
        let mut queued_somewhere = false;
        for (s, class) in classes {
            let arrival = match self.shedders.try_borrow_mut() {
                Ok(mut sh) => sh.arrive(&SharedData, now, s, id, class),
                Err(_) => continue,
            };
            self.shed_changes();
            match arrival {
                Arrival::Admit { slot } => {
                    if slot {
                        self.hold(id, s);
                    }
                }
                Arrival::Shed => {
                    self.shed_finish(id);
                    self.shed_answer(s, class, None);
                    return Err(Shed);
                }
                Arrival::Queue { evicted } => {
                    bump(self.shed_metrics.get(s).queued, 1);
                    self.fast_tick();
                    if let Some(w) = evicted {
                        bump(self.shed_metrics.get(s).queued, -1);
                        self.shed_answer(s, w.class, Some(w.id));
                        let _ = hostcalls::set_effective_context(id);
                    }
                    // Only the first shedder with a queue applies to a request.
                    queued_somewhere = true;
                    break;
                }
            }
        }
        Ok((!queued_somewhere, watched))
    }

    /// Ticks every millisecond while requests wait, so that a slot freed on
    /// another worker is used within about a millisecond.
    fn fast_tick(&self) {
        if !self.fast_tick.replace(true) {
            let _ = hostcalls::set_tick_period(std::time::Duration::from_millis(1));
        }
    }

    /// Back to the slow tick once no request waits in this VM (and no
    /// failed decrement waits to be retried).
    pub fn slow_tick_when_idle(&self) {
        let idle = self.shedders.try_borrow().is_ok_and(|sh| {
            // Failed decrements are retried on the next tick: soon.
            !sh.has_retries() && (0..self.config.shedders.len()).all(|s| sh.queued(s) == 0)
        });
        if idle && self.fast_tick.replace(false) {
            let _ = hostcalls::set_tick_period(super::root::SLOW_TICK);
        }
    }

    /// Resumes or sheds queued streams (after a release, and on ticks).
    pub fn shed_wake(&self, current: Option<u32>) {
        let mut now = None;
        // Whether the effective context may have moved to another stream.
        let mut switched = false;
        for s in 0..self.config.shedders.len() {
            let wakes = match self.shedders.try_borrow_mut() {
                Ok(mut sh) if sh.queued(s) > 0 || sh.overloaded(s) || sh.has_retries() => {
                    let now = *now.get_or_insert_with(|| now_ns() / 1_000_000);
                    sh.wake(&SharedData, now, s)
                }
                _ => continue,
            };
            switched |= !wakes.is_empty();
            self.shed_changes();
            let m = self.shed_metrics.get(s);
            for w in wakes {
                bump(m.queued, -1);
                match w {
                    Wake::Resume {
                        id,
                        waited_ms,
                        slot,
                    } => {
                        let _ = hostcalls::record_metric(m.queue_ms, waited_ms);
                        if hostcalls::set_effective_context(id).is_ok() {
                            if slot {
                                self.hold(id, s);
                            }
                            let _ = hostcalls::resume_http_request();
                        } else if slot {
                            // The stream is gone: give its slot straight back.
                            if let Ok(mut sh) = self.shedders.try_borrow_mut() {
                                sh.release(&SharedData, s);
                            }
                        }
                    }
                    Wake::Shed { waiter } => self.shed_answer(s, waiter.class, Some(waiter.id)),
                }
            }
        }
        if let (Some(id), true) = (current, switched) {
            let _ = hostcalls::set_effective_context(id);
        }
    }

    /// A stream ended (or was refused): releases its slots exactly once and
    /// takes it out of any queue, then lets waiters in.
    pub fn shed_finish(&self, id: u32) {
        let slots = self
            .held
            .try_borrow_mut()
            .ok()
            .and_then(|mut h| h.remove(&id))
            .unwrap_or_default();
        let mut cancelled = false;
        if let Ok(mut sh) = self.shedders.try_borrow_mut() {
            for &s in &slots {
                sh.release(&SharedData, s);
            }
            for s in 0..self.config.shedders.len() {
                if sh.cancel(&SharedData, s, id) {
                    cancelled = true;
                    bump(self.shed_metrics.get(s).queued, -1);
                }
            }
        }
        for &s in &slots {
            bump(self.shed_metrics.get(s).in_flight, -1);
        }
        if !slots.is_empty() || cancelled {
            self.shed_wake(Some(id));
        }
    }

    /// Gives this worker's leased slots back (every tick: see
    /// `Shedders::return_leases`).
    pub fn shed_return_leases(&self) {
        if let Ok(mut sh) = self.shedders.try_borrow_mut() {
            sh.return_leases(&SharedData);
        }
    }

    /// Latency mode: feeds a response's latency to the shedders that watch it.
    pub fn shed_response(&self, watched: &[usize], now: u64, start_ms: u64) {
        for &s in watched {
            // A queue time the upstream reports, in ms, if this shedder reads one.
            let reported_ms = self
                .config
                .shedders
                .get(s)
                .and_then(|spec| spec.latency.queue_time_header.as_deref())
                .and_then(|h| {
                    hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, h)
                        .ok()
                        .flatten()
                })
                .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok());
            if let Ok(mut sh) = self.shedders.try_borrow_mut() {
                sh.response(now, s, now.saturating_sub(start_ms), reported_ms);
            }
        }
        self.shed_changes();
    }
}
