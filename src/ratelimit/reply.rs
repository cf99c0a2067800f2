//! Turning a limiter evaluation into what the client sees: the refusal
//! (status, `Retry-After`, JSON body, or a gRPC RESOURCE_EXHAUSTED) and the
//! rate-limit headers (see [`crate::reply`] for `Retry-After`).

use super::algorithm::Algorithm;
use super::{Evaluation, LimitVerdict, RuleReport, RuleResult};
use crate::config::{HeaderStyle, ResponseSpec};
use crate::duration::{NS_PER_MS, NS_PER_S};
use crate::header::{HeaderValue, Headers};
use crate::reply::{
    ceil_secs, push_decimal, retry_after_secs, Detail, Rejection, GRPC_RESOURCE_EXHAUSTED,
};
use crate::rng::SplitMix;
use crate::time::Duration;
use std::rc::Rc;

/// What the headers say about a rule's policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInfo {
    /// Shared with every refusal by the rule (a refusal keeps the name).
    pub name: Rc<str>,
    /// The quota: the bucket's burst.
    pub quota: u64,
    /// Seconds an empty bucket takes to refill completely (at least 1).
    pub window_s: u64,
    /// A shadow rule's: never in the headers (a dry run tells clients
    /// nothing).
    pub shadow: bool,
}

impl PolicyInfo {
    /// The policy of a rule's algorithm.
    pub fn of(name: &str, a: &Algorithm) -> Self {
        let window_s = u64::try_from(a.window_ns().div_ceil(NS_PER_S as u128))
            .unwrap_or(u64::MAX)
            .max(1);
        PolicyInfo {
            name: name.into(),
            quota: a.quota(),
            window_s,
            shadow: false,
        }
    }
}

/// What an evaluation comes to: its refusal, or, for an admitted request,
/// none, and the headers for its response added to `response_headers`.
/// `policies` is indexed by rule.
pub fn action(
    eval: &Evaluation,
    spec: &ResponseSpec,
    policies: &[PolicyInfo],
    rng: &mut SplitMix,
    response_headers: &mut Headers,
) -> Option<Rejection> {
    match eval.verdict {
        LimitVerdict::Allow => {
            if spec.headers_on_allowed {
                // The tightest enforcing rule is the one a client must pace to.
                let enforcing = |r: &&RuleReport| !policies.get(r.rule).is_some_and(|p| p.shadow);
                if let Some(r) = eval
                    .reports
                    .iter()
                    .filter(|r| matches!(r.result, RuleResult::Allowed | RuleResult::Delayed))
                    .filter(enforcing)
                    .min_by_key(|r| r.remaining)
                {
                    rate_headers(response_headers, spec.ratelimit_headers, r, policies, None);
                }
            }
            None
        }
        LimitVerdict::Deny { rule, wait_ns } => {
            let spread = Duration::from_ns(spec.retry_after_jitter_ns);
            let retry_after = retry_after_secs(Duration::from_ns(wait_ns), spread, rng);
            let name = policies
                .get(rule)
                .map_or_else(|| Rc::from(""), |p| p.name.clone());
            let wait_ms = wait_ns.div_ceil(NS_PER_MS);
            // Retry-After and at most 5 rate-limit headers, in one allocation.
            let mut headers = Vec::with_capacity(6);
            headers.push(("retry-after", HeaderValue::decimal(retry_after)));
            if let Some(report) = eval.reports.iter().find(|r| r.rule == rule) {
                rate_headers(
                    &mut headers,
                    spec.ratelimit_headers,
                    report,
                    policies,
                    Some(retry_after),
                );
            }
            // The texts are formatted by the host, only those it sends.
            Some(Rejection {
                status: spec.status,
                headers,
                grpc_status: GRPC_RESOURCE_EXHAUSTED,
                detail: Detail::RateLimited {
                    rule: name,
                    wait_ms,
                    retry_after_s: retry_after,
                },
            })
        }
    }
}

