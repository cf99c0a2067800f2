//! What a client refused by an open breaker sees.

use crate::header::HeaderValue;
use crate::reply::{json_str, retry_after_secs, Detail, Rejection, GRPC_UNAVAILABLE};
use crate::rng::SplitMix;
use crate::time::Duration;

/// The answer of an open (or half-open, probes taken) breaker: never
/// earlier than the earliest probe time, plus jitter, and a header that
/// tells it apart from an upstream 503.
pub fn rejection(
    name: &str,
    status: u32,
    wait_ms: u64,
    half_open: bool,
    spread_ns: u64,
    rng: &mut SplitMix,
) -> Rejection {
    let retry_after = retry_after_secs(
        Duration::from_ms(wait_ms),
        Duration::from_ns(spread_ns),
        rng,
    );
    let state = if half_open { "half-open" } else { "open" };
    Rejection {
        status,
        headers: vec![
            ("retry-after", HeaderValue::decimal(retry_after)),
            ("x-sluice-circuit", state.into()),
        ],
        grpc_status: GRPC_UNAVAILABLE,
        detail: Detail::CircuitOpen {
            breaker: name.to_string(),
            half_open,
            wait_ms,
            retry_after_s: retry_after,
        },
    }
}

/// The answer of graded breaking: refused by chance while the breaker is
/// closed and the error rate high (`x-sluice-circuit: throttled`).
pub fn throttled(
    name: &str,
    status: u32,
    reject_permille: u32,
    spread_ns: u64,
    rng: &mut SplitMix,
) -> Rejection {
    let retry_after = retry_after_secs(Duration::from_secs(1), Duration::from_ns(spread_ns), rng);
    Rejection {
        status,
        headers: vec![
            ("retry-after", HeaderValue::decimal(retry_after)),
            ("x-sluice-circuit", "throttled".into()),
        ],
        grpc_status: GRPC_UNAVAILABLE,
        detail: Detail::Text {
            body: format!(
            "{{\"error\":\"circuit_throttled\",\"breaker\":{},\"reject_permille\":{reject_permille},\"retry_after_s\":{retry_after}}}",
            json_str(name)
        ),
            grpc_message: format!("circuit {name} is throttling ({reject_permille} per 1000 refused)"),
            reason: format!("breaker/{name}"),
        },
    }
}
