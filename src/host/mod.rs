//! The host adapter: the only code that calls proxy-wasm. It maps shared
//! data, the clock, randomness, metrics and logs onto the core, and carries
//! out the core's decisions. Hook bodies stay short on purpose.

mod http;
mod metrics;
mod plugin;
mod root;
mod shedding;
mod store;

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
