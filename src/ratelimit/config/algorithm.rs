//! The sections of the two algorithms a rule may count with: `bucket`
//! (a token bucket) and `window` (a sliding window), their JSON and
//! their validation, with the bounds that keep every state within a
//! slot. Its own file because each algorithm's section is checked on its
//! own; which one a rule takes is decided with the rest of the rule.

use crate::config::fields::{err, positive, ConfigError};
use crate::duration::parse_duration;
use crate::ratelimit::bucket::BucketSpec;
use crate::ratelimit::window::WindowSpec;
use serde::Deserialize;

const NS_PER_YEAR: u64 = 365 * 24 * 3_600 * 1_000_000_000;
/// Longest accepted time to refill a full bucket (2^62 ns, 146 years):
/// keeps every state (now and the burst, in units of 1/rate ns) within the
/// slot's 96 bits, and every wait within a `u64` of nanoseconds.
pub const MAX_REFILL_NS: u64 = u64::MAX / 4;

/// Longest accepted sliding window (a year): longer quotas are contracts,
/// not rate limits.
pub const MAX_WINDOW_NS: u64 = 366 * 24 * 3_600 * 1_000_000_000;

/// `algorithm`: how a rule counts.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmName {
    /// A token bucket (`bucket`): bursts up to `burst`, refilled at `rate`.
    #[default]
    TokenBucket,
    /// Two fixed windows weighted by the overlap (`window`): a rolling
    /// quota of `limit` per `period`.
    SlidingWindow,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawWindow {
    pub limit: i64,
    pub period: String,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawBucket {
    pub rate: i64,
    pub period: String,
    pub burst: Option<i64>,
}

pub(super) fn validate_window(at: &str, raw: &RawWindow) -> Result<WindowSpec, ConfigError> {
    let limit = positive(format!("{at}.window.limit"), raw.limit)?;
    if limit > u64::from(u32::MAX) {
        return Err(err(
            format!("{at}.window.limit"),
            format!("must be at most {}", u32::MAX),
        ));
    }
    let window_ns =
        parse_duration(&raw.period).map_err(|p| err(format!("{at}.window.period"), p))?;
    if window_ns < 1_000_000_000 || window_ns % 1_000_000 != 0 {
        return Err(err(
            format!("{at}.window.period"),
            "must be at least 1s and a whole number of milliseconds (use a token bucket for shorter spans)",
        ));
    }
    if window_ns > MAX_WINDOW_NS {
        return Err(err(
            format!("{at}.window.period"),
            "must be at most 8784h (366 days)",
        ));
    }
    Ok(WindowSpec { limit, window_ns })
}

pub(super) fn validate_bucket(at: &str, raw: &RawBucket) -> Result<BucketSpec, ConfigError> {
    let rate = positive(format!("{at}.bucket.rate"), raw.rate)?;
    let period_ns =
        parse_duration(&raw.period).map_err(|p| err(format!("{at}.bucket.period"), p))?;
    if period_ns == 0 {
        return Err(err(format!("{at}.bucket.period"), "must be longer than 0"));
    }
    if rate > u32::MAX as u64 {
        return Err(err(
            format!("{at}.bucket.rate"),
            format!("must be at most {} per period", u32::MAX),
        ));
    }
    let burst = match raw.burst {
        Some(b) => positive(format!("{at}.bucket.burst"), b)?,
        None => rate,
    };
    // The time to refill a whole burst must fit the state's arithmetic.
    if (burst as u128) * (period_ns as u128) / (rate as u128) > MAX_REFILL_NS as u128 {
        return Err(err(
            format!("{at}.bucket"),
            format!(
                "burst x period / rate (the time to refill a full bucket) must be at most {} years",
                MAX_REFILL_NS / NS_PER_YEAR
            ),
        ));
    }
    Ok(BucketSpec {
        rate,
        period_ns,
        burst,
    })
}
