//! A rule's `global` section: where its tokens come from (a rate-limit
//! service behind an Envoy cluster), and what happens when that service
//! is slow or down.

use crate::config::fields::{err, millis, ConfigError, Strict};
use crate::keys::KeyPart;
use serde::Deserialize;

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawGlobal {
    /// The Envoy cluster of the rate-limit service (HTTP/2).
    pub cluster: Option<String>,
    /// The protocol: `rls` (Envoy's RateLimitService, the only one).
    #[serde(default)]
    pub protocol: Option<String>,
    /// The RLS `domain` (default: the configuration's domain).
    #[serde(default)]
    pub domain: Option<String>,
    /// How many Envoys share the limit: the backstop is limit / instances.
    #[serde(default)]
    pub instances: Option<i64>,
    /// Or this Envoy's share of the limit for the backstop (0 to 1).
    #[serde(default)]
    pub share: Option<f64>,
    /// Descriptor entry keys, one per key part (default: Envoy's names).
    #[serde(default)]
    pub descriptor_keys: Option<Vec<String>>,
    /// How long a call may take (default 200ms).
    #[serde(default)]
    pub timeout: Option<String>,
    /// How far ahead of need tokens are fetched (default 1s of demand).
    #[serde(default)]
    pub lead: Option<String>,
    /// The most tokens asked for in one call (default 100000).
    #[serde(default)]
    pub max_batch: Option<i64>,
    /// When the service is down: refuse once the tokens held are spent,
    /// instead of the local backstop.
    #[serde(default)]
    pub failure_mode_deny: bool,
    /// How long a request of a key whose pool is being filled (a new key's
    /// first batch) waits for it before it is refused (default 0s: refused
    /// at once).
    #[serde(default)]
    pub wait_for_tokens: Option<String>,
    #[serde(default)]
    pub breaker: Option<Strict<RawServiceBreaker>>,
}

#[derive(Deserialize, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawServiceBreaker {
    /// Failed calls in a row (timeouts, gRPC errors) that open it (default 3).
    pub failures: Option<i64>,
    /// How long it stays open before one probe (default 5s; plus 0-20%).
    pub cooldown: Option<String>,
}

/// A validated `global` section.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalSpec {
    pub cluster: String,
    /// The RLS domain, if not the configuration's.
    pub domain: Option<String>,
    /// The backstop's fraction of the limit: 1 / instances, or the share.
    pub share: f64,
    pub descriptor_keys: Vec<String>,
    pub timeout_ms: u64,
    pub lead_ms: u64,
    pub max_batch: u32,
    pub failure_mode_deny: bool,
    pub failures: u32,
    pub cooldown_ms: u64,
    /// How long a request of a key being filled waits for its tokens (0:
    /// refused at once).
    pub wait_for_tokens_ms: u64,
}

impl Eq for GlobalSpec {}

/// Largest accepted `max_batch`.
pub const MAX_BATCH: i64 = 1_000_000;

/// Envoy's descriptor key for a key part (as its rate-limit actions name
/// them: `remote_address`, `generic_key`, ...; a header by its name).
pub fn default_descriptor_key(part: &KeyPart) -> String {
    match part {
        KeyPart::Header(name) => name.to_ascii_lowercase(),
        KeyPart::Path => "path".into(),
        KeyPart::Method => "method".into(),
        KeyPart::Authority => "authority".into(),
        KeyPart::ClientAddress => "remote_address".into(),
        KeyPart::Route => "route".into(),
        KeyPart::Cluster => "cluster".into(),
        KeyPart::Constant(_) => "generic_key".into(),
    }
}

