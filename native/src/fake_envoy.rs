//! The callbacks of `abi`, for unit tests: a stream is a [`FakeStream`]
//! (its `FilterPtr` points at it), and what the module asked of Envoy is
//! recorded in it.

#![allow(clippy::missing_safety_doc)]

use crate::abi::{Buffer, FilterPtr, Header, SchedulerPtr};

/// A local reply: status, headers, body.
pub type Reply = (u32, Vec<(String, String)>, String);

#[derive(Default, Debug)]
pub struct FakeStream {
    pub request: Vec<(String, String)>,
    pub response: Vec<(String, String)>,
    pub worker: u32,
    /// (status, headers, body) of each local reply.
    pub replies: Vec<Reply>,
    pub continued: u32,
}

impl FakeStream {
    pub fn ptr(&mut self) -> FilterPtr {
        (self as *mut FakeStream).cast()
    }
}

unsafe fn stream<'a>(f: FilterPtr) -> &'a mut FakeStream {
    unsafe { &mut *f.cast::<FakeStream>() }
}

unsafe fn text(b: Buffer) -> String {
    String::from_utf8(unsafe { b.to_vec() }.unwrap_or_default()).unwrap()
}

fn map(s: &mut FakeStream, header_type: u32) -> &mut Vec<(String, String)> {
    if header_type == crate::abi::REQUEST_HEADERS {
        &mut s.request
    } else {
        &mut s.response
    }
}

pub unsafe fn envoy_dynamic_module_callback_log(_level: u32, _message: Buffer) {}

pub unsafe fn envoy_dynamic_module_callback_log_enabled(_level: u32) -> bool {
    false
}

/// Two workers, as the tests' Envoys have.
pub unsafe fn envoy_dynamic_module_callback_get_concurrency() -> u32 {
    2
}

pub unsafe fn envoy_dynamic_module_callback_http_get_header(
    f: FilterPtr,
    header_type: u32,
    key: Buffer,
    result: *mut Buffer,
    _index: usize,
    _optional_size: *mut usize,
) -> bool {
    let key = unsafe { text(key) };
    let s = unsafe { stream(f) };
    match map(s, header_type).iter().find(|(k, _)| *k == key) {
        Some((_, v)) => {
            unsafe { *result = Buffer::of(v.as_bytes()) };
            true
        }
        None => false,
    }
}

pub unsafe fn envoy_dynamic_module_callback_http_add_header(
    f: FilterPtr,
    header_type: u32,
    key: Buffer,
    value: Buffer,
) -> bool {
    let (k, v) = unsafe { (text(key), text(value)) };
    map(unsafe { stream(f) }, header_type).push((k, v));
    true
}

pub unsafe fn envoy_dynamic_module_callback_http_set_header(
    f: FilterPtr,
    header_type: u32,
    key: Buffer,
    value: Buffer,
) -> bool {
    let (k, v) = unsafe { (text(key), text(value)) };
    let m = map(unsafe { stream(f) }, header_type);
    m.retain(|(n, _)| *n != k);
    m.push((k, v));
    true
}

pub unsafe fn envoy_dynamic_module_callback_http_send_response(
    f: FilterPtr,
    status: u32,
    headers: *const Header,
    headers_len: usize,
    body: Buffer,
    _details: Buffer,
) {
    let headers = unsafe { std::slice::from_raw_parts(headers, headers_len) }
        .iter()
        .map(|h| unsafe {
            (
                text(Buffer {
                    ptr: h.key_ptr,
                    len: h.key_len,
                }),
                text(Buffer {
                    ptr: h.value_ptr,
                    len: h.value_len,
                }),
            )
        })
        .collect();
    let body = unsafe { text(body) };
    unsafe { stream(f) }.replies.push((status, headers, body));
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
    _f: FilterPtr,
    _attribute: u32,
    _result: *mut Buffer,
) -> bool {
    false
}

