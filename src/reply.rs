//! What every refusal shares: the local reply as a value, `Retry-After`
//! with jitter, and gRPC status codes. Each mechanism builds its own reply
//! in its `reply.rs`; the host only sends it.
//!
//! A refusal keeps what it will say ([`Detail`]) rather than its texts: the
//! host formats only what it sends (the JSON body or the gRPC message, and
//! the reason header if configured), which spares a refused request the
//! texts it does not get.
//!
//! `Retry-After` is whole seconds, at least 1, and never earlier than the
//! moment the request could pass: the wait rounded up to whole seconds,
//! plus a jitter uniform in `[0, spread]` rounded to whole seconds at
//! random (see [`retry_after_secs`]), so clients refused together come back
//! spread over whole seconds.

use crate::duration::NS_PER_S;
use crate::header::HeaderValue;
use crate::rng::SplitMix;
use crate::time::Duration;
use std::rc::Rc;

/// A local reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u32,
    /// Values inline (see [`HeaderValue`]): one allocation for the list.
    pub headers: Vec<(&'static str, HeaderValue)>,
    /// For gRPC requests: this grpc-status and [`Rejection::grpc_message`]
    /// instead of the status and [`Rejection::body`].
    pub grpc_status: u32,
    /// What the body, the gRPC message and the reason say.
    pub detail: Detail,
}

/// Which mechanism refused, and the figures its texts carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detail {
    RateLimited {
        rule: Rc<str>,
        wait_ms: u64,
        retry_after_s: u64,
    },
    CircuitOpen {
        breaker: String,
        half_open: bool,
        wait_ms: u64,
        retry_after_s: u64,
    },
    Shed {
        shedder: String,
        priority: &'static str,
        retry_after_s: u64,
    },
    /// Texts a mechanism wrote out itself (its refusals are rare enough not
    /// to need formatting only what is sent): a new mechanism needs no
    /// variant here.
    Text {
        body: String,
        grpc_message: String,
        reason: String,
    },
}

impl Rejection {
    /// The JSON body of an HTTP refusal.
    pub fn body(&self) -> String {
        let mut b = String::with_capacity(128);
        self.write_body(&mut b);
        b
    }

    /// Appends [`Rejection::body`] to `b` (a host may reuse one buffer).
    pub fn write_body(&self, b: &mut String) {
        match &self.detail {
            Detail::RateLimited {
                rule,
                wait_ms,
                retry_after_s,
            } => {
                b.push_str("{\"error\":\"rate_limited\",\"rule\":");
                push_json_str(b, rule);
                b.push_str(",\"retry_after_ms\":");
                push_decimal(b, *wait_ms);
                b.push_str(",\"retry_after_s\":");
                push_decimal(b, *retry_after_s);
            }
            Detail::CircuitOpen {
                breaker,
                half_open,
                wait_ms,
                retry_after_s,
            } => {
                b.push_str("{\"error\":\"circuit_open\",\"breaker\":");
                push_json_str(b, breaker);
                b.push_str(",\"state\":\"");
                b.push_str(circuit_state(*half_open));
                b.push_str("\",\"retry_after_ms\":");
                push_decimal(b, *wait_ms);
                b.push_str(",\"retry_after_s\":");
                push_decimal(b, *retry_after_s);
            }
            Detail::Shed {
                shedder,
                priority,
                retry_after_s,
            } => {
                b.push_str("{\"error\":\"overloaded\",\"shedder\":");
                push_json_str(b, shedder);
                b.push_str(",\"priority\":");
                push_json_str(b, priority);
                b.push_str(",\"retry_after_s\":");
                push_decimal(b, *retry_after_s);
            }
            Detail::Text { body, .. } => {
                b.push_str(body);
                return;
            }
        }
        b.push('}');
    }

    /// The message of a gRPC refusal.
    pub fn grpc_message(&self) -> String {
        match &self.detail {
            Detail::RateLimited { rule, wait_ms, .. } => {
                format!("rate limited by rule {rule}; retry in {wait_ms} ms")
            }
            Detail::CircuitOpen {
                breaker,
                half_open,
                wait_ms,
                ..
            } => format!(
                "circuit {breaker} is {}; retry in {wait_ms} ms",
                circuit_state(*half_open)
            ),
            Detail::Shed {
                shedder,
                priority,
                retry_after_s,
                ..
            } => format!("shed by {shedder} for overload ({priority}); retry in {retry_after_s} s"),
            Detail::Text { grpc_message, .. } => grpc_message.clone(),
        }
    }

    /// Mechanism and name, e.g. `ratelimit/per-client`, for the optional
    /// reason header (`response.reason_header`).
    pub fn reason(&self) -> String {
        match &self.detail {
            Detail::RateLimited { rule, .. } => format!("ratelimit/{rule}"),
            Detail::CircuitOpen { breaker, .. } => format!("breaker/{breaker}"),
            Detail::Shed { shedder, .. } => format!("shed/{shedder}"),
            Detail::Text { reason, .. } => reason.clone(),
        }
    }
}

fn circuit_state(half_open: bool) -> &'static str {
    if half_open {
        "half-open"
    } else {
        "open"
    }
}

