//! Sending a local reply on the current stream (the effective context).
//!
//! One host call serves HTTP and gRPC alike: `proxy_send_local_response`
//! with the refusal's HTTP status and its gRPC status. Envoy itself then
//! decides, by its own rule, whether the request is gRPC: a gRPC request
//! gets a trailers-only gRPC error (HTTP 200, `grpc-status`, the body as
//! `grpc-message`), any other request the HTTP status. So a refusal can
//! never come out as a bare 200, whatever the content type. sluice applies
//! the same rule only to choose the body: the JSON document, or the gRPC
//! message.
//!
//! The SDK's `send_http_response` and `send_grpc_response` panic (killing
//! the VM) when Envoy refuses the call, and neither passes both statuses:
//! this module calls the host directly.

use crate::reply::{is_grpc_content_type, Rejection};
use log::{debug, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, Status};

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> Status;
}

/// The header map in the proxy-wasm wire format: the count, each name's
/// and value's length, then each name and value followed by a NUL.
fn serialize<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> Vec<u8> {
    let (count, size) = pairs.clone().fold((0u32, 4), |(n, size), (k, v)| {
        (n + 1, size + k.len() + v.len() + 10)
    });
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&count.to_le_bytes());
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// Answers the current stream with a local reply. Only the texts sent are
/// formatted: the JSON body or the gRPC message, and the reason if asked.
pub fn send(r: &Rejection, reason_header: Option<&str>) {
    let reason = reason_header.map(|name| (name, r.reason()));
    // Read once per refusal, so not through the request's header cache.
    let grpc = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "content-type")
        .ok()
        .flatten()
        .is_some_and(|v| is_grpc_content_type(&v));
    let (body, content_type) = if grpc {
        (r.grpc_message(), None)
    } else {
        (r.body(), Some(("content-type", "application/json")))
    };
    debug!("sluice: refused: {body}");
    let headers = serialize(
        r.headers
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain(reason.as_ref().map(|(k, v)| (*k, v.as_str())))
            .chain(content_type),
    );
    // gRPC statuses are 0 to 16; 2 is UNKNOWN.
    let grpc_status = i32::try_from(r.grpc_status).unwrap_or(2);
    // SAFETY: every pointer and length describes a live slice for the call.
    let status = unsafe {
        proxy_send_local_response(
            r.status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            grpc_status,
        )
    };
    if status != Status::Ok {
        warn!("sluice: could not send the local reply: {status:?}");
    }
}
