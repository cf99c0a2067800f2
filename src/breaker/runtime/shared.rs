//! The shared state of each key: this VM's cache of it (which keys are
//! tracked, when each was read), its re-reads every `SYNC_MS`, and its
//! compare-and-swap updates in the store.

use super::{Breakers, Cached, SYNC_MS};
use crate::breaker::codec::{decode, decode_count, encode, encode_count};
use crate::breaker::{BreakerSpec, State};
use crate::store::{update, Store, StoreError, Update};

impl Breakers {
    fn shared_key(&self, breaker: usize, key: u64) -> String {
        let prefix = self.rules.get(breaker).map_or("", |r| r.prefix.as_str());
        shared_name(prefix, key)
    }

    /// Reads, changes and writes one key's shared state with CAS, retrying
    /// conflicts; returns the new state and `f`'s result, with the corrupt
    /// states it replaced (store failures).
    pub(super) fn update<R>(
        &self,
        store: &dyn Store,
        breaker: usize,
        key: u64,
        mut f: impl FnMut(&mut State) -> R,
    ) -> (Result<(State, R), StoreError>, u32) {
        let name = self.shared_key(breaker, key);
        let mut corrupt = 0;
        let result = update(store, &name, self.max_retries, |found| {
            let old = match found {
                Some(e) => decode(&e.bytes).unwrap_or_else(|_| {
                    corrupt += 1;
                    State::new()
                }),
                None => State::new(),
            };
            let mut new = old;
            let r = f(&mut new);
            if new == old {
                Update::Keep((new, r))
            } else {
                Update::Write(encode(&new), (new, r))
            }
        });
        (result, corrupt)
    }

    pub(super) fn remember(&mut self, breaker: usize, key: u64, state: State, now_ms: u64) {
        if let Some(l) = self.local.get_mut(&(breaker, key)) {
            l.state = state;
            l.fetched_ms = Some(now_ms);
        }
    }

    /// Starts tracking a key if there is room; whether it is tracked.
    pub(super) fn track(
        &mut self,
        b: usize,
        key: u64,
        value: &[u8],
        spec: &BreakerSpec,
        now_ms: u64,
    ) -> bool {
        if self.local.contains_key(&(b, key)) {
            return true;
        }
        let Some(n) = self.tracked.get_mut(b) else {
            return false;
        };
        if *n >= spec.max_keys {
            return false;
        }
        *n += 1;
        self.local.insert(
            (b, key),
            Cached {
                name: String::from_utf8_lossy(value.get(..128).unwrap_or(value)).into(),
                state: State::new(),
                fetched_ms: None,
                pending: 0,
                // Never merged: the key's first success is merged at once
                // (it may end a streak of failures other workers merged).
                flushed_ms: now_ms.saturating_sub(SYNC_MS),
            },
        );
        true
    }

    /// Re-reads a key's shared state if the cached one is `SYNC_MS` old;
    /// `Err` when the store failed or the state is corrupt.
    pub(super) fn refresh(
        &mut self,
        store: &dyn Store,
        b: usize,
        key: u64,
        now_ms: u64,
    ) -> Result<(), ()> {
        let stale = self.local.get(&(b, key)).is_some_and(|l| {
            l.fetched_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= SYNC_MS)
        });
        if !stale {
            return Ok(());
        }
        let fresh = match store.get(&self.shared_key(b, key)) {
            Ok(Some(e)) => decode(&e.bytes).map_err(|_| ())?,
            Ok(None) => State::new(),
            Err(_) => return Err(()),
        };
        self.remember(b, key, fresh, now_ms);
        Ok(())
    }
}

impl Breakers {
    /// The name of a breaker's count of keys not closed: its prefix and
    /// `open`, never 16 hex digits as a key's.
    fn count_name(&self, breaker: usize) -> String {
        let prefix = self.rules.get(breaker).map_or("", |r| r.prefix.as_str());
        format!("{prefix}open")
    }

    /// How many of a breaker's keys are open or half-open, as the store
    /// has it: 0 in a store that starts empty (a new module file, another
    /// `vm_id`), and for a corrupt count.
    pub fn open_count(&self, store: &dyn Store, breaker: usize) -> Result<u64, StoreError> {
        Ok(store
            .get(&self.count_name(breaker))?
            .and_then(|e| decode_count(&e.bytes).ok())
            .unwrap_or(0))
    }

    /// Adds `by` to that count by CAS (from 0 if it was corrupt; never
    /// below 0); the count after.
    pub fn add_open(&self, store: &dyn Store, breaker: usize, by: i64) -> Result<u64, StoreError> {
        update(
            store,
            &self.count_name(breaker),
            self.max_retries,
            |found| {
                let old = found.and_then(|e| decode_count(&e.bytes).ok()).unwrap_or(0);
                let new = old.saturating_add_signed(by);
                Update::Write(encode_count(new), new)
            },
        )
    }
}

/// A key's name in the store: the breaker's prefix and the key's hash in
/// 16 hex digits (written without `format!`, ten times dearer).
fn shared_name(prefix: &str, key: u64) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut name = String::with_capacity(prefix.len() + 16);
    name.push_str(prefix);
    for shift in (0..16).rev() {
        let digit = HEX.get((key >> (shift * 4)) as usize & 15).copied();
        name.push(char::from(digit.unwrap_or(b'0')));
    }
    name
}

#[cfg(test)]
mod tests {
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_shared_name_is_the_prefix_and_sixteen_hex_digits() {
        for key in [0, 1, 0xabc, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_eq!(
                super::shared_name("cb1a2b3c4d/", key),
                format!("cb1a2b3c4d/{key:016x}")
            );
        }
    }
}
