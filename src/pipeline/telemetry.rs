//! Metrics as the core declares them: each stage defines its metrics by
//! name in a [`Registry`] when it is built, and reports changes to a
//! [`Sink`] by the ids the registry gave. The host defines the names with
//! Envoy and maps the ids; the core never sees Envoy's metric ids.
//!
//! Names are `sluice_<mechanism>_<what>.<tag>.<name>`, such as
//! `sluice_rl_allowed.rule.<rule>`: Envoy shows them with a `wasmcustom.`
//! prefix in /stats, and with the `stats_tags` shipped in `envoy/`, as
//! `sluice_rl_allowed{rule="<rule>"}` in /stats/prometheus.

/// An index into the registry.
pub type MetricId = u32;

/// A metric's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A metric to define with the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricDef {
    pub kind: Kind,
    pub name: String,
}

/// Every metric of one configuration, in definition order.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    pub defs: Vec<MetricDef>,
}

impl Registry {
    /// Defines `sluice_<prefix><what>.<tag>.<name>` (or finds it).
    pub fn tagged(
        &mut self,
        kind: Kind,
        prefix: &str,
        what: &str,
        tag: &str,
        name: &str,
    ) -> MetricId {
        self.untagged(kind, &format!("sluice_{prefix}{what}.{tag}.{name}"))
    }

    /// Defines the metric `name` (or finds it).
    pub fn untagged(&mut self, kind: Kind, name: &str) -> MetricId {
        if let Some(i) = self.defs.iter().position(|d| d.name == name) {
            return i as MetricId;
        }
        self.defs.push(MetricDef {
            kind,
            name: name.to_string(),
        });
        (self.defs.len() - 1) as MetricId
    }
}

/// Where metric changes go (the host's metrics; a recorder in tests).
pub trait Sink {
    /// Adds to a counter or gauge; the host may hand changes over in batches.
    fn add(&mut self, m: MetricId, by: i64);
    /// Adds to a counter at once.
    fn add_now(&mut self, m: MetricId, by: i64);
    /// Sets a gauge, or records a histogram value, at once.
    fn record(&mut self, m: MetricId, value: u64);
}
