//! Concurrency limits per key (bulkheads per tenant): at most `max`
//! requests of one key (tenant, API key, route class: the key parts of
//! rate limits) in flight at once, exact across Envoy's workers.
//!
//! Each key maps to one slot of a fixed table of `max_keys` entries in
//! shared data, holding the requests in flight. Admission is a
//! compare-and-swap increment that never passes `max`; the end of the
//! stream, however it ends, decrements once. Two keys that share a slot
//! share its count: a key can be limited early under collisions, never
//! late. A decrement that fails is retried on the next tick, so a store
//! hiccup never shrinks a key's limit for good; an increment that fails
//! lets the request through without a slot (fail open), counted.
//!
//! With a `max_wait`, a request over the limit waits, paused, in a line per
//! key on its worker (`queue.rs`, `wait.rs`) until a place frees or its
//! time is up; waiters of a key on one worker are served in arrival order.

pub mod codec;
pub mod config;
pub mod queue;
pub mod reply;
pub mod stage;
#[cfg(test)]
mod tests;
mod wait;
#[cfg(test)]
mod wait_tests;

use crate::config::fields::{check_state_id, StateId};
use crate::config::{Common, ConfigError};
use crate::keys::place;
use crate::request::RequestView;
use crate::store::{update, Store, StoreError, Update};
use config::LimitSpec;

/// A limit and the shared-data key prefix of its table.
#[derive(Debug, Clone)]
pub struct Limit {
    pub spec: LimitSpec,
    pub prefix: String,
}

/// A request's verdict at one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// In: holds slot `slot` of the limit's table until its stream ends.
    Holds { slot: u32 },
    /// In without a slot: the key was missing (skipped) or the store
    /// failed (fail open).
    Free,
    /// `max` requests of its key are in flight already.
    Full,
}

/// All concurrency limits of one configuration, in one VM.
pub struct Bulkheads {
    pub rules: Vec<Limit>,
    seed: (u64, u64),
    max_retries: u32,
    /// Decrements that failed, retried on the next tick.
    retry: Vec<(usize, u32)>,
}

fn state_id(domain: &str, spec: &LimitSpec) -> u32 {
    let mut id = StateId::new((0x6275_6c6b, 0x6865_6164), domain)
        .text(&spec.name)
        .num(u64::from(spec.max_keys));
    for part in &spec.key {
        id = id.text(part.encode());
    }
    id.finish()
}

