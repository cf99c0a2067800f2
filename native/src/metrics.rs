//! The core's metrics as Envoy's dynamic-module metrics: each one the core
//! defines is defined with Envoy when the configuration loads (creation is
//! frozen afterwards), under the same name as in the wasm build: labels
//! encoded in the name (`domain=.=d;.;rule=.=r;.;...`), which the same
//! `stats_tags` (or Istio's `extraStatTags`) turn into the same labels.
//! Changes go to Envoy at once: a call here is an atomic add, not a trip
//! out of a VM, so nothing is batched.

use crate::abi::{self, Buffer, ConfigEnvoyPtr, FilterPtr};
use sluice::pipeline::telemetry::{Kind, MetricDef, MetricId, Sink};

/// Envoy's id of each metric, indexed by the core's (0: not defined).
#[derive(Default)]
pub struct Ids(Vec<(Kind, usize)>);

/// Defines every metric of a configuration with Envoy.
pub fn define(config: ConfigEnvoyPtr, defs: &[MetricDef]) -> Ids {
    Ids(defs
        .iter()
        .map(|d| (d.kind, define_one(config, d)))
        .collect())
}

fn define_one(config: ConfigEnvoyPtr, d: &MetricDef) -> usize {
    let mut id = 0;
    let name = Buffer::of(d.name.as_bytes());
    let none = std::ptr::null();
    // SAFETY: `config` is the configuration being made (`config_new`'s
    // argument); the name lives for the call; `id` is ours.
    let result = unsafe {
        match d.kind {
            Kind::Counter => abi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                config, name, none, 0, &mut id,
            ),
            Kind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_define_gauge(
                config, name, none, 0, &mut id,
            ),
            Kind::Histogram => {
                abi::envoy_dynamic_module_callback_http_filter_config_define_histogram(
                    config, name, none, 0, &mut id,
                )
            }
        }
    };
    if result != 0 {
        log::warn!("sluice: metric {} not defined ({result})", d.name);
        return 0;
    }
    id
}

/// The core's metric changes, to Envoy, through a stream's filter of the
/// configuration (Envoy's metric calls take one).
pub struct EnvoySink<'a> {
    pub ids: &'a Ids,
    pub filter: FilterPtr,
}

impl Ids {
    /// The kind and Envoy's id of the core's metric `m`, if defined.
    pub fn get(&self, m: MetricId) -> Option<(Kind, usize)> {
        self.0.get(m as usize).copied().filter(|(_, id)| *id != 0)
    }
}

impl EnvoySink<'_> {
    fn id(&self, m: MetricId) -> Option<(Kind, usize)> {
        self.ids.get(m)
    }
}

impl Sink for EnvoySink<'_> {
    fn add(&mut self, m: MetricId, by: i64) {
        let Some((kind, id)) = self.id(m) else {
            return;
        };
        let n = by.unsigned_abs();
        let none = std::ptr::null();
        // SAFETY: `filter` is a live stream's filter of the configuration
        // that defined `id`.
        unsafe {
            match (kind, by < 0) {
                (Kind::Counter, false) => {
                    abi::envoy_dynamic_module_callback_http_filter_increment_counter(
                        self.filter,
                        id,
                        none,
                        0,
                        n,
                    )
                }
                (Kind::Gauge, false) => {
                    abi::envoy_dynamic_module_callback_http_filter_increment_gauge(
                        self.filter,
                        id,
                        none,
                        0,
                        n,
                    )
                }
                (Kind::Gauge, true) => {
                    abi::envoy_dynamic_module_callback_http_filter_decrement_gauge(
                        self.filter,
                        id,
                        none,
                        0,
                        n,
                    )
                }
                _ => 0,
            };
        }
    }

    fn add_now(&mut self, m: MetricId, by: i64) {
        self.add(m, by);
    }

    fn record(&mut self, m: MetricId, value: u64) {
        let Some((kind, id)) = self.id(m) else {
            return;
        };
        let none = std::ptr::null();
        // SAFETY: as in `add`.
        unsafe {
            match kind {
                Kind::Gauge => abi::envoy_dynamic_module_callback_http_filter_set_gauge(
                    self.filter,
                    id,
                    none,
                    0,
                    value,
                ),
                Kind::Histogram => {
                    abi::envoy_dynamic_module_callback_http_filter_record_histogram_value(
                        self.filter,
                        id,
                        none,
                        0,
                        value,
                    )
                }
                Kind::Counter => 0,
            };
        }
    }
}
