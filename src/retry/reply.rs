//! What a client whose retry was over budget sees: distinct from a rate
//! limit (`x-sluice-retry-budget: exhausted`, error `retry_budget_exhausted`).

use crate::header::HeaderValue;
use crate::reply::{json_str, retry_after_secs, Detail, Rejection, GRPC_RESOURCE_EXHAUSTED};
use crate::rng::SplitMix;
use crate::time::Duration;

/// The refusal of a retry over budget `name`.
pub fn rejection(name: &str, status: u32, spread_ns: u64, rng: &mut SplitMix) -> Rejection {
    let retry_after = retry_after_secs(Duration::from_secs(1), Duration::from_ns(spread_ns), rng);
    Rejection {
        status,
        headers: vec![
            ("retry-after", HeaderValue::decimal(retry_after)),
            ("x-sluice-retry-budget", "exhausted".into()),
        ],
        grpc_status: GRPC_RESOURCE_EXHAUSTED,
        detail: Detail::Text {
            body: format!(
            "{{\"error\":\"retry_budget_exhausted\",\"budget\":{},\"retry_after_s\":{retry_after}}}",
            json_str(name)
        ),
            grpc_message: format!("retry budget {name} exhausted; retry in {retry_after} s"),
            reason: format!("retry_budget/{name}"),
        },
    }
}