/// Appends `n` in decimal (two digits at a time, see
/// [`HeaderValue::decimal`]).
pub fn push_decimal(out: &mut String, n: u64) {
    out.push_str(HeaderValue::decimal(n).as_str());
}

/// gRPC status RESOURCE_EXHAUSTED (rate limited).
pub const GRPC_RESOURCE_EXHAUSTED: u32 = 8;
/// gRPC status UNAVAILABLE (circuit open, shed).
pub const GRPC_UNAVAILABLE: u32 = 14;

pub fn ceil_secs(ns: u64) -> u64 {
    ns / NS_PER_S + u64::from(ns % NS_PER_S != 0)
}

/// `Retry-After` seconds for a wait: the wait rounded up to whole seconds
/// (never before the request could pass), plus a jitter drawn uniformly in
/// `[0, spread]` and rounded to whole seconds at random in proportion to
/// its fraction (0.3 s adds a second with probability 0.3), so its mean is
/// kept. Adding the jitter before rounding would collapse it: for a wait of
/// a whole second or just under one, `ceil(wait + [0, 1 s])` is almost
/// always the same whole second, and clients refused together would all
/// come back together.
pub fn retry_after_secs(wait: Duration, spread: Duration, rng: &mut SplitMix) -> u64 {
    let jitter = rng.below(spread.as_ns().saturating_add(1));
    let rounded_up = rng.below(NS_PER_S) < jitter % NS_PER_S;
    let extra = jitter / NS_PER_S + u64::from(rounded_up);
    ceil_secs(wait.as_ns()).max(1).saturating_add(extra)
}

/// Appends `s` as a JSON string literal (names are restricted to
/// `[A-Za-z0-9_-]`, but stay safe regardless): quotes, backslashes and
/// control characters escaped as RFC 8259 requires.
pub fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    push_json_str(&mut out, s);
    out
}

