//! Sample merging: the latency samples one worker gathers between its
//! ticks ([`Samples`]), and their merge into the shared record on the tick
//! ([`Auto::merge`]), which rotates the floor's half-windows and ends the
//! interval once it has lasted long enough.

use super::spec::AdaptiveSpec;
use super::state::Auto;

/// Latency samples one worker gathered since its last tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Samples {
    pub sum_us: u64,
    pub count: u64,
    pub min_us: Option<u64>,
    /// The most requests in flight (all workers) this worker saw.
    pub peak_inflight: u64,
    /// How long since the first of these samples came (ms): the stretch
    /// of time they come from.
    pub span_ms: u64,
    /// While the floor is measured: the latencies of the requests
    /// admitted under the held limit ([`Auto::measured_from_ms`]).
    pub cal_sum_us: u64,
    pub cal_count: u64,
    /// The fastest of them.
    pub cal_min_us: Option<u64>,
}

impl Samples {
    pub fn add(&mut self, latency_us: u64) {
        self.sum_us = self.sum_us.saturating_add(latency_us);
        self.count += 1;
        self.min_us = Some(self.min_us.map_or(latency_us, |m| m.min(latency_us)));
    }

    /// A latency that counts towards a measurement of the floor.
    pub fn add_measured(&mut self, latency_us: u64) {
        self.cal_sum_us = self.cal_sum_us.saturating_add(latency_us);
        self.cal_count += 1;
        self.cal_min_us = Some(self.cal_min_us.map_or(latency_us, |m| m.min(latency_us)));
    }
}

impl Auto {
    /// Adds a worker's samples and, once an interval is over, computes the
    /// next limit from every worker's samples.
    pub fn merge(mut self, spec: &AdaptiveSpec, s: &Samples, now_ms: u64) -> Auto {
        if now_ms.saturating_sub(self.floor_rotated_ms) >= spec.floor_window_ms / 2 {
            self.floor_previous_us = self.floor_current_us.take();
            self.floor_rotated_ms = now_ms;
        }
        if let Some(m) = s.min_us {
            self.follow_faster(spec, m, now_ms);
            self.floor_current_us = Some(self.floor_current_us.map_or(m, |f| f.min(m)));
        }
        self.sum_us = self.sum_us.saturating_add(s.sum_us);
        self.count = self.count.saturating_add(s.count);
        self.peak_inflight = self.peak_inflight.max(s.peak_inflight);
        if s.count > 0 {
            self.max_span_ms = self.max_span_ms.max(s.span_ms);
        }
        if self.measure_limit.is_some() {
            self.cal_sum_us = self.cal_sum_us.saturating_add(s.cal_sum_us);
            self.cal_count = self.cal_count.saturating_add(s.cal_count);
            if let Some(m) = s.cal_min_us {
                self.cal_min_us = Some(self.cal_min_us.map_or(m, |f| f.min(m)));
            }
        }
        // An interval lasts at least twice the floor (up to half the
        // floor window; the average latency before there is a floor):
        // with an upstream slower than `interval`, responses come in
        // bursts an interval holds all or none of (4 slots of 200 ms: 8
        // in one interval, then none), and its rate said twice the
        // capacity; the limit then kept a queue the lowest latency took
        // for the floor, and ran up to its maximum. Not twice the average
        // latency: that stretched intervals while a queue drained after a
        // drop in capacity, and with a few very long requests.
        let elapsed_ms = now_ms.saturating_sub(self.interval_start_ms);
        let typical_us = self
            .floor_us()
            .or(self.sum_us.checked_div(self.count))
            .unwrap_or(0);
        let long_enough = spec
            .interval_ms
            .max((typical_us / 500).min(spec.floor_window_ms / 2));
        if elapsed_ms >= long_enough {
            self.end_interval(spec, now_ms, elapsed_ms);
        }
        self
    }
}
