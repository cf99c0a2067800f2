//! The plugin configuration: JSON as written by the user (`raw` structs, with
//! unknown fields refused) and its validated form (`Config`), which the rest
//! of the core trusts without further checks.
//!
//! Every error names the field by its JSON path (`rate_limits[1].bucket.rate`)
//! and the problem, so the log line Envoy prints when it refuses the plugin is
//! enough to fix the configuration.

use crate::duration::{parse_duration, NS_PER_S};
use crate::keys::KeyPart;
use crate::matcher::{HeaderMatch, Match};
use serde::Deserialize;
use std::fmt;

/// Largest accepted `max_keys`: every slot is a shared-data entry created at
/// configuration time, so this bounds start-up work and Envoy memory.
pub const MAX_TABLE_SIZE: u32 = 1_000_000;
/// Longest accepted rule name (it appears in shared-data keys and metric names).
pub const MAX_NAME_LEN: usize = 64;

/// A configuration error: the JSON path of the offending field and the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid configuration: {}", self.problem)
        } else {
            write!(f, "invalid configuration: {}: {}", self.field, self.problem)
        }
    }
}

/// Refuses item `i` of `list` (`rate_limits`, `circuit_breakers`,
/// `shedders`) if its state id (the 32-bit hash of its definition that
/// prefixes its shared-data keys) is already taken by an earlier item
/// `(id, name)`: the two would share state. About one chance in four
/// billion per pair; renaming either one changes its id.
pub(crate) fn check_state_id<'a>(
    list: &str,
    i: usize,
    id: &str,
    earlier: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), ConfigError> {
    match earlier.into_iter().find(|(other, _)| *other == id) {
        Some((_, name)) => Err(err(
            format!("{list}[{i}].name"),
            format!("its state id collides with `{name}`'s; rename one of them"),
        )),
        None => Ok(()),
    }
}

pub(crate) fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

