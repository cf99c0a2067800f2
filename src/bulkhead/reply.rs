//! What a client refused by a full bulkhead sees: the status (429),
//! `Retry-After`, `x-sluice-bulkhead: full`, a JSON body naming the limit,
//! or gRPC RESOURCE_EXHAUSTED.

use crate::header::HeaderValue;
use crate::reply::{json_str, retry_after_secs, Detail, Rejection, GRPC_RESOURCE_EXHAUSTED};
use crate::rng::SplitMix;
use crate::time::Duration;

/// The refusal of a request over limit `name` of `max` in flight.
pub fn rejection(
    name: &str,
    max: u32,
    status: u32,
    spread_ns: u64,
    rng: &mut SplitMix,
) -> Rejection {
    let retry_after = retry_after_secs(Duration::from_secs(1), Duration::from_ns(spread_ns), rng);
    Rejection {
        status,
        headers: vec![
            ("retry-after", HeaderValue::decimal(retry_after)),
            ("x-sluice-bulkhead", "full".into()),
        ],
        grpc_status: GRPC_RESOURCE_EXHAUSTED,
        detail: Detail::Text {
            body: format!(
            "{{\"error\":\"concurrency_limited\",\"limit\":{},\"max_in_flight\":{max},\"retry_after_s\":{retry_after}}}",
            json_str(name)
        ),
            grpc_message: format!("{name}: {max} requests of this caller in flight already"),
            reason: format!("bulkhead/{name}"),
        },
    }
}
