//! The metrics of each shedder (labels `domain`, `shedder`): their ids,
//! kept by each shedder, and their declaration in the registry when the
//! shedders are built.

use super::config::{Class, ShedderSpec};
use crate::pipeline::telemetry::Declared;
use crate::pipeline::telemetry::{Kind, MetricId, Registry};

/// The metrics of shedders.
pub const METRICS: &[Declared] = &[
    Declared {
        name: "sluice_shed_total",
        kind: Kind::Counter,
        labels: &["domain", "shedder", "priority"],
    },
    Declared {
        name: "sluice_shed_in_flight",
        kind: Kind::Gauge,
        labels: &["domain", "shedder"],
    },
    Declared {
        name: "sluice_shed_queued",
        kind: Kind::Gauge,
        labels: &["domain", "shedder"],
    },
    Declared {
        name: "sluice_shed_queue_ms",
        kind: Kind::Histogram,
        labels: &["domain", "shedder"],
    },
    Declared {
        name: "sluice_shed_overloaded_workers",
        kind: Kind::Gauge,
        labels: &["domain", "shedder"],
    },
    Declared {
        name: "sluice_shed_limit",
        kind: Kind::Gauge,
        labels: &["domain", "shedder"],
    },
    Declared {
        name: "sluice_shed_latency_floor_ms",
        kind: Kind::Gauge,
        labels: &["domain", "shedder"],
    },
];

/// Metric ids of one shedder (labels `domain`, `shedder`).
#[derive(Debug, Clone, Copy)]
pub struct ShedMetrics {
    pub(super) in_flight: MetricId,
    pub(super) queued: MetricId,
    pub(super) queue_ms: MetricId,
    pub(super) overloaded: MetricId,
    pub(super) shed: [MetricId; 3],
    /// Adaptive limits only: the limit, and the latency floor (ms).
    pub(super) adaptive: Option<(MetricId, MetricId)>,
}

/// The metrics of one shedder (labels `domain`, `shedder`).
pub(super) fn shedder_metrics(reg: &mut Registry, domain: &str, s: &ShedderSpec) -> ShedMetrics {
    let labels = [("domain", domain), ("shedder", s.name.as_str())];
    // Indexed by `Class as usize`.
    let classes = [Class::Sheddable, Class::Default, Class::Critical].map(Class::name);
    let shed = reg.variants("sluice_shed_total", &labels, "priority", classes);
    let mut m = |kind, name| reg.labelled(kind, name, &labels);
    let adaptive = s.concurrency.as_ref().and_then(|c| c.adaptive).map(|_| {
        (
            m(Kind::Gauge, "sluice_shed_limit"),
            m(Kind::Gauge, "sluice_shed_latency_floor_ms"),
        )
    });
    ShedMetrics {
        in_flight: m(Kind::Gauge, "sluice_shed_in_flight"),
        queued: m(Kind::Gauge, "sluice_shed_queued"),
        queue_ms: m(Kind::Histogram, "sluice_shed_queue_ms"),
        overloaded: m(Kind::Gauge, "sluice_shed_overloaded_workers"),
        shed,
        adaptive,
    }
}
