//! One HTTP stream: asks the core for a decision on the request headers and
//! carries it out (a local reply, or headers added to the response).

use super::root::Plugin;
use super::store::SharedData;
use crate::request::{Attribute, RequestView};
use crate::response::{action, Action, Rejection};
use log::debug;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action as HostAction, GrpcStatusCode, MapType};
use std::rc::Rc;
use std::time::UNIX_EPOCH;

pub struct Stream {
    plugin: Option<Rc<Plugin>>,
    response_headers: Vec<(&'static str, String)>,
}

impl Stream {
    pub fn new(plugin: Option<Rc<Plugin>>) -> Self {
        Stream {
            plugin,
            response_headers: Vec::new(),
        }
    }
}

/// The current request, read lazily through host calls.
struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn attribute(&self, attr: Attribute) -> Option<Vec<u8>> {
        let path = match attr {
            Attribute::ClientAddress => vec!["source", "address"],
            Attribute::RouteName => vec!["xds", "route_name"],
            Attribute::ClusterName => vec!["xds", "cluster_name"],
        };
        hostcalls::get_property(path).ok().flatten()
    }
}

fn now_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn is_grpc(req: &HostRequest) -> bool {
    req.header("content-type")
        .is_some_and(|v| v.starts_with(b"application/grpc"))
}

fn reject(req: &HostRequest, r: &Rejection) {
    let result = if is_grpc(req) {
        let meta: Vec<(&str, &[u8])> = r.headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        hostcalls::send_grpc_response(
            GrpcStatusCode::ResourceExhausted,
            Some(&r.grpc_message),
            meta,
        )
    } else {
        let mut headers: Vec<(&str, &str)> =
            r.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        headers.push(("content-type", "application/json"));
        hostcalls::send_http_response(r.status, headers, Some(r.body.as_bytes()))
    };
    if let Err(e) = result {
        log::warn!("sluice: could not send the local reply: {e:?}");
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> HostAction {
        let Some(plugin) = &self.plugin else {
            return HostAction::Continue;
        };
        if plugin.limiter.rules.is_empty() {
            return HostAction::Continue;
        }
        let req = HostRequest;
        let eval = plugin.limiter.evaluate(&SharedData, now_ns(), &req);
        plugin.metrics.record(&eval);
        let decided = {
            let Ok(mut rng) = plugin.rng.try_borrow_mut() else {
                return HostAction::Continue;
            };
            action(&eval, &plugin.config.response, &plugin.policies, &mut rng)
        };
        match decided {
            Action::Continue { response_headers } => {
                self.response_headers = response_headers;
                HostAction::Continue
            }
            Action::Reject(r) => {
                debug!("sluice: refused: {}", r.body);
                reject(&req, &r);
                HostAction::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> HostAction {
        for (name, value) in self.response_headers.drain(..) {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(&value));
        }
        HostAction::Continue
    }
}
