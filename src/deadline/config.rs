//! The `deadlines` section: which headers carry a request's deadline, how
//! little may be left for a request to be worth starting, and whether a
//! wait in sluice is taken off the deadline sent upstream.

use crate::config::fields::{err, header_name, millis_or_zero, status, ConfigError};
use serde::Deserialize;

/// How a deadline header is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// gRPC's `grpc-timeout`: digits and a unit (`100m`, `2S`).
    GrpcTimeout,
    /// Milliseconds as a decimal integer.
    Millis,
}

/// The validated `deadlines` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadlineSpec {
    /// Headers to read, in order; the first present and valid wins.
    pub headers: Vec<(String, Format)>,
    pub min_remaining_ms: u64,
    pub propagate: bool,
    pub status: u32,
}

impl DeadlineSpec {
    /// What is left of deadline `d`, as read now from a request that
    /// waited `waited_ms` in earlier stages: with `propagate`, the header
    /// was already reduced by that wait when it went on; without, it was
    /// not, and the wait is taken off here.
    pub fn remaining_ms(&self, d: &super::Deadline, waited_ms: u64) -> u64 {
        if self.propagate {
            d.remaining_ms
        } else {
            d.remaining_ms.saturating_sub(waited_ms)
        }
    }

    /// How much longer a request may wait in sluice: until it has only
    /// `min_remaining` left, when it could no longer be served in time by
    /// the operator's own measure (and would have been refused had it
    /// arrived so).
    pub fn wait_ms(&self, d: &super::Deadline, waited_ms: u64) -> u64 {
        self.remaining_ms(d, waited_ms)
            .saturating_sub(self.min_remaining_ms)
    }

    /// The time a request still has at `now_ms`, when the wait it may
    /// spend here (`wait_ms`) runs out at `until_ms`: `min_remaining` then,
    /// more before, less after.
    pub fn left_at(&self, until_ms: u64, now_ms: u64) -> u64 {
        until_ms
            .saturating_add(self.min_remaining_ms)
            .saturating_sub(now_ms)
    }
}

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
    let min_remaining_ms = match raw.min_remaining {
        None => 0,
        Some(t) => millis_or_zero("deadlines.min_remaining", t)?,
    };
    Ok(DeadlineSpec {
        headers,
        min_remaining_ms,
        propagate: raw.propagate.unwrap_or(true),
        status: status("deadlines.status".into(), raw.status.unwrap_or(504))?,
    })
}
