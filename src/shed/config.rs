//! Shedder settings: the JSON under `shedders[i]` and its validated form.

use super::adaptive::AdaptiveSpec;
use crate::config::fields::{
    check_name, err, header_name, millis, positive, status, validate_match, ConfigError, RawMatch,
    Strict,
};
use crate::matcher::Match;
use serde::Deserialize;

/// A request's priority class. Ordered: `Sheddable < Default < Critical`.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Sheddable,
    #[default]
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
    /// The limit; with `adaptive`, its upper bound.
    pub max: u32,
    pub queue: u32,
    pub max_wait_ms: u64,
    /// `shed_early`: an arrival whose expected wait (its place in line over
    /// the recent admission rate) is past its longest wait is shed at once.
    pub shed_early: bool,
    /// `max: "auto"`: the limit is learned from latency.
    pub adaptive: Option<AdaptiveSpec>,
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
    /// Guaranteed shares of the admissions per class (percent, indexed by
    /// `Class as usize`), instead of strict priority.
    pub shares: Option<[u32; 3]>,
    /// Newest first within a class while overloaded.
    pub lifo: bool,
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
    #[serde(default)]
    shares: Option<Strict<RawShares>>,
    #[serde(default)]
    lifo: bool,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawShares {
    critical: i64,
    default: i64,
    sheddable: i64,
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
    max: RawMax,
    queue: Option<i64>,
    max_wait: Option<String>,
    #[serde(default)]
    shed_early: bool,
    #[serde(default)]
    adaptive: Option<Strict<RawAdaptive>>,
}

