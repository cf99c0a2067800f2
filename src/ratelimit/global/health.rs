//! The health of each rate-limit service: its breaker, kept in shared
//! data (failed calls in a row open it; after the cool-down one probe
//! goes through), and the mode it puts each global rule in. Its own file
//! because every VM follows the breakers, while only the leader moves
//! them.

use super::codec::{Health, HealthState};
use super::config::GlobalSpec;
use super::{Coordinator, Mode, Report, RuleId};
use crate::config::fields::StateId;
use crate::rng::SplitMix;
use crate::store::Store;

/// One rate-limit service (cluster): its breaker, as the leader keeps it.
#[derive(Debug, Clone)]
pub struct Service {
    pub cluster: String,
    pub health_key: String,
    pub health: Health,
    pub failures: u32,
    pub cooldown_ms: u64,
    pub timeout_ms: u64,
}

impl Coordinator {
    /// The shared-data key of the breaker on a service.
    pub fn health_key(config_domain: &str, cluster: &str) -> String {
        let id = StateId::new((0x676c_6f62_616c, 0x6865_616c_7468), config_domain)
            .text(cluster)
            .finish();
        format!("sg{id:08x}/health")
    }

    /// Reads the breakers and sets each rule's mode (also at start, so
    /// that a new configuration starts in the mode the Envoy is in).
    pub fn follow_health(&mut self, store: &dyn Store, report: &mut Report) {
        for s in self.services.iter_mut() {
            if let Ok(Some(e)) = store.get(&s.health_key) {
                if let Ok(h) = Health::decode(&e.bytes) {
                    s.health = h;
                }
            }
        }
        for (id, r) in RuleId::all().zip(self.rules.iter_mut()) {
            let down = self
                .services
                .get(r.service)
                .is_some_and(|s| s.health.down());
            let mode = match (down, r.spec.failure_mode_deny) {
                (false, _) => Mode::Service,
                (true, false) => Mode::Backstop,
                (true, true) => Mode::Deny,
            };
            if r.mode != mode {
                r.mode = mode;
                report.modes.push((id, mode));
            }
        }
    }
}

impl Service {
    /// A breaker on `cluster`, closed, with the rule's settings.
    pub fn new(config_domain: &str, spec: &GlobalSpec) -> Self {
        Service {
            cluster: spec.cluster.clone(),
            health_key: Coordinator::health_key(config_domain, &spec.cluster),
            health: Health::default(),
            failures: spec.failures,
            cooldown_ms: spec.cooldown_ms,
            timeout_ms: spec.timeout_ms,
        }
    }

    fn write(&mut self, store: &dyn Store, h: Health, i: usize, report: &mut Report) {
        if h.state != self.health.state {
            report.transitions.push((i, h.state));
        }
        self.health = h;
        let _ = store.set(&self.health_key, &h.encode(), None);
    }

    /// The leader's tick: an open breaker whose cool-down is over lets one
    /// probe through (returns true); a probe that never came back counts
    /// as failed.
    pub(super) fn advance(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        i: usize,
        report: &mut Report,
    ) -> bool {
        if let Ok(Some(e)) = store.get(&self.health_key) {
            if let Ok(h) = Health::decode(&e.bytes) {
                self.health = h;
            }
        }
        let h = self.health;
        match h.state {
            HealthState::Open if now_ms >= h.until_ms => {
                let probe = Health {
                    state: HealthState::HalfOpen,
                    failures: h.failures,
                    until_ms: now_ms + self.timeout_ms + 1_000,
                };
                self.write(store, probe, i, report);
                true
            }
            HealthState::HalfOpen if now_ms >= h.until_ms => {
                let open = self.opened(now_ms, rng, h.failures);
                self.write(store, open, i, report);
                false
            }
            _ => false,
        }
    }

    fn opened(&self, now_ms: u64, rng: &mut SplitMix, failures: u32) -> Health {
        let jitter = rng.below(self.cooldown_ms / 5 + 1);
        Health {
            state: HealthState::Open,
            failures,
            until_ms: now_ms + self.cooldown_ms + jitter,
        }
    }

    /// A call's result: failures in a row open the breaker (a failed probe
    /// at once); a success closes it.
    pub(super) fn record(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        ok: bool,
        i: usize,
        report: &mut Report,
    ) {
        let h = self.health;
        let next = if ok {
            Health::default()
        } else {
            let failures = h.failures.saturating_add(1);
            if h.state == HealthState::HalfOpen
                || (h.state == HealthState::Closed && failures >= self.failures)
            {
                self.opened(now_ms, rng, failures)
            } else {
                Health { failures, ..h }
            }
        };
        if next != h {
            self.write(store, next, i, report);
        }
    }
}
