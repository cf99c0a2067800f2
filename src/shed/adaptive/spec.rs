//! The settings of an adaptive limit, as validated from the configuration.

/// Validated settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveSpec {
    /// Bounds of the limit.
    pub min: u32,
    pub max: u32,
    /// The limit before anything is learned.
    pub initial: u32,
    /// Latency up to `floor × tolerance_pct / 100` counts as no queueing.
    pub tolerance_pct: u32,
    /// How often the limit is recomputed.
    pub interval_ms: u64,
    /// The floor is the minimum over the last one to two half-windows.
    pub floor_window_ms: u64,
}