/// `concurrency.max`: a number, or `"auto"`.
#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(
    untagged,
    expecting = "must be a whole number of requests, or \"auto\""
)]
enum RawMax {
    Fixed(i64),
    Auto(String),
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawAdaptive {
    min: Option<i64>,
    max: Option<i64>,
    initial: Option<i64>,
    tolerance: Option<f64>,
    interval: Option<String>,
    floor_window: Option<String>,
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
    let mut priority = raw.priority.map(Strict::into_inner).unwrap_or(RawPriority {
        header: None,
        default: None,
        classes: Vec::new(),
        shares: None,
        lifo: false,
    });
    let shares = queue_order(at, &mut priority, raw.concurrency.is_some())?;
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
    if raw.concurrency.is_some() && raw.latency.is_some() {
        return Err(err(
            format!("{at}.latency"),
            "applies only to a shedder without concurrency (latency mode); with concurrency, \
             queue time is measured in sluice's own queue",
        ));
    }
    Ok(ShedderSpec {
        name: raw.name,
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        priority_header,
        default_class: priority.default.unwrap_or(Class::Default),
        classes,
        shares,
        lifo: priority.lifo,
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

/// The order of a queue-mode shedder's waiters: shares (taken out of
/// `priority`), and whether LIFO may apply.
fn queue_order(
    at: &str,
    priority: &mut RawPriority,
    queue: bool,
) -> Result<Option<[u32; 3]>, ConfigError> {
    let shares = priority
        .shares
        .take()
        .map(|sh| validate_shares(at, sh.into_inner(), queue))
        .transpose()?;
    let lifo = format!("{at}.priority.lifo");
    if priority.lifo && !queue {
        return Err(err(lifo, "needs a concurrency limit (queue mode)"));
    }
    if priority.lifo && shares.is_some() {
        // Serving a class's newest waiter leaves its oldest, whose turn
        // decides which class goes next, first in line: that class would
        // be served again and again.
        return Err(err(lifo, "cannot be combined with shares"));
    }
    Ok(shares)
}

/// Shares in percent, indexed by `Class as usize`; they must add up to 100.
fn validate_shares(at: &str, raw: RawShares, queue: bool) -> Result<[u32; 3], ConfigError> {
    let field = format!("{at}.priority.shares");
    if !queue {
        return Err(err(field, "needs a concurrency limit (queue mode)"));
    }
    let mut out = [0u32; 3];
    for (class, v) in [
        (Class::Sheddable, raw.sheddable),
        (Class::Default, raw.default),
        (Class::Critical, raw.critical),
    ] {
        if !(0..=100).contains(&v) {
            return Err(err(
                format!("{field}.{}", class.name()),
                format!("must be a percentage between 0 and 100, got {v}"),
            ));
        }
        if let Some(o) = out.get_mut(class as usize) {
            *o = v as u32;
        }
    }
    let sum: u32 = out.iter().sum();
    if sum != 100 {
        return Err(err(field, format!("must add up to 100, got {sum}")));
    }
    Ok(out)
}

fn optional_header(field: String, raw: Option<String>) -> Result<Option<String>, ConfigError> {
    raw.map(|h| header_name(&field, &h)).transpose()
}

fn concurrency(at: &str, c: RawConcurrency) -> Result<ConcurrencySpec, ConfigError> {
    let adaptive = match (&c.max, c.adaptive) {
        (RawMax::Auto(t), a) if t == "auto" => Some(adaptive(
            at,
            a.map(Strict::into_inner).unwrap_or(RawAdaptive {
                min: None,
                max: None,
                initial: None,
                tolerance: None,
                interval: None,
                floor_window: None,
            }),
        )?),
        (RawMax::Auto(t), _) => {
            return Err(err(
                format!("{at}.concurrency.max"),
                format!("must be a positive integer or \"auto\", got \"{t}\""),
            ))
        }
        (RawMax::Fixed(_), Some(_)) => {
            return Err(err(
                format!("{at}.concurrency.adaptive"),
                "only applies with max: \"auto\"",
            ))
        }
        (RawMax::Fixed(_), None) => None,
    };
    let max = match (&c.max, &adaptive) {
        (_, Some(a)) => u64::from(a.max),
        (RawMax::Fixed(n), None) => {
            let field = format!("{at}.concurrency.max");
            let n = positive(field.clone(), *n)?;
            if n > 1_000_000 {
                return Err(err(field, format!("must be at most 1000000, got {n}")));
            }
            n
        }
        (RawMax::Auto(_), None) => 0,
    };
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
        max: u32::try_from(max).unwrap_or(u32::MAX),
        queue: queue as u32,
        max_wait_ms: millis(format!("{at}.concurrency.max_wait"), c.max_wait, "1s")?,
        shed_early: c.shed_early,
        adaptive,
    })
}

/// Largest accepted adaptive bound.
const MAX_ADAPTIVE: i64 = 100_000;

fn adaptive(at: &str, a: RawAdaptive) -> Result<AdaptiveSpec, ConfigError> {
    let field = |f: &str| format!("{at}.concurrency.adaptive.{f}");
    let bound = |f: &str, v: Option<i64>, default: i64| -> Result<u32, ConfigError> {
        let v = v.unwrap_or(default);
        if (1..=MAX_ADAPTIVE).contains(&v) {
            Ok(v as u32)
        } else {
            Err(err(
                field(f),
                format!("must be between 1 and {MAX_ADAPTIVE}, got {v}"),
            ))
        }
    };
    let min = bound("min", a.min, 2)?;
    let max = bound("max", a.max, 1000)?;
    if max < min {
        return Err(err(field("max"), format!("must be at least min ({min})")));
    }
    let initial = bound("initial", a.initial, i64::from(min.max(10).min(max)))?;
    if !(min..=max).contains(&initial) {
        return Err(err(
            field("initial"),
            format!("must be between min ({min}) and max ({max})"),
        ));
    }
    let tolerance = a.tolerance.unwrap_or(1.25);
    if !(1.0..=10.0).contains(&tolerance) {
        return Err(err(field("tolerance"), "must be between 1.0 and 10.0"));
    }
    // Kept in hundredths: a finer one would not be the one written.
    if ((tolerance * 100.0).round() - tolerance * 100.0).abs() > 1e-6 {
        return Err(err(
            field("tolerance"),
            format!("must be a multiple of 0.01, got {tolerance}"),
        ));
    }
    let interval_ms = millis(field("interval"), a.interval, "100ms")?;
    let floor_window_ms = millis(field("floor_window"), a.floor_window, "30s")?;
    if floor_window_ms < 2 * interval_ms {
        return Err(err(
            field("floor_window"),
            "must be at least twice the interval",
        ));
    }
    Ok(AdaptiveSpec {
        min,
        max,
        initial,
        tolerance_pct: (tolerance * 100.0).round() as u32,
        interval_ms,
        floor_window_ms,
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