/// Appends `s` as a JSON string literal.
pub fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    // Names are plain (`[A-Za-z0-9_-]`): most need no escape at all.
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push_str(s);
        out.push('"');
        return;
    }
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                let n = u32::from(c);
                out.push_str("\\u00");
                for nibble in [n >> 4, n & 15] {
                    out.push(char::from_digit(nibble, 16).unwrap_or('0'));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Whether Envoy treats the request as gRPC: a `content-type` of exactly
/// `application/grpc`, or starting with `application/grpc+` (Envoy's
/// `Grpc::Common::hasGrpcContentType`; `application/grpc-web...` is not).
pub fn is_grpc_content_type(v: &[u8]) -> bool {
    match v.strip_prefix(b"application/grpc") {
        Some(rest) => rest.is_empty() || rest.first() == Some(&b'+'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = NS_PER_S;

    /// `retry_after_secs` for a wait and a spread in nanoseconds.
    fn retry_after_ns(wait: u64, spread: u64, rng: &mut SplitMix) -> u64 {
        retry_after_secs(Duration::from_ns(wait), Duration::from_ns(spread), rng)
    }

    #[test]
    fn property_retry_after_is_never_early_and_stays_within_the_spread() {
        let mut rng = SplitMix(5);
        for _ in 0..10_000 {
            let wait = rng.below(100 * S);
            let spread = rng.below(10 * S);
            let ra = retry_after_ns(wait, spread, &mut rng);
            assert!(ra >= 1);
            assert!(ra * S >= wait, "told {ra}s for a wait of {wait}ns");
            assert!(ra <= ceil_secs(wait).max(1) + ceil_secs(spread));
        }
    }

    /// 100 clients refused at once, at the default spread of 1 s, for waits
    /// that are whole seconds or just under (the common case): several
    /// values, none told to more than 90% of them, none early.
    #[test]
    fn jitter_spreads_waits_of_whole_seconds_over_whole_seconds() {
        let mut rng = SplitMix(7);
        for wait in [
            1,
            S / 1000,
            S / 2,
            S - 1,
            S,
            2 * S - 1,
            2 * S,
            5 * S,
            6 * S - 3,
        ] {
            let mut counts = std::collections::BTreeMap::new();
            for _ in 0..100 {
                let ra = retry_after_ns(wait, S, &mut rng);
                assert!(ra * S >= wait, "told {ra}s for a wait of {wait}ns");
                *counts.entry(ra).or_insert(0u32) += 1;
            }
            assert!(counts.len() >= 2, "wait {wait}: {counts:?}");
            assert!(counts.values().all(|&n| n <= 90), "wait {wait}: {counts:?}");
        }
    }

    /// Every mechanism's refusal, 100 clients at once at the default jitter
    /// (1 s): spread over whole seconds, none of them early.
    #[test]
    fn every_kind_of_refusal_spreads_clients_refused_together() {
        type Make = fn(&mut SplitMix) -> Rejection;
        let kinds: [(&str, u64, Make); 6] = [
            ("shedder", S, |r| {
                crate::shed::reply::rejection("s", "default", 503, S, r)
            }),
            ("bulkhead", S, |r| {
                crate::bulkhead::reply::rejection("b", 1, 429, S, r)
            }),
            ("retry budget", S, |r| {
                crate::retry::reply::rejection("r", 429, S, r)
            }),
            ("breaker open", 5 * S, |r| {
                crate::breaker::reply::rejection("c", 503, 5_000, false, S, r)
            }),
            ("breaker half-open", S - 3_000_000, |r| {
                crate::breaker::reply::rejection("c", 503, 997, true, S, r)
            }),
            ("breaker throttled", S, |r| {
                crate::breaker::reply::throttled("c", 503, 500, S, r)
            }),
        ];
        let mut rng = SplitMix(11);
        for (kind, wait_ns, make) in kinds {
            let mut counts = std::collections::BTreeMap::new();
            for _ in 0..100 {
                let r = make(&mut rng);
                let ra: u64 = r
                    .headers
                    .iter()
                    .find(|(h, _)| *h == "retry-after")
                    .and_then(|(_, v)| v.parse().ok())
                    .expect("a Retry-After");
                assert!(ra * S >= wait_ns, "{kind}: {ra}");
                *counts.entry(ra).or_insert(0u32) += 1;
            }
            assert!(counts.len() >= 2, "{kind}: {counts:?}");
            assert!(counts.values().all(|&n| n <= 90), "{kind}: {counts:?}");
        }
    }

    #[test]
    fn the_jitter_keeps_its_mean_when_rounded_to_whole_seconds() {
        let mut rng = SplitMix(3);
        for spread in [S / 4, S, 3 * S / 2, 4 * S] {
            let n = 20_000u64;
            let sum: u64 = (0..n)
                .map(|_| retry_after_ns(S, spread, &mut rng) - 1)
                .sum();
            let mean_ms = sum * 1000 / n;
            let want_ms = spread / 2 / 1_000_000;
            assert!(
                mean_ms.abs_diff(want_ms) <= want_ms / 20 + 10,
                "{spread}: {mean_ms} ms"
            );
        }
    }

    #[test]
    fn jitter_spreads_clients_refused_together() {
        let mut rng = SplitMix(1);
        let values: std::collections::BTreeSet<u64> = (0..100)
            .map(|_| retry_after_ns(S / 2, 5 * S, &mut rng))
            .collect();
        assert!(values.len() >= 5, "{values:?}");
        assert_eq!(retry_after_ns(S / 2, 0, &mut rng), 1);
    }

    #[test]
    fn json_strings_and_decimals_match_serde_json_and_to_string() {
        for s in [
            "r",
            "per-client_1",
            "a\"b\\c",
            "x\ny\t\r\u{1}\u{8}\u{c}\u{1f}\u{7f}z",
            "é€𝄞",
            "",
        ] {
            let mut out = String::new();
            push_json_str(&mut out, s);
            assert_eq!(out, serde_json::to_string(s).unwrap(), "{s:?}");
        }
        for n in [0, 1, 9, 10, 99, 100, 12345, u64::from(u32::MAX), u64::MAX] {
            let mut out = String::from("x");
            push_decimal(&mut out, n);
            assert_eq!(out, format!("x{n}"));
        }
    }

    #[test]
    fn texts_are_the_documented_ones() {
        let r = |detail| Rejection {
            status: 429,
            headers: Vec::new(),
            grpc_status: 8,
            detail,
        };
        let rl = r(Detail::RateLimited {
            rule: "r".into(),
            wait_ms: 2500,
            retry_after_s: 3,
        });
        assert_eq!(
            rl.body(),
            r#"{"error":"rate_limited","rule":"r","retry_after_ms":2500,"retry_after_s":3}"#
        );
        assert_eq!(
            rl.grpc_message(),
            "rate limited by rule r; retry in 2500 ms"
        );
        assert_eq!(rl.reason(), "ratelimit/r");
        let cb = r(Detail::CircuitOpen {
            breaker: "b".into(),
            half_open: true,
            wait_ms: 40,
            retry_after_s: 1,
        });
        assert_eq!(
            cb.body(),
            r#"{"error":"circuit_open","breaker":"b","state":"half-open","retry_after_ms":40,"retry_after_s":1}"#
        );
        assert_eq!(cb.grpc_message(), "circuit b is half-open; retry in 40 ms");
        assert_eq!(cb.reason(), "breaker/b");
        let shed = r(Detail::Shed {
            shedder: "s".into(),
            priority: "sheddable",
            retry_after_s: 2,
        });
        assert_eq!(
            shed.body(),
            r#"{"error":"overloaded","shedder":"s","priority":"sheddable","retry_after_s":2}"#
        );
        assert_eq!(
            shed.grpc_message(),
            "shed by s for overload (sheddable); retry in 2 s"
        );
        assert_eq!(shed.reason(), "shed/s");
    }

    #[test]
    fn grpc_is_recognised_exactly_as_envoy_does() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+json",
        ] {
            assert!(is_grpc_content_type(ct.as_bytes()), "{ct}");
        }
        for ct in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc;charset=utf-8",
            "application/grpcx",
            "Application/grpc",
            "application/json",
            "",
        ] {
            assert!(!is_grpc_content_type(ct.as_bytes()), "{ct}");
        }
    }
}
