//! The part of Envoy's dynamic-module ABI this module uses, declared by
//! hand (no bindgen, no libclang), pinned to Envoy 1.40's ABI `v0.2.0`
//! (`source/extensions/dynamic_modules/abi/abi.h`; the callbacks' argument
//! lists checked against the 1.40 binary).
//!
//! Buffers are `{ptr, len}` passed by value: on x86-64 and aarch64 a
//! 16-byte struct of two integers travels in two registers, as two
//! arguments would. Every callback declared here is imported, and a Rust
//! `cdylib` binds them all at load: a callback the Envoy binary lacks fails
//! the load (the e2e test checks the imports against the binary in use).

use std::ffi::c_void;

/// The ABI version Envoy 1.40 expects from `envoy_dynamic_module_on_program_init`.
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// Envoy's `DynamicModuleHttpFilter` of one stream (`filter_envoy_ptr`).
pub type FilterPtr = *mut c_void;
/// Envoy's `DynamicModuleHttpFilterConfig` (`filter_config_envoy_ptr`).
pub type ConfigEnvoyPtr = *mut c_void;
/// A per-stream scheduler Envoy made for the module.
pub type SchedulerPtr = *mut c_void;
/// A per-configuration scheduler: its events run on Envoy's main thread.
pub type ConfigSchedulerPtr = *mut c_void;

/// `envoy_dynamic_module_type_{envoy,module}_buffer`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buffer {
    pub ptr: *const u8,
    pub len: usize,
}

impl Buffer {
    pub const EMPTY: Buffer = Buffer {
        ptr: std::ptr::null(),
        len: 0,
    };

    pub fn of(bytes: &[u8]) -> Buffer {
        Buffer {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }

    /// The bytes, copied (`None` for a null pointer).
    ///
    /// # Safety
    /// As for [`Buffer::as_slice`].
    pub unsafe fn to_vec(self) -> Option<Vec<u8>> {
        // SAFETY: the caller's promise.
        unsafe { self.as_slice() }.map(<[u8]>::to_vec)
    }

    /// The bytes, borrowed (`None` for a null pointer).
    ///
    /// # Safety
    /// `ptr` must point at `len` readable bytes (Envoy's promise for the
    /// duration of the call that handed the buffer over) for as long as
    /// the slice is used.
    pub unsafe fn as_slice<'a>(self) -> Option<&'a [u8]> {
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: the caller's promise.
        Some(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Header {
    pub key_ptr: *const u8,
    pub key_len: usize,
    pub value_ptr: *const u8,
    pub value_len: usize,
}

impl Header {
    pub const EMPTY: Header = Header {
        key_ptr: std::ptr::null(),
        key_len: 0,
        value_ptr: std::ptr::null(),
        value_len: 0,
    };

    pub fn of(key: &str, value: &str) -> Header {
        Header::bytes(key, value.as_bytes())
    }

    /// A header whose value is bytes (sent as they are).
    pub fn bytes(key: &str, value: &[u8]) -> Header {
        Header {
            key_ptr: key.as_ptr(),
            key_len: key.len(),
            value_ptr: value.as_ptr(),
            value_len: value.len(),
        }
    }

    /// An Envoy-owned header (`envoy_dynamic_module_type_envoy_http_header`,
    /// the same layout), copied.
    ///
    /// # Safety
    /// Both pointers must describe readable bytes (Envoy's promise for the
    /// hook that handed the header over).
    pub unsafe fn to_pair(self) -> (Vec<u8>, Vec<u8>) {
        // SAFETY: the caller's promise.
        unsafe {
            let key = Buffer {
                ptr: self.key_ptr,
                len: self.key_len,
            };
            let value = Buffer {
                ptr: self.value_ptr,
                len: self.value_len,
            };
            (
                key.to_vec().unwrap_or_default(),
                value.to_vec().unwrap_or_default(),
            )
        }
    }
}

/// `envoy_dynamic_module_type_http_callout_init_result_Success`: a stream
/// to a cluster was started (its events follow); any other value, it was
/// not (no event follows).
pub const CALLOUT_STARTED: u32 = 0;

/// `envoy_dynamic_module_type_http_header_type`.
pub const REQUEST_HEADERS: u32 = 0;
pub const RESPONSE_HEADERS: u32 = 2;

/// `envoy_dynamic_module_type_on_http_filter_*_status`: go on, or stop
/// iteration (the stream waits for `continue_decoding` or a local reply).
pub const CONTINUE: u32 = 0;
pub const STOP_ITERATION: u32 = 1;

/// `envoy_dynamic_module_type_attribute_id`.
pub const ATTR_RESPONSE_CODE: u32 = 15;
pub const ATTR_RESPONSE_CODE_DETAILS: u32 = 16;
pub const ATTR_SOURCE_ADDRESS: u32 = 24;
pub const ATTR_XDS_CLUSTER_NAME: u32 = 57;
pub const ATTR_XDS_ROUTE_NAME: u32 = 61;

/// `envoy_dynamic_module_type_log_level`.
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;

#[cfg(not(test))]
extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: u32, message: Buffer);
    pub fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;
    /// Envoy's worker count (main thread only; 0 if unknown).
    pub fn envoy_dynamic_module_callback_get_concurrency() -> u32;
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterPtr,
        header_type: u32,
        key: Buffer,
        result: *mut Buffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: FilterPtr,
        header_type: u32,
        key: Buffer,
        value: Buffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterPtr,
        header_type: u32,
        key: Buffer,
        value: Buffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterPtr,
        status: u32,
        headers: *const Header,
        headers_len: usize,
        body: Buffer,
        details: Buffer,
    );
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterPtr,
        attribute: u32,
        result: *mut Buffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter: FilterPtr,
        attribute: u32,
        result: *mut u64,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_worker_index(filter: FilterPtr) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterPtr);
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter: FilterPtr,
    ) -> SchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: SchedulerPtr,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: SchedulerPtr);
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: ConfigEnvoyPtr,
    ) -> ConfigSchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: ConfigSchedulerPtr,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler: ConfigSchedulerPtr,
    );
    /// A stream to `cluster` from the configuration, on the main thread
    /// (its events too): the request's headers, its body, and a timeout
    /// for the whole exchange.
    #[allow(clippy::too_many_arguments)]
    pub fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
        config: ConfigEnvoyPtr,
        stream_id: *mut u64,
        cluster: Buffer,
        headers: *const Header,
        headers_len: usize,
        body: Buffer,
        end_stream: bool,
        timeout_ms: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: ConfigEnvoyPtr,
        name: Buffer,
        label_names: *const Buffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: ConfigEnvoyPtr,
        name: Buffer,
        label_names: *const Buffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: ConfigEnvoyPtr,
        name: Buffer,
        label_names: *const Buffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: FilterPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_increment_gauge(
        filter: FilterPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_decrement_gauge(
        filter: FilterPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter: FilterPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter: FilterPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const Buffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
}

#[cfg(test)]
pub use crate::fake_envoy::*;
