//! A rate-limit rule's settings: the JSON under `rate_limits[i]` and its
//! validated form, which the limiter trusts without further checks.
//!
//! Where each part lives: this file holds the rule's JSON and its
//! validation (with its cost, its key table and its `global` section);
//! `algorithm.rs` the sections of the two algorithms, `bucket` and
//! `window`; `shaping.rs` the settings of `on_limit: delay`.

mod algorithm;
mod shaping;

use super::algorithm::Algorithm;
pub use super::bucket::BucketSpec;
use super::global::config::{self as global_config, GlobalSpec, RawGlobal};
use super::global::pool::PoolSpec;
use super::window::WindowSpec;
use crate::config::fields::{
    check_name, err, header_name, positive, validate_match, ConfigError, RawMatch, Strict,
};
use crate::keys::{KeyPart, MissingKey};
use crate::matcher::Match;
use algorithm::{validate_bucket, validate_window};
pub use algorithm::{AlgorithmName, RawBucket, RawWindow, MAX_REFILL_NS, MAX_WINDOW_NS};
use serde::Deserialize;
use shaping::validate_shaping;
pub use shaping::{OnLimit, Shaping, MAX_DELAYED, MAX_DELAY_NS};

/// Largest accepted `max_keys`: every slot is a shared-data entry created at
/// configuration time, so this bounds start-up work and Envoy memory.
pub const MAX_TABLE_SIZE: u32 = 1_000_000;

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
