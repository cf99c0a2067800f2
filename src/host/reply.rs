//! Sending a local reply on the current stream (the effective context).

use super::views::HostRequest;
use crate::reply::{Rejection, GRPC_UNAVAILABLE};
use crate::request::RequestView;
use log::debug;
use proxy_wasm::hostcalls;
use proxy_wasm::types::GrpcStatusCode;

fn is_grpc() -> bool {
    HostRequest::default()
        .header("content-type")
        .is_some_and(|v| v.starts_with(b"application/grpc"))
}

/// Answers the current stream with a local reply: a gRPC error for gRPC
/// requests, else the reply's status, headers and JSON body.
pub fn send(r: &Rejection, reason_header: Option<&str>) {
    debug!("sluice: refused: {}", r.body);
    let mut pairs: Vec<(&str, &str)> = r.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Some(name) = reason_header {
        pairs.push((name, r.reason.as_str()));
    }
    let result = if is_grpc() {
        let meta: Vec<(&str, &[u8])> = pairs.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        let code = if r.grpc_status == GRPC_UNAVAILABLE {
            GrpcStatusCode::Unavailable
        } else {
            GrpcStatusCode::ResourceExhausted
        };
        hostcalls::send_grpc_response(code, Some(&r.grpc_message), meta)
    } else {
        pairs.push(("content-type", "application/json"));
        hostcalls::send_http_response(r.status, pairs, Some(r.body.as_bytes()))
    };
    if let Err(e) = result {
        log::warn!("sluice: could not send the local reply: {e:?}");
    }
}
