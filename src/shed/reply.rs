//! What a client whose request was shed sees.

use crate::header::HeaderValue;
use crate::reply::{retry_after_secs, Detail, Rejection, GRPC_UNAVAILABLE};
use crate::rng::SplitMix;
use crate::time::Duration;

/// The answer to a request shed for overload: distinguishable from a rate
/// limit (429) and a breaker (`x-sluice-circuit`) by `x-sluice-shed`.
pub fn rejection(
    name: &str,
    class: &'static str,
    status: u32,
    spread_ns: u64,
    rng: &mut SplitMix,
) -> Rejection {
    let retry_after = retry_after_secs(Duration::from_secs(1), Duration::from_ns(spread_ns), rng);
    Rejection {
        status,
        headers: vec![
            ("retry-after", HeaderValue::decimal(retry_after)),
            ("x-sluice-shed", class.into()),
        ],
        grpc_status: GRPC_UNAVAILABLE,
        detail: Detail::Shed {
            shedder: name.to_string(),
            priority: class,
            retry_after_s: retry_after,
        },
    }
}
