//! Deadlines: how long the caller will still wait, read from the request
//! (`grpc-timeout`, Envoy's `x-envoy-expected-rq-timeout-ms`, or a
//! configured header). This folder holds the `deadlines` section and the
//! stage that refuses at once a request whose deadline cannot be met
//! (already passed, or less left than `min_remaining`). Reading the
//! deadline, bounding every wait by it, answering a wait cut short by it
//! and reducing the header sent upstream after a wait are the pipeline's
//! (`pipeline/deadline.rs`), the same for every mechanism that waits.

pub mod config;
pub mod stage;
#[cfg(test)]
mod tests;
