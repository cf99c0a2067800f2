//! The `deadlines` section: which headers carry a request's deadline, how
//! little may be left for a request to be worth starting, and whether a
//! wait in sluice is taken off the deadline sent upstream.

use crate::config::fields::{err, header_name, millis_or_zero, status, ConfigError};
pub use crate::pipeline::deadline::{DeadlineSpec, Format};
use crate::time::Duration;
use serde::Deserialize;

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawDeadlines {
    #[serde(default)]
    headers: Option<Vec<String>>,
    #[serde(default)]
    min_remaining: Option<String>,
    #[serde(default)]
    propagate: Option<bool>,
    #[serde(default)]
    status: Option<i64>,
}

/// Validates the `deadlines` section.
pub fn validate(raw: RawDeadlines) -> Result<DeadlineSpec, ConfigError> {
    let names = raw.headers.unwrap_or_else(|| {
        vec![
            "grpc-timeout".to_string(),
            "x-envoy-expected-rq-timeout-ms".to_string(),
        ]
    });
    if names.is_empty() {
        return Err(err("deadlines.headers", "must name at least one header"));
    }
    let mut headers = Vec::with_capacity(names.len());
    for (j, h) in names.iter().enumerate() {
        let name = header_name(&format!("deadlines.headers[{j}]"), h)?;
        let format = if name == "grpc-timeout" {
            Format::GrpcTimeout
        } else {
            Format::Millis
        };
        headers.push((name, format));
    }
    let min_remaining = match raw.min_remaining {
        None => Duration::ZERO,
        Some(t) => Duration::from_ms(millis_or_zero("deadlines.min_remaining", t)?),
    };
    Ok(DeadlineSpec {
        headers,
        min_remaining,
        propagate: raw.propagate.unwrap_or(true),
        status: status("deadlines.status".into(), raw.status.unwrap_or(504))?,
    })
}
