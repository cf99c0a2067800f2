//! What a shedder learns from traffic: CoDel's overload state from queue
//! delays (its own queue's waits, or latency over the floor without one),
//! and the adaptive limit's latency samples, merged into the shared entry
//! on the tick.

use super::adaptive::{Auto, Samples};
use super::{Report, ShedderId, Shedders};
use crate::store::{update, Store, Update};

impl Shedders {
    pub(super) fn roll(&mut self, s: ShedderId, now_ms: u64) {
        if let Some(l) = self.local_mut(s) {
            if let Some(state) = l.codel.roll(now_ms) {
                self.report.changes.push((s, state));
            }
        }
    }

    pub(super) fn note_shed(&mut self, s: ShedderId, now_ms: u64) {
        if let Some(l) = self.local_mut(s) {
            if let Some(state) = l.codel.shed(now_ms) {
                self.report.changes.push((s, state));
            }
        }
    }

    pub(super) fn observe(&mut self, s: ShedderId, now_ms: u64, delay_ms: u64) {
        if let Some(l) = self.local_mut(s) {
            if let Some(state) = l.codel.observe(now_ms, delay_ms) {
                self.report.changes.push((s, state));
            }
        }
    }

    /// A waiter joined or stayed in the queue: the oldest waiter anywhere
    /// (this worker's, or another worker's claim) tells how long the global
    /// queue has been standing. A sample of its age lets a worker with
    /// little traffic of its own see the overload its waiters are part of.
    pub(super) fn observe_global(&mut self, s: ShedderId, other: Option<u64>, own: Option<u64>) {
        let now = self.now_ms;
        if let Some(since) = other.into_iter().chain(own).min() {
            let age = now.saturating_sub(since);
            if age > 0 {
                self.observe(s, now, age);
            }
        }
    }

    /// Adaptive limit: the latency of a request admitted at shedder `s`,
    /// from its admission (after any wait) to its response.
    /// While its floor is measured, the latency also counts towards the
    /// measurement if the request was admitted under the held limit.
    pub fn sample(&mut self, s: ShedderId, latency_us: u64, now_ms: u64) {
        let spec = self
            .get(s)
            .and_then(|r| r.spec.concurrency.as_ref())
            .and_then(|c| c.adaptive);
        let Some(l) = self.local_mut(s) else {
            return;
        };
        let (Some(auto), Some(spec)) = (l.auto.as_ref(), spec) else {
            return;
        };
        l.first_sample_ms.get_or_insert(now_ms);
        let admitted_ms = now_ms.saturating_sub(latency_us / 1000);
        if auto
            .measured_from_ms(&spec)
            .is_some_and(|from| admitted_ms >= from)
        {
            l.samples.add_measured(latency_us);
        }
        l.samples.add(latency_us);
    }

    /// Adaptive limits (on the tick): adds this worker's samples to each
    /// shared entry, which computes the next limit once an interval is
    /// over, and reads the limit back.
    pub fn adapt(&mut self, store: &dyn Store, now_ms: u64) -> Report {
        for s in self.ids() {
            let Some(rule) = self.get(s) else {
                continue;
            };
            let (Some(key), Some(spec)) = (
                rule.auto_key.clone(),
                rule.spec.concurrency.as_ref().and_then(|c| c.adaptive),
            ) else {
                continue;
            };
            // This worker's part, apart from its failures count.
            let Some(l) = self.all.get_mut(s.0 as usize).map(|x| &mut x.local) else {
                continue;
            };
            l.full = false;
            let samples = Samples {
                span_ms: l
                    .first_sample_ms
                    .take()
                    .map_or(0, |first| now_ms.saturating_sub(first)),
                ..std::mem::take(&mut l.samples)
            };
            let failures = &mut self.report.store_failures;
            let merged = update(store, &key, self.max_retries, |found| {
                let old = match found.map(|e| Auto::decode(&e.bytes)) {
                    Some(Ok(a)) => a,
                    Some(Err(_)) => {
                        *failures += 1;
                        Auto::new(&spec, now_ms)
                    }
                    None => Auto::new(&spec, now_ms),
                };
                let next = old.merge(&spec, &samples, now_ms);
                Update::Write(next.encode(), next)
            });
            match merged {
                Ok(a) => l.auto = Some(a),
                Err(_) => self.report.store_failures += 1,
            }
        }
        self.done()
    }

    /// Whether latency samples gathered here should be merged on the next
    /// millisecond rather than the slow tick: once an op on the shared
    /// entry since the last merge found the limit in full use, as
    /// under overload, where the rate of responses decides how far the
    /// limit grows after a rise in capacity and how far it shrinks after
    /// a fall. A batch merged on the slow tick may span up to 100 ms, and
    /// an interval with such a batch cannot count the rate
    /// (`RATE_SPANS` in `adaptive/gradient.rs`): its latency alone, which lags the limit,
    /// then decides. Merged on the slow tick, about a fifth of the
    /// intervals of `bench/overload.py` would go so, in some rounds nearly
    /// all: the limit shrinks from 13 to 7 on 8 slots, and floor
    /// measurements started from such intervals hold 6 on 8 slots. Not
    /// while the limit is partly used: a worker serving one request at a
    /// time would then pay a tick per response (+24% instructions per
    /// request in `rl_shed_auto`).
    pub fn merge_soon(&self) -> bool {
        self.all
            .iter()
            .any(|x| x.local.full && x.local.samples.count > 0)
    }

    /// Latency mode: a request was let through at shedder `s` (its answer
    /// will be a sample).
    pub fn started(&mut self, s: ShedderId) {
        if let Some(l) = self.local_mut(s) {
            l.codel.started();
        }
    }

    /// Latency mode: a request let through at shedder `s` ended without an
    /// answer (reset, client gone, refused later).
    pub fn abandoned(&mut self, s: ShedderId) {
        if let Some(l) = self.local_mut(s) {
            l.codel.finished();
        }
    }

    /// Latency mode: records a response's upstream latency (or the queue
    /// time the upstream reported) as a delay sample.
    pub fn response(
        &mut self,
        now_ms: u64,
        s: ShedderId,
        latency_ms: u64,
        reported_ms: Option<u64>,
    ) -> Report {
        let Some(window) = self.get(s).map(|r| r.spec.latency.floor_window_ms) else {
            return self.done();
        };
        let Some(l) = self.local_mut(s) else {
            return self.done();
        };
        l.codel.finished();
        // The floor is the minimum over the last one to two half-windows.
        if now_ms.saturating_sub(l.floor_rotated_ms) >= window / 2 {
            l.floor_previous = l.floor_current.take();
            l.floor_rotated_ms = now_ms;
        }
        l.floor_current = Some(l.floor_current.map_or(latency_ms, |m| m.min(latency_ms)));
        let floor = l
            .floor_current
            .into_iter()
            .chain(l.floor_previous)
            .min()
            .unwrap_or(latency_ms);
        let delay = reported_ms.unwrap_or(latency_ms.saturating_sub(floor));
        self.observe(s, now_ms, delay);
        self.done()
    }
}
