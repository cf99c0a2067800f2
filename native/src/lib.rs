//! sluice as an Envoy dynamic module: the same core as the proxy-wasm build
//! (`sluice::pipeline`), behind Envoy 1.40's dynamic-module ABI instead of
//! proxy-wasm. Glue only:
//!
//! - [`abi`]: the ABI's types and the callbacks used, declared by hand.
//! - `hooks` (this file): every event hook Envoy 1.40 resolves, each
//!   catching a panic and applying the failure policy.
//! - [`adapter`]: the one place that calls the core's pipeline.
//! - [`config`]: a filter configuration, with one pipeline per worker
//!   ([`worker`]: its state and the lock it is used under).
//! - [`main_thread`]: its pipeline on Envoy's main thread (the leader of
//!   its global rules); [`idle`]: that thread's tick, which also ticks the
//!   workers no hook ticks; [`config_hooks`]: that thread's hooks;
//!   [`calls`]: gRPC calls over Envoy's HTTP streams.
//! - [`filter`]: one stream's hooks and the effects carried out.
//! - [`store`]: the core's store over process memory.
//! - [`ticker`]: the thread that commits Envoy's schedulers when due.
//! - [`metrics`], [`config_metrics`]: the core's metrics as Envoy's (through
//!   a stream, or the configuration), named as in the wasm build.
//! - [`views`], [`reply`], [`log`]: requests, local replies, Envoy's log.

#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

mod abi;
mod adapter;
mod calls;
mod config;
mod config_hooks;
mod config_metrics;
#[cfg(test)]
mod fake_envoy;
mod filter;
#[cfg(test)]
mod global_tests;
mod hooks;
mod idle;
mod log;
mod main_thread;
mod metrics;
mod reply;
mod store;
#[cfg(test)]
mod tests;
mod ticker;
mod views;
mod worker;
