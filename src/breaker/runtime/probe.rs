//! Probes: a half-open (or due) key lets a request through only with a
//! probe claimed in the shared state, so that no more than `probes` are
//! out across the VMs.

use super::check::One;
use super::{Breakers, Event, Ticket};
use crate::breaker::{Admit, BreakerSpec, Phase};
use crate::store::Store;

impl Breakers {
    /// Claims a probe of a half-open (or due) key across the VMs; with
    /// the store failures it met.
    pub(super) fn probe(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        (b, key): (usize, u64),
        spec: &BreakerSpec,
        events: &mut Vec<Event>,
    ) -> (One, u32) {
        let (result, mut failures) = self.update(store, b, key, |s| s.claim_probe(spec, now_ms));
        let one = match result {
            Ok((s, Ok(transition))) => {
                self.settle((b, key), now_ms, s, transition, events);
                One::Pass(Some(Ticket {
                    breaker: b,
                    key,
                    probe: true,
                    epoch: s.epoch,
                }))
            }
            Ok((s, Err(_))) => {
                self.remember(b, key, s, now_ms);
                match s.admit(spec, now_ms) {
                    Admit::FailFast { retry_after_ms } if s.phase == Phase::Open => {
                        One::Open { retry_after_ms }
                    }
                    _ => One::NoProbeLeft,
                }
            }
            Err(_) => {
                failures += 1;
                One::store_down(spec)
            }
        };
        (one, failures)
    }
}
