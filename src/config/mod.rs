//! What every mechanism shares from the configuration: the [`Common`]
//! settings (domain, failure policy, compare-and-swap retries, the
//! `response` section, the configuration's version) and, in [`fields`],
//! the validators every mechanism's own `config.rs` uses. A mechanism is
//! built from its own section plus [`Common`]; the whole configuration is
//! assembled in `src/wiring/`.

pub mod fields;

use crate::duration::{parse_duration, NS_PER_S};
pub use fields::{check_name, err, ConfigError, Strict};
use serde::Deserialize;

/// The settings every mechanism may use besides its own section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Common {
    /// `domain`: names every mechanism's state and labels its metrics.
    pub domain: String,
    pub response: ResponseSpec,
    pub failure_mode_deny: bool,
    pub max_cas_retries: u32,
    /// A fingerprint of the configuration's text: every VM given one
    /// configuration has the same, and a replacement (ECDS) has another,
    /// so that the state of a configuration still alive only for its last
    /// requests can tell it was replaced (see global limits' lease).
    pub version: u64,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawResponse {
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

/// `max_cas_retries`, validated (default 16).
pub fn cas_retries(raw: Option<u32>) -> Result<u32, ConfigError> {
    match raw.unwrap_or(16) {
        n @ 1..=1000 => Ok(n),
        _ => Err(err("max_cas_retries", "must be between 1 and 1000")),
    }
}

/// The `response` section, validated.
pub fn validate_response(raw: RawResponse) -> Result<ResponseSpec, ConfigError> {
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
