//! One HTTP stream: each hook calls the pipeline and carries out its answer.

use super::plugin::Plugin;
use super::reply;
use super::views::{HostRequest, HostResponse};
use crate::header::Headers;
use crate::pipeline::{StreamId, Verdict};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, MapType};
use std::rc::Rc;

/// A stream's id and its configuration's plugin: the pipeline keeps
/// whatever else it needs of the stream, by id, and hands over the response
/// headers of a stream no stage holds.
pub struct HttpStream {
    id: StreamId,
    plugin: Option<Rc<Plugin>>,
    /// Whether the pipeline keeps anything of the stream (`Outcome::kept`;
    /// until its request is decided, it may).
    kept: bool,
    /// Headers for the response, from the request's decision.
    headers: Headers,
}

impl HttpStream {
    pub fn new(id: u32, plugin: Option<Rc<Plugin>>) -> Self {
        // A stream of an empty configuration never calls the pipeline.
        let plugin = plugin.filter(|p| !p.is_empty());
        HttpStream {
            id: StreamId(id),
            plugin,
            kept: true,
            headers: Headers::new(),
        }
    }
}

impl Context for HttpStream {}

/// The SDK drops a stream's context when Envoy deletes it (`proxy_on_delete`,
/// once per stream, however it ended). Doing the end-of-stream work here
/// rather than in `on_log` or `on_done` lets `make build` strip those two
/// exports, which saves two trips into the VM on every request.
impl Drop for HttpStream {
    fn drop(&mut self) {
        if let Some(plugin) = self.plugin.as_ref().filter(|_| self.kept) {
            let id = self.id;
            if let Some(out) = plugin.call(|p, env| p.end(env, id)) {
                plugin.apply(out, Some(self.id));
            }
        }
    }
}

impl HttpContext for HttpStream {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(plugin) = &self.plugin else {
            return Action::Continue;
        };
        let req = HostRequest::default();
        let id = self.id;
        let decided = plugin.call(|p, env| (p.request(env, id, &req), p.handed_headers()));
        let Some(((verdict, out), headers)) = decided else {
            return Action::Continue;
        };
        self.kept = out.kept;
        if let Some(headers) = headers {
            self.headers = headers;
        }
        plugin.apply(out, Some(self.id));
        match verdict {
            Verdict::Continue => Action::Continue,
            // Queued: resumed or answered later, maybe from a tick.
            Verdict::Pause => Action::Pause,
            Verdict::Reply(r) => {
                reply::send(&r, plugin.reason_header());
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(plugin) = &self.plugin else {
            return Action::Continue;
        };
        // The headers come from the decision or from the pipeline, never both.
        let mut headers = std::mem::take(&mut self.headers);
        if self.kept {
            let id = self.id;
            if let Some((kept, out)) = plugin.call(|p, env| p.response(env, id, &HostResponse)) {
                plugin.apply(out, Some(self.id));
                if headers.is_empty() {
                    headers = kept;
                } else {
                    headers.extend(kept);
                }
            }
        }
        // Appended, as Envoy's local_ratelimit does (a third cheaper than
        // replacing: no search for an existing header of the same name).
        for (name, value) in headers.iter() {
            let _ = hostcalls::add_map_value_bytes(
                MapType::HttpResponseHeaders,
                name,
                value.as_bytes(),
            );
        }
        Action::Continue
    }
}
