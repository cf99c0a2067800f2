//! The leader's plan: each key's rate, which keys are due for tokens,
//! how many to ask for, and the calls to the service that follow (on
//! the tick, on a wake-up for starved keys, and a half-open breaker's
//! probe). Its own file because this is the policy of the global rules;
//! the pools it reads are in `fill.rs`.

use super::codec::HealthState;
use super::fill::{fresh, live_tokens, pool_slots, read_sites};
use super::proto;
use super::{
    oldest_first, Call, Coordinator, GlobalRule, Key, Report, RuleId, MAX_CALLS_PER_TICK, METHOD,
    SERVICE,
};
use crate::rng::SplitMix;
use crate::store::Store;

/// The span a first rate is measured over, for want of a tick before it.
const FIRST_TICK_MS: u64 = 100;

/// A key without demand for this long is forgotten by the leader.
const IDLE_MS: u64 = 30_000;

/// The tag a key's pool is marked with, as `owners` keeps it.
fn owner_tag(fingerprint: u64) -> u32 {
    ((fingerprint >> 32) as u32) | 1
}

impl Coordinator {
    /// The leader, woken by a VM that reported starved demand (or by its
    /// own report): takes the demand and calls at once for the keys never
    /// called for yet, instead of on its next tick (up to 100 ms later).
    /// Their rate is not known yet: it is taken as their demand so far
    /// over one tick, as the first tick does. Nothing for a VM that is not
    /// the leader (it lost the lease since it listened). Every wake-up
    /// takes the demand (two in one millisecond bring two workers' keys).
    pub fn hurry(&mut self, store: &dyn Store, now_ms: u64, report: &mut Report) {
        // Read again: a newer configuration's VM may have taken the lease
        // since this one's last tick (and this one's calls may die soon).
        if !self.leader || !self.holds_lease(store, now_ms) {
            return;
        }
        // Only the keys this demand brings (not every key the leader
        // knows: a wake-up must cost little however many keys there are).
        for (g, fp) in self.take_demand(store, now_ms) {
            if report.calls.len() >= MAX_CALLS_PER_TICK {
                break;
            }
            let closed = self
                .rule(g)
                .and_then(|r| self.services.get(r.service))
                .is_some_and(|s| s.health.state == HealthState::Closed);
            let Some(k) = self.keys.get_mut(&(g, fp)) else {
                continue;
            };
            if !closed || k.last_call_ms != 0 || k.inflight || now_ms < k.blocked_until_ms {
                continue;
            }
            if k.rate == 0.0 {
                k.rate = k.pending as f64 * 1_000.0 / FIRST_TICK_MS as f64;
            }
            self.owners.insert((g, owner_tag(fp)), k.last_demand_ms);
            if let Some(call) = self.plan(store, now_ms, g, fp, false) {
                report.calls.push(call);
            }
        }
    }

    /// The leader's work: take in the demand, move the breakers on, and
    /// ask for the tokens the keys will need.
    pub(super) fn lead(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        rng: &mut SplitMix,
        report: &mut Report,
    ) {
        self.take_demand(store, now_ms);
        self.owners = self
            .keys
            .iter()
            .map(|(&(g, fp), k)| ((g, owner_tag(fp)), k.last_demand_ms))
            .collect();
        self.update_rates(now_ms);
        self.forget_idle(store, now_ms, report);
        let mut probes: Vec<bool> = Vec::with_capacity(self.services.len());
        for (i, s) in self.services.iter_mut().enumerate() {
            probes.push(s.advance(store, now_ms, rng, i, report));
        }
        self.call_due(store, now_ms, &mut probes, report);
        self.probe_busiest(store, now_ms, &probes, report);
    }

    /// The calls for the keys due for tokens, at most
    /// `MAX_CALLS_PER_TICK`, through closed breakers; a half-open
    /// breaker that may probe (`probes`) lets its first call through.
    fn call_due(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        probes: &mut [bool],
        report: &mut Report,
    ) {
        for (g, fp) in self.due(now_ms) {
            if report.calls.len() >= MAX_CALLS_PER_TICK {
                break;
            }
            let Some(svc) = self.rule(g).map(|r| r.service) else {
                continue;
            };
            let probe = match self.services.get(svc).map(|s| s.health.state) {
                Some(HealthState::Closed) => false,
                Some(HealthState::HalfOpen) if probes.get(svc) == Some(&true) => true,
                _ => continue,
            };
            if let Some(call) = self.plan(store, now_ms, g, fp, false) {
                report.calls.push(call);
                if probe {
                    // One probe: the first call made while half-open.
                    if let Some(p) = probes.get_mut(svc) {
                        *p = false;
                    }
                }
            }
        }
    }

    /// A half-open breaker whose probe found no key short of tokens
    /// (on the backstop, pools are not spent): one hit for its busiest
    /// key, so that the service's return is noticed anyway.
    fn probe_busiest(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        probes: &[bool],
        report: &mut Report,
    ) {
        for (svc, _) in probes.iter().enumerate().filter(|(_, p)| **p) {
            let busiest = self
                .keys
                .iter()
                .filter(|((g, _), k)| {
                    !k.inflight && self.rule(*g).is_some_and(|r| r.service == svc)
                })
                .max_by(|a, b| a.1.rate.total_cmp(&b.1.rate))
                .map(|(&id, _)| id);
            if let Some((g, fp)) = busiest {
                if let Some(call) = self.plan(store, now_ms, g, fp, true) {
                    report.calls.push(call);
                }
            }
        }
    }

