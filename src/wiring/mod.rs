//! The wiring: which mechanisms exist, in which order a request meets
//! them, and how the configuration is assembled from their sections and
//! checked. The only module that knows every mechanism: [`crate::pipeline`]
//! runs stages it does not name, [`crate::config`] holds what they share,
//! and each mechanism is built from its own section plus
//! [`crate::config::Common`].
//!
//! A new mechanism: a folder with its `config.rs` (its section), its
//! `stage.rs` (its [`crate::pipeline::Stage`]), and one line here and one
//! field in [`config::Config`].

pub mod check;
pub mod config;
mod seed;
#[cfg(test)]
mod tests;

pub use config::{parse, Config};
pub use seed::shared_seed;

use crate::config::ConfigError;
use crate::pipeline::deadline::Budgets;
use crate::pipeline::telemetry::{Declared, Kind, Registry};
use crate::pipeline::{Pipeline, Stage};
pub use crate::ratelimit::global::Leading;
use crate::time::Instant;

/// Every mechanism's table of the metrics it may define.
pub const METRIC_TABLES: &[&[Declared]] = &[
    crate::pipeline::deadline::METRICS,
    crate::breaker::stage::METRICS,
    crate::retry::stage::METRICS,
    crate::bulkhead::stage::METRICS,
    crate::ratelimit::stage::METRICS,
    crate::shed::stage::METRICS,
];

/// Builds a configuration's pipeline, its stages in request order:
/// deadlines first (a request that cannot finish in time is refused before
/// anything is spent); breakers next, so a fast-failed request spends no
/// token; then retry budgets; then concurrency limits per key; then rate
/// limits; then shedders, which may queue. `seed` is the hash seed every VM
/// of this Envoy shares; `worker` a random tag of this VM; `now` the
/// time; `rng` seeds jitter.
pub fn pipeline(
    config: &Config,
    seed: (u64, u64),
    worker: u32,
    now: Instant,
    rng: u64,
) -> Result<Pipeline, ConfigError> {
    build(config, seed, (worker, now, rng), Leading::Allowed)
}

/// A configuration's pipeline, as [`pipeline`] builds it, whose global
/// rules never lead (see [`Leading`]): for a host whose pipeline cannot
/// call out from where it runs (the native build's workers).
pub fn follower(
    config: &Config,
    seed: (u64, u64),
    worker: u32,
    now: Instant,
    rng: u64,
) -> Result<Pipeline, ConfigError> {
    build(config, seed, (worker, now, rng), Leading::Never)
}

/// A configuration's pipeline, as [`pipeline`] builds it, built again
/// after the one that could lead was lost (a panic): it may lead, but does
/// not say its configuration is the newest (see [`Leading`]).
pub fn rebuilt(
    config: &Config,
    seed: (u64, u64),
    worker: u32,
    now: Instant,
    rng: u64,
) -> Result<Pipeline, ConfigError> {
    build(config, seed, (worker, now, rng), Leading::Rebuilt)
}

fn build(
    config: &Config,
    seed: (u64, u64),
    (worker, now, rng): (u32, Instant, u64),
    leading: Leading,
) -> Result<Pipeline, ConfigError> {
    let common = &config.common;
    let deadlines = config.deadlines.as_ref();
    // Every mechanism's table of metrics: defining another is refused.
    let mut metrics = Registry::declared(METRIC_TABLES);
    let m = &mut metrics;
    // The pipeline reads every request's deadline and bounds every wait by it.
    let budgets = deadlines.map(|spec| {
        let labels = [("domain", common.domain.as_str())];
        let refused = m.labelled(Kind::Counter, "sluice_deadline_refused_total", &labels);
        Budgets::new(spec.clone(), refused)
    });
    // The registration list: one line per mechanism, in request order.
    let stages: Vec<Box<dyn Stage>> = [
        crate::deadline::stage::build(deadlines)?,
        crate::breaker::stage::build(&config.breakers, common, seed, m)?,
        crate::retry::stage::build(&config.retry_budgets, common, m)?,
        crate::bulkhead::stage::build(&config.concurrency_limits, common, seed, m)?,
        crate::ratelimit::stage::build(&config.rules, common, seed, (rng, leading), m)?,
        crate::shed::stage::build(&config.shedders, common, now.as_ms(), worker, m)?,
    ]
    .into_iter()
    .flatten()
    .collect();
    metrics
        .check()
        .map_err(|e| crate::config::err("", format!("{e} (a defect of sluice)")))?;
    Ok(Pipeline::new(
        stages,
        common.response.clone(),
        budgets,
        metrics,
        rng,
    ))
}
