//! A rate-limit rule's settings: the JSON under `rate_limits[i]` and its
//! validated form, which the limiter trusts without further checks.

use super::algorithm::Algorithm;
pub use super::bucket::BucketSpec;
use super::global::config::{self as global_config, GlobalSpec, RawGlobal};
use super::global::pool::PoolSpec;
use super::window::WindowSpec;
use crate::config::fields::{
    check_name, err, header_name, positive, validate_match, ConfigError, RawMatch, Strict,
};
use crate::duration::parse_duration;
use crate::keys::{KeyPart, MissingKey};
use crate::matcher::Match;
use serde::Deserialize;

/// Largest accepted `max_keys`: every slot is a shared-data entry created at
/// configuration time, so this bounds start-up work and Envoy memory.
pub const MAX_TABLE_SIZE: u32 = 1_000_000;

const NS_PER_YEAR: u64 = 365 * 24 * 3_600 * 1_000_000_000;
/// Longest accepted time to refill a full bucket (2^62 ns, 146 years):
/// keeps every state (now and the burst, in units of 1/rate ns) within the
/// slot's 96 bits, and every wait within a `u64` of nanoseconds.
pub const MAX_REFILL_NS: u64 = u64::MAX / 4;

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    pub name: String,
    #[serde(default, rename = "match")]
    pub matcher: Option<Strict<RawMatch>>,
    #[serde(default)]
    pub key: Vec<KeyPart>,
    #[serde(default)]
    pub on_missing_key: MissingKey,
    #[serde(default)]
    pub algorithm: AlgorithmName,
    #[serde(default)]
    pub bucket: Option<Strict<RawBucket>>,
    #[serde(default)]
    pub window: Option<Strict<RawWindow>>,
    #[serde(default)]
    pub cost: Option<Strict<RawCost>>,
    #[serde(default)]
    pub shadow: bool,
    #[serde(default)]
    pub max_keys: Option<i64>,
    #[serde(default)]
    pub on_limit: OnLimit,
    #[serde(default)]
    pub max_delay: Option<String>,
    #[serde(default)]
    pub max_delayed: Option<i64>,
    /// Tokens from a rate-limit service shared by the fleet (see
    /// `ratelimit::global`).
    #[serde(default)]
    pub global: Option<Strict<RawGlobal>>,
}

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

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawCost {
    pub default: Option<i64>,
    pub header: Option<String>,
    pub max: Option<i64>,
}

/// Request cost settings, validated so that `1 <= default <= max <= burst`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostSpec {
    pub default: u64,
    pub header: Option<String>,
    pub max: u64,
}

/// Shaping settings of a token-bucket rule with `on_limit: delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaping {
    /// The longest a request may be held for its turn.
    pub max_delay_ns: u64,
    /// The most requests held at once by one worker (beyond, refused).
    pub max_delayed: u32,
}

/// A validated rate-limit rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSpec {
    pub name: String,
    pub matcher: Match,
    pub key: Vec<KeyPart>,
    pub on_missing_key: MissingKey,
    pub algorithm: Algorithm,
    pub cost: CostSpec,
    pub shadow: bool,
    pub max_keys: u32,
    pub shaping: Option<Shaping>,
    /// A global rule: `algorithm` is its pool of tokens from the service.
    pub global: Option<Box<GlobalRuleSpec>>,
}

/// A global rule's settings: the service, the fleet-wide limit (the
/// rule's `bucket` or `window`, for the headers), and the local backstop
/// (that limit times the share) used while the service is down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalRuleSpec {
    pub service: GlobalSpec,
    pub limit: Algorithm,
    pub backstop: Algorithm,
}

/// Longest accepted sliding window (a year): longer quotas are contracts,
/// not rate limits.
pub const MAX_WINDOW_NS: u64 = 366 * 24 * 3_600 * 1_000_000_000;
/// Longest accepted `max_delay`.
pub const MAX_DELAY_NS: u64 = 60 * 1_000_000_000;
/// Largest accepted `max_delayed`.
pub const MAX_DELAYED: i64 = 100_000;

