//! What a client whose deadline cannot be met sees: 504 (or the configured
//! status) and gRPC DEADLINE_EXCEEDED, with a reason naming what refused.

use crate::reply::{json_str, Detail, Rejection};

/// gRPC status DEADLINE_EXCEEDED.
pub const GRPC_DEADLINE_EXCEEDED: u32 = 4;

/// The answer to a request whose deadline cannot be met; `by` names the
/// mechanism (`deadline`, or `shed/<shedder>` for a wait cut short).
pub fn rejection(by: &str, status: u32, remaining_ms: u64) -> Rejection {
    Rejection {
        status,
        headers: vec![("x-sluice-deadline", "exceeded".to_string())],
        grpc_status: GRPC_DEADLINE_EXCEEDED,
        detail: Detail::Text {
            body: format!(
                "{{\"error\":\"deadline_exceeded\",\"by\":{},\"remaining_ms\":{remaining_ms}}}",
                json_str(by)
            ),
            grpc_message: format!("deadline exceeded ({by}); {remaining_ms} ms were left"),
            reason: by.to_string(),
        },
    }
}
