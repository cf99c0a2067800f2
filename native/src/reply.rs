//! Local replies. For a gRPC request (by its content type, the rule the
//! wasm build's Envoy applies) the reply carries an explicit `grpc-status`
//! and `grpc-message` (percent-encoded), without which a gRPC client would
//! read Envoy's local reply as a success; any other request gets the HTTP
//! status, the headers and the JSON body.

use crate::abi::{self, Buffer, FilterPtr, Header};
use crate::adapter::Rejection;
use crate::views;
use sluice::reply::is_grpc_content_type;

/// Most headers a reply sends without a heap allocation for their list.
const INLINE_HEADERS: usize = 12;

/// Answers the stream with a refusal.
pub fn send(filter: FilterPtr, r: &Rejection, reason_header: Option<&str>) {
    let grpc = views::header_with(filter, abi::REQUEST_HEADERS, "content-type", |v| {
        is_grpc_content_type(v)
    })
    .unwrap_or(false);
    let reason = reason_header.map(|name| (name, r.reason()));
    let (status, message, body);
    let tail: [(&str, &str); 2] = if grpc {
        status = sluice::reply::decimal(u64::from(r.grpc_status));
        message = percent_encode(&r.grpc_message());
        body = String::new();
        [("grpc-status", &status), ("grpc-message", &message)]
    } else {
        body = r.body();
        [("content-type", "application/json"), ("", "")]
    };
    let pairs = r
        .headers
        .iter()
        .map(|(k, v)| (*k, v.as_str()))
        .chain(reason.as_ref().map(|(k, v)| (*k, v.as_str())))
        .chain(tail.into_iter().filter(|(k, _)| !k.is_empty()));
    if log::log_enabled!(log::Level::Debug) {
        // What the client is told, as the wasm build logs it.
        if body.is_empty() {
            log::debug!("sluice: refused: {}", r.grpc_message());
        } else {
            log::debug!("sluice: refused: {body}");
        }
    }
    respond_with(filter, r.status, pairs, &body);
}

/// Sends a local reply of `status` with these headers and body.
pub fn respond(filter: FilterPtr, status: u32, pairs: &[(&str, &str)], body: &str) {
    respond_with(filter, status, pairs.iter().copied(), body);
}

/// `respond` over any list of headers: up to [`INLINE_HEADERS`] of them
/// on the stack.
fn respond_with<'a>(
    filter: FilterPtr,
    status: u32,
    pairs: impl Iterator<Item = (&'a str, &'a str)>,
    body: &str,
) {
    let mut inline = [Header::EMPTY; INLINE_HEADERS];
    let mut spilled = Vec::new();
    let mut n = 0;
    for (k, v) in pairs {
        match inline.get_mut(n) {
            Some(h) if spilled.is_empty() => *h = Header::of(k, v),
            _ => {
                if spilled.is_empty() {
                    spilled.extend(inline.iter().copied());
                }
                spilled.push(Header::of(k, v));
            }
        }
        n += 1;
    }
    let headers: &[Header] = if spilled.is_empty() {
        inline.get(..n).unwrap_or_default()
    } else {
        &spilled
    };
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
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push('%');
            for nibble in [b >> 4, b & 15] {
                out.push(char::from(
                    HEX.get(usize::from(nibble)).copied().unwrap_or(b'0'),
                ));
            }
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