pub(crate) mod raw {
    use super::*;

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub struct Config {
        #[serde(default)]
        pub domain: Option<String>,
        #[serde(default)]
        pub rate_limits: Vec<Rule>,
        #[serde(default)]
        pub response: Response,
        #[serde(default)]
        pub failure_mode_deny: bool,
        #[serde(default)]
        pub max_cas_retries: Option<u32>,
        #[serde(default)]
        pub circuit_breakers: Vec<crate::breaker::config::RawBreaker>,
        #[serde(default)]
        pub shedders: Vec<crate::shed::config::RawShedder>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Rule {
        pub name: String,
        #[serde(default, rename = "match")]
        pub matcher: Option<RawMatch>,
        #[serde(default)]
        pub key: Vec<KeyPart>,
        #[serde(default)]
        pub on_missing_key: MissingKey,
        pub bucket: Bucket,
        #[serde(default)]
        pub cost: Option<Cost>,
        #[serde(default)]
        pub shadow: bool,
        #[serde(default)]
        pub max_keys: Option<i64>,
    }

    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    pub struct RawMatch {
        pub path_prefix: Option<String>,
        pub path: Option<String>,
        #[serde(default)]
        pub methods: Vec<String>,
        #[serde(default)]
        pub headers: Vec<RawHeaderMatch>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct RawHeaderMatch {
        pub name: String,
        pub exact: Option<String>,
        pub present: Option<bool>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Bucket {
        pub rate: i64,
        pub period: String,
        pub burst: Option<i64>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Cost {
        pub default: Option<i64>,
        pub header: Option<String>,
        pub max: Option<i64>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Response {
        #[serde(default = "default_status")]
        pub status: i64,
        #[serde(default = "default_jitter")]
        pub retry_after_jitter: String,
        #[serde(default)]
        pub ratelimit_headers: HeaderStyle,
        #[serde(default)]
        pub headers_on_allowed: bool,
        #[serde(default)]
        pub reason_header: Option<String>,
    }

    impl Default for Response {
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
}

/// What a rule does when a key part is missing from the request.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    /// The rule does not apply to the request (as Envoy's descriptors do).
    #[default]
    Skip,
    /// All requests missing that part share one bucket, distinct from any value.
    Shared,
}

/// Which rate-limit headers to send.
#[derive(Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
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
    pub breakers: Vec<crate::breaker::BreakerSpec>,
    pub shedders: Vec<crate::shed::ShedderSpec>,
}

/// Parses and validates the plugin configuration. An empty input means "no
/// rules": the filter then passes every request untouched.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    let raw: raw::Config = if first.is_none() {
        raw::Config::default()
    } else if first != Some(&b'{') {
        return Err(err("", "the configuration must be a JSON object"));
    } else {
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        serde_path_to_error::deserialize(de).map_err(|e| {
            // serde_path_to_error writes `?` for a position it could not name.
            let path = e.path().to_string();
            let path = path.trim_end_matches('?').trim_end_matches('.');
            let field = if path == "." {
                String::new()
            } else {
                path.to_string()
            };
            err(field, e.into_inner().to_string())
        })?
    };
    validate(raw)
}

fn validate(raw: raw::Config) -> Result<Config, ConfigError> {
    let domain = raw.domain.unwrap_or_else(|| "default".to_string());
    check_name("domain", &domain)?;
    let mut rules = Vec::with_capacity(raw.rate_limits.len());
    for (i, rule) in raw.rate_limits.into_iter().enumerate() {
        let at = format!("rate_limits[{i}]");
        let rule = validate_rule(&at, rule)?;
        if rules.iter().any(|r: &RuleSpec| r.name == rule.name) {
            return Err(err(
                format!("{at}.name"),
                format!("duplicate rule name `{}`", rule.name),
            ));
        }
        rules.push(rule);
    }
    let max_cas_retries = raw.max_cas_retries.unwrap_or(16);
    if max_cas_retries == 0 || max_cas_retries > 1000 {
        return Err(err("max_cas_retries", "must be between 1 and 1000"));
    }
    let mut breakers = Vec::with_capacity(raw.circuit_breakers.len());
    for (i, b) in raw.circuit_breakers.into_iter().enumerate() {
        let at = format!("circuit_breakers[{i}]");
        let b = crate::breaker::config::validate(&at, b)?;
        if breakers
            .iter()
            .any(|x: &crate::breaker::BreakerSpec| x.name == b.name)
        {
            return Err(err(
                format!("{at}.name"),
                format!("duplicate breaker name `{}`", b.name),
            ));
        }
        breakers.push(b);
    }
    let mut shedders = Vec::with_capacity(raw.shedders.len());
    for (i, sh) in raw.shedders.into_iter().enumerate() {
        let at = format!("shedders[{i}]");
        let sh = crate::shed::config::validate(&at, sh)?;
        if shedders
            .iter()
            .any(|x: &crate::shed::ShedderSpec| x.name == sh.name)
        {
            return Err(err(
                format!("{at}.name"),
                format!("duplicate shedder name `{}`", sh.name),
            ));
        }
        shedders.push(sh);
    }
    Ok(Config {
        breakers,
        shedders,
        domain,
        rules,
        response: validate_response(raw.response)?,
        failure_mode_deny: raw.failure_mode_deny,
        max_cas_retries,
    })
}

pub(crate) fn check_name(field: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(err(field, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(err(
            field,
            format!("must be at most {MAX_NAME_LEN} characters"),
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(err(
            field,
            format!("`{name}` may only contain letters, digits, `_` and `-`"),
        ));
    }
    Ok(())
}

/// A duration field in whole milliseconds (at least 1 ms), `default` if absent.
pub(crate) fn millis(
    field: String,
    text: Option<String>,
    default: &str,
) -> Result<u64, ConfigError> {
    let ns =
        parse_duration(text.as_deref().unwrap_or(default)).map_err(|p| err(field.clone(), p))?;
    if ns < crate::duration::NS_PER_MS {
        return Err(err(field, "must be at least 1ms"));
    }
    Ok(ns / crate::duration::NS_PER_MS)
}

pub(crate) fn positive(field: String, value: i64) -> Result<u64, ConfigError> {
    if value <= 0 {
        return Err(err(field, format!("must be greater than 0, got {value}")));
    }
    Ok(value as u64)
}

fn validate_rule(at: &str, raw: raw::Rule) -> Result<RuleSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let rate = positive(format!("{at}.bucket.rate"), raw.bucket.rate)?;
    let period_ns =
        parse_duration(&raw.bucket.period).map_err(|p| err(format!("{at}.bucket.period"), p))?;
    if period_ns == 0 {
        return Err(err(format!("{at}.bucket.period"), "must be longer than 0"));
    }
    if rate > u32::MAX as u64 {
        return Err(err(
            format!("{at}.bucket.rate"),
            format!("must be at most {} per period", u32::MAX),
        ));
    }
    if rate > period_ns {
        return Err(err(
            format!("{at}.bucket.rate"),
            "more than one token per nanosecond is not supported",
        ));
    }
    let burst = match raw.bucket.burst {
        Some(b) => positive(format!("{at}.bucket.burst"), b)?,
        None => rate,
    };
    // The bucket's full-refill time (burst * period / rate) must fit in u64 ns.
    if (burst as u128) * (period_ns as u128) / (rate as u128) > (u64::MAX / 4) as u128 {
        return Err(err(
            format!("{at}.bucket"),
            "burst takes too long to refill",
        ));
    }
    let cost = validate_cost(at, raw.cost, burst)?;
    let max_keys = match raw.max_keys {
        None => 10_000,
        Some(n) if n <= 0 => {
            return Err(err(
                format!("{at}.max_keys"),
                format!("must be greater than 0, got {n}"),
            ))
        }
        Some(n) if n > MAX_TABLE_SIZE as i64 => {
            return Err(err(
                format!("{at}.max_keys"),
                format!("must be at most {MAX_TABLE_SIZE}"),
            ))
        }
        Some(n) => n as u32,
    };
    for (j, part) in raw.key.iter().enumerate() {
        part.validate()
            .map_err(|p| err(format!("{at}.key[{j}]"), p))?;
    }
    Ok(RuleSpec {
        name: raw.name,
        matcher: validate_match(at, raw.matcher.unwrap_or_default())?,
        key: raw.key.into_iter().map(KeyPart::normalised).collect(),
        on_missing_key: raw.on_missing_key,
        bucket: BucketSpec {
            rate,
            period_ns,
            burst,
        },
        cost,
        shadow: raw.shadow,
        max_keys,
    })
}

fn validate_cost(at: &str, raw: Option<raw::Cost>, burst: u64) -> Result<CostSpec, ConfigError> {
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

/// Validates and lower-cases a header name.
pub(crate) fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    if name.is_empty() || name.len() > 256 {
        return Err(err(field, "header name must be 1 to 256 characters"));
    }
    let ok = name.bytes().enumerate().all(|(i, b)| {
        b.is_ascii_alphanumeric() || b"-_.!#$%&'*+^`|~".contains(&b) || (i == 0 && b == b':')
    });
    if !ok {
        return Err(err(field, format!("`{name}` is not a valid header name")));
    }
    Ok(name.to_ascii_lowercase())
}

pub(crate) fn validate_match(at: &str, raw: raw::RawMatch) -> Result<Match, ConfigError> {
    if raw.path_prefix.is_some() && raw.path.is_some() {
        return Err(err(
            format!("{at}.match"),
            "give either `path` or `path_prefix`, not both",
        ));
    }
    for (field, value) in [("path_prefix", &raw.path_prefix), ("path", &raw.path)] {
        if let Some(p) = value {
            if !p.starts_with('/') {
                return Err(err(
                    format!("{at}.match.{field}"),
                    format!("`{p}` must start with `/`"),
                ));
            }
        }
    }
    let mut methods = Vec::with_capacity(raw.methods.len());
    for (j, m) in raw.methods.iter().enumerate() {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(err(
                format!("{at}.match.methods[{j}]"),
                format!("`{m}` is not an HTTP method"),
            ));
        }
        methods.push(m.to_ascii_uppercase());
    }
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (j, h) in raw.headers.into_iter().enumerate() {
        let field = format!("{at}.match.headers[{j}]");
        let name = header_name(&format!("{field}.name"), &h.name)?;
        let m = match (h.exact, h.present) {
            (Some(_), Some(_)) => {
                return Err(err(field, "give either `exact` or `present`, not both"))
            }
            (Some(value), None) => HeaderMatch::Exact(name, value.into_bytes()),
            (None, Some(present)) => HeaderMatch::Present(name, present),
            (None, None) => HeaderMatch::Present(name, true),
        };
        headers.push(m);
    }
    Ok(Match {
        path_prefix: raw.path_prefix,
        path: raw.path,
        methods,
        headers,
    })
}

fn validate_response(raw: raw::Response) -> Result<ResponseSpec, ConfigError> {
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
        Some(h) => Some(header_name("response.reason_header", &h)?),
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
