//! Metrics as the core declares them: each stage defines its metrics by
//! name in a [`Registry`] when it is built, and reports changes to a
//! [`Sink`] by the ids the registry gave. The host defines the names with
//! Envoy and maps the ids; the core never sees Envoy's metric ids.
//!
//! Names follow Prometheus and Istio: counters end in `_total`, variants
//! are labels, and every series of a configuration carries its `domain`.
//! Labels are encoded in the name as Istio's own stats encode theirs,
//! `domain=.=default;.;rule=.=per-client;.;result=.=allowed;.;sluice_rl_requests_total`,
//! so that Istio's `extraStatTags` (or the `stats_tags` shipped in
//! `envoy/`, the same regexes, in plain Envoy) turn them into labels:
//! `sluice_rl_requests_total{domain="default",rule="per-client",result="allowed"}`.
//! Label values are names the configuration validated (`[A-Za-z0-9_-]`) or
//! fixed words, so they never contain the encoding's separators.

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

/// A metric a mechanism declares, in its one table of metrics: its name,
/// kind and label names (in order, a variant's label last).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declared {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
}

/// Every metric of one configuration, in definition order.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    pub defs: Vec<MetricDef>,
    /// The metrics that may be defined (`Registry::declared`): defining
    /// another, or one with another kind or labels, is a mistake that
    /// `check` reports (the configuration is then refused at start).
    declared: Option<Vec<Declared>>,
    mistakes: Vec<String>,
}

/// Every label name sluice uses, for `extraStatTags` and `stats_tags`.
pub const LABELS: [&str; 9] = [
    "domain",
    "budget",
    "limit",
    "rule",
    "result",
    "breaker",
    "transition",
    "shedder",
    "priority",
];

impl Registry {
    /// A registry that accepts only the metrics of these tables.
    pub fn declared(tables: &[&[Declared]]) -> Self {
        Registry {
            declared: Some(tables.iter().flat_map(|t| t.iter().copied()).collect()),
            ..Registry::default()
        }
    }

    /// The first metric defined that no table declares as defined, if any.
    pub fn check(&self) -> Result<(), String> {
        match self.mistakes.first() {
            Some(m) => Err(m.clone()),
            None => Ok(()),
        }
    }

    /// Notes a definition that does not match the declarations.
    fn verify(&mut self, kind: Kind, name: &str, labels: &[(&str, &str)]) {
        let Some(declared) = &self.declared else {
            return;
        };
        let names: Vec<&str> = labels.iter().map(|(k, _)| *k).collect();
        let found = declared.iter().find(|d| d.name == name);
        let problem = match found {
            None => "is not declared",
            Some(d) if d.kind != kind => "is declared with another kind",
            Some(d) if d.labels != names.as_slice() => "is declared with other labels",
            Some(_) => return,
        };
        self.mistakes.push(format!("metric `{name}` {problem}"));
    }

    /// Defines the metric `name` with these labels (or finds it).
    pub fn labelled(&mut self, kind: Kind, name: &str, labels: &[(&str, &str)]) -> MetricId {
        self.verify(kind, name, labels);
        let mut full = String::new();
        for (k, v) in labels {
            full.push_str(k);
            full.push_str("=.=");
            full.push_str(v);
            full.push_str(";.;");
        }
        full.push_str(name);
        self.untagged(kind, &full)
    }

    /// Defines counter `name` once for each value of label `key` (after
    /// `labels`), in the order given: a mechanism's variants, such as a
    /// rule's results.
    pub fn variants<const N: usize>(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        key: &str,
        values: [&str; N],
    ) -> [MetricId; N] {
        values.map(|v| {
            let mut l = labels.to_vec();
            l.push((key, v));
            self.labelled(Kind::Counter, name, &l)
        })
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

/// A sink for tests: sums every counter and gauge change, by name.
#[cfg(test)]
#[derive(Default)]
pub struct Recorder {
    pub names: Vec<String>,
    pub sums: std::collections::HashMap<String, i64>,
}

#[cfg(test)]
impl Recorder {
    /// A recorder that knows the names of `reg`'s metrics.
    pub fn of(reg: &Registry) -> Self {
        Recorder {
            names: reg.defs.iter().map(|d| d.name.clone()).collect(),
            ..Recorder::default()
        }
    }

    fn name(&self, m: MetricId) -> String {
        self.names.get(m as usize).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
impl Sink for Recorder {
    fn add(&mut self, m: MetricId, by: i64) {
        *self.sums.entry(self.name(m)).or_default() += by;
    }
    fn add_now(&mut self, m: MetricId, by: i64) {
        self.add(m, by);
    }
    fn record(&mut self, _m: MetricId, _value: u64) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const TABLE: &[Declared] = &[Declared {
        name: "sluice_x_total",
        kind: Kind::Counter,
        labels: &["domain", "result"],
    }];

    #[test]
    fn a_metric_defined_otherwise_than_declared_is_a_mistake_reported() {
        let mut r = Registry::declared(&[TABLE]);
        r.variants("sluice_x_total", &[("domain", "d")], "result", ["a", "b"]);
        assert_eq!(r.check(), Ok(()));
        for (kind, name, labels) in [
            (Kind::Counter, "sluice_y_total", &[("domain", "d")][..]),
            (
                Kind::Gauge,
                "sluice_x_total",
                &[("domain", "d"), ("result", "a")][..],
            ),
            (Kind::Counter, "sluice_x_total", &[("domain", "d")][..]),
        ] {
            let mut r = Registry::declared(&[TABLE]);
            r.labelled(kind, name, labels);
            assert!(r.check().is_err(), "{name} {kind:?} {labels:?}");
        }
    }

    #[test]
    fn labels_are_encoded_as_istio_extracts_them() {
        let mut r = Registry::default();
        let m = r.labelled(
            Kind::Counter,
            "sluice_rl_requests_total",
            &[("domain", "d"), ("rule", "r-1"), ("result", "allowed")],
        );
        assert_eq!(
            r.defs[m as usize].name,
            "domain=.=d;.;rule=.=r-1;.;result=.=allowed;.;sluice_rl_requests_total"
        );
        assert_eq!(
            r.labelled(
                Kind::Counter,
                "sluice_rl_requests_total",
                &[("domain", "d"), ("rule", "r-1"), ("result", "allowed")]
            ),
            m
        );
    }
}