impl Bulkheads {
    /// Prepares the limits; `seed` must be the same in every VM.
    pub fn new(
        specs: &[LimitSpec],
        common: &Common,
        seed: (u64, u64),
    ) -> Result<Self, ConfigError> {
        let mut rules: Vec<Limit> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let prefix = format!("bh{:08x}/", state_id(&common.domain, spec));
            let earlier = rules
                .iter()
                .map(|r| (r.prefix.as_str(), r.spec.name.as_str()));
            check_state_id("concurrency_limits", i, &prefix, earlier)?;
            rules.push(Limit {
                spec: spec.clone(),
                prefix,
            });
        }
        Ok(Bulkheads {
            rules,
            seed,
            max_retries: common.max_cas_retries,
            retry: Vec::new(),
        })
    }

    fn slot_key(&self, b: usize, slot: u32) -> String {
        let prefix = self.rules.get(b).map_or("", |r| r.prefix.as_str());
        crate::keys::slot_key(prefix, slot)
    }

    /// Slots in limit `b`'s table (one for a key without variable parts).
    fn table_len(&self, b: usize) -> u32 {
        self.rules.get(b).map_or(1, |r| {
            if crate::keys::has_variable_parts(&r.spec.key) {
                r.spec.max_keys
            } else {
                1
            }
        })
    }

    /// Creates every missing slot (at configuration: a missing key cannot be
    /// created by compare-and-swap without racing another worker).
    pub fn create(&self, store: &dyn Store) -> Result<(), StoreError> {
        let zero = codec::encode(0);
        for b in 0..self.rules.len() {
            for slot in 0..self.table_len(b) {
                let key = self.slot_key(b, slot);
                if store.get(&key)?.is_none() {
                    store.set(&key, &zero, None)?;
                }
            }
        }
        Ok(())
    }

    /// Admits the request at limit `b` if its key has a place; with the
    /// store failures met (see `take`).
    pub fn admit(&self, store: &dyn Store, b: usize, req: &dyn RequestView) -> (Admission, u32) {
        match self.place_of(b, req) {
            Some(slot) => self.take(store, b, slot),
            None => (Admission::Free, 0),
        }
    }

    /// The slot of limit `b`'s table the request's key lives in; `None`
    /// when the key is missing and the limit skips such requests.
    pub fn place_of(&self, b: usize, req: &dyn RequestView) -> Option<u32> {
        let spec = &self.rules.get(b)?.spec;
        let p = place(
            &spec.key,
            spec.on_missing_key,
            self.seed,
            self.table_len(b),
            req,
        )?;
        Some(p.slots().first().copied().unwrap_or(0))
    }

    /// Takes a place in slot `slot` of limit `b` if it has one free; with
    /// the store failures met (corrupt counts, read as 0; an update that
    /// failed, which lets the request in without a place).
    pub fn take(&self, store: &dyn Store, b: usize, slot: u32) -> (Admission, u32) {
        let Some(max) = self.rules.get(b).map(|r| r.spec.max) else {
            return (Admission::Free, 0);
        };
        let key = self.slot_key(b, slot);
        let mut failures = 0;
        let got = update(store, &key, self.max_retries, |found| {
            let n = found
                .map_or(Ok(0), |e| codec::decode(&e.bytes))
                .unwrap_or_else(|_| {
                    failures += 1;
                    0
                });
            if n >= max {
                Update::Keep(false)
            } else {
                Update::Write(codec::encode(n + 1), true)
            }
        });
        match got {
            Ok(true) => (Admission::Holds { slot }, failures),
            Ok(false) => (Admission::Full, failures),
            Err(_) => (Admission::Free, failures + 1),
        }
    }

    /// Gives slot `slot` of limit `b` back (exactly once per admission: the
    /// caller forgets it); a failed decrement is kept and retried. Returns
    /// the store failures met (1 if the decrement failed).
    pub fn release(&mut self, store: &dyn Store, b: usize, slot: u32) -> u32 {
        match self.decrement(store, b, slot) {
            Ok(corrupt) => u32::from(corrupt),
            Err(_) => {
                self.retry.push((b, slot));
                1
            }
        }
    }

    /// Retries failed decrements (on every tick).
    pub fn retry_failed(&mut self, store: &dyn Store) {
        for (b, slot) in std::mem::take(&mut self.retry) {
            if self.decrement(store, b, slot).is_err() {
                self.retry.push((b, slot));
            }
        }
    }

    /// Takes one from a slot's count; `Ok(true)`: its record was corrupt
    /// (read as 0, so it is rewritten as 0).
    fn decrement(&self, store: &dyn Store, b: usize, slot: u32) -> Result<bool, StoreError> {
        update(store, &self.slot_key(b, slot), self.max_retries, |found| {
            let read = found.map_or(Ok(0), |e| codec::decode(&e.bytes));
            let corrupt = read.is_err();
            let n = read.unwrap_or(0);
            Update::Write(codec::encode(n.saturating_sub(1)), corrupt)
        })
    }

    /// Requests in flight in limit `b`'s slot `slot` (for tests).
    pub fn in_flight(&self, store: &dyn Store, b: usize, slot: u32) -> u32 {
        store
            .get(&self.slot_key(b, slot))
            .ok()
            .flatten()
            .and_then(|e| codec::decode(&e.bytes).ok())
            .unwrap_or(0)
    }
}