/// Validates `at.global` for a rule keyed by `key`.
pub fn validate(at: &str, raw: RawGlobal, key: &[KeyPart]) -> Result<GlobalSpec, ConfigError> {
    let at = format!("{at}.global");
    let cluster = validate_cluster(&at, raw.cluster)?;
    if let Some(p) = raw.protocol.as_deref().filter(|p| *p != "rls") {
        return Err(err(
            format!("{at}.protocol"),
            format!("unknown protocol {p:?}: the only one is \"rls\" (envoy.service.ratelimit.v3)"),
        ));
    }
    if raw.domain.as_deref().is_some_and(str::is_empty) {
        return Err(err(format!("{at}.domain"), "must not be empty"));
    }
    let share = validate_share(&at, raw.instances, raw.share)?;
    let descriptor_keys = validate_descriptor_keys(&at, raw.descriptor_keys, key)?;
    let timeout_ms = millis(format!("{at}.timeout"), raw.timeout, "200ms")?;
    if timeout_ms > 60_000 {
        return Err(err(format!("{at}.timeout"), "must be at most 60s"));
    }
    let lead_ms = millis(format!("{at}.lead"), raw.lead, "1s")?;
    if !(100..=60_000).contains(&lead_ms) {
        return Err(err(format!("{at}.lead"), "must be between 100ms and 60s"));
    }
    let max_batch = int_in(format!("{at}.max_batch"), raw.max_batch, 100_000, MAX_BATCH)?;
    let breaker = raw.breaker.map(Strict::into_inner).unwrap_or_default();
    let failures = int_in(format!("{at}.breaker.failures"), breaker.failures, 3, 1_000)?;
    let cooldown_ms = millis(format!("{at}.breaker.cooldown"), breaker.cooldown, "5s")?;
    if !(100..=3_600_000).contains(&cooldown_ms) {
        return Err(err(
            format!("{at}.breaker.cooldown"),
            "must be between 100ms and 1h",
        ));
    }
    let wait_for_tokens_ms = match raw.wait_for_tokens {
        None => 0,
        Some(t) => crate::config::fields::millis_or_zero(&format!("{at}.wait_for_tokens"), t)?,
    };
    if wait_for_tokens_ms > 1_000 {
        return Err(err(
            format!("{at}.wait_for_tokens"),
            "must be at most 1s (a request waits for a key's first tokens, a round trip to the service)",
        ));
    }
    Ok(GlobalSpec {
        cluster,
        domain: raw.domain,
        share,
        descriptor_keys,
        timeout_ms,
        lead_ms,
        max_batch,
        failure_mode_deny: raw.failure_mode_deny,
        failures,
        cooldown_ms,
        wait_for_tokens_ms,
    })
}

fn validate_cluster(at: &str, cluster: Option<String>) -> Result<String, ConfigError> {
    match cluster {
        Some(c) if c.trim().is_empty() || c.len() > 512 || c.chars().any(char::is_control) => {
            Err(err(
                format!("{at}.cluster"),
                "must be an Envoy cluster name (1 to 512 characters, no control characters)",
            ))
        }
        Some(c) => Ok(c),
        None => Err(err(
            format!("{at}.cluster"),
            "missing: the Envoy cluster of the rate-limit service",
        )),
    }
}

/// The backstop's share of the limit: `1 / instances`, or `share`.
fn validate_share(
    at: &str,
    instances: Option<i64>,
    share: Option<f64>,
) -> Result<f64, ConfigError> {
    match (instances, share) {
        (Some(_), Some(_)) => Err(err(
            format!("{at}.share"),
            "give instances or share, not both",
        )),
        (Some(n), None) => Ok(1.0 / int_in(format!("{at}.instances"), Some(n), 1, 100_000)? as f64),
        (None, Some(s)) if s > 0.0 && s <= 1.0 => Ok(s),
        (None, Some(s)) => Err(err(
            format!("{at}.share"),
            format!("must be above 0 and at most 1, got {s}"),
        )),
        (None, None) => Err(err(
            format!("{at}.instances"),
            "missing: how many Envoys share the limit (or `share`), to size the backstop",
        )),
    }
}

fn validate_descriptor_keys(
    at: &str,
    raw: Option<Vec<String>>,
    key: &[KeyPart],
) -> Result<Vec<String>, ConfigError> {
    let keys = match raw {
        None => key.iter().map(default_descriptor_key).collect(),
        Some(keys) if keys.len() != key.len() => {
            return Err(err(
                format!("{at}.descriptor_keys"),
                format!(
                    "has {} names for {} key parts: give one per part",
                    keys.len(),
                    key.len()
                ),
            ))
        }
        Some(keys) => keys,
    };
    if let Some(i) = keys.iter().position(|k| k.is_empty() || k.len() > 128) {
        return Err(err(
            format!("{at}.descriptor_keys[{i}]"),
            "must be 1 to 128 characters",
        ));
    }
    if keys.is_empty() {
        return Err(err(
            at.to_string(),
            "a global rule needs a key (the descriptor sent to the service)",
        ));
    }
    Ok(keys)
}

/// An integer field between 1 and `max`; `default` if absent.
fn int_in(field: String, value: Option<i64>, default: u32, max: i64) -> Result<u32, ConfigError> {
    match value {
        None => Ok(default),
        Some(n) if (1..=max).contains(&n) => Ok(n as u32),
        Some(n) => Err(err(field, format!("must be between 1 and {max}, got {n}"))),
    }
}
