//! Demand: what the workers note on the request path (which keys wanted
//! tokens, and how many), how each VM adds it to the shared record on its
//! tick, and how the leader takes that record into its table of keys.
//! Its own file because it is the one part every VM runs, leader or not,
//! and the part the request path feeds.

use super::codec::{self, Want};
use super::{oldest_first, Coordinator, Key, RuleId, MAX_KEYS, MAX_LOCAL_KEYS};
use crate::hash::FastMap;
use crate::store::{Store, StoreError};

impl Coordinator {
    /// Whether the request path must read the key's parts to note its
    /// demand (the first time in a report interval).
    pub fn knows(&self, id: RuleId, fingerprint: u64) -> bool {
        self.local.contains_key(&(id, fingerprint))
    }

    /// Notes that a request wanted a token of global rule `id` for a key;
    /// `values` reads the key's parts (called only for a key not yet noted
    /// since the last report). A key found without tokens (`starved`, not
    /// over its limit) asks for the demand to be reported on the next fast
    /// tick rather than the next slow one (see `wants_fast_tick`), so that
    /// its first tokens come sooner; nothing is written on the request path.
    /// Demand is counted in tokens (`cost`), as batches are.
    pub fn note(
        &mut self,
        id: RuleId,
        fingerprint: u64,
        starved: bool,
        cost: u64,
        values: impl FnOnce() -> Vec<Vec<u8>>,
    ) {
        self.cold |= starved;
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        if let Some(w) = self.local.get_mut(&(id, fingerprint)) {
            w.count = w.count.saturating_add(cost);
            return;
        }
        if self.local.len() >= MAX_LOCAL_KEYS {
            return;
        }
        self.local.insert(
            (id, fingerprint),
            Want {
                rule: id.0,
                fingerprint,
                count: cost,
                // Cut here, not only when encoded: a VM keeps no more.
                values: values()
                    .into_iter()
                    .map(|mut v| {
                        v.truncate(codec::MAX_VALUE_LEN);
                        v
                    })
                    .collect(),
            },
        );
    }

    /// Whether this VM has demand of starved keys to report at once.
    pub fn wants_fast_tick(&self) -> bool {
        self.cold
    }

    /// Adds this VM's demand to the shared record; whether it did.
    pub(super) fn report_demand(&mut self, store: &dyn Store) -> bool {
        if self.local.is_empty() {
            return false;
        }
        for _ in 0..8 {
            let (mut merged, cas) = match store.get(&self.want_key) {
                Ok(Some(e)) => (codec::decode_wants(&e.bytes).unwrap_or_default(), e.cas),
                Ok(None) => (Vec::new(), None),
                Err(_) => return false,
            };
            let mut at: FastMap<(RuleId, u64), usize> = merged
                .iter()
                .enumerate()
                .map(|(i, w)| ((RuleId(w.rule), w.fingerprint), i))
                .collect();
            for (k, w) in &self.local {
                match at.get(k).and_then(|&i| merged.get_mut(i)) {
                    Some(m) => m.count = m.count.saturating_add(w.count),
                    None => {
                        at.insert(*k, merged.len());
                        merged.push(w.clone());
                    }
                }
            }
            let (bytes, left_out) = codec::encode_wants(merged.iter());
            match store.set(&self.want_key, &bytes, cas) {
                Ok(()) => {
                    // What did not fit waits here for the next report.
                    let kept: FastMap<(RuleId, u64), Want> = left_out
                        .iter()
                        .filter_map(|&i| merged.get(i))
                        .filter_map(|w| {
                            let k = (RuleId(w.rule), w.fingerprint);
                            self.local.get(&k).map(|l| (k, l.clone()))
                        })
                        .collect();
                    self.local = kept;
                    return true;
                }
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Unavailable) => return false,
            }
        }
        false
    }

    /// Moves the shared demand record into the leader's keys.
    /// Takes the demand the VMs reported; the keys it was for.
    pub(super) fn take_demand(&mut self, store: &dyn Store, now_ms: u64) -> Vec<(RuleId, u64)> {
        for _ in 0..8 {
            let (wants, cas) = match store.get(&self.want_key) {
                Ok(Some(e)) => (codec::decode_wants(&e.bytes).unwrap_or_default(), e.cas),
                _ => return Vec::new(),
            };
            if wants.is_empty() {
                return Vec::new();
            }
            let (empty, _) = codec::encode_wants(std::iter::empty());
            match store.set(&self.want_key, &empty, cas) {
                Ok(()) => {
                    let ids = wants
                        .iter()
                        .map(|w| (RuleId(w.rule), w.fingerprint))
                        .collect();
                    for w in wants {
                        self.add_demand(w, now_ms);
                    }
                    return ids;
                }
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Unavailable) => return Vec::new(),
            }
        }
        Vec::new()
    }

    fn add_demand(&mut self, w: Want, now_ms: u64) {
        let key = (RuleId(w.rule), w.fingerprint);
        if self.rule(key.0).is_none() {
            return;
        }
        if self.keys.len() >= MAX_KEYS && !self.keys.contains_key(&key) {
            self.evict();
        }
        let k = self.keys.entry(key).or_insert_with(|| Key {
            values: w.values,
            rate: 0.0,
            pending: 0,
            last_pending: 0,
            last_call_ms: 0,
            last_demand_ms: now_ms,
            inflight: false,
            blocked_until_ms: 0,
            remaining: None,
        });
        k.pending = k.pending.saturating_add(u64::from(w.count));
        k.last_demand_ms = now_ms;
    }

    /// Makes room in a full key table: the tenth of the keys whose demand
    /// is oldest are forgotten (a new key is never locked out).
    fn evict(&mut self) {
        let mut by_age: Vec<((RuleId, u64), u64)> = self
            .keys
            .iter()
            .filter(|(_, k)| !k.inflight)
            .map(|(&id, k)| (id, k.last_demand_ms))
            .collect();
        oldest_first(&mut by_age);
        for (id, _) in by_age.into_iter().take(MAX_KEYS / 10) {
            self.keys.remove(&id);
            self.evicted.push(id);
        }
    }
}
