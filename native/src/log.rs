//! The `log` crate's records (the core's and this crate's) to Envoy's log,
//! under its `dynamic_modules` logger and level.

use crate::abi::{self, Buffer};
use log::{Level, LevelFilter, Log, Metadata, Record};
use std::sync::atomic::{AtomicBool, Ordering};

struct EnvoyLog;

fn level(l: Level) -> u32 {
    match l {
        Level::Error => abi::LOG_ERROR,
        Level::Warn => abi::LOG_WARN,
        Level::Info => abi::LOG_INFO,
        Level::Debug | Level::Trace => abi::LOG_DEBUG,
    }
}

impl Log for EnvoyLog {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        // SAFETY: a plain query of Envoy's logger.
        unsafe { abi::envoy_dynamic_module_callback_log_enabled(level(m.level())) }
    }

    fn log(&self, r: &Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let text = r.args().to_string();
        // SAFETY: the message lives for the call; Envoy copies it.
        unsafe {
            abi::envoy_dynamic_module_callback_log(level(r.level()), Buffer::of(text.as_bytes()))
        }
    }

    fn flush(&self) {}
}

/// Routes the `log` crate to Envoy (once per process).
pub fn init() {
    static LOGGER: EnvoyLog = EnvoyLog;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Debug);
    }
}

/// Says once that a worker index is beyond `config::MAX_WORKERS`.
pub fn once_worker_out_of_range(index: u32) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        log::error!("sluice: worker {index} is beyond the workers sluice serves; its streams pass");
    }
}
