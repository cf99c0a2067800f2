//! What a client whose request was shed sees.

use crate::duration::NS_PER_S;
use crate::reply::{json_str, retry_after_secs, Rejection, GRPC_UNAVAILABLE};
use crate::rng::SplitMix;

/// The answer to a request shed for overload: distinguishable from a rate
/// limit (429) and a breaker (`x-sluice-circuit`) by `x-sluice-shed`.
pub fn rejection(
    name: &str,
    class: &str,
    status: u32,
    spread_ns: u64,
    rng: &mut SplitMix,
) -> Rejection {
    let retry_after = retry_after_secs(NS_PER_S, spread_ns, rng);
    Rejection {
        status,
        headers: vec![("retry-after", retry_after.to_string()), ("x-sluice-shed", class.to_string())],
        body: format!(
            "{{\"error\":\"overloaded\",\"shedder\":{},\"priority\":\"{class}\",\"retry_after_s\":{retry_after}}}",
            json_str(name)
        ),
        grpc_status: GRPC_UNAVAILABLE,
        grpc_message: format!("shed by {name} for overload ({class}); retry in {retry_after} s"),
        reason: format!("shed/{name}"),
    }
}
