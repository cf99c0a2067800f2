//! [`Remembering`]: a store layer that remembers this VM's own last write to
//! each key, so a VM writing the same key again and again (one worker, or a
//! quiet moment) can skip the read before each write.

use super::{Entry, Store, StoreError};
use crate::hash::FastMap;
use std::cell::RefCell;

/// How many right guesses in a row a key needs before its reads are skipped.
const TRUST: u8 = 2;
/// At most this many keys are remembered.
const MAX_REMEMBERED: usize = 1024;

/// What this VM remembers of its last write to one key.
struct Memory {
    bytes: Vec<u8>,
    /// The guessed version of that write (0: none): at most the version
    /// the write got, so if the key has exactly this version, it still
    /// holds `bytes`.
    version: u32,
    /// Consecutive reads that found the key at `version` (the guess held).
    streak: u8,
    /// `version` was handed out by `get_for_update` and not yet written.
    lent: bool,
    /// Written since the last `age`.
    used: bool,
}

#[derive(Default)]
struct Memo {
    /// Keyed by the shared-data keys this VM writes: at most
    /// [`MAX_REMEMBERED`], and not chosen by clients (their slot numbers
    /// come from the keyed table hash), so a fast unkeyed hash will do.
    keys: FastMap<String, Memory>,
    /// A lower bound on the next version the host will hand out (0: none).
    /// Learnt only from keys this VM wrote lately (see `observed`).
    floor: u32,
    skipped: u64,
    stale: u64,
}

impl Memo {
    fn saw_version(&mut self, cas: Option<u32>) {
        let Some(next) = cas.and_then(|c| c.checked_add(1)) else {
            return;
        };
        if self.floor.saturating_sub(next) > 1 << 31 {
            // The host's counter wrapped around: start over.
            self.forget();
        }
        self.floor = self.floor.max(next);
    }

    /// A read from the host: learn from it, and check the guess.
    ///
    /// Only a key this VM wrote lately (since the last-but-one `age`) tells
    /// where the host's counter is: its version was handed out since then.
    /// Any other key may have been written a whole counter cycle ago, at a
    /// version *ahead* of the counter once it has wrapped around, which
    /// would lift `floor` above the version our next write gets.
    fn observed(&mut self, key: &str, found: &Option<Entry>) {
        let cas = found.as_ref().and_then(|e| e.cas);
        let Some(m) = self.keys.get_mut(key) else {
            return;
        };
        m.lent = false;
        if m.version != 0 {
            m.streak = if cas == Some(m.version) {
                m.streak.saturating_add(1)
            } else {
                0
            };
        }
        self.saw_version(cas);
    }

    fn wrote(&mut self, key: &str, value: &[u8], cas: Option<u32>) {
        if let Some(m) = self.keys.get(key) {
            if m.lent && m.version != 0 && cas == Some(m.version) {
                self.skipped += 1; // the read this write would have needed
            }
            // The key held `cas`, handed out lately (see `observed`).
            self.saw_version(cas);
        }
        // Our write got a version at least `floor`, if `floor` is known:
        // the host's versions only grow (until the counter wraps, far
        // beyond a tick). Remembering `floor` is therefore safe: if the key
        // still has that version, it still holds our bytes, since any later
        // write got a higher one. A wrong guess only costs a failed write.
        let version = self.floor;
        if version != 0 {
            self.floor = version.checked_add(1).unwrap_or(0);
            if self.floor == 0 {
                // Out of versions to reason with (the host's counter wraps).
                self.forget();
                return;
            }
        }
        let full = self.keys.len() >= MAX_REMEMBERED;
        match self.keys.get_mut(key) {
            Some(m) => {
                m.bytes.clear();
                m.bytes.extend_from_slice(value);
                m.version = version;
                m.lent = false;
                m.used = true;
            }
            None if full => {}
            None => {
                self.keys.insert(
                    key.to_string(),
                    Memory {
                        bytes: value.to_vec(),
                        version,
                        streak: 0,
                        lent: false,
                        used: true,
                    },
                );
            }
        }
    }

    fn failed(&mut self, key: &str, cas: Option<u32>) {
        if let Some(m) = self.keys.get_mut(key) {
            if m.lent && cas == Some(m.version) {
                self.stale += 1;
            }
            m.version = 0;
            m.streak = 0;
            m.lent = false;
        }
    }

    fn forget(&mut self) {
        self.keys.clear();
        self.floor = 0;
    }

    fn age(&mut self) {
        self.keys.retain(|_, m| std::mem::take(&mut m.used));
        for m in self.keys.values_mut() {
            m.version = 0;
            m.lent = false;
        }
        self.floor = 0;
    }
}

/// A store that remembers this VM's own last write to each key and, once
/// guessing the key's version has proved right, answers `get_for_update`
/// from that memory: one host call per update instead of two.
///
/// The host does not say which version a write got. Envoy (proxy-wasm's
/// C++ host) hands out versions from one counter that only grows, shared by
/// every key, so the version our write gets is more than any version handed
/// out before it: more than the versions this VM lately read on keys it
/// wrote lately, and than the guesses for its own earlier writes. That
/// lower bound is the guess: a CAS with it succeeds only if nobody (on any
/// worker, on any key) wrote in between, and it can never match somebody
/// else's later write, which got a higher version. The bound is learnt only
/// from keys written lately because the 32-bit counter wraps around: a key
/// untouched for a whole cycle can carry a version ahead of the counter.
/// For the same reason versions are forgotten (`age`) long before the
/// counter could wrap: sluice does so on every tick.
#[derive(Default)]
pub struct Remembering<S> {
    inner: S,
    memo: RefCell<Memo>,
}

impl<S: Store> Remembering<S> {
    pub fn new(inner: S) -> Self {
        Remembering {
            inner,
            memo: RefCell::new(Memo::default()),
        }
    }

    /// Drops everything remembered.
    pub fn forget(&self) {
        if let Ok(mut m) = self.memo.try_borrow_mut() {
            m.forget();
        }
    }

    /// Forgets every version, and the keys not written since the last call;
    /// keeps how well guessing has worked for the others, so a key in use
    /// needs one read to be remembered again.
    pub fn age(&self) {
        if let Ok(mut m) = self.memo.try_borrow_mut() {
            m.age();
        }
    }

    /// (reads skipped: writes made from memory without a read; remembered
    /// answers that proved out of date) since the last call.
    pub fn take_counts(&self) -> (u64, u64) {
        match self.memo.try_borrow_mut() {
            Ok(mut m) => (std::mem::take(&mut m.skipped), std::mem::take(&mut m.stale)),
            Err(_) => (0, 0),
        }
    }

    fn recall(&self, key: &str) -> Option<Entry> {
        let mut memo = self.memo.try_borrow_mut().ok()?;
        let m = memo.keys.get_mut(key)?;
        if m.version == 0 || m.streak < TRUST {
            return None;
        }
        m.lent = true;
        Some(Entry {
            bytes: m.bytes.clone(),
            cas: Some(m.version),
            remembered: true,
        })
    }
}

impl<S: Store> Store for Remembering<S> {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let found = self.inner.get(key)?;
        if let Ok(mut m) = self.memo.try_borrow_mut() {
            m.observed(key, &found);
        }
        Ok(found)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let result = self.inner.set(key, value, cas);
        if let Ok(mut m) = self.memo.try_borrow_mut() {
            match result {
                Ok(()) => m.wrote(key, value, cas),
                Err(_) => m.failed(key, cas),
            }
        }
        result
    }

    fn get_for_update(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        match self.recall(key) {
            Some(entry) => Ok(Some(entry)),
            None => self.get(key),
        }
    }
}
