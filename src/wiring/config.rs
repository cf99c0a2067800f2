//! The plugin configuration as a whole: the top-level JSON (unknown fields
//! refused) and the assembly of every mechanism's validated items (each
//! mechanism validates its own in its `config.rs`, with the shared
//! validators of [`crate::config::fields`]).

use crate::breaker::config::{self as breaker_config, BreakerSpec, RawBreaker};
use crate::bulkhead::config::{self as bulkhead_config, LimitSpec, RawLimit};
use crate::config::{
    cas_retries, check_name, err, validate_response, Common, ConfigError, RawResponse, Strict,
};
use crate::deadline::config::{self as deadline_config, DeadlineSpec, RawDeadlines};
use crate::ratelimit::config::{self as rule_config, RawRule, RuleSpec};
use crate::retry::config::{self as retry_config, BudgetSpec, RawBudget};
use crate::shed::config::{self as shed_config, RawShedder, ShedderSpec};
use serde::Deserialize;

/// The sluice plugin configuration: Envoy's `configuration` of the
/// `envoy.filters.http.wasm` filter, or Istio's `pluginConfig`.
#[derive(Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
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

/// The validated plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// What every mechanism shares (domain, response, failure policy...).
    pub common: Common,
    pub rules: Vec<RuleSpec>,
    pub breakers: Vec<BreakerSpec>,
    pub shedders: Vec<ShedderSpec>,
    pub retry_budgets: Vec<BudgetSpec>,
    pub deadlines: Option<DeadlineSpec>,
    pub concurrency_limits: Vec<LimitSpec>,
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
    config.common.version = version_of(bytes);
    Ok(config)
}

/// serde_json's "expected value" where a value does start: a field that
/// takes a name or a one-field object (a key part, `on_limit`...) was
/// given an array, a number or a literal, or an object of no field (the
/// error at its `}`) or of more than one (at the end of the first one's
/// value).
/// (A true syntax error, where no value starts, keeps serde_json's
/// message and position.)
fn wrong_type(bytes: &[u8], e: &serde_json::Error) -> bool {
    if !e.is_syntax() || !e.to_string().starts_with("expected value") {
        return false;
    }
    let Some(line) = bytes.split(|&b| b == b'\n').nth(e.line().saturating_sub(1)) else {
        return false;
    };
    let col = e.column().saturating_sub(1);
    let before = line
        .get(..col)
        .and_then(|l| l.iter().rev().find(|b| !b.is_ascii_whitespace()));
    let after = line
        .get(col + 1..)
        .and_then(|l| l.iter().find(|b| !b.is_ascii_whitespace()));
    match (line.get(col), before, after) {
        // `{}`, or the end of the first field's value with a second to come.
        (Some(b'}'), Some(b'{'), _) | (Some(b'"'), _, Some(b',')) => true,
        (Some(b), _, _) => b"[-0123456789tfn".contains(b),
        (None, _, _) => false,
    }
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
        common: Common {
            domain,
            response: validate_response(raw.response.into_inner())?,
            failure_mode_deny: raw.failure_mode_deny,
            max_cas_retries,
            version: 0,
        },
        concurrency_limits,
        deadlines,
        retry_budgets,
        breakers,
        shedders,
        rules,
    })
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
