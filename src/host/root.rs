//! The root context: parses the configuration, agrees on the hash seed with
//! the other VMs, creates the slot tables, and hands each HTTP stream the
//! shared per-VM state.

use super::http::{now_ns, Stream};
use super::metrics::{BreakerMetrics, Metrics, StoreMetrics};
use super::plugin::Plugin;
use super::shedding::ShedMetrics;
use super::store::{self, SharedData};
use crate::breaker::runtime::Breakers;
use crate::config;
use crate::fastmap::FastMap;
use crate::limiter::Limiter;
use crate::response::PolicyInfo;
use crate::rng::SplitMix;
use crate::shed::Shedders;
use crate::store::Store;
use log::{error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::rc::Rc;

/// The tick period when no request waits in a sluice queue.
pub const SLOW_TICK: std::time::Duration = std::time::Duration::from_millis(100);

#[derive(Default)]
pub struct Root {
    plugin: Option<Rc<Plugin>>,
}

impl Context for Root {}

/// The table-hash seed: created once per Envoy (per vm_id and domain) and
/// read by every VM, so all workers place a key in the same slots.
fn shared_seed(store: &dyn Store, domain: &str) -> Option<(u64, u64)> {
    let key = format!("sluice/seed/{domain}");
    let decode = |b: &[u8]| -> Option<(u64, u64)> {
        let a: [u8; 8] = b.get(..8)?.try_into().ok()?;
        let c: [u8; 8] = b.get(8..16)?.try_into().ok()?;
        (b.len() == 16).then(|| (u64::from_le_bytes(a), u64::from_le_bytes(c)))
    };
    if let Ok(Some(entry)) = store.get(&key) {
        if let Some(seed) = decode(&entry.bytes) {
            return Some(seed);
        }
        warn!("sluice: shared seed {key} is corrupt; replacing it");
    }
    let mut fresh = [0u8; 16];
    getrandom::fill(&mut fresh).ok()?;
    store.set(&key, &fresh, None).ok()?;
    // Read back: if another VM raced us, everyone ends up on the stored one.
    decode(&store.get(&key).ok()??.bytes)
}

fn random_u64() -> u64 {
    getrandom::u64().unwrap_or(0x5eed_5eed_5eed_5eed)
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        super::sync_log_level();
        let bytes = proxy_wasm::hostcalls::get_buffer(
            proxy_wasm::types::BufferType::PluginConfiguration,
            0,
            usize::MAX,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let config = match config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                error!("sluice: {e}");
                return false;
            }
        };
        store::forget();
        let store = SharedData;
        let Some(seed) = shared_seed(&store, &config.domain) else {
            error!("sluice: could not create the shared hash seed in shared data");
            return false;
        };
        let limiter = match Limiter::new(&config, seed) {
            Ok(l) => l,
            Err(e) => {
                error!("sluice: {e}");
                return false;
            }
        };
        match limiter.create_tables(&store) {
            Ok(created) if created > 0 => info!("sluice: created {created} shared-data slots"),
            Ok(_) => {}
            Err(e) => {
                error!("sluice: could not create slot tables in shared data: {e:?}");
                return false;
            }
        }
        let tables: Vec<(&str, u32)> = config
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_str(), limiter.table_len(i)))
            .collect();
        let metrics = Metrics::define(&tables);
        let breakers = match Breakers::new(&config, seed) {
            Ok(b) => b,
            Err(e) => {
                error!("sluice: {e}");
                return false;
            }
        };
        let names: Vec<&str> = config.breakers.iter().map(|b| b.name.as_str()).collect();
        let breaker_metrics = BreakerMetrics::define(&names);
        let shedders = match Shedders::new(&config, now_ns() / 1_000_000, random_u64() as u32) {
            Ok(s) => s,
            Err(e) => {
                error!("sluice: {e}");
                return false;
            }
        };
        if let Err(e) = shedders.create(&store) {
            error!("sluice: could not create shedder counters in shared data: {e:?}");
            return false;
        }
        let names: Vec<&str> = config.shedders.iter().map(|s| s.name.as_str()).collect();
        let shed_metrics = ShedMetrics::define(&names);
        let any_mechanism =
            !config.rules.is_empty() || !config.breakers.is_empty() || !config.shedders.is_empty();
        let store_metrics = if any_mechanism {
            StoreMetrics::define()
        } else {
            StoreMetrics::default()
        };
        // A slow tick hands the batched metric changes to Envoy, merges each
        // VM's batched breaker successes when traffic stops and returns
        // leased shedder slots; while requests wait in a sluice queue, the
        // tick runs every millisecond to let them in when a slot frees on
        // another worker (see `Plugin::fast_tick`).
        if any_mechanism {
            self.set_tick_period(SLOW_TICK);
        }
        let policies = config
            .rules
            .iter()
            .map(|r| PolicyInfo::of(&r.name, &r.bucket))
            .collect();
        info!(
            "sluice: configured {} rate-limit rule(s), {} circuit breaker(s), {} shedder(s)",
            config.rules.len(),
            config.breakers.len(),
            config.shedders.len()
        );
        self.plugin = Some(Rc::new(Plugin {
            config,
            limiter,
            policies,
            metrics,
            breakers: RefCell::new(breakers),
            breaker_metrics,
            shedders: RefCell::new(shedders),
            held: RefCell::new(FastMap::default()),
            fast_tick: std::cell::Cell::new(false),
            shed_metrics,
            store_metrics,
            rng: RefCell::new(SplitMix(random_u64())),
        }));
        true
    }

    fn on_tick(&mut self) {
        if let Some(plugin) = &self.plugin {
            if plugin.has_breakers() {
                plugin.breaker_flush(now_ns() / 1_000_000);
            }
            if plugin.has_shedders() {
                plugin.shed_return_leases();
                plugin.shed_wake(None);
                plugin.slow_tick_when_idle();
            }
            // The tick bounds how long a version is remembered (see
            // `store::age`).
            plugin.store_metrics.record(store::take_counts());
            store::age();
            super::metrics::flush();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(context_id, self.plugin.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
