//! A concurrency limit per key (a bulkhead): the JSON under
//! `concurrency_limits[i]` and its validated form.

use crate::config::fields::{
    check_name, err, millis, positive, status, validate_match, ConfigError, RawMatch, Strict,
};
use crate::keys::{KeyPart, MissingKey};
use crate::matcher::Match;
use serde::Deserialize;

/// Largest accepted `max_keys` (one shared-data entry each).
pub const MAX_KEYS: u32 = 100_000;
/// Largest accepted `queue` (waiters per key and worker).
pub const MAX_QUEUE: u32 = 100_000;
/// Longest accepted `max_wait`.
const MAX_WAIT_MS: u64 = 3_600_000;

/// Waiting for a place: how long at most, and how many waiters per key
/// and worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitSpec {
    pub max_wait_ms: u64,
    pub queue: u32,
}

/// A validated concurrency limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitSpec {
    pub name: String,
    pub matcher: Match,
    pub key: Vec<KeyPart>,
    pub on_missing_key: MissingKey,
    /// Requests in flight per key, at most.
    pub max: u32,
    pub max_keys: u32,
    pub status: u32,
    /// `None`: a request over the limit is refused at once.
    pub wait: Option<WaitSpec>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    name: String,
    #[serde(default, rename = "match")]
    matcher: Option<Strict<RawMatch>>,
    #[serde(default)]
    key: Vec<KeyPart>,
    #[serde(default)]
    on_missing_key: MissingKey,
    max: i64,
    #[serde(default)]
    max_keys: Option<i64>,
    #[serde(default)]
    status: Option<i64>,
    #[serde(default)]
    max_wait: Option<String>,
    #[serde(default)]
    queue: Option<i64>,
}

/// Validates limit `at` (`concurrency_limits[i]`).
pub fn validate(at: &str, raw: RawLimit) -> Result<LimitSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let max = positive(format!("{at}.max"), raw.max)?;
    if max > 1_000_000 {
        return Err(err(format!("{at}.max"), "must be at most 1000000"));
    }
    let max_keys = match raw.max_keys {
        None => 1_000,
        Some(n) => positive(format!("{at}.max_keys"), n)?,
    };
    if max_keys > u64::from(MAX_KEYS) {
        return Err(err(
            format!("{at}.max_keys"),
            format!("must be at most {MAX_KEYS}"),
        ));
    }
    for (j, part) in raw.key.iter().enumerate() {
        part.validate()
            .map_err(|p| err(format!("{at}.key[{j}]"), p))?;
    }
    let wait = wait(at, raw.max_wait, raw.queue, max)?;
    Ok(LimitSpec {
        wait,
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        key: raw.key.into_iter().map(KeyPart::normalised).collect(),
        on_missing_key: raw.on_missing_key,
        max: max as u32,
        max_keys: max_keys as u32,
        status: status(format!("{at}.status"), raw.status.unwrap_or(429))?,
        name: raw.name,
    })
}

/// Validates `max_wait` and `queue` (the default queue: `4 * max`, within
/// the bounds).
fn wait(
    at: &str,
    max_wait: Option<String>,
    queue: Option<i64>,
    max: u64,
) -> Result<Option<WaitSpec>, ConfigError> {
    let Some(text) = max_wait else {
        if queue.is_some() {
            return Err(err(format!("{at}.queue"), "needs `max_wait`"));
        }
        return Ok(None);
    };
    let max_wait_ms = millis(format!("{at}.max_wait"), Some(text), "")?;
    if max_wait_ms > MAX_WAIT_MS {
        return Err(err(format!("{at}.max_wait"), "must be at most 1h"));
    }
    let queue = match queue {
        None => max.saturating_mul(4).min(u64::from(MAX_QUEUE)),
        Some(n) => positive(format!("{at}.queue"), n)?,
    };
    if queue > u64::from(MAX_QUEUE) {
        return Err(err(
            format!("{at}.queue"),
            format!("must be at most {MAX_QUEUE}"),
        ));
    }
    Ok(Some(WaitSpec {
        max_wait_ms,
        queue: queue as u32,
    }))
}