/// The response code, as Envoy's stream info has it once response
/// headers are there: the `:status` a test gave the response.
pub unsafe fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
    f: FilterPtr,
    attribute: u32,
    result: *mut u64,
) -> bool {
    let s = unsafe { stream(f) };
    let code = s.response.iter().find(|(k, _)| k == ":status");
    match code.and_then(|(_, v)| v.parse().ok()) {
        Some(c) if attribute == crate::abi::ATTR_RESPONSE_CODE => {
            unsafe { *result = c };
            true
        }
        _ => false,
    }
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_get_worker_index(f: FilterPtr) -> u32 {
    unsafe { stream(f) }.worker
}

/// What a test has Envoy do at once when a stream is continued.
type OnContinue = Option<Box<dyn FnMut(FilterPtr)>>;

thread_local! {
    /// What Envoy does synchronously when a stream is continued (a
    /// resumed stream answered and completed at once, say).
    pub static ON_CONTINUE: std::cell::RefCell<OnContinue> = const { std::cell::RefCell::new(None) };
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_continue_decoding(f: FilterPtr) {
    unsafe { stream(f) }.continued += 1;
    let hook = ON_CONTINUE.with(|h| h.borrow_mut().take());
    if let Some(mut h) = hook {
        h(f);
        ON_CONTINUE.with(|c| *c.borrow_mut() = Some(h));
    }
}

/// A scheduler that schedules nothing (tests tick through the hooks).
pub unsafe fn envoy_dynamic_module_callback_http_filter_scheduler_new(
    f: FilterPtr,
) -> SchedulerPtr {
    f
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
    _s: SchedulerPtr,
    _event_id: u64,
) {
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_scheduler_delete(_s: SchedulerPtr) {}

/// Metrics: ids count up from 1; changes are not recorded.
static NEXT_METRIC: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

pub unsafe fn envoy_dynamic_module_callback_http_filter_config_define_counter(
    _config: crate::abi::ConfigEnvoyPtr,
    _name: Buffer,
    _label_names: *const Buffer,
    _label_names_len: usize,
    id: *mut usize,
) -> u32 {
    unsafe { *id = NEXT_METRIC.fetch_add(1, std::sync::atomic::Ordering::Relaxed) };
    0
}

pub use envoy_dynamic_module_callback_http_filter_config_define_counter as envoy_dynamic_module_callback_http_filter_config_define_gauge;
pub use envoy_dynamic_module_callback_http_filter_config_define_counter as envoy_dynamic_module_callback_http_filter_config_define_histogram;

pub unsafe fn envoy_dynamic_module_callback_http_filter_increment_counter(
    _f: FilterPtr,
    _id: usize,
    _label_values: *const Buffer,
    _label_values_len: usize,
    _value: u64,
) -> u32 {
    0
}

pub use envoy_dynamic_module_callback_http_filter_increment_counter as envoy_dynamic_module_callback_http_filter_increment_gauge;
pub use envoy_dynamic_module_callback_http_filter_increment_counter as envoy_dynamic_module_callback_http_filter_decrement_gauge;
pub use envoy_dynamic_module_callback_http_filter_increment_counter as envoy_dynamic_module_callback_http_filter_set_gauge;
pub use envoy_dynamic_module_callback_http_filter_increment_counter as envoy_dynamic_module_callback_http_filter_record_histogram_value;

/// Configuration schedulers: each a box; commits are recorded (tests run
/// the scheduled hook themselves).
pub static CONFIG_COMMITS: std::sync::Mutex<Vec<(usize, u64)>> = std::sync::Mutex::new(Vec::new());

pub unsafe fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
    _config: crate::abi::ConfigEnvoyPtr,
) -> crate::abi::ConfigSchedulerPtr {
    Box::into_raw(Box::new(0u64)).cast()
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
    s: crate::abi::ConfigSchedulerPtr,
    event_id: u64,
) {
    if let Ok(mut c) = CONFIG_COMMITS.lock() {
        c.push((s as usize, event_id));
    }
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
    s: crate::abi::ConfigSchedulerPtr,
) {
    drop(unsafe { Box::from_raw(s.cast::<u64>()) });
}

/// A stream the module started to a cluster: cluster, headers, body, timeout.
#[derive(Debug, Clone)]
pub struct Started {
    pub id: u64,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub end_stream: bool,
    pub timeout_ms: u64,
}

thread_local! {
    /// The streams started on this thread, and whether starting fails.
    pub static STARTED: std::cell::RefCell<Vec<Started>> = const { std::cell::RefCell::new(Vec::new()) };
    pub static START_FAILS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set to a configuration `config_new` made: a call's stream is reset
    /// inside `start_http_stream`, as Envoy resets one to a cluster
    /// without a healthy host before the start returns.
    pub static RESET_ON_START: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

static NEXT_STREAM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[allow(clippy::too_many_arguments)]
pub unsafe fn envoy_dynamic_module_callback_http_filter_config_start_http_stream(
    _config: crate::abi::ConfigEnvoyPtr,
    stream_id: *mut u64,
    cluster: Buffer,
    headers: *const Header,
    headers_len: usize,
    body: Buffer,
    end_stream: bool,
    timeout_ms: u64,
) -> u32 {
    if START_FAILS.with(|f| f.get()) {
        return 2;
    }
    let id = NEXT_STREAM.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let headers = unsafe { std::slice::from_raw_parts(headers, headers_len) }
        .iter()
        .map(|h| {
            let (k, v) = unsafe { h.to_pair() };
            (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap())
        })
        .collect();
    let started = Started {
        id,
        cluster: unsafe { text(cluster) },
        headers,
        body: unsafe { body.to_vec() }.unwrap_or_default(),
        end_stream,
        timeout_ms,
    };
    STARTED.with(|s| s.borrow_mut().push(started));
    unsafe { *stream_id = id };
    let reset = RESET_ON_START.with(|r| r.get());
    if reset != 0 {
        crate::config_hooks::envoy_dynamic_module_on_http_filter_config_http_stream_reset(
            std::ptr::null_mut(),
            reset as *const std::ffi::c_void,
            id,
            0,
        );
    }
    0
}

pub unsafe fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
    _config: crate::abi::ConfigEnvoyPtr,
    _id: usize,
    _label_values: *const Buffer,
    _label_values_len: usize,
    _value: u64,
) -> u32 {
    0
}

pub use envoy_dynamic_module_callback_http_filter_config_increment_counter as envoy_dynamic_module_callback_http_filter_config_increment_gauge;
pub use envoy_dynamic_module_callback_http_filter_config_increment_counter as envoy_dynamic_module_callback_http_filter_config_decrement_gauge;
pub use envoy_dynamic_module_callback_http_filter_config_increment_counter as envoy_dynamic_module_callback_http_filter_config_set_gauge;
pub use envoy_dynamic_module_callback_http_filter_config_increment_counter as envoy_dynamic_module_callback_http_filter_config_record_histogram_value;
