//! Local replies. For a gRPC request (by its content type, the rule the
//! wasm build's Envoy applies) the reply carries an explicit `grpc-status`
//! and `grpc-message` (percent-encoded), without which a gRPC client would
//! read Envoy's local reply as a success; any other request gets the HTTP
//! status, the headers and the JSON body.

use crate::abi::{self, Buffer, FilterPtr, Header};
use crate::adapter::Rejection;
use crate::views;
use sluice::reply::is_grpc_content_type;

/// Answers the stream with a refusal.
pub fn send(filter: FilterPtr, r: &Rejection, reason_header: Option<&str>) {
    let grpc = views::header(filter, abi::REQUEST_HEADERS, "content-type")
        .is_some_and(|v| is_grpc_content_type(&v));
    let reason = reason_header.map(|name| (name, r.reason()));
    let mut pairs: Vec<(&str, String)> = r
        .headers
        .iter()
        .map(|(k, v)| (*k, v.clone()))
        .chain(reason)
        .collect();
    let body = if grpc {
        pairs.push(("grpc-status", r.grpc_status.to_string()));
        pairs.push(("grpc-message", percent_encode(&r.grpc_message())));
        String::new()
    } else {
        pairs.push(("content-type", "application/json".to_string()));
        r.body()
    };
    log::debug!("sluice: refused: {}", r.reason());
    respond(filter, r.status, &pairs, &body);
}

/// Sends a local reply of `status` with these headers and body.
pub fn respond(filter: FilterPtr, status: u32, pairs: &[(&str, String)], body: &str) {
    let headers: Vec<Header> = pairs.iter().map(|(k, v)| Header::of(k, v)).collect();
    // SAFETY: `filter` is the stream's live Envoy filter; every pointer
    // describes a live slice for the duration of the call (Envoy copies).
    unsafe {
        abi::envoy_dynamic_module_callback_http_send_response(
            filter,
            status,
            headers.as_ptr(),
            headers.len(),
            Buffer::of(body.as_bytes()),
            Buffer::of(b"sluice"),
        );
    }
}

/// gRPC's percent-encoding of `grpc-message`: bytes outside printable
/// ASCII, and `%`, as `%XX`.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn percent_encoding() {
        assert_eq!(super::percent_encode("a b%é"), "a b%25%C3%A9");
    }
}
