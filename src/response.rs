//! Turning a limiter evaluation into what the client sees: the refusal
//! (status, `Retry-After`, JSON body, or a gRPC RESOURCE_EXHAUSTED) and the
//! rate-limit headers.
//!
//! `Retry-After` is whole seconds, at least 1, and never earlier than the
//! moment the request could pass: `ceil((wait + jitter) / 1s)` with jitter
//! uniform in `[0, spread]`, so clients refused together come back spread out.

use crate::config::{HeaderStyle, ResponseSpec};
use crate::duration::{NS_PER_MS, NS_PER_S};
use crate::limiter::{Evaluation, RuleReport, RuleResult, Verdict};
use crate::rng::SplitMix;

/// What the adapter must do with the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Let it through, adding these response headers (possibly none).
    Continue { response_headers: Vec<(&'static str, String)> },
    /// Answer it now.
    Reject(Rejection),
}

/// A local reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
    /// For gRPC requests: grpc-status 8 (RESOURCE_EXHAUSTED) and this message.
    pub grpc_message: String,
}

/// gRPC status RESOURCE_EXHAUSTED.
pub const GRPC_RESOURCE_EXHAUSTED: u32 = 8;

fn ceil_secs(ns: u64) -> u64 {
    ns / NS_PER_S + u64::from(ns % NS_PER_S != 0)
}

/// `Retry-After` seconds for a wait, with jitter drawn from `rng`.
pub fn retry_after_secs(wait_ns: u64, spread_ns: u64, rng: &mut SplitMix) -> u64 {
    let jitter = rng.below(spread_ns.saturating_add(1));
    ceil_secs(wait_ns.saturating_add(jitter)).max(1)
}

/// Escapes a string for a JSON string literal (rule names are restricted to
/// `[A-Za-z0-9_-]`, but stay safe regardless).
fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// What the headers say about a rule's policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInfo {
    pub name: String,
    /// The quota: the bucket's burst.
    pub quota: u64,
    /// Seconds an empty bucket takes to refill completely (at least 1).
    pub window_s: u64,
}

impl PolicyInfo {
    /// The policy of a bucket.
    pub fn of(name: &str, b: &crate::config::BucketSpec) -> Self {
        let refill_ns = (b.burst as u128 * b.period_ns as u128).div_ceil(b.rate as u128);
        let window_s = u64::try_from(refill_ns.div_ceil(NS_PER_S as u128)).unwrap_or(u64::MAX).max(1);
        PolicyInfo { name: name.to_string(), quota: b.burst, window_s }
    }
}

/// Builds the action for an evaluation. `policies` is indexed by rule.
pub fn action(eval: &Evaluation, spec: &ResponseSpec, policies: &[PolicyInfo], rng: &mut SplitMix) -> Action {
    match eval.verdict {
        Verdict::Allow => {
            let response_headers = if spec.headers_on_allowed {
                // The tightest enforcing rule is the one a client must pace to.
                eval.reports
                    .iter()
                    .filter(|r| r.result == RuleResult::Allowed)
                    .min_by_key(|r| r.remaining)
                    .map(|r| rate_headers(spec.ratelimit_headers, r, policies, None))
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            Action::Continue { response_headers }
        }
        Verdict::Deny { rule, wait_ns } => {
            let retry_after = retry_after_secs(wait_ns, spec.retry_after_jitter_ns, rng);
            let name = policies.get(rule).map_or("", |p| p.name.as_str());
            let wait_ms = wait_ns.div_ceil(NS_PER_MS);
            let mut headers = vec![("retry-after", retry_after.to_string())];
            if let Some(report) = eval.reports.iter().find(|r| r.rule == rule) {
                headers.extend(rate_headers(spec.ratelimit_headers, report, policies, Some(retry_after)));
            }
            let body = format!(
                "{{\"error\":\"rate_limited\",\"rule\":{},\"retry_after_ms\":{wait_ms},\"retry_after_s\":{retry_after}}}",
                json_str(name)
            );
            Action::Reject(Rejection {
                status: spec.status,
                headers,
                body,
                grpc_message: format!("rate limited by rule {name}; retry in {wait_ms} ms"),
            })
        }
    }
}

/// The rate-limit headers for one rule. `reset_override` is the refusal's
/// `Retry-After`, so a refused client is told one consistent time.
fn rate_headers(style: HeaderStyle, r: &RuleReport, policies: &[PolicyInfo], reset_override: Option<u64>) -> Vec<(&'static str, String)> {
    let Some(p) = policies.get(r.rule) else { return Vec::new() };
    let reset = reset_override.unwrap_or_else(|| ceil_secs(r.full_in_ns));
    let mut out = Vec::new();
    if matches!(style, HeaderStyle::Draft | HeaderStyle::Both) {
        out.push(("ratelimit-policy", format!("\"{}\";q={};w={}", p.name, p.quota, p.window_s)));
        out.push(("ratelimit", format!("\"{}\";r={};t={reset}", p.name, r.remaining)));
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        out.push(("x-ratelimit-limit", p.quota.to_string()));
        out.push(("x-ratelimit-remaining", r.remaining.to_string()));
        out.push(("x-ratelimit-reset", reset.to_string()));
    }
    out
}