    /// Each key's rate: the demand since the last tick, smoothed.
    fn update_rates(&mut self, now_ms: u64) {
        let dt_ms = match self.last_tick_ms {
            0 => FIRST_TICK_MS,
            last => now_ms.saturating_sub(last).clamp(1, 10_000),
        };
        self.last_tick_ms = now_ms;
        for k in self.keys.values_mut() {
            let seen = k.pending as f64 * 1_000.0 / dt_ms as f64;
            k.rate = if k.rate == 0.0 {
                seen
            } else {
                0.5 * k.rate + 0.5 * seen
            };
            k.last_pending = std::mem::take(&mut k.pending);
        }
    }

    /// Forgets the keys without demand for `IDLE_MS` (and those a full
    /// table evicted), and settles the pools of forgotten keys whose
    /// window has ended.
    fn forget_idle(&mut self, store: &dyn Store, now_ms: u64, report: &mut Report) {
        let idle: Vec<(RuleId, u64)> = self
            .keys
            .iter()
            .filter(|(_, k)| !k.inflight && now_ms.saturating_sub(k.last_demand_ms) >= IDLE_MS)
            .map(|(&id, _)| id)
            .collect();
        for id in idle {
            self.keys.remove(&id);
            self.forget(store, now_ms, id, report);
        }
        // Evicted ones already left the table; one back since stays.
        for id in std::mem::take(&mut self.evicted) {
            if !self.keys.contains_key(&id) {
                self.forget(store, now_ms, id, report);
            }
        }
        self.settle_ended(store, now_ms, report);
    }

    /// The keys that may need tokens now, the one called least recently
    /// first: when a tick cannot serve everyone, every key still gets its
    /// turn within a few ticks.
    fn due(&self, now_ms: u64) -> Vec<(RuleId, u64)> {
        let mut due: Vec<((RuleId, u64), u64)> = Vec::new();
        for (&(g, fp), k) in &self.keys {
            let lead_ms = self.rule(g).map_or(1_000, |r| r.spec.lead_ms);
            if !k.inflight && now_ms >= k.blocked_until_ms && k.wanted(lead_ms) {
                due.push(((g, fp), k.last_call_ms));
            }
        }
        oldest_first(&mut due);
        due.into_iter().map(|(id, _)| id).collect()
    }

    /// The call for a key whose pool runs low, if it does.
    /// `probe`: a half-open breaker's probe, one hit, made even if the
    /// pool holds enough.
    fn plan(
        &mut self,
        store: &dyn Store,
        now_ms: u64,
        g: RuleId,
        fp: u64,
        probe: bool,
    ) -> Option<Call> {
        let rule = self.rule(g)?;
        let k = self.keys.get(&(g, fp))?;
        let batch = batch(rule, k);
        let (keys, tag) = pool_slots(rule, fp);
        // No slot for a pool: no call (the tokens would have nowhere to go).
        let fresh = fresh(&self.owners, g, now_ms);
        let live = u64::from(live_tokens(
            &read_sites(store, &keys)?,
            tag,
            now_ms,
            &fresh,
        )?);
        if !probe && live > batch / 2 && live >= rule.cost_max.min(batch) {
            return None;
        }
        let hits = if probe {
            1
        } else {
            batch.saturating_sub(live).max(1) as u32
        };
        let parts: Vec<(&str, &[u8])> = rule
            .spec
            .descriptor_keys
            .iter()
            .map(String::as_str)
            .zip(k.values.iter().map(Vec::as_slice))
            .collect();
        let message = proto::request(&rule.domain, &parts, hits);
        let cluster = self.services.get(rule.service)?.cluster.clone();
        let timeout_ms = rule.spec.timeout_ms;
        let id = self.next_call;
        self.next_call += 1;
        self.calls.insert(id, (g, fp, hits, now_ms));
        if let Some(k) = self.keys.get_mut(&(g, fp)) {
            k.inflight = true;
            k.last_call_ms = now_ms;
        }
        Some(Call {
            id,
            cluster,
            service: SERVICE,
            method: METHOD,
            message,
            timeout: crate::time::Duration::from_ms(timeout_ms),
        })
    }
}

/// How many tokens to ask for: a lead's worth of demand, at most
/// max_batch and half this Envoy's share of the limit (what a refused batch
/// may waste) and, near the limit, half its share of what the service last
/// said was left (so batches shrink as the count nears the limit); never
/// below the dearest request (`cost.max`).
fn batch(rule: &GlobalRule, k: &Key) -> u64 {
    let lead_s = rule.spec.lead_ms as f64 / 1_000.0;
    let cap = u64::from(rule.spec.max_batch)
        .min(((rule.quota as f64 * rule.spec.share / 2.0) as u64).max(1))
        .max(rule.cost_max);
    let mut batch = ((k.rate * lead_s).ceil() as u64).clamp(1, cap);
    if let Some(left) = k.remaining {
        batch = batch.min(((left as f64 * rule.spec.share / 2.0) as u64).max(1));
    }
    batch.max(rule.cost_max)
}

impl Key {
    /// Whether tokens should be fetched for the key: someone asked since
    /// the last tick, or its rate expects a request within its lead.
    fn wanted(&self, lead_ms: u64) -> bool {
        self.last_pending > 0 || self.rate * lead_ms as f64 / 1_000.0 >= 0.5
    }
}
