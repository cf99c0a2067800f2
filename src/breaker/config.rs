//! Breaker settings: the JSON under `circuit_breakers[i]` and its validated
//! form. Errors name the field by its JSON path, like the rate limits'.

use crate::config::fields::{
    check_name, err, header_name, millis, permille, positive, status, validate_match, ConfigError,
    RawMatch, Strict,
};
use crate::matcher::Match;
use serde::Deserialize;

/// How the upstream answered a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    Success,
    Failure,
    /// No verdict on the upstream (refused by another mechanism, client gone).
    Ignored,
}

/// What identifies the protected dependency.
#[derive(Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum BreakerKey {
    /// The upstream cluster Envoy routed to (`xds.cluster_name`).
    #[default]
    Cluster,
    /// The route name (`xds.route_name`).
    Route,
    /// A request header's value.
    Header(String),
}

/// Which responses count as failures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureSpec {
    /// Status classes (`5` for 5xx) counted as failures.
    pub classes: Vec<u32>,
    /// Individual statuses counted as failures (e.g. 429).
    pub codes: Vec<u32>,
    /// Envoy-side failures: connection failure, reset, upstream timeout.
    pub local_failures: bool,
    /// A call slower than this (ms) is a failure, counted as soon as it
    /// has taken that long (a hanging dependency trips the breaker before
    /// its timeouts do).
    pub slow_ms: Option<u64>,
    /// Bit `c`: `grpc-status: c` in the headers of an upstream's 200 (a
    /// gRPC error without a message, trailers-only) is a failure.
    pub grpc_statuses: u32,
}

/// The gRPC statuses that count as failures unless `failure.grpc_statuses`
/// says otherwise: as Envoy's `admission_control`, those fewer requests
/// may help (DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL,
/// UNAVAILABLE, DATA_LOSS).
pub const GRPC_FAILURES: [u32; 6] = [4, 8, 10, 13, 14, 15];

/// The gRPC status header of a trailers-only response.
pub const GRPC_STATUS: &str = "grpc-status";

impl FailureSpec {
    /// Whether an upstream status counts as a failure.
    pub fn is_failure_status(&self, status: u32) -> bool {
        self.classes.contains(&(status / 100)) || self.codes.contains(&status)
    }

    /// Whether a `grpc-status` value (as sent: decimal) is one counted as
    /// a failure.
    pub fn is_failure_grpc(&self, value: &[u8]) -> bool {
        let code = crate::request::first_value(value)
            .and_then(|t| t.parse::<u32>().ok())
            .filter(|&c| c < 32);
        code.is_some_and(|c| self.grpc_statuses & (1 << c) != 0)
    }

    /// Classifies a response from its status and Envoy's response code
    /// details: `via_upstream` is the upstream's own answer (judged by
    /// status); `upstream_*` details (connection failure, reset, upstream
    /// timeout) and `no_healthy_upstream` are Envoy-side upstream failures;
    /// any other detail, or none on an error status, is a local reply by a
    /// filter (an authz denial, or sluice itself, whose replies carry no
    /// details) and says nothing about the upstream.
    /// `grpc` is the response's `grpc-status`, if read (a 200's).
    pub fn classify(
        &self,
        status: Option<u32>,
        details: Option<&[u8]>,
        grpc: Option<&[u8]>,
    ) -> CallOutcome {
        let by_status = || match status {
            Some(s) if self.is_failure_status(s) => CallOutcome::Failure,
            Some(_) if grpc.is_some_and(|g| self.is_failure_grpc(g)) => CallOutcome::Failure,
            Some(_) => CallOutcome::Success,
            None => CallOutcome::Ignored,
        };
        match details {
            Some(b"via_upstream") => by_status(),
            // A host that gives no details: judged by the status, as long
            // as it is not an error a local reply could have made.
            None if status.is_some_and(|s| s < 400) => by_status(),
            Some(d)
                if d.starts_with(b"upstream_")
                    || d == b"no_healthy_upstream"
                    || d == b"response_timeout" =>
            {
                if self.local_failures {
                    CallOutcome::Failure
                } else {
                    CallOutcome::Ignored
                }
            }
            _ => CallOutcome::Ignored,
        }
    }
}

