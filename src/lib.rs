//! sluice: a proxy-wasm filter for Envoy that rate-limits with token buckets
//! kept in shared data, exact across worker threads.
//!
//! Everything but `host` is the pure core: no proxy-wasm, time and
//! randomness passed in, decisions returned as values. `host` is the thin
//! adapter compiled only for `wasm32-wasip1`.

#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

pub mod breaker;
pub mod bucket;
pub mod codec;
pub mod config;
pub mod duration;
pub mod fastmap;
pub mod keys;
pub mod limiter;
pub mod matcher;
pub mod request;
pub mod response;
pub mod rng;
pub mod shed;
pub mod siphash;
pub mod store;

#[cfg(test)]
mod config_tests;
#[cfg(test)]
mod limiter_tests;
#[cfg(test)]
mod store_tests;

#[cfg(target_os = "wasi")]
mod host;
