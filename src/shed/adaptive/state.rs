//! The state of an adaptive limit as the logic works on it ([`Auto`]): a
//! value that may be absent is an `Option` (or [`Measured`]); a fresh
//! state, and the limit it holds in whole requests. Its stored bytes are
//! `layout.rs`'s.

use super::spec::AdaptiveSpec;

/// The shared entry: the limit (in thousandths, so that small steps add
/// up), the floor's two half-windows, and the current interval's samples
/// from every worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Auto {
    pub limit_milli: u64,
    /// The lowest latency of the floor's current and previous
    /// half-windows (`None`: no sample in it).
    pub floor_current_us: Option<u64>,
    pub floor_previous_us: Option<u64>,
    pub floor_rotated_ms: u64,
    pub interval_start_ms: u64,
    pub sum_us: u64,
    pub count: u64,
    pub peak_inflight: u64,
    /// The longest span of a batch of samples merged in this interval.
    pub max_span_ms: u64,
    /// What the last measurement of the floor found ([`Auto::measure`];
    /// `None`: no measurement in force), and when it ended (or the entry
    /// was made; a `floor_window` earlier once the upstream became faster,
    /// [`Auto::follow_faster`]).
    pub floor_cal: Option<Measured>,
    pub floor_cal_ms: u64,
    /// Samples gathered towards that measurement, and the fastest of
    /// them (`None`: none yet); once it measured a floor, the lowest
    /// latency seen then (`None`: not kept).
    pub cal_sum_us: u64,
    pub cal_count: u64,
    pub cal_min_us: Option<u64>,
    /// How many intervals in a row the limit wanted to shrink and could
    /// not.
    pub stuck_run: u64,
    /// The limit held while measuring the floor (`None`: not measuring),
    /// and since when (the last measurement's start).
    pub measure_limit: Option<u64>,
    pub measure_start_ms: u64,
    /// What the upstream served at once in the last interval, by Little's
    /// law at the floor ([`Seen::serving`]), in thousandths.
    pub serving_milli: u64,
    /// The limit before the measurement, given back if the floor stays.
    pub before_measure_milli: u64,
    /// The average latency of the interval before the measurement (`None`:
    /// no response), and of how many responses.
    pub before_measure_avg_us: Option<u64>,
    pub before_measure_count: u64,
    /// Intervals left whose step is skipped: the one after a limit is
    /// given back (its responses were let in under the held limit).
    pub quiet: u64,
}

/// What a measurement of the floor found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measured {
    /// Nothing: the floor stays the lowest latency seen.
    NothingLearned,
    /// A floor (µs, at least 1).
    FloorUs(u64),
}

impl Auto {
    /// A fresh entry at the initial limit.
    pub fn new(spec: &AdaptiveSpec, now_ms: u64) -> Self {
        Auto {
            limit_milli: u64::from(spec.initial) * 1000,
            floor_current_us: None,
            floor_previous_us: None,
            floor_rotated_ms: now_ms,
            interval_start_ms: now_ms,
            sum_us: 0,
            count: 0,
            peak_inflight: 0,
            max_span_ms: 0,
            floor_cal: None,
            floor_cal_ms: now_ms,
            cal_sum_us: 0,
            cal_count: 0,
            cal_min_us: None,
            stuck_run: 0,
            measure_limit: None,
            measure_start_ms: 0,
            serving_milli: 0,
            before_measure_milli: 0,
            before_measure_avg_us: None,
            before_measure_count: 0,
            quiet: 0,
        }
    }

    /// The limit in whole requests, rounded to the nearest (rounding down
    /// would keep a small limit half a request below what was learned: 2
    /// instead of 2.5 leaves an upstream of 2 slots idle between requests).
    pub fn limit(&self) -> u64 {
        self.limit_milli.saturating_add(500) / 1000
    }
}
