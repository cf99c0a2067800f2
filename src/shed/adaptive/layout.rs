//! The shared record of an adaptive limit as stored: its fields ([`Auto`]),
//! the sentinels some of them hold ([`NONE`], [`NOTHING_LEARNED`]), a fresh
//! record, the limit it holds in whole requests, and its bytes (versioned
//! and checksummed).

use super::spec::AdaptiveSpec;
use crate::codec::{check, checked_body, Corrupt, Reader};

/// The shared entry: the limit (in thousandths, so that small steps add
/// up), the floor's two half-windows, and the current interval's samples
/// from every worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Auto {
    pub limit_milli: u64,
    pub floor_current_us: u64,
    pub floor_previous_us: u64,
    pub floor_rotated_ms: u64,
    pub interval_start_ms: u64,
    pub sum_us: u64,
    pub count: u64,
    pub peak_inflight: u64,
    /// The longest span of a batch of samples merged in this interval.
    pub max_span_ms: u64,
    /// The floor measured at a low limit ([`Auto::measure`]), and when
    /// (`NONE`: none).
    pub floor_cal_us: u64,
    pub floor_cal_ms: u64,
    /// Samples gathered towards that measurement, and the fastest of
    /// them (`NONE`: none yet).
    pub cal_sum_us: u64,
    pub cal_count: u64,
    pub cal_min_us: u64,
    /// How many intervals in a row the limit wanted to shrink and could
    /// not.
    pub stuck_run: u64,
    /// The limit held while measuring the floor (0: not measuring), and
    /// since when.
    pub measure_limit: u64,
    pub measure_start_ms: u64,
    /// What the upstream served at once in the last interval, by Little's
    /// law at the floor ([`Seen::serving`]), in thousandths.
    pub serving_milli: u64,
    /// The limit before the measurement, given back if the floor stays.
    pub before_measure_milli: u64,
    /// The average latency of the interval before the measurement (`NONE`:
    /// no response), and of how many responses.
    pub before_measure_avg_us: u64,
    pub before_measure_count: u64,
    /// Intervals left whose step is skipped: the one after a limit is
    /// given back (its responses were let in under the held limit).
    pub quiet: u64,
}

const VERSION: u8 = 5;
const BODY: usize = 1 + 22 * 8;
/// No floor seen yet.
pub(super) const NONE: u64 = u64::MAX;
/// A floor measurement that left the floor at the lowest latency seen.
pub(super) const NOTHING_LEARNED: u64 = 0;

impl Auto {
    /// A fresh entry at the initial limit.
    pub fn new(spec: &AdaptiveSpec, now_ms: u64) -> Self {
        Auto {
            limit_milli: u64::from(spec.initial) * 1000,
            floor_current_us: NONE,
            floor_previous_us: NONE,
            floor_rotated_ms: now_ms,
            interval_start_ms: now_ms,
            sum_us: 0,
            count: 0,
            peak_inflight: 0,
            max_span_ms: 0,
            floor_cal_us: NONE,
            floor_cal_ms: now_ms,
            cal_sum_us: 0,
            cal_count: 0,
            cal_min_us: NONE,
            stuck_run: 0,
            measure_limit: 0,
            measure_start_ms: 0,
            serving_milli: 0,
            before_measure_milli: 0,
            before_measure_avg_us: NONE,
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

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BODY + 4);
        out.push(VERSION);
        for v in [
            self.limit_milli,
            self.floor_current_us,
            self.floor_previous_us,
            self.floor_rotated_ms,
            self.interval_start_ms,
            self.sum_us,
            self.count,
            self.peak_inflight,
            self.max_span_ms,
            self.floor_cal_us,
            self.floor_cal_ms,
            self.cal_sum_us,
            self.cal_count,
            self.cal_min_us,
            self.stuck_run,
            self.measure_limit,
            self.measure_start_ms,
            self.serving_milli,
            self.before_measure_milli,
            self.before_measure_avg_us,
            self.before_measure_count,
            self.quiet,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let sum = check(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Auto, Corrupt> {
        if bytes.len() != BODY + 4 || bytes.first() != Some(&VERSION) {
            return Err(Corrupt);
        }
        let body = checked_body(bytes, BODY)?;
        let mut r = Reader(body.get(1..).ok_or(Corrupt)?);
        let mut next = || r.u64();
        Ok(Auto {
            limit_milli: next()?,
            floor_current_us: next()?,
            floor_previous_us: next()?,
            floor_rotated_ms: next()?,
            interval_start_ms: next()?,
            sum_us: next()?,
            count: next()?,
            peak_inflight: next()?,
            max_span_ms: next()?,
            floor_cal_us: next()?,
            floor_cal_ms: next()?,
            cal_sum_us: next()?,
            cal_count: next()?,
            cal_min_us: next()?,
            stuck_run: next()?,
            measure_limit: next()?,
            measure_start_ms: next()?,
            serving_milli: next()?,
            before_measure_milli: next()?,
            before_measure_avg_us: next()?,
            before_measure_count: next()?,
            quiet: next()?,
        })
    }
}