/// A validated breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerSpec {
    pub name: String,
    pub matcher: Match,
    pub key: BreakerKey,
    pub failure: FailureSpec,
    /// Trip when failures * 1000 >= error_rate_permille * requests in the window.
    pub error_rate_permille: u32,
    pub window_ms: u64,
    pub min_requests: u32,
    pub consecutive_failures: Option<u32>,
    pub open_base_ms: u64,
    pub open_max_ms: u64,
    pub open_multiplier: u32,
    pub probes: u32,
    pub successes_to_close: u32,
    pub probe_timeout_ms: u64,
    pub status: u32,
    pub failure_mode_deny: bool,
    pub max_keys: u32,
    /// Graded breaking, if on.
    pub graded: Option<GradedSpec>,
}

/// Graded breaking: below the trip threshold, refuse requests at random in
/// proportion to the error rate above `from` (as Envoy's
/// `admission_control`), up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradedSpec {
    pub from_permille: u32,
    pub max_permille: u32,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    name: String,
    #[serde(default, rename = "match")]
    matcher: Option<Strict<RawMatch>>,
    #[serde(default)]
    key: BreakerKey,
    #[serde(default)]
    failure: Option<Strict<RawFailure>>,
    #[serde(default)]
    error_rate: Option<f64>,
    #[serde(default)]
    window: Option<String>,
    #[serde(default)]
    min_requests: Option<i64>,
    #[serde(default)]
    consecutive_failures: Option<i64>,
    #[serde(default)]
    open: Option<Strict<RawOpen>>,
    #[serde(default)]
    half_open: Option<Strict<RawHalfOpen>>,
    #[serde(default)]
    status: Option<i64>,
    #[serde(default)]
    failure_mode_deny: bool,
    #[serde(default)]
    max_keys: Option<i64>,
    #[serde(default)]
    graded: Option<Strict<RawGraded>>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawGraded {
    from: Option<f64>,
    max: Option<f64>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawFailure {
    statuses: Option<Vec<String>>,
    grpc_statuses: Option<Vec<i64>>,
    local_failures: Option<bool>,
    #[serde(default)]
    slow_call: Option<String>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawOpen {
    base: Option<String>,
    max: Option<String>,
    multiplier: Option<i64>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
struct RawHalfOpen {
    probes: Option<i64>,
    successes_to_close: Option<i64>,
    probe_timeout: Option<String>,
}

fn count(field: String, value: Option<i64>, default: i64, max: i64) -> Result<u32, ConfigError> {
    let v = positive(field.clone(), value.unwrap_or(default))?;
    if v > max as u64 {
        return Err(err(field, format!("must be at most {max}")));
    }
    Ok(v as u32)
}

fn failure(at: &str, raw: Option<RawFailure>) -> Result<FailureSpec, ConfigError> {
    let raw = raw.unwrap_or(RawFailure {
        statuses: None,
        grpc_statuses: None,
        local_failures: None,
        slow_call: None,
    });
    let slow_ms = match raw.slow_call {
        None => None,
        Some(t) => Some(millis(format!("{at}.failure.slow_call"), Some(t), "1s")?),
    };
    let mut spec = FailureSpec {
        classes: Vec::new(),
        codes: Vec::new(),
        local_failures: raw.local_failures.unwrap_or(true),
        slow_ms,
        grpc_statuses: 0,
    };
    let grpc = raw
        .grpc_statuses
        .unwrap_or_else(|| GRPC_FAILURES.iter().map(|&c| i64::from(c)).collect());
    for (j, &c) in grpc.iter().enumerate() {
        if !(1..=16).contains(&c) {
            return Err(err(
                format!("{at}.failure.grpc_statuses[{j}]"),
                format!("`{c}` is not a gRPC error status (1-16)"),
            ));
        }
        spec.grpc_statuses |= 1 << c;
    }
    let statuses = raw.statuses.unwrap_or_else(|| vec!["5xx".to_string()]);
    for (j, s) in statuses.iter().enumerate() {
        let field = format!("{at}.failure.statuses[{j}]");
        let bytes = s.as_bytes();
        match bytes {
            [c @ b'1'..=b'5', b'x', b'x'] => spec.classes.push((c - b'0') as u32),
            _ => match s.parse::<u32>() {
                // Three digits as written, not `+500` or `0500`.
                Ok(code) if (100..=599).contains(&code) && s.len() == 3 => spec.codes.push(code),
                _ => {
                    return Err(err(
                        field,
                        format!("`{s}` is neither a status (100-599) nor a class like \"5xx\""),
                    ))
                }
            },
        }
    }
    Ok(spec)
}

/// Validates one breaker.
pub fn validate(at: &str, raw: RawBreaker) -> Result<BreakerSpec, ConfigError> {
    check_name(&format!("{at}.name"), &raw.name)?;
    let key = match raw.key {
        BreakerKey::Header(h) => BreakerKey::Header(header_name(&format!("{at}.key.header"), &h)?),
        k => k,
    };
    let (open_base_ms, open_max_ms, open_multiplier) =
        open_periods(at, raw.open.map(Strict::into_inner))?;
    let half = raw
        .half_open
        .map(Strict::into_inner)
        .unwrap_or(RawHalfOpen {
            probes: None,
            successes_to_close: None,
            probe_timeout: None,
        });
    let consecutive = format!("{at}.consecutive_failures");
    let error_rate_permille = error_rate(at, raw.error_rate)?;
    Ok(BreakerSpec {
        matcher: validate_match(at, raw.matcher.map(Strict::into_inner).unwrap_or_default())?,
        key,
        failure: failure(at, raw.failure.map(Strict::into_inner))?,
        error_rate_permille,
        window_ms: millis(format!("{at}.window"), raw.window, "10s")?,
        min_requests: count(
            format!("{at}.min_requests"),
            raw.min_requests,
            20,
            1_000_000_000,
        )?,
        consecutive_failures: raw
            .consecutive_failures
            .map(|n| count(consecutive, Some(n), 1, 1_000_000_000))
            .transpose()?,
        open_base_ms,
        open_max_ms,
        open_multiplier,
        probes: count(format!("{at}.half_open.probes"), half.probes, 1, 10_000)?,
        successes_to_close: count(
            format!("{at}.half_open.successes_to_close"),
            half.successes_to_close,
            1,
            10_000,
        )?,
        probe_timeout_ms: millis(
            format!("{at}.half_open.probe_timeout"),
            half.probe_timeout,
            "30s",
        )?,
        status: status(format!("{at}.status"), raw.status.unwrap_or(503))?,
        failure_mode_deny: raw.failure_mode_deny,
        max_keys: count(format!("{at}.max_keys"), raw.max_keys, 100, 100_000)?,
        graded: raw
            .graded
            .map(|g| graded(at, g.into_inner(), error_rate_permille))
            .transpose()?,
        name: raw.name,
    })
}

/// Graded breaking: `from` an error rate under the trip rate (default
/// half of it, rounded down to a step of 0.001: the steps bind what is
/// written, not the default), `max` a chance in (0, 1] (default 0.9).
fn graded(at: &str, raw: RawGraded, trip_permille: u32) -> Result<GradedSpec, ConfigError> {
    let trip = f64::from(trip_permille) / 1000.0;
    let from_permille = match raw.from {
        None => trip_permille / 2,
        Some(from) if (0.0..trip).contains(&from) => permille(format!("{at}.graded.from"), from)?,
        Some(from) => {
            return Err(err(
                format!("{at}.graded.from"),
                format!("must be at least 0 and under error_rate ({trip}), got {from}"),
            ))
        }
    };
    let max = raw.max.unwrap_or(0.9);
    if !(max > 0.0 && max <= 1.0) {
        return Err(err(
            format!("{at}.graded.max"),
            format!("must be in (0, 1], got {max}"),
        ));
    }
    Ok(GradedSpec {
        from_permille,
        max_permille: permille(format!("{at}.graded.max"), max)?,
    })
}

/// The error rate that trips, in permille (at least 1).
fn error_rate(at: &str, raw: Option<f64>) -> Result<u32, ConfigError> {
    let rate = raw.unwrap_or(0.5);
    if !(rate > 0.0 && rate <= 1.0) {
        return Err(err(
            format!("{at}.error_rate"),
            format!("must be in (0, 1], got {rate}"),
        ));
    }
    permille(format!("{at}.error_rate"), rate)
}

/// The open period's base, maximum (ms) and multiplier.
fn open_periods(at: &str, raw: Option<RawOpen>) -> Result<(u64, u64, u32), ConfigError> {
    let open = raw.unwrap_or(RawOpen {
        base: None,
        max: None,
        multiplier: None,
    });
    let base = millis(format!("{at}.open.base"), open.base, "5s")?;
    let max = millis(format!("{at}.open.max"), open.max, "60s")?;
    if max < base {
        return Err(err(
            format!("{at}.open.max"),
            "must not be shorter than open.base",
        ));
    }
    let multiplier = count(format!("{at}.open.multiplier"), open.multiplier, 2, 100)?;
    Ok((base, max, multiplier))
}
