//! The current request and response, read lazily through host calls.

use crate::request::{Attribute, RequestView, ResponseView};
use crate::time::Instant;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;
use std::cell::RefCell;
use std::time::UNIX_EPOCH;

/// Now, from the host (nanoseconds since the Unix epoch).
pub fn now() -> Instant {
    let ns = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    Instant::from_ns(ns)
}

/// The current request. Each header and attribute is fetched from the host
/// at most once per request, however many rules look at it (every host
/// call that returns a value also calls back into the VM to allocate it).
#[derive(Default)]
pub struct HostRequest {
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

/// The current response's headers, each read when a stage asks.
pub struct HostResponse;

impl ResponseView for HostResponse {
    fn status(&self) -> Option<u32> {
        let v = self.header(":status")?;
        std::str::from_utf8(&v).ok()?.parse().ok()
    }

    fn code_details(&self) -> Option<Vec<u8>> {
        hostcalls::get_property(vec!["response", "code_details"])
            .ok()
            .flatten()
    }

    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }

    /// One call for every header, instead of one per header.
    fn status_and_upstream_mark(&self) -> (Option<u32>, bool) {
        let Ok(headers) = hostcalls::get_map_bytes(MapType::HttpResponseHeaders) else {
            return (None, false);
        };
        let mut status = None;
        let mut marked = false;
        for (name, value) in &headers {
            if name == ":status" {
                status = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
            } else if name == crate::request::UPSTREAM_MARK {
                marked = true;
            }
        }
        (status, marked)
    }
}
