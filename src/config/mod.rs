//! The plugin configuration as a whole: the top-level JSON (unknown fields
//! refused), the shared `response` settings, and the assembly of every
//! mechanism's validated items (each mechanism validates its own in its
//! `config.rs`, with the shared validators of [`fields`]).

pub mod check;
pub mod fields;
#[cfg(test)]
mod tests;

use crate::breaker::config::{self as breaker_config, BreakerSpec, RawBreaker};
use crate::bulkhead::config::{self as bulkhead_config, LimitSpec, RawLimit};
use crate::deadline::config::{self as deadline_config, DeadlineSpec, RawDeadlines};
use crate::duration::{parse_duration, NS_PER_S};
use crate::ratelimit::config::{self as rule_config, RawRule, RuleSpec};
use crate::retry::config::{self as retry_config, BudgetSpec, RawBudget};
use crate::shed::config::{self as shed_config, RawShedder, ShedderSpec};
use fields::Strict;
pub use fields::{check_name, err, ConfigError};
use serde::Deserialize;

/// The sluice plugin configuration: Envoy's `configuration` of the
/// `envoy.filters.http.wasm` filter, or Istio's `pluginConfig`.
#[derive(Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    domain: Option<String>,
    #[serde(default)]
    rate_limits: Vec<Strict<RawRule>>,
    #[serde(default)]
    response: Strict<RawResponse>,
    #[serde(default)]
    failure_mode_deny: bool,
    #[serde(default)]
    max_cas_retries: Option<u32>,
    #[serde(default)]
    circuit_breakers: Vec<Strict<RawBreaker>>,
    #[serde(default)]
    shedders: Vec<Strict<RawShedder>>,
    #[serde(default)]
    retry_budgets: Vec<Strict<RawBudget>>,
    #[serde(default)]
    deadlines: Option<Strict<RawDeadlines>>,
    #[serde(default)]
    concurrency_limits: Vec<Strict<RawLimit>>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawResponse {
    #[serde(default = "default_status")]
    status: i64,
    #[serde(default = "default_jitter")]
    retry_after_jitter: String,
    #[serde(default)]
    ratelimit_headers: HeaderStyle,
    #[serde(default)]
    headers_on_allowed: bool,
    #[serde(default)]
    reason_header: Option<String>,
}

impl Default for RawResponse {
    fn default() -> Self {
        Self {
            status: default_status(),
            retry_after_jitter: default_jitter(),
            ratelimit_headers: HeaderStyle::default(),
            headers_on_allowed: false,
            reason_header: None,
        }
    }
}

fn default_status() -> i64 {
    429
}
fn default_jitter() -> String {
    "1s".to_string()
}

/// Which rate-limit headers to send.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum HeaderStyle {
    /// IETF draft `RateLimit-Policy` and `RateLimit` structured fields.
    Draft,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    Legacy,
    /// Both of the above.
    #[default]
    Both,
    /// None.
    None,
}

/// Validated response settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseSpec {
    pub status: u32,
    pub retry_after_jitter_ns: u64,
    pub ratelimit_headers: HeaderStyle,
    pub headers_on_allowed: bool,
    /// If set, every sluice refusal names its mechanism and rule in this header.
    pub reason_header: Option<String>,
}

/// The validated plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub domain: String,
    pub rules: Vec<RuleSpec>,
    pub response: ResponseSpec,
    pub failure_mode_deny: bool,
    pub max_cas_retries: u32,
    pub breakers: Vec<BreakerSpec>,
    pub shedders: Vec<ShedderSpec>,
    pub retry_budgets: Vec<BudgetSpec>,
    pub deadlines: Option<DeadlineSpec>,
    pub concurrency_limits: Vec<LimitSpec>,
    /// A fingerprint of the configuration's text: every VM given one
    /// configuration has the same, and a replacement (ECDS) has another,
    /// so that the state of a configuration still alive only for its last
    /// requests can tell it was replaced (see global limits' lease).
    pub version: u64,
}

/// Parses and validates the plugin configuration. An empty input means "no
/// rules": the filter then passes every request untouched.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    let raw: RawConfig = if first.is_none() {
        RawConfig::default()
    } else if first != Some(&b'{') {
        return Err(err("", "the configuration must be a JSON object"));
    } else {
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        // Through `Strict`, so the configuration's own reader is a function
        // of its own too (see `Strict`).
        let raw = serde_path_to_error::deserialize(&mut *de)
            .map(Strict::into_inner)
            .map_err(|e| {
                // serde_path_to_error writes `?` for a position it could not name.
                let path = e.path().to_string();
                let path = path.trim_end_matches('?').trim_end_matches('.');
                let field = if path == "." {
                    String::new()
                } else {
                    path.to_string()
                };
                let inner = e.into_inner();
                let problem = if wrong_type(bytes, &inner) {
                    "has the wrong JSON type: expected a name (a string) or, where the name \
                     takes a value, an object of one field (a key part {\"header\": \"x-tenant\"})"
                        .to_string()
                } else {
                    inner.to_string()
                };
                err(field, problem)
            })?;
        // Nothing may follow the object: not a second object, not text.
        de.end().map_err(|e| {
            err(
                "",
                format!("unexpected data after the configuration object ({e})"),
            )
        })?;
        raw
    };
    let mut config = validate(raw)?;
    config.version = version_of(bytes);
    Ok(config)
}

