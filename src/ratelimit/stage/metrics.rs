//! The metrics the rate-limit stage declares: each rule's counters,
//! gauges and histogram, and each global rule's. Declared once, when the
//! stage is built; its own file so that every metric name and label of
//! rate limiting is found in one place.

use crate::pipeline::telemetry::Declared;
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::ratelimit::config::RuleSpec;
use crate::ratelimit::global::{GlobalMetrics, TokenMetrics};

/// The metrics of rate limits, global rules included.
pub const METRICS: &[Declared] = &[
    Declared {
        name: "sluice_rl_requests_total",
        kind: Kind::Counter,
        labels: &["domain", "rule", "result"],
    },
    Declared {
        name: "sluice_rl_table_entries",
        kind: Kind::Gauge,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_rl_cas_retries_total",
        kind: Kind::Counter,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_rl_corrupt_state_total",
        kind: Kind::Counter,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_rl_collisions_total",
        kind: Kind::Counter,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_rl_delay_ms",
        kind: Kind::Histogram,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_rl_held",
        kind: Kind::Gauge,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_global_leader",
        kind: Kind::Gauge,
        labels: &["domain"],
    },
    Declared {
        name: "sluice_global_mode",
        kind: Kind::Gauge,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_global_starved_total",
        kind: Kind::Counter,
        labels: &["domain", "rule"],
    },
    Declared {
        name: "sluice_global_calls_total",
        kind: Kind::Counter,
        labels: &["domain", "rule", "result"],
    },
    Declared {
        name: "sluice_global_tokens_total",
        kind: Kind::Counter,
        labels: &["domain", "rule", "result"],
    },
];

/// Metric ids of one rule (labels `domain`, `rule`).
#[derive(Clone, Copy)]
pub(super) struct RuleMetrics {
    pub(super) allowed: MetricId,
    pub(super) limited: MetricId,
    pub(super) shadow_limited: MetricId,
    pub(super) store_failures: MetricId,
    pub(super) cas_retries: MetricId,
    pub(super) corrupt: MetricId,
    pub(super) collisions: MetricId,
    pub(super) table_entries: MetricId,
    /// Shaping rules only: delayed requests, the delay histogram (ms), and
    /// the requests held now.
    pub(super) delayed: Option<(MetricId, MetricId, MetricId)>,
}

/// The metrics of one global rule.
pub(super) fn global_metrics(reg: &mut Registry, domain: &str, rule: &str) -> GlobalMetrics {
    let labels = [("domain", domain), ("rule", rule)];
    GlobalMetrics {
        mode: reg.labelled(Kind::Gauge, "sluice_global_mode", &labels),
        starved: reg.labelled(Kind::Counter, "sluice_global_starved_total", &labels),
        calls: reg.variants(
            "sluice_global_calls_total",
            &labels,
            "result",
            ["ok", "over_limit", "error"],
        ),
        tokens: {
            let [granted, dropped] = reg.variants(
                "sluice_global_tokens_total",
                &labels,
                "result",
                ["granted", "dropped"],
            );
            TokenMetrics { granted, dropped }
        },
    }
}

/// The metrics of one rule (labels `domain`, `rule`).
pub(super) fn rule_metrics(reg: &mut Registry, domain: &str, r: &RuleSpec) -> RuleMetrics {
    let labels = [("domain", domain), ("rule", r.name.as_str())];
    let [allowed, limited, shadow_limited, store_failures] = reg.variants(
        "sluice_rl_requests_total",
        &labels,
        "result",
        ["allowed", "limited", "shadow_limited", "store_failure"],
    );
    let mut m = |kind, name| reg.labelled(kind, name, &labels);
    RuleMetrics {
        allowed,
        limited,
        shadow_limited,
        store_failures,
        table_entries: m(Kind::Gauge, "sluice_rl_table_entries"),
        cas_retries: m(Kind::Counter, "sluice_rl_cas_retries_total"),
        corrupt: m(Kind::Counter, "sluice_rl_corrupt_state_total"),
        collisions: m(Kind::Counter, "sluice_rl_collisions_total"),
        delayed: r.shaping.map(|_| {
            let delayed = [labels[0], labels[1], ("result", "delayed")];
            (
                reg.labelled(Kind::Counter, "sluice_rl_requests_total", &delayed),
                reg.labelled(Kind::Histogram, "sluice_rl_delay_ms", &labels),
                reg.labelled(Kind::Gauge, "sluice_rl_held", &labels),
            )
        }),
    }
}
