//! sluice: a proxy-wasm filter for Envoy that keeps services standing under
//! pressure: rate limits with token buckets kept in shared data (exact
//! across worker threads), circuit breakers on upstream error rates, and
//! load shedding by queue latency.
//!
//! Everything but `host` is the pure core: no proxy-wasm, time and
//! randomness passed in, decisions returned as values. The map:
//!
//! - [`pipeline`]: one request's way through the mechanisms, in order, and
//!   the per-stream state from arrival to the stream's end; the seam
//!   ([`pipeline::Stage`]) every mechanism plugs into.
//! - one folder per mechanism, each with the same roles: `mod.rs` (the
//!   mechanism), `config.rs` (its JSON and validation), `codec.rs` (its
//!   shared-data bytes), `reply.rs` (what a refused client sees),
//!   `stage.rs` (its [`pipeline::Stage`]): [`ratelimit`], [`breaker`],
//!   [`shed`], [`retry`], [`deadline`], [`bulkhead`].
//! - [`wiring`]: which mechanisms exist and in which order, the whole
//!   configuration assembled from their sections, and its check.
//! - [`config`]: what every mechanism shares ([`config::Common`]) and the
//!   validators in [`config::fields`].
//! - [`store`]: shared data as a compare-and-swap store, the layer that
//!   remembers a worker's own writes, and an in-memory store for tests.
//! - small shared pieces: [`keys`], [`request`], [`matcher`], [`reply`],
//!   [`codec`], [`hash`], [`duration`], [`rng`], [`sort`], and [`time`]
//!   (the instants and durations every interface between modules carries).
//! - `host` (wasm32-wasip1 only): the proxy-wasm adapter, glue only.

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
pub mod bulkhead;
pub mod codec;
pub mod config;
pub mod deadline;
pub mod duration;
pub mod hash;
pub mod header;
pub mod keys;
pub mod matcher;
pub mod pipeline;
pub mod ratelimit;
pub mod reply;
pub mod request;
pub mod retry;
pub mod rng;
pub mod shed;
pub mod small;
pub mod sort;
pub mod store;
pub mod time;
pub mod wiring;

#[cfg(target_os = "wasi")]
mod host;

/// How many seeds a seeded property test of the core runs, of the `n` it
/// runs natively: all of them natively, a quarter as wasm32. Under Node's
/// WebAssembly each seed takes about twice as long, and the wasm32 run is
/// there to show the core behaves the same on a 32-bit target, which a
/// quarter of the seeds shows as well; natively every seed runs.
#[cfg(test)]
pub(crate) fn test_seeds(n: u64) -> u64 {
    if cfg!(target_arch = "wasm32") {
        n.div_ceil(4)
    } else {
        n
    }
}