/// A list rate-limit headers are appended to: a refusal's, or an admitted
/// request's (values inline, see [`Headers`]).
trait HeaderList {
    fn push(&mut self, name: &'static str, value: HeaderValue);
}

impl HeaderList for Vec<(&'static str, HeaderValue)> {
    fn push(&mut self, name: &'static str, value: HeaderValue) {
        Vec::push(self, (name, value));
    }
}

impl HeaderList for Headers {
    fn push(&mut self, name: &'static str, value: HeaderValue) {
        Headers::push(self, (name, value));
    }
}

/// Appends the rate-limit headers for one rule. `reset_override` is the
/// refusal's `Retry-After`, so a refused client is told one consistent time.
fn rate_headers<L: HeaderList>(
    out: &mut L,
    style: HeaderStyle,
    r: &RuleReport,
    policies: &[PolicyInfo],
    reset_override: Option<u64>,
) {
    let Some(p) = policies.get(r.rule) else {
        return;
    };
    // A held request's response comes `delay_ns` after its charge.
    let reset =
        reset_override.unwrap_or_else(|| ceil_secs(r.full_in_ns.saturating_sub(r.delay_ns)));
    if matches!(style, HeaderStyle::Draft | HeaderStyle::Both) {
        // `"name";q=Q;w=W` and `"name";r=R;t=T`, without `format!`.
        let field = |a: &str, x: u64, b: &str, y: u64| {
            let mut v = String::with_capacity(p.name.len() + 48);
            v.push('"');
            v.push_str(&p.name);
            v.push_str(a);
            push_decimal(&mut v, x);
            v.push_str(b);
            push_decimal(&mut v, y);
            v
        };
        let policy = field("\";q=", p.quota, ";w=", p.window_s);
        out.push("ratelimit-policy", policy.into());
        let state = field("\";r=", r.remaining, ";t=", reset);
        out.push("ratelimit", state.into());
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        out.push("x-ratelimit-limit", HeaderValue::decimal(p.quota));
        out.push("x-ratelimit-remaining", HeaderValue::decimal(r.remaining));
        out.push("x-ratelimit-reset", HeaderValue::decimal(reset));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HeaderStyle;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = NS_PER_S;

    fn report(result: RuleResult, remaining: u64, wait_ns: u64, full_in_ns: u64) -> RuleReport {
        RuleReport {
            rule: 0,
            result,
            cost: 1,
            remaining,
            full_in_ns,
            wait_ns,
            delay_ns: 0,
            cas_retries: 0,
            corrupt: false,
            collision: false,
        }
    }

    fn spec(style: HeaderStyle, on_allowed: bool, jitter: u64) -> ResponseSpec {
        ResponseSpec {
            status: 429,
            retry_after_jitter_ns: jitter,
            ratelimit_headers: style,
            headers_on_allowed: on_allowed,
            reason_header: None,
        }
    }

    fn policies() -> Vec<PolicyInfo> {
        vec![PolicyInfo::of(
            "r",
            &Algorithm::Bucket(crate::ratelimit::config::BucketSpec {
                rate: 10,
                period_ns: 60 * S,
                burst: 20,
            }),
        )]
    }

    #[test]
    fn refusal_carries_status_body_and_consistent_headers() {
        let eval = Evaluation {
            verdict: LimitVerdict::Deny {
                rule: 0,
                wait_ns: 2_500_000_000,
            },
            reports: vec![report(RuleResult::Limited, 0, 2_500_000_000, 120 * S)].into(),
            delay_ns: 0,
            reservations: Vec::new(),
            global_keys: Vec::new(),
        };
        let Some(r) = action(
            &eval,
            &spec(HeaderStyle::Both, false, 0),
            &policies(),
            &mut SplitMix(0),
            &mut Headers::new(),
        ) else {
            panic!()
        };
        assert_eq!(r.status, 429);
        let h: std::collections::HashMap<_, _> = r.headers.iter().cloned().collect();
        assert_eq!(h["retry-after"], "3");
        assert_eq!(h["ratelimit-policy"], "\"r\";q=20;w=120");
        assert_eq!(h["ratelimit"], "\"r\";r=0;t=3");
        assert_eq!(h["x-ratelimit-limit"], "20");
        assert_eq!(h["x-ratelimit-reset"], "3");
        assert_eq!(
            r.body(),
            r#"{"error":"rate_limited","rule":"r","retry_after_ms":2500,"retry_after_s":3}"#
        );
        assert!(r.grpc_message().contains("rule r"));
        assert_eq!(r.reason(), "ratelimit/r");
    }

    #[test]
    fn allowed_requests_carry_headers_only_when_configured_and_in_the_chosen_style() {
        let eval = Evaluation {
            verdict: LimitVerdict::Allow,
            reports: vec![report(RuleResult::Allowed, 7, 0, 39 * S + 1)].into(),
            delay_ns: 0,
            reservations: Vec::new(),
            global_keys: Vec::new(),
        };
        let admitted = |style, on_allowed| {
            let mut h = Headers::new();
            let r = action(
                &eval,
                &spec(style, on_allowed, 0),
                &policies(),
                &mut SplitMix(0),
                &mut h,
            );
            assert_eq!(r, None);
            h
        };
        assert!(admitted(HeaderStyle::Both, false).is_empty());
        assert_eq!(
            admitted(HeaderStyle::Legacy, true),
            vec![
                ("x-ratelimit-limit", "20".into()),
                ("x-ratelimit-remaining", "7".into()),
                ("x-ratelimit-reset", "40".into())
            ]
        );
        assert!(admitted(HeaderStyle::None, true).is_empty());
    }

    /// The headers of an admitted request, legacy style.
    fn allowed_headers(reports: Vec<RuleReport>, policies: &[PolicyInfo]) -> Headers {
        let eval = Evaluation {
            verdict: LimitVerdict::Allow,
            reports: reports.into(),
            delay_ns: 0,
            reservations: Vec::new(),
            global_keys: Vec::new(),
        };
        let mut h = Headers::new();
        if action(
            &eval,
            &spec(HeaderStyle::Legacy, true, 0),
            policies,
            &mut SplitMix(0),
            &mut h,
        )
        .is_some()
        {
            return Headers::new();
        }
        h
    }

    #[test]
    fn a_shadow_rule_is_never_in_an_admitted_requests_headers() {
        let two = vec![
            PolicyInfo {
                shadow: true,
                ..policies().remove(0)
            },
            policies().remove(0),
        ];
        let shadow = |result, remaining| RuleReport {
            remaining,
            ..report(result, remaining, 0, S)
        };
        let enforcing = RuleReport {
            rule: 1,
            ..report(RuleResult::Allowed, 9, 0, S)
        };
        // Tighter than the enforcing rule, admitting or not: not shown.
        for r in [
            shadow(RuleResult::Allowed, 1),
            shadow(RuleResult::ShadowLimited, 0),
        ] {
            let h = allowed_headers(vec![r, enforcing], &two);
            assert_eq!(h.get(1).map(|(_, v)| v.as_bytes()), Some(&b"9"[..]));
        }
        // Alone, it adds none.
        assert!(allowed_headers(vec![shadow(RuleResult::Allowed, 1)], &two).is_empty());
    }

    #[test]
    fn a_held_requests_reset_counts_from_its_release() {
        let held = RuleReport {
            delay_ns: 2 * S,
            ..report(RuleResult::Delayed, 0, 0, 3 * S)
        };
        let h = allowed_headers(vec![held], &policies());
        assert_eq!(h.get(2).map(|(_, v)| v.as_bytes()), Some(&b"1"[..]));
    }
}