/// A global rule's `wait_for_tokens` holds a request inside the rate-limit
/// stage, which a shaping rule in the same configuration does too, in a
/// way of its own: the two are not combined.
pub fn check_waits(rules: &[RuleSpec]) -> Result<(), ConfigError> {
    if !rules.iter().any(|r| r.shaping.is_some()) {
        return Ok(());
    }
    let waits = |r: &RuleSpec| {
        r.global
            .as_ref()
            .is_some_and(|g| g.service.wait_for_tokens_ms > 0)
    };
    match rules.iter().position(waits) {
        Some(i) => Err(err(
            format!("rate_limits[{i}].global.wait_for_tokens"),
            "does not apply while a rule of the configuration shapes (on_limit: delay)",
        )),
        None => Ok(()),
    }
}

/// Validates rule `at` (`rate_limits[i]`).
pub fn validate(at: &str, raw: RawRule) -> Result<RuleSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let algorithm = validate_algorithm(at, &raw)?;
    let global = raw.global.is_some();
    let cost = validate_cost(
        at,
        raw.cost.map(Strict::into_inner),
        algorithm.quota(),
        global,
    )?;
    let max_keys = validate_max_keys(at, raw.max_keys)?;
    let delays = (raw.max_delay, raw.max_delayed);
    let shaping = validate_shaping(at, raw.on_limit, delays, &algorithm, raw.shadow)?;
    let global = match raw.global {
        Some(g) if shaping.is_some() => {
            drop(g);
            return Err(err(
                format!("{at}.on_limit"),
                "delay (shaping) does not apply to a global rule",
            ));
        }
        Some(g) => Some(Box::new(validate_global(
            at,
            g.into_inner(),
            &raw.key,
            algorithm,
        )?)),
        None => None,
    };
    let algorithm = match &global {
        Some(g) => Algorithm::Pool(PoolSpec {
            quota: g.limit.quota(),
            window_ns: u64::try_from(g.limit.window_ns()).unwrap_or(u64::MAX),
            retry_ns: super::global::STARVED_WAIT_NS,
        }),
        None => algorithm,
    };
    for (j, part) in raw.key.iter().enumerate() {
        part.validate()
            .map_err(|p| err(format!("{at}.key[{j}]"), p))?;
    }
    Ok(RuleSpec {
        name: raw.name,
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        key: raw.key.into_iter().map(KeyPart::normalised).collect(),
        on_missing_key: raw.on_missing_key,
        algorithm,
        cost,
        shadow: raw.shadow,
        max_keys,
        shaping,
        global,
    })
}

/// `global`, over the rule's limit: its backstop is the limit times the
/// share, never below one request.
fn validate_global(
    at: &str,
    raw: RawGlobal,
    key: &[KeyPart],
    limit: Algorithm,
) -> Result<GlobalRuleSpec, ConfigError> {
    let service = global_config::validate(at, raw, key)?;
    let scale = |n: u64| ((n as f64 * service.share).floor() as u64).max(1);
    let backstop = match limit {
        Algorithm::Bucket(b) => Algorithm::Bucket(BucketSpec {
            rate: scale(b.rate),
            period_ns: b.period_ns,
            burst: scale(b.burst),
        }),
        Algorithm::Window(w) => Algorithm::Window(WindowSpec {
            limit: scale(w.limit),
            window_ns: w.window_ns,
        }),
        Algorithm::Pool(_) => limit,
    };
    Ok(GlobalRuleSpec {
        service,
        limit,
        backstop,
    })
}

impl RuleSpec {
    /// The token bucket, if the rule has one.
    pub fn bucket(&self) -> Option<&BucketSpec> {
        match &self.algorithm {
            Algorithm::Bucket(b) => Some(b),
            Algorithm::Window(_) | Algorithm::Pool(_) => None,
        }
    }
}

