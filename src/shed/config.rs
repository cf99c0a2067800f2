//! Shedder settings: the JSON under `shedders[i]` and its validated form.

use crate::config::fields::{
    check_name, err, header_name, millis, positive, status, validate_match, ConfigError, RawMatch,
    Strict,
};
use crate::matcher::Match;
use serde::Deserialize;

/// A request's priority class. Ordered: `Sheddable < Default < Critical`.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Sheddable,
    Default,
    Critical,
}

impl Class {
    /// Parses a header value (case-insensitive).
    pub fn parse(v: &[u8]) -> Option<Class> {
        match v.to_ascii_lowercase().as_slice() {
            b"critical" => Some(Class::Critical),
            b"default" => Some(Class::Default),
            b"sheddable" => Some(Class::Sheddable),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Class::Critical => "critical",
            Class::Default => "default",
            Class::Sheddable => "sheddable",
        }
    }
}

/// sluice's own admission queue (a bulkhead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConcurrencySpec {
    pub max: u32,
    pub queue: u32,
    pub max_wait_ms: u64,
}

/// Queue delay estimated from upstream latency over its no-load floor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencySpec {
    pub floor_window_ms: u64,
    /// Use this upstream response header (milliseconds) as the queue delay.
    pub queue_time_header: Option<String>,
}

/// A validated shedder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShedderSpec {
    pub name: String,
    pub matcher: Match,
    pub priority_header: Option<String>,
    pub default_class: Class,
    pub classes: Vec<(Match, Class)>,
    pub concurrency: Option<ConcurrencySpec>,
    pub latency: LatencySpec,
    pub target_ms: u64,
    pub interval_ms: u64,
    pub status: u32,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawShedder {
    name: String,
    #[serde(default, rename = "match")]
    matcher: Option<Strict<RawMatch>>,
    #[serde(default)]
    priority: Option<Strict<RawPriority>>,
    #[serde(default)]
    concurrency: Option<Strict<RawConcurrency>>,
    #[serde(default)]
    latency: Option<Strict<RawLatency>>,
    #[serde(default)]
    target: Option<String>,
    #[serde(default)]
    interval: Option<String>,
    #[serde(default)]
    status: Option<i64>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawPriority {
    header: Option<String>,
    default: Option<Class>,
    #[serde(default)]
    classes: Vec<Strict<RawClassRule>>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawClassRule {
    #[serde(rename = "match")]
    matcher: Strict<RawMatch>,
    class: Class,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawConcurrency {
    max: i64,
    queue: Option<i64>,
    max_wait: Option<String>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawLatency {
    floor_window: Option<String>,
    queue_time_header: Option<String>,
}

/// Validates one shedder.
pub fn validate(at: &str, raw: RawShedder) -> Result<ShedderSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let priority = raw.priority.map(Strict::into_inner).unwrap_or(RawPriority {
        header: None,
        default: None,
        classes: Vec::new(),
    });
    let priority_header = optional_header(format!("{at}.priority.header"), priority.header)?;
    let mut classes = Vec::new();
    for (j, c) in priority
        .classes
        .into_iter()
        .map(Strict::into_inner)
        .enumerate()
    {
        classes.push((
            validate_match(
                &format!("{at}.priority.classes[{j}]"),
                c.matcher.into_inner(),
            )?,
            c.class,
        ));
    }
    let target_ms = millis(format!("{at}.target"), raw.target, "5ms")?;
    let interval_ms = millis(format!("{at}.interval"), raw.interval, "100ms")?;
    if interval_ms <= target_ms {
        return Err(err(format!("{at}.interval"), "must be longer than target"));
    }
    Ok(ShedderSpec {
        name: raw.name,
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        priority_header,
        default_class: priority.default.unwrap_or(Class::Default),
        classes,
        concurrency: raw
            .concurrency
            .map(|c| concurrency(at, c.into_inner()))
            .transpose()?,
        latency: latency(at, raw.latency.map(Strict::into_inner))?,
        target_ms,
        interval_ms,
        status: status(format!("{at}.status"), raw.status.unwrap_or(503))?,
    })
}

fn optional_header(field: String, raw: Option<String>) -> Result<Option<String>, ConfigError> {
    raw.map(|h| header_name(&field, &h)).transpose()
}

fn concurrency(at: &str, c: RawConcurrency) -> Result<ConcurrencySpec, ConfigError> {
    let max = positive(format!("{at}.concurrency.max"), c.max)?;
    let queue = c
        .queue
        .unwrap_or((max as i64).saturating_mul(4).min(100_000));
    if !(0..=100_000).contains(&queue) {
        return Err(err(
            format!("{at}.concurrency.queue"),
            "must be between 0 and 100000",
        ));
    }
    Ok(ConcurrencySpec {
        max: max.min(u32::MAX as u64) as u32,
        queue: queue as u32,
        max_wait_ms: millis(format!("{at}.concurrency.max_wait"), c.max_wait, "1s")?,
    })
}

fn latency(at: &str, raw: Option<RawLatency>) -> Result<LatencySpec, ConfigError> {
    let raw = raw.unwrap_or(RawLatency {
        floor_window: None,
        queue_time_header: None,
    });
    Ok(LatencySpec {
        floor_window_ms: millis(
            format!("{at}.latency.floor_window"),
            raw.floor_window,
            "30s",
        )?,
        queue_time_header: optional_header(
            format!("{at}.latency.queue_time_header"),
            raw.queue_time_header,
        )?,
    })
}
