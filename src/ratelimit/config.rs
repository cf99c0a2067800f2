//! A rate-limit rule's settings: the JSON under `rate_limits[i]` and its
//! validated form, which the limiter trusts without further checks.

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
    pub bucket: Strict<RawBucket>,
    #[serde(default)]
    pub cost: Option<Strict<RawCost>>,
    #[serde(default)]
    pub shadow: bool,
    #[serde(default)]
    pub max_keys: Option<i64>,
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

/// A validated token bucket: `rate` tokens per `period_ns`, holding `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSpec {
    pub rate: u64,
    pub period_ns: u64,
    pub burst: u64,
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
    pub bucket: BucketSpec,
    pub cost: CostSpec,
    pub shadow: bool,
    pub max_keys: u32,
}

/// Validates rule `at` (`rate_limits[i]`).
pub fn validate(at: &str, raw: RawRule) -> Result<RuleSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let bucket = validate_bucket(at, &raw.bucket)?;
    let cost = validate_cost(at, raw.cost.map(Strict::into_inner), bucket.burst)?;
    let max_keys = validate_max_keys(at, raw.max_keys)?;
    for (j, part) in raw.key.iter().enumerate() {
        part.validate()
            .map_err(|p| err(format!("{at}.key[{j}]"), p))?;
    }
    Ok(RuleSpec {
        name: raw.name,
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        key: raw.key.into_iter().map(KeyPart::normalised).collect(),
        on_missing_key: raw.on_missing_key,
        bucket,
        cost,
        shadow: raw.shadow,
        max_keys,
    })
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

fn validate_cost(at: &str, raw: Option<RawCost>, burst: u64) -> Result<CostSpec, ConfigError> {
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
        None => burst,
    };
    if max > burst {
        return Err(err(
            format!("{at}.cost.max"),
            format!("{max} is larger than the burst ({burst}): such a request could never pass"),
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