/// The algorithm and its one settings object: `bucket` for a token bucket,
/// `window` for a sliding window, never both.
fn validate_algorithm(at: &str, raw: &RawRule) -> Result<Algorithm, ConfigError> {
    match (raw.algorithm, &raw.bucket, &raw.window) {
        (AlgorithmName::TokenBucket, Some(b), None) => {
            Ok(Algorithm::Bucket(validate_bucket(at, &b.0)?))
        }
        (AlgorithmName::SlidingWindow, None, Some(w)) => {
            Ok(Algorithm::Window(validate_window(at, &w.0)?))
        }
        (AlgorithmName::TokenBucket, _, Some(_)) => Err(err(
            format!("{at}.window"),
            "is for algorithm sliding_window; a token bucket takes `bucket`",
        )),
        (AlgorithmName::SlidingWindow, Some(_), _) => Err(err(
            format!("{at}.bucket"),
            "is for algorithm token_bucket; a sliding window takes `window`",
        )),
        (AlgorithmName::TokenBucket, None, None) => {
            Err(err(format!("{at}.bucket"), "missing field `bucket`"))
        }
        (AlgorithmName::SlidingWindow, None, None) => Err(err(
            format!("{at}.window"),
            "missing field `window` (algorithm sliding_window)",
        )),
    }
}

fn validate_window(at: &str, raw: &RawWindow) -> Result<WindowSpec, ConfigError> {
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

fn validate_shaping(
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

fn validate_bucket(at: &str, raw: &RawBucket) -> Result<BucketSpec, ConfigError> {
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

fn validate_max_keys(at: &str, raw: Option<i64>) -> Result<u32, ConfigError> {
    match raw {
        None => Ok(10_000),
        Some(n) if n <= 0 => Err(err(
            format!("{at}.max_keys"),
            format!("must be greater than 0, got {n}"),
        )),
        Some(n) if n > MAX_TABLE_SIZE as i64 => Err(err(
            format!("{at}.max_keys"),
            format!("must be at most {MAX_TABLE_SIZE}"),
        )),
        Some(n) => Ok(n as u32),
    }
}

/// `quota`: the burst of a bucket, or the limit of a window; no request
/// may cost more.
/// `global`: every batch a global rule fetches is at least `cost.max`, so
/// its default there is not the whole limit (which would fetch the whole
/// limit at once) but `cost.default`, and with a cost header it must be
/// given.
fn validate_cost(
    at: &str,
    raw: Option<RawCost>,
    quota: u64,
    global: bool,
) -> Result<CostSpec, ConfigError> {
    let Some(raw) = raw else {
        return Ok(CostSpec {
            default: 1,
            header: None,
            max: 1,
        });
    };
    let default = match raw.default {
        Some(d) => positive(format!("{at}.cost.default"), d)?,
        None => 1,
    };
    let max = match raw.max {
        Some(m) => positive(format!("{at}.cost.max"), m)?,
        None if global && raw.header.is_some() => {
            return Err(err(
                format!("{at}.cost.max"),
                "is required for a global rule whose cost comes from a header: every batch of \
                 tokens fetched is at least the dearest request, so give the dearest cost you \
                 expect (the default, the whole limit, would fetch it all at once)",
            ))
        }
        None if global => default.min(quota),
        None => quota,
    };
    if max > quota {
        return Err(err(
            format!("{at}.cost.max"),
            format!(
                "{max} is larger than the burst or window limit ({quota}): such a request could never pass"
            ),
        ));
    }
    if default > max {
        return Err(err(
            format!("{at}.cost.default"),
            format!("{default} is larger than cost.max ({max})"),
        ));
    }
    let header = match raw.header {
        Some(h) => Some(header_name(&format!("{at}.cost.header"), &h)?),
        None => None,
    };
    Ok(CostSpec {
        default,
        header,
        max,
    })
}
