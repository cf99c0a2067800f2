//! A retry budget's settings: the JSON under `retry_budgets[i]` and its
//! validated form.

use crate::config::fields::{
    check_name, err, header_name, millis, permille, status, validate_match, ConfigError, RawMatch,
    Strict,
};
use crate::matcher::Match;
use serde::Deserialize;

/// How a request is told to be a retry: the header's value, a decimal
/// integer, is above `above`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySign {
    pub header: String,
    pub above: u64,
}

/// A validated retry budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetSpec {
    pub name: String,
    pub matcher: Match,
    /// Retries allowed per first try, in permille.
    pub ratio_permille: u32,
    /// Retries allowed per second whatever the traffic (a quiet service can
    /// still retry).
    pub min_per_second: u32,
    pub window_ms: u64,
    pub retry_signs: Vec<RetrySign>,
    pub status: u32,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    name: String,
    #[serde(default, rename = "match")]
    matcher: Option<Strict<RawMatch>>,
    #[serde(default)]
    ratio: Option<f64>,
    #[serde(default)]
    min_per_second: Option<i64>,
    #[serde(default)]
    window: Option<String>,
    #[serde(default)]
    retry_when: Option<Vec<Strict<RawSign>>>,
    #[serde(default)]
    status: Option<i64>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawSign {
    header: String,
    above: i64,
}

/// What clients and proxies send on a retry: Envoy's router sets
/// `x-envoy-attempt-count` (1 on a first try) when asked to, and gRPC
/// clients send `grpc-previous-rpc-attempts` on a retry or hedge.
fn default_signs() -> Vec<RetrySign> {
    vec![
        RetrySign {
            header: "x-envoy-attempt-count".into(),
            above: 1,
        },
        RetrySign {
            header: "grpc-previous-rpc-attempts".into(),
            above: 0,
        },
    ]
}

/// Validates one retry budget.
pub fn validate(at: &str, raw: RawBudget) -> Result<BudgetSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let ratio = raw.ratio.unwrap_or(0.1);
    if !(0.0..=10.0).contains(&ratio) || ratio.is_nan() {
        return Err(err(
            format!("{at}.ratio"),
            format!("must be between 0 and 10 (retries per first try), got {ratio}"),
        ));
    }
    let ratio_permille = permille(format!("{at}.ratio"), ratio)?;
    let min = raw.min_per_second.unwrap_or(10);
    if !(0..=1_000_000).contains(&min) {
        return Err(err(
            format!("{at}.min_per_second"),
            format!("must be between 0 and 1000000, got {min}"),
        ));
    }
    let window_ms = millis(format!("{at}.window"), raw.window, "10s")?;
    if !(1_000..=3_600_000).contains(&window_ms) {
        return Err(err(format!("{at}.window"), "must be between 1s and 1h"));
    }
    let retry_signs = match raw.retry_when {
        None => default_signs(),
        Some(signs) if signs.is_empty() => {
            return Err(err(
                format!("{at}.retry_when"),
                "must name at least one header",
            ))
        }
        Some(signs) => signs
            .into_iter()
            .map(Strict::into_inner)
            .enumerate()
            .map(|(j, s)| sign(&format!("{at}.retry_when[{j}]"), s))
            .collect::<Result<_, _>>()?,
    };
    Ok(BudgetSpec {
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        ratio_permille,
        min_per_second: min as u32,
        window_ms,
        retry_signs,
        status: status(format!("{at}.status"), raw.status.unwrap_or(429))?,
        name: raw.name,
    })
}

fn sign(at: &str, raw: RawSign) -> Result<RetrySign, ConfigError> {
    if raw.above < 0 {
        return Err(err(
            format!("{at}.above"),
            format!("must be 0 or more, got {}", raw.above),
        ));
    }
    Ok(RetrySign {
        header: header_name(&format!("{at}.header"), &raw.header)?,
        above: raw.above as u64,
    })
}