/// serde_json's "expected value" where a value does start: a field that
/// takes a name or a one-field object (a key part, `on_limit`...) was
/// given an array, a number or a literal. (A true syntax error, where no
/// value starts, keeps serde_json's message and position.)
fn wrong_type(bytes: &[u8], e: &serde_json::Error) -> bool {
    if !e.is_syntax() || !e.to_string().starts_with("expected value") {
        return false;
    }
    let line = bytes.split(|&b| b == b'\n').nth(e.line().saturating_sub(1));
    let at = line.and_then(|l| l.get(e.column().saturating_sub(1)));
    at.is_some_and(|b| b"[-0123456789tfn".contains(b))
}

fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
    let domain = raw.domain.unwrap_or_else(|| "default".to_string());
    check_name("domain", &domain)?;
    let max_cas_retries = cas_retries(raw.max_cas_retries)?;
    let rules = items(
        "rate_limits",
        "rule",
        raw.rate_limits,
        rule_config::validate,
        |r| &r.name,
    )?;
    rule_config::check_waits(&rules)?;
    let breakers = items(
        "circuit_breakers",
        "breaker",
        raw.circuit_breakers,
        breaker_config::validate,
        |b| &b.name,
    )?;
    let shedders = items(
        "shedders",
        "shedder",
        raw.shedders,
        shed_config::validate,
        |s| &s.name,
    )?;
    let retry_budgets = items(
        "retry_budgets",
        "retry budget",
        raw.retry_budgets,
        retry_config::validate,
        |b| &b.name,
    )?;
    let concurrency_limits = items(
        "concurrency_limits",
        "concurrency limit",
        raw.concurrency_limits,
        bulkhead_config::validate,
        |l| &l.name,
    )?;
    let deadlines = raw
        .deadlines
        .map(|d| deadline_config::validate(d.into_inner()))
        .transpose()?;
    Ok(Config {
        concurrency_limits,
        deadlines,
        retry_budgets,
        breakers,
        shedders,
        domain,
        rules,
        response: validate_response(raw.response.into_inner())?,
        failure_mode_deny: raw.failure_mode_deny,
        max_cas_retries,
        version: 0,
    })
}

fn cas_retries(raw: Option<u32>) -> Result<u32, ConfigError> {
    match raw.unwrap_or(16) {
        n @ 1..=1000 => Ok(n),
        _ => Err(err("max_cas_retries", "must be between 1 and 1000")),
    }
}

/// The configuration's version: a hash of its text.
fn version_of(bytes: &[u8]) -> u64 {
    let mut h = crate::hash::Keyed::new((0x736c_7569_6365, 0x0076_6572_7369_6f6e));
    h.field(bytes);
    h.finish()
}

/// Validates the items of list `list` in order, refusing a name given twice.
fn items<R, T>(
    list: &str,
    what: &str,
    raw: Vec<Strict<R>>,
    validate: fn(&str, R) -> Result<T, ConfigError>,
    name: fn(&T) -> &String,
) -> Result<Vec<T>, ConfigError> {
    let mut out: Vec<T> = Vec::with_capacity(raw.len());
    for (i, r) in raw.into_iter().enumerate() {
        let at = format!("{list}[{i}]");
        let item = validate(&at, r.into_inner())?;
        if out.iter().any(|x| name(x) == name(&item)) {
            return Err(err(
                format!("{at}.name"),
                format!("duplicate {what} name `{}`", name(&item)),
            ));
        }
        out.push(item);
    }
    Ok(out)
}

fn validate_response(raw: RawResponse) -> Result<ResponseSpec, ConfigError> {
    if !(400..=599).contains(&raw.status) {
        return Err(err(
            "response.status",
            format!("must be between 400 and 599, got {}", raw.status),
        ));
    }
    let jitter = parse_duration(&raw.retry_after_jitter)
        .map_err(|p| err("response.retry_after_jitter", p))?;
    if jitter > 3_600 * NS_PER_S {
        return Err(err("response.retry_after_jitter", "must be at most 1h"));
    }
    let reason_header = match raw.reason_header {
        Some(h) => Some(fields::response_header_name("response.reason_header", &h)?),
        None => None,
    };
    Ok(ResponseSpec {
        reason_header,
        status: raw.status as u32,
        retry_after_jitter_ns: jitter,
        ratelimit_headers: raw.ratelimit_headers,
        headers_on_allowed: raw.headers_on_allowed,
    })
}
