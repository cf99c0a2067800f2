//! Local replies. For a gRPC request (by its content type, the rule the
//! wasm build's Envoy applies) the reply carries an explicit `grpc-status`
//! and `grpc-message` (percent-encoded), without which a gRPC client would
//! read Envoy's local reply as a success; any other request gets the HTTP
//! status, the headers and the JSON body.

use crate::abi::{self, Buffer, FilterPtr, Header};
use crate::adapter::Rejection;
use crate::views;
use sluice::header::HeaderValue;
use sluice::reply::is_grpc_content_type;
use std::cell::RefCell;

/// Most headers a reply sends without a heap allocation for their list.
const INLINE_HEADERS: usize = 12;

thread_local! {
    /// The buffer refusals' JSON bodies are written into, one per worker
    /// thread: a refusal allocates none.
    static BODY: RefCell<String> = RefCell::new(String::with_capacity(256));
}

/// Answers the stream with a refusal.
pub fn send(filter: FilterPtr, r: &Rejection, reason_header: Option<&str>) {
    let grpc = views::header_with(filter, abi::REQUEST_HEADERS, "content-type", |v| {
        is_grpc_content_type(v)
    })
    .unwrap_or(false);
    if grpc {
        let status = HeaderValue::decimal(u64::from(r.grpc_status));
        let message = percent_encode(&r.grpc_message());
        let tail = [
            ("grpc-status", status.as_bytes()),
            ("grpc-message", message.as_bytes()),
        ];
        send_with(filter, r, reason_header, tail, "");
        return;
    }
    let json = [("content-type", &b"application/json"[..])];
    // A reply re-entering this one (none does), or one sent while the
    // thread ends, gets a buffer of its own.
    let sent = BODY
        .try_with(|cell| {
            let mut body = cell.try_borrow_mut().ok()?;
            body.clear();
            r.write_body(&mut body);
            send_with(filter, r, reason_header, json, &body);
            Some(())
        })
        .ok()
        .flatten();
    if sent.is_none() {
        send_with(filter, r, reason_header, json, &r.body());
    }
}

/// Sends refusal `r` with its headers, the reason header if configured,
/// then `tail`, and `body` (empty: a gRPC refusal, logged by its message).
fn send_with<const N: usize>(
    filter: FilterPtr,
    r: &Rejection,
    reason_header: Option<&str>,
    tail: [(&str, &[u8]); N],
    body: &str,
) {
    let reason = reason_header.map(|name| (name, r.reason()));
    let pairs = r
        .headers
        .iter()
        .map(|(k, v)| (*k, v.as_bytes()))
        .chain(reason.as_ref().map(|(k, v)| (*k, v.as_bytes())))
        .chain(tail);
    if log::log_enabled!(log::Level::Debug) {
        // What the client is told, as the wasm build logs it.
        if body.is_empty() {
            log::debug!("sluice: refused: {}", r.grpc_message());
        } else {
            log::debug!("sluice: refused: {body}");
        }
    }
    respond_with(filter, r.status, pairs, body);
}

/// Sends a local reply of `status` with these headers and body.
pub fn respond(filter: FilterPtr, status: u32, pairs: &[(&str, &str)], body: &str) {
    respond_with(
        filter,
        status,
        pairs.iter().map(|&(k, v)| (k, v.as_bytes())),
        body,
    );
}

/// `respond` over any list of headers: up to [`INLINE_HEADERS`] of them
/// on the stack.
fn respond_with<'a>(
    filter: FilterPtr,
    status: u32,
    pairs: impl Iterator<Item = (&'a str, &'a [u8])>,
    body: &str,
) {
    let mut inline = [Header::EMPTY; INLINE_HEADERS];
    let mut spilled = Vec::new();
    let mut n = 0;
    for (k, v) in pairs {
        match inline.get_mut(n) {
            Some(h) if spilled.is_empty() => *h = Header::bytes(k, v),
            _ => {
                if spilled.is_empty() {
                    spilled.extend(inline.iter().copied());
                }
                spilled.push(Header::bytes(k, v));
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
