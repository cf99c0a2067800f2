//! The core's metric changes to Envoy through the configuration instead of
//! a stream (Envoy's `http_filter_config_*` metric callbacks): for the
//! calls that have no stream, on the main thread (the configuration's own
//! pipeline, a worker's tick run on its behalf, a configuration going
//! away). The same ids as `metrics::EnvoySink`'s.

use crate::abi::{self, ConfigEnvoyPtr};
use crate::metrics::Ids;
use sluice::pipeline::telemetry::{Kind, MetricId, Sink};

pub struct ConfigSink<'a> {
    pub ids: &'a Ids,
    pub config: ConfigEnvoyPtr,
}

impl Sink for ConfigSink<'_> {
    fn add(&mut self, m: MetricId, by: i64) {
        let Some((kind, id)) = self.ids.get(m) else {
            return;
        };
        let (c, n, none) = (self.config, by.unsigned_abs(), std::ptr::null());
        // SAFETY: `config` is Envoy's configuration that defined `id`,
        // alive while the module's configuration is (it destroys ours).
        unsafe {
            match (kind, by < 0) {
                (Kind::Counter, false) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                        c, id, none, 0, n,
                    )
                }
                (Kind::Gauge, false) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                        c, id, none, 0, n,
                    )
                }
                (Kind::Gauge, true) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                        c, id, none, 0, n,
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
        let Some((kind, id)) = self.ids.get(m) else {
            return;
        };
        let (c, none) = (self.config, std::ptr::null());
        // SAFETY: as in `add`.
        unsafe {
            match kind {
                Kind::Gauge => abi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                    c, id, none, 0, value,
                ),
                Kind::Histogram => {
                    abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
                        c, id, none, 0, value,
                    )
                }
                Kind::Counter => 0,
            };
        }
    }
}
