//! Every HTTP-filter event hook Envoy 1.40 resolves when it loads the
//! configuration (used or not: a missing one fails the load). Each entry
//! catches a panic: unwinding across the C boundary would abort Envoy. A
//! panic in a request's hook applies the configured failure policy: the
//! request goes on (the default), or with `failure_mode_deny` it is
//! answered 500.

use crate::abi::{self, Buffer, ConfigEnvoyPtr, FilterPtr};
use crate::config::FilterConfig;
use crate::filter::{self as stream, Filter, Place};
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// Runs `f`, or answers `fallback` if it panics.
pub fn guard<R>(what: &str, fallback: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            // Logging could panic too (a formatting bug): catch that also.
            let _ = catch_unwind(|| log::error!("sluice: panic in {what}; failure policy applied"));
            fallback
        }
    }
}

/// The stream's filter, from the pointer `on_http_filter_new` returned.
///
/// # Safety
/// `ptr` is null or a pointer `on_http_filter_new` returned and
/// `on_http_filter_destroy` did not take back; Envoy calls a stream's
/// hooks on one thread. A hook may run inside another of the same stream
/// (a local reply runs the response hook): the filter is shared, never
/// borrowed mutably, and what a hook changes is in cells.
unsafe fn filter<'a>(ptr: *mut c_void) -> Option<&'a Filter> {
    // SAFETY: the caller's promise.
    unsafe { ptr.cast::<Place>().as_ref() }?.as_ref()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    guard("program init", std::ptr::null(), || {
        crate::log::init();
        abi::ABI_VERSION.as_ptr()
    })
}

/// A configuration: sluice's JSON (the filter_config `StringValue`). A bad
/// one is refused (null), the error logged naming the field.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: ConfigEnvoyPtr,
    _name: Buffer,
    config: Buffer,
) -> *const c_void {
    guard("config_new", std::ptr::null(), || {
        // SAFETY: Envoy's buffer lives for the call.
        let bytes = unsafe { config.to_vec() }.unwrap_or_default();
        match FilterConfig::new(envoy, &bytes) {
            Ok(c) => Arc::into_raw(Arc::new(c)).cast(),
            Err(e) => {
                log::error!("sluice: {e}");
                std::ptr::null()
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    guard("config_destroy", (), || {
        if !config.is_null() {
            // SAFETY: the pointer `config_new` made, taken back once.
            drop(unsafe { Arc::from_raw(config.cast::<FilterConfig>()) });
        }
    })
}

/// Per-route configuration is not used: refused.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: Buffer,
    _config: Buffer,
) -> *const c_void {
    std::ptr::null()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _config: *const c_void,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    envoy: FilterPtr,
) -> *mut c_void {
    guard("filter_new", std::ptr::null_mut(), || {
        if config.is_null() {
            return std::ptr::null_mut();
        }
        let config = config.cast::<FilterConfig>();
        // SAFETY: a live pointer `config_new` made: Envoy destroys a
        // configuration after its filters. The filter takes a reference.
        let config = unsafe {
            Arc::increment_strong_count(config);
            Arc::from_raw(config)
        };
        Box::into_raw(stream::boxed(Filter::new(config, envoy))).cast()
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(ptr: *mut c_void) {
    guard("filter_destroy", (), || {
        if ptr.is_null() {
            return;
        }
        // SAFETY: the pointer `filter_new` made, taken back once; the
        // filter's drop ends the stream for the pipeline if nothing did.
        stream::unboxed(unsafe { Box::from_raw(ptr.cast::<Place>()) });
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterPtr,
    ptr: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy's promise for hook arguments (see `filter`).
    let Some(f) = (unsafe { filter(ptr) }) else {
        return abi::CONTINUE;
    };
    let deny = f.deny_on_failure();
    let failed = if deny {
        abi::STOP_ITERATION
    } else {
        abi::CONTINUE
    };
    let status = guard("request_headers", None, || Some(f.request_headers()));
    status.unwrap_or_else(|| {
        if deny {
            guard("failure reply", (), || {
                crate::reply::respond(envoy, 500, &[], "sluice: internal error\n")
            });
        }
        failed
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _envoy: FilterPtr,
    ptr: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    guard("response_headers", abi::CONTINUE, || {
        // SAFETY: as in `request_headers`.
        unsafe { filter(ptr) }.map_or(abi::CONTINUE, Filter::response_headers)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _envoy: FilterPtr,
    ptr: *mut c_void,
) {
    guard("stream_complete", (), || {
        // SAFETY: as in `request_headers`.
        if let Some(f) = unsafe { filter(ptr) } {
            f.end();
        }
    })
}

/// The ticker's event (see `ticker`).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _envoy: FilterPtr,
    ptr: *mut c_void,
    _event_id: u64,
) {
    guard("scheduled", (), || {
        // SAFETY: as in `request_headers`.
        if let Some(f) = unsafe { filter(ptr) } {
            f.scheduled();
        }
    })
}

/// The hooks sluice has no use for: bodies and trailers go on untouched.
macro_rules! pass {
    ($($name:ident),*) => {$(
        #[no_mangle]
        pub extern "C" fn $name(_envoy: FilterPtr, _ptr: *mut c_void, _end_of_stream: bool) -> u32 {
            abi::CONTINUE
        }
    )*};
}

pass!(
    envoy_dynamic_module_on_http_filter_request_body,
    envoy_dynamic_module_on_http_filter_request_trailers,
    envoy_dynamic_module_on_http_filter_response_body,
    envoy_dynamic_module_on_http_filter_response_trailers
);

/// Events of calls from a stream (sluice calls from its configuration,
/// `config_hooks`), and of watermarks: nothing to do.
macro_rules! ignore {
    ($($name:ident),*) => {$(
        #[no_mangle]
        pub extern "C" fn $name(_envoy: FilterPtr, _ptr: *mut c_void) {}
    )*};
}

ignore!(
    envoy_dynamic_module_on_http_filter_http_callout_done,
    envoy_dynamic_module_on_http_filter_http_stream_headers,
    envoy_dynamic_module_on_http_filter_http_stream_data,
    envoy_dynamic_module_on_http_filter_http_stream_trailers,
    envoy_dynamic_module_on_http_filter_http_stream_complete,
    envoy_dynamic_module_on_http_filter_http_stream_reset,
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark
);

#[cfg(test)]
mod tests {
    #[test]
    fn a_panic_gives_the_fallback() {
        assert_eq!(super::guard("test", 7, || 1), 1);
        assert_eq!(super::guard("test", 7, || panic!("boom")), 7);
    }
}
