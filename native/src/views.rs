//! The current request and response, read through Envoy's callbacks.

use crate::abi::{self, Buffer, FilterPtr};
use sluice::request::{Attribute, RequestView, ResponseView};

/// Envoy's response code details of a response from the upstream.
const VIA_UPSTREAM: &[u8] = b"via_upstream";

/// The first value of header `name` of `map` (`abi::REQUEST_HEADERS`...).
pub fn header(filter: FilterPtr, map: u32, name: &str) -> Option<Vec<u8>> {
    header_with(filter, map, name, <[u8]>::to_vec)
}

/// `f` of the first value of header `name` of `map`, read in place.
pub fn header_with<R>(
    filter: FilterPtr,
    map: u32,
    name: &str,
    f: impl FnOnce(&[u8]) -> R,
) -> Option<R> {
    let mut value = Buffer::EMPTY;
    // SAFETY: `filter` is the stream's live Envoy filter (the hook's
    // argument, or a paused stream's, kept until its end); the key lives
    // for the call; Envoy's value is valid until the headers change, and
    // is used before this returns.
    unsafe {
        if !abi::envoy_dynamic_module_callback_http_get_header(
            filter,
            map,
            Buffer::of(name.as_bytes()),
            &mut value,
            0,
            std::ptr::null_mut(),
        ) {
            return None;
        }
        value.as_slice().map(f)
    }
}

/// A string attribute of the stream (`abi::ATTR_*`).
fn attribute(filter: FilterPtr, id: u32) -> Option<Vec<u8>> {
    attribute_with(filter, id, <[u8]>::to_vec)
}

/// `f` of a string attribute of the stream, read in place.
fn attribute_with<R>(filter: FilterPtr, id: u32, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
    let mut value = Buffer::EMPTY;
    // SAFETY: as in `header_with`.
    unsafe {
        if !abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
            filter, id, &mut value,
        ) {
            return None;
        }
        value.as_slice().map(f)
    }
}

/// Envoy's attribute of a request attribute.
fn attribute_id(attr: Attribute) -> u32 {
    match attr {
        Attribute::ClientAddress => abi::ATTR_SOURCE_ADDRESS,
        Attribute::RouteName => abi::ATTR_XDS_ROUTE_NAME,
        Attribute::ClusterName => abi::ATTR_XDS_CLUSTER_NAME,
    }
}

/// The request of one stream.
pub struct HostRequest(pub FilterPtr);

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        header(self.0, abi::REQUEST_HEADERS, name)
    }

    fn attribute(&self, attr: Attribute) -> Option<Vec<u8>> {
        attribute(self.0, attribute_id(attr))
    }

    fn header_with(&self, name: &str, f: &mut dyn FnMut(Option<&[u8]>)) {
        if header_with(self.0, abi::REQUEST_HEADERS, name, |v| f(Some(v))).is_none() {
            f(None);
        }
    }

    fn attribute_with(&self, attr: Attribute, f: &mut dyn FnMut(Option<&[u8]>)) {
        if attribute_with(self.0, attribute_id(attr), |v| f(Some(v))).is_none() {
            f(None);
        }
    }
}

/// The response of one stream, each header read when a stage asks.
pub struct HostResponse(pub FilterPtr);

impl ResponseView for HostResponse {
    /// Envoy's response code (set on the stream before response filters
    /// run, for the upstream's response and a local reply alike): a number
    /// read in place, about a third of `:status` looked up by name, which
    /// stays the fallback.
    fn status(&self) -> Option<u32> {
        let mut code = 0u64;
        // SAFETY: the filter pointer is Envoy's for this stream, valid during
        // the hook; `code` outlives the call.
        let known = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_int(
                self.0,
                abi::ATTR_RESPONSE_CODE,
                &mut code,
            )
        };
        if let Some(c) = known.then(|| u32::try_from(code).ok()).flatten() {
            return Some(c);
        }
        header_with(self.0, abi::RESPONSE_HEADERS, ":status", |v| {
            std::str::from_utf8(v).ok()?.parse().ok()
        })?
    }

    fn code_details(&self) -> Option<Vec<u8>> {
        attribute(self.0, abi::ATTR_RESPONSE_CODE_DETAILS)
    }

    fn header(&self, name: &str) -> Option<Vec<u8>> {
        header(self.0, abi::RESPONSE_HEADERS, name)
    }

    /// The status, and whether the response came from the upstream by
    /// Envoy's response code details (`via_upstream`: the router sets them
    /// when the upstream's headers arrive, before any response filter sees
    /// them, as it adds its mark): read in place, an attribute costs a
    /// fraction of a header looked up by name.
    fn status_and_upstream_mark(&self) -> (Option<u32>, bool) {
        let mut value = Buffer::EMPTY;
        // SAFETY: as in `attribute`; the buffer is read before this returns.
        let via_upstream = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.0,
                abi::ATTR_RESPONSE_CODE_DETAILS,
                &mut value,
            ) && value.as_slice() == Some(VIA_UPSTREAM)
        };
        (self.status(), via_upstream)
    }
}

/// Adds a header to a map of the stream (appended, as the wasm build does:
/// no search for an existing one).
pub fn add_header(filter: FilterPtr, map: u32, name: &str, value: &[u8]) {
    // SAFETY: as in `header`; both buffers live for the call.
    unsafe {
        abi::envoy_dynamic_module_callback_http_add_header(
            filter,
            map,
            Buffer::of(name.as_bytes()),
            Buffer::of(value),
        );
    }
}

/// Sets (replaces) a header of a map of the stream.
pub fn set_header(filter: FilterPtr, map: u32, name: &str, value: &str) {
    // SAFETY: as in `add_header`.
    unsafe {
        abi::envoy_dynamic_module_callback_http_set_header(
            filter,
            map,
            Buffer::of(name.as_bytes()),
            Buffer::of(value.as_bytes()),
        );
    }
}
