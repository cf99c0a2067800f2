//! One HTTP stream: asks the core for decisions on the request headers
//! (breakers first, so a fast-failed request spends no rate-limit token),
//! carries them out, and reports the upstream's answer to the breakers.

use super::plugin::Plugin;
use super::store::SharedData;
use crate::breaker::runtime::{Check, Outcome, Ticket};
use crate::request::{Attribute, RequestView};
use crate::response::{action, Action, Rejection};
use log::debug;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action as HostAction, GrpcStatusCode, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::UNIX_EPOCH;

pub struct Stream {
    id: u32,
    plugin: Option<Rc<Plugin>>,
    response_headers: Vec<(&'static str, String)>,
    tickets: Vec<Ticket>,
    /// Latency-mode shedders to report the response latency to.
    watched: Vec<usize>,
    start_ms: u64,
}

impl Stream {
    pub fn new(id: u32, plugin: Option<Rc<Plugin>>) -> Self {
        Stream {
            id,
            plugin,
            response_headers: Vec::new(),
            tickets: Vec::new(),
            watched: Vec::new(),
            start_ms: 0,
        }
    }

    /// The stream ended, whichever way: gives back any probe claim without
    /// a verdict (client gone, reset) and any concurrency slot, exactly once.
    fn end(&mut self) {
        self.report(None, |_| Outcome::Ignored);
        if let Some(plugin) = &self.plugin {
            if plugin.has_shedders() {
                plugin.shed_finish(self.id);
            }
        }
    }

    fn report(
        &mut self,
        now: Option<u64>,
        outcome: impl Fn(&crate::breaker::FailureSpec) -> Outcome,
    ) {
        let Some(plugin) = &self.plugin else { return };
        if self.tickets.is_empty() {
            return;
        }
        let now = now.unwrap_or_else(|| now_ns() / 1_000_000);
        for t in std::mem::take(&mut self.tickets) {
            let Some(spec) = plugin.breaker_spec(t.breaker) else {
                continue;
            };
            plugin.breaker_record(now, t, outcome(&spec.failure));
        }
    }
}

/// The current request, read lazily through host calls. Each header and
/// attribute is fetched from the host at most once per request, however
/// many rules look at it (every host call that returns a value also calls
/// back into the VM to allocate it).
#[derive(Default)]
pub(super) struct HostRequest {
    headers: RefCell<Vec<(String, Option<Vec<u8>>)>>,
    attributes: RefCell<[Option<Option<Vec<u8>>>; 3]>,
}

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        if let Ok(cache) = self.headers.try_borrow() {
            if let Some((_, v)) = cache.iter().find(|(n, _)| n == name) {
                return v.clone();
            }
        }
        let v = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten();
        if let Ok(mut cache) = self.headers.try_borrow_mut() {
            cache.push((name.to_string(), v.clone()));
        }
        v
    }

    fn attribute(&self, attr: Attribute) -> Option<Vec<u8>> {
        let (slot, path) = match attr {
            Attribute::ClientAddress => (0, ["source", "address"]),
            Attribute::RouteName => (1, ["xds", "route_name"]),
            Attribute::ClusterName => (2, ["xds", "cluster_name"]),
        };
        if let Ok(cache) = self.attributes.try_borrow() {
            if let Some(Some(v)) = cache.get(slot) {
                return v.clone();
            }
        }
        let v = hostcalls::get_property(path.to_vec()).ok().flatten();
        if let Ok(mut cache) = self.attributes.try_borrow_mut() {
            if let Some(entry) = cache.get_mut(slot) {
                *entry = Some(v.clone());
            }
        }
        v
    }
}

/// Nanoseconds since the Unix epoch, from the host.
pub(super) fn now_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn is_grpc() -> bool {
    HostRequest::default()
        .header("content-type")
        .is_some_and(|v| v.starts_with(b"application/grpc"))
}

