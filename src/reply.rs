//! What every refusal shares: the local reply as a value, `Retry-After`
//! with jitter, and gRPC status codes. Each mechanism builds its own reply
//! in its `reply.rs`; the host only sends it.
//!
//! `Retry-After` is whole seconds, at least 1, and never earlier than the
//! moment the request could pass: `ceil((wait + jitter) / 1s)` with jitter
//! uniform in `[0, spread]`, so clients refused together come back spread out.

use crate::duration::NS_PER_S;
use crate::rng::SplitMix;

/// A local reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
    /// For gRPC requests: this grpc-status and message instead.
    pub grpc_status: u32,
    pub grpc_message: String,
    /// Mechanism and name, e.g. `ratelimit/per-client`, for the optional
    /// reason header (`response.reason_header`).
    pub reason: String,
}

/// gRPC status RESOURCE_EXHAUSTED (rate limited).
pub const GRPC_RESOURCE_EXHAUSTED: u32 = 8;
/// gRPC status UNAVAILABLE (circuit open, shed).
pub const GRPC_UNAVAILABLE: u32 = 14;

pub fn ceil_secs(ns: u64) -> u64 {
    ns / NS_PER_S + u64::from(ns % NS_PER_S != 0)
}

/// `Retry-After` seconds for a wait, with jitter drawn from `rng`.
pub fn retry_after_secs(wait_ns: u64, spread_ns: u64, rng: &mut SplitMix) -> u64 {
    let jitter = rng.below(spread_ns.saturating_add(1));
    ceil_secs(wait_ns.saturating_add(jitter)).max(1)
}

/// Escapes a string for a JSON string literal (names are restricted to
/// `[A-Za-z0-9_-]`, but stay safe regardless).
pub fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
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

    #[test]
    fn property_retry_after_is_never_early_and_stays_within_the_spread() {
        let mut rng = SplitMix(5);
        for _ in 0..10_000 {
            let wait = rng.below(100 * S);
            let spread = rng.below(10 * S);
            let ra = retry_after_secs(wait, spread, &mut rng);
            assert!(ra >= 1);
            assert!(ra * S >= wait, "told {ra}s for a wait of {wait}ns");
            assert!(ra <= ceil_secs(wait + spread).max(1));
        }
    }

    #[test]
    fn jitter_spreads_clients_refused_together() {
        let mut rng = SplitMix(1);
        let values: std::collections::BTreeSet<u64> = (0..100)
            .map(|_| retry_after_secs(S / 2, 5 * S, &mut rng))
            .collect();
        assert!(values.len() >= 5, "{values:?}");
        assert_eq!(retry_after_secs(S / 2, 0, &mut rng), 1);
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
