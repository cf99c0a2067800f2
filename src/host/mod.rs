//! The host adapter: the only code that calls proxy-wasm. Glue only: each
//! hook reads what the pipeline asks for, calls the pipeline, and carries
//! out its answer (a local reply, a paused or resumed stream, response
//! headers, a tick period, metric changes).

mod metrics;
mod plugin;
mod reply;
mod root;
mod store;
mod stream;
mod views;

use proxy_wasm::types::LogLevel;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::default()));
}}

/// Follows Envoy's `wasm` log level, so that debug lines cost nothing when
/// Envoy would drop them.
fn sync_log_level() {
    if let Ok(level) = proxy_wasm::hostcalls::get_log_level() {
        proxy_wasm::set_log_level(level);
    }
}