/// Answers the current stream (the effective context) with a local reply.
pub(super) fn reject(r: &Rejection, reason_header: Option<&str>) {
    debug!("sluice: refused: {}", r.body);
    let mut pairs: Vec<(&str, &str)> = r.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Some(name) = reason_header {
        pairs.push((name, r.reason.as_str()));
    }
    let result = if is_grpc() {
        let meta: Vec<(&str, &[u8])> = pairs.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
        let code = if r.grpc_status == crate::response::GRPC_UNAVAILABLE {
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

fn response_status() -> Option<u32> {
    let v = hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, ":status")
        .ok()
        .flatten()?;
    std::str::from_utf8(&v).ok()?.parse().ok()
}

impl Context for Stream {}

/// The SDK drops a stream's context when Envoy deletes it (`proxy_on_delete`,
/// once per stream, however it ended). Doing the end-of-stream work here
/// rather than in `on_log` or `on_done` lets `make build` strip those two
/// exports, which saves two trips into the VM on every request.
impl Drop for Stream {
    fn drop(&mut self) {
        self.end();
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> HostAction {
        let Some(plugin) = self.plugin.clone() else {
            return HostAction::Continue;
        };
        let req = HostRequest::default();
        let now = now_ns();
        if plugin.has_breakers() {
            match plugin.breaker_check(now / 1_000_000, &req) {
                Check::Pass(tickets) => self.tickets = tickets,
                Check::FailFast {
                    breaker,
                    retry_after_ms,
                    half_open,
                } => {
                    if let Some(r) = plugin.breaker_answer(breaker, retry_after_ms, half_open) {
                        reject(&r, plugin.config.response.reason_header.as_deref());
                        return HostAction::Pause;
                    }
                }
            }
        }
        if !plugin.limiter.rules.is_empty() {
            if let Some(action) = self.rate_limit(&plugin, now, &req) {
                return action;
            }
        }
        if plugin.has_shedders() {
            self.start_ms = now / 1_000_000;
            match plugin.shed_arrive(self.id, self.start_ms, &req) {
                Ok((true, watched)) => self.watched = watched,
                Ok((false, _)) => return HostAction::Pause, // queued: resumed or shed later
                Err(_) => {
                    self.report(None, |_| Outcome::Ignored);
                    return HostAction::Pause;
                }
            }
        }
        HostAction::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> HostAction {
        let now = if self.tickets.is_empty() && self.watched.is_empty() {
            0 // not needed: no host call
        } else {
            now_ns() / 1_000_000
        };
        if !self.tickets.is_empty() {
            let status = response_status();
            // Only an error status needs telling apart an upstream answer from
            // an Envoy or filter local reply: skip the host call otherwise.
            let details = match status {
                Some(s) if s < 400 => None,
                _ => hostcalls::get_property(vec!["response", "code_details"])
                    .ok()
                    .flatten(),
            };
            self.report(Some(now), |f| f.classify(status, details.as_deref()));
        }
        if !self.watched.is_empty() {
            if let Some(plugin) = &self.plugin {
                plugin.shed_response(&self.watched, now, self.start_ms);
            }
        }
        // Appended, as Envoy's local_ratelimit does (a third cheaper than
        // replacing: no search for an existing header of the same name).
        for (name, value) in self.response_headers.drain(..) {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value);
        }
        HostAction::Continue
    }
}

impl Stream {
    /// Applies the rate limits; `Some(action)` when the request was refused.
    fn rate_limit(&mut self, plugin: &Plugin, now: u64, req: &HostRequest) -> Option<HostAction> {
        let eval = plugin.limiter.evaluate(&SharedData, now, req);
        plugin.metrics.record(&eval);
        let mut rng = plugin.rng.try_borrow_mut().ok()?;
        let decided = action(&eval, &plugin.config.response, &plugin.policies, &mut rng);
        drop(rng);
        match decided {
            Action::Continue { response_headers } => {
                self.response_headers = response_headers;
                None
            }
            Action::Reject(r) => {
                // Refused before reaching the upstream: no verdict on it.
                self.report(None, |_| Outcome::Ignored);
                reject(&r, plugin.config.response.reason_header.as_deref());
                Some(HostAction::Pause)
            }
        }
    }
}
