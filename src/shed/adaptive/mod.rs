//! An adaptive concurrency limit (`concurrency.max: "auto"`), learned from
//! latency as Netflix's gradient limiter and Envoy's `adaptive_concurrency`
//! do: while admitted requests take about as long as the upstream's
//! no-load floor, the limit grows in proportion and by about its square
//! root per interval; when they take longer (the upstream queues), it
//! shrinks in proportion (`limit × tolerance × floor / latency`, at most
//! halving per interval), keeping one request over what the upstream
//! serves at its floor latency.
//!
//! Shared across Envoy's workers: each worker adds its latency samples to
//! one shared entry on its tick (one CAS per tick, never per request), and
//! the first worker to find an interval over computes the next limit from
//! everyone's samples. The floor is the lowest latency seen over the last
//! one to two half-windows of `floor_window`, so it follows an upstream
//! whose own speed changes, within a window. Every worker reads the limit
//! back on its tick: an update reaches all of them within a tick.
//!
//! By role: `spec.rs` holds the settings; `state.rs` the shared record as
//! the logic works on it (absent values as `Option`s); `layout.rs` the
//! record as stored (its fields, sentinels and bytes); `samples.rs` what a
//! worker gathers and its merge into the record; `gradient.rs` the limit's
//! update at the end of an interval; `floor.rs` the latency floor,
//! estimated and measured.

mod floor;
mod gradient;
mod layout;
mod samples;
mod spec;
mod state;
#[cfg(test)]
mod tests;

pub use floor::CAL_SAMPLES;
// For the simulations in `adaptive_sim` (tests only).
#[cfg(test)]
pub(crate) use gradient::STUCK_RUN;
pub use samples::Samples;
pub use spec::AdaptiveSpec;
pub use state::{Auto, Measured};
