//! sluice as an Envoy dynamic module: the same core as the proxy-wasm build
//! (`sluice::pipeline`), behind Envoy 1.40's dynamic-module ABI instead of
//! proxy-wasm. Glue only:
//!
//! - [`abi`]: the ABI's types and the callbacks used, declared by hand.
//! - `hooks` (this file): every event hook Envoy 1.40 resolves, each
//!   catching a panic and applying the failure policy.
//! - [`adapter`]: the one place that calls the core's pipeline.
//! - [`config`]: a filter configuration, with one pipeline per worker.
//! - [`filter`]: one stream's hooks and the effects carried out.
//! - [`store`]: the core's store over process memory.
//! - [`ticker`]: ticks for workers whose streams wait.
//! - [`metrics`]: the core's metrics as Envoy's, named as in the wasm build.
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
mod config;
#[cfg(test)]
mod fake_envoy;
mod filter;
mod hooks;
mod log;
mod metrics;
mod reply;
mod store;
#[cfg(test)]
mod tests;
mod ticker;
mod views;
