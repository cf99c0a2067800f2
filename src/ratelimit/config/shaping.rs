//! The settings of shaping (`on_limit: delay`, with `max_delay` and
//! `max_delayed`): which rules may hold a request for its turn, and for
//! how long. Its own file because these three fields are checked
//! together, apart from the rest of the rule.

use crate::config::fields::{err, ConfigError};
use crate::duration::parse_duration;
use crate::ratelimit::algorithm::Algorithm;
use serde::Deserialize;

/// `on_limit`: what a token-bucket rule does with a request over its rate.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    /// Refuse it (429 with Retry-After).
    #[default]
    Refuse,
    /// Hold it until its turn, up to `max_delay`, then send it on
    /// (shaping); a later turn is refused.
    Delay,
}

/// Shaping settings of a token-bucket rule with `on_limit: delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaping {
    /// The longest a request may be held for its turn.
    pub max_delay_ns: u64,
    /// The most requests held at once by one worker (beyond, refused).
    pub max_delayed: u32,
}

/// Longest accepted `max_delay`.
pub const MAX_DELAY_NS: u64 = 60 * 1_000_000_000;
/// Largest accepted `max_delayed`.
pub const MAX_DELAYED: i64 = 100_000;

pub(super) fn validate_shaping(
    at: &str,
    on_limit: OnLimit,
    (max_delay, max_delayed): (Option<String>, Option<i64>),
    algorithm: &Algorithm,
    shadow: bool,
) -> Result<Option<Shaping>, ConfigError> {
    if on_limit == OnLimit::Refuse {
        let stray = match (&max_delay, max_delayed) {
            (Some(_), _) => Some("max_delay"),
            (_, Some(_)) => Some("max_delayed"),
            _ => None,
        };
        return match stray {
            Some(f) => Err(err(
                format!("{at}.{f}"),
                "only applies with on_limit: delay",
            )),
            None => Ok(None),
        };
    }
    if matches!(algorithm, Algorithm::Window(_)) {
        return Err(err(
            format!("{at}.on_limit"),
            "delay (shaping) needs algorithm token_bucket",
        ));
    }
    let Some(text) = max_delay else {
        return Err(err(
            format!("{at}.max_delay"),
            "is required with on_limit: delay (the longest a request may be held)",
        ));
    };
    let max_delay_ns = parse_duration(&text).map_err(|p| err(format!("{at}.max_delay"), p))?;
    if max_delay_ns == 0 || max_delay_ns > MAX_DELAY_NS {
        return Err(err(
            format!("{at}.max_delay"),
            "must be longer than 0 and at most 60s",
        ));
    }
    let max_delayed = validate_max_delayed(at, max_delayed)?;
    if shadow {
        // A shadow rule holds nothing: its counts could not show what
        // holding would do (how many held, for how long, which refused
        // past `max_delay` or `max_delayed`).
        return Err(err(
            format!("{at}.shadow"),
            "cannot be combined with on_limit: delay (a shadow rule holds no request, so it cannot \
             show what shaping would do; try the rule with on_limit: refuse in shadow first)",
        ));
    }
    Ok(Some(Shaping {
        max_delay_ns,
        max_delayed,
    }))
}

/// `max_delayed`: how many requests a worker may hold (default 1,000).
fn validate_max_delayed(at: &str, max_delayed: Option<i64>) -> Result<u32, ConfigError> {
    match max_delayed {
        None => Ok(1_000),
        Some(n) if (1..=MAX_DELAYED).contains(&n) => Ok(n as u32),
        Some(n) => Err(err(
            format!("{at}.max_delayed"),
            format!("must be between 1 and {MAX_DELAYED}, got {n}"),
        )),
    }
}
