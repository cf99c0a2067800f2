//! The shared record of an adaptive limit as stored: its fields in order,
//! the sentinels that stand in them for the absent values of [`Auto`]
//! ([`NONE`], [`NOTHING_LEARNED`], [`NOT_MEASURING`]), and its bytes
//! (versioned and checksummed).

use super::state::{Auto, Measured};
use crate::codec::{check, checked_body, Corrupt, Reader};

const VERSION: u8 = 5;
const BODY: usize = 1 + 22 * 8;
/// No latency (`None`): no floor seen, no measured floor in force, no
/// measured sample, no response before a measurement.
const NONE: u64 = u64::MAX;
/// A floor measurement that left the floor at the lowest latency seen
/// ([`Measured::NothingLearned`]).
const NOTHING_LEARNED: u64 = 0;
/// No limit held: the floor is not being measured.
const NOT_MEASURING: u64 = 0;

fn latency(v: Option<u64>) -> u64 {
    v.unwrap_or(NONE)
}

fn latency_of(word: u64) -> Option<u64> {
    (word != NONE).then_some(word)
}

fn measured(m: Option<Measured>) -> u64 {
    match m {
        None => NONE,
        Some(Measured::NothingLearned) => NOTHING_LEARNED,
        Some(Measured::FloorUs(us)) => us,
    }
}

fn measured_of(word: u64) -> Option<Measured> {
    match word {
        NONE => None,
        NOTHING_LEARNED => Some(Measured::NothingLearned),
        us => Some(Measured::FloorUs(us)),
    }
}

impl Auto {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BODY + 4);
        out.push(VERSION);
        for v in [
            self.limit_milli,
            latency(self.floor_current_us),
            latency(self.floor_previous_us),
            self.floor_rotated_ms,
            self.interval_start_ms,
            self.sum_us,
            self.count,
            self.peak_inflight,
            self.max_span_ms,
            measured(self.floor_cal),
            self.floor_cal_ms,
            self.cal_sum_us,
            self.cal_count,
            latency(self.cal_min_us),
            self.stuck_run,
            self.measure_limit.unwrap_or(NOT_MEASURING),
            self.measure_start_ms,
            self.serving_milli,
            self.before_measure_milli,
            latency(self.before_measure_avg_us),
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
            floor_current_us: latency_of(next()?),
            floor_previous_us: latency_of(next()?),
            floor_rotated_ms: next()?,
            interval_start_ms: next()?,
            sum_us: next()?,
            count: next()?,
            peak_inflight: next()?,
            max_span_ms: next()?,
            floor_cal: measured_of(next()?),
            floor_cal_ms: next()?,
            cal_sum_us: next()?,
            cal_count: next()?,
            cal_min_us: latency_of(next()?),
            stuck_run: next()?,
            measure_limit: Some(next()?).filter(|&l| l != NOT_MEASURING),
            measure_start_ms: next()?,
            serving_milli: next()?,
            before_measure_milli: next()?,
            before_measure_avg_us: latency_of(next()?),
            before_measure_count: next()?,
            quiet: next()?,
        })
    }
}
