//! The core's `Store` over process memory: what Envoy's shared data is to
//! the wasm build, shared by every worker of this Envoy (plain memory is,
//! in a dynamic module).
//!
//! The semantics are shared data's (proxy-wasm's `SharedData`, which
//! `src/host/store.rs` maps): each write gives the key a new version, a
//! non-zero 32-bit number from one counter that wraps; `get` answers the
//! bytes and that version as the CAS token; `set` with a token fails with
//! `CasMismatch` if the key's version is another, and `set` without one
//! (or with one for a key never written) writes unconditionally. Keys are
//! never deleted, as in shared data. Bounded: a new key beyond
//! [`MAX_KEYS`], or a value over [`MAX_VALUE`] bytes, is refused as
//! `Unavailable` (every mechanism then applies its failure policy).

use sluice::store::{Entry, Store, StoreError};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

/// Shards, each a map under its own lock: workers touching different keys
/// rarely wait for each other.
const SHARDS: usize = 16;
/// The most keys the store holds (sluice's keys are per table slot, not
/// per client: a configuration needs a bounded number of them).
pub const MAX_KEYS: usize = 1 << 20;
/// The largest value the store accepts.
pub const MAX_VALUE: usize = 1 << 20;

/// One shard: each key's bytes and version.
type Shard = Mutex<HashMap<String, (Vec<u8>, u32)>>;

/// The process's store.
pub struct ProcessStore {
    shards: [Shard; SHARDS],
    hasher: RandomState,
    version: AtomicU32,
    keys: AtomicU32,
}

impl Default for ProcessStore {
    fn default() -> Self {
        ProcessStore {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            hasher: RandomState::new(),
            version: AtomicU32::new(1),
            keys: AtomicU32::new(0),
        }
    }
}

/// The one store of this process (every configuration and worker).
pub fn shared() -> &'static ProcessStore {
    static STORE: OnceLock<ProcessStore> = OnceLock::new();
    STORE.get_or_init(ProcessStore::default)
}

impl ProcessStore {
    fn shard(&self, key: &str) -> &Shard {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        let [first, ..] = &self.shards;
        self.shards.get(i).unwrap_or(first)
    }

    /// The next version: never 0 (0 means "no token" to shared data).
    fn next_version(&self) -> u32 {
        loop {
            let v = self.version.fetch_add(1, Ordering::Relaxed);
            if v != 0 {
                return v;
            }
        }
    }
}

impl Store for ProcessStore {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let map = self
            .shard(key)
            .lock()
            .map_err(|_| StoreError::Unavailable)?;
        Ok(map
            .get(key)
            .map(|(bytes, v)| Entry::read(bytes.clone(), Some(*v))))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if value.len() > MAX_VALUE {
            return Err(StoreError::Unavailable);
        }
        let mut map = self
            .shard(key)
            .lock()
            .map_err(|_| StoreError::Unavailable)?;
        match map.get_mut(key) {
            Some((bytes, v)) => {
                if matches!(cas, Some(c) if c != 0 && c != *v) {
                    return Err(StoreError::CasMismatch);
                }
                bytes.clear();
                bytes.extend_from_slice(value);
                *v = self.next_version();
            }
            None => {
                let n = self.keys.load(Ordering::Relaxed) as usize;
                if n >= MAX_KEYS {
                    return Err(StoreError::Unavailable);
                }
                self.keys.fetch_add(1, Ordering::Relaxed);
                map.insert(key.to_string(), (value.to_vec(), self.next_version()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice::store::{update, Update};
    use std::sync::Arc;

    #[test]
    fn versions_and_compare_and_swap() {
        let s = ProcessStore::default();
        assert_eq!(s.get("k"), Ok(None));
        // A token for a key never written: written (as shared data does).
        s.set("k", b"a", Some(7)).unwrap();
        let e = s.get("k").unwrap().unwrap();
        assert_eq!(e.bytes, b"a");
        let v1 = e.cas.unwrap();
        assert_ne!(v1, 0);
        s.set("k", b"b", Some(v1)).unwrap();
        // The old token no longer matches.
        assert_eq!(s.set("k", b"c", Some(v1)), Err(StoreError::CasMismatch));
        let v2 = s.get("k").unwrap().unwrap().cas.unwrap();
        assert_ne!(v1, v2);
        // Without a token: unconditional.
        s.set("k", b"d", None).unwrap();
        assert_eq!(s.get("k").unwrap().unwrap().bytes, b"d");
    }

    #[test]
    fn the_version_counter_skips_zero_when_it_wraps() {
        let s = ProcessStore::default();
        s.version.store(u32::MAX, Ordering::Relaxed);
        s.set("a", b"1", None).unwrap();
        s.set("b", b"1", None).unwrap();
        assert_eq!(s.get("a").unwrap().unwrap().cas, Some(u32::MAX));
        assert_eq!(s.get("b").unwrap().unwrap().cas, Some(1));
    }

    #[test]
    fn bounded() {
        let s = ProcessStore::default();
        assert_eq!(
            s.set("big", &vec![0; MAX_VALUE + 1], None),
            Err(StoreError::Unavailable)
        );
        s.keys.store(MAX_KEYS as u32, Ordering::Relaxed);
        assert_eq!(s.set("new", b"x", None), Err(StoreError::Unavailable));
    }

    /// Counters updated by compare-and-swap from several threads lose no
    /// update: the exactness every mechanism relies on across workers.
    #[test]
    fn no_update_is_lost_across_threads() {
        let s = Arc::new(ProcessStore::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        update(&*s, "n", u32::MAX, |e| {
                            let n = e.map_or(0u64, |e| {
                                u64::from_le_bytes(e.bytes[..8].try_into().unwrap())
                            });
                            Update::Write((n + 1).to_le_bytes(), ())
                        })
                        .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let n = s.get("n").unwrap().unwrap().bytes;
        assert_eq!(u64::from_le_bytes(n[..8].try_into().unwrap()), 8000);
    }
}
