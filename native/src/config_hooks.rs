//! The event hooks of a configuration, on Envoy's main thread: its
//! scheduler's events (`main_thread`) and the events of the streams its
//! calls run on (`calls`). Optional in Envoy 1.40 (a module without them
//! loads); each catches a panic, as every hook does.

use crate::abi::{Buffer, ConfigEnvoyPtr, Header};
use crate::config::FilterConfig;
use crate::hooks::guard;
use crate::ticker;
use std::ffi::c_void;

/// The configuration `config_new` made.
///
/// # Safety
/// `ptr` is null or the pointer `config_new` returned, not yet destroyed
/// (Envoy calls a configuration's hooks only while it lives).
unsafe fn config<'a>(ptr: *const c_void) -> Option<&'a FilterConfig> {
    // SAFETY: the caller's promise.
    unsafe { ptr.cast::<FilterConfig>().as_ref() }
}

/// Envoy's headers of a hook, copied.
///
/// # Safety
/// `headers` is null or points at `n` headers (Envoy's promise for the hook).
unsafe fn pairs(headers: *const Header, n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    if headers.is_null() {
        return Vec::new();
    }
    // SAFETY: the caller's promise.
    let list = unsafe { std::slice::from_raw_parts(headers, n) };
    // SAFETY: as above, for each header's bytes.
    list.iter().map(|h| unsafe { h.to_pair() }).collect()
}

/// The configuration's scheduler: its tick, or a wake-up of its queue.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    event_id: u64,
) {
    // SAFETY: Envoy's promise for hook arguments (see `config`).
    let Some(c) = (unsafe { config(ptr) }) else {
        return;
    };
    if event_id == ticker::EVENT_WAKE {
        guard("config woken", (), || c.main.woken(c));
        return;
    }
    let next = guard("config tick", None, || Some(c.main_tick()));
    guard("config tick", (), || {
        if let Some(key) = c.main.key() {
            let fallback = crate::adapter::now_ms() + crate::main_thread::SLOW_MS;
            ticker::main_ran(key, next.unwrap_or(fallback));
        }
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    stream: u64,
    headers: *const Header,
    n: usize,
    _end_stream: bool,
) {
    guard("call headers", (), || {
        // SAFETY: as in `config_scheduled`; the headers live for the hook.
        if let Some(c) = unsafe { config(ptr) } {
            c.main
                .call_headers(stream, &unsafe { pairs(headers, n) }, false);
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    stream: u64,
    data: *const Buffer,
    n: usize,
    _end_stream: bool,
) {
    guard("call data", (), || {
        // SAFETY: as in `config_scheduled`.
        let Some(c) = (unsafe { config(ptr) }) else {
            return;
        };
        if data.is_null() {
            return;
        }
        // SAFETY: Envoy's `n` buffers, alive for the hook.
        for b in unsafe { std::slice::from_raw_parts(data, n) } {
            // SAFETY: as above.
            if let Some(bytes) = unsafe { b.to_vec() } {
                c.main.call_data(stream, &bytes);
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    stream: u64,
    trailers: *const Header,
    n: usize,
) {
    guard("call trailers", (), || {
        // SAFETY: as in `call_headers`.
        if let Some(c) = unsafe { config(ptr) } {
            c.main
                .call_headers(stream, &unsafe { pairs(trailers, n) }, true);
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(
    _envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    stream: u64,
) {
    guard("call complete", (), || {
        // SAFETY: as in `config_scheduled`.
        if let Some(c) = unsafe { config(ptr) } {
            c.main.call_end(c, stream, true);
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(
    _envoy: ConfigEnvoyPtr,
    ptr: *const c_void,
    stream: u64,
    _reason: u32,
) {
    guard("call reset", (), || {
        // SAFETY: as in `config_scheduled`.
        if let Some(c) = unsafe { config(ptr) } {
            c.main.call_end(c, stream, false);
        }
    })
}
