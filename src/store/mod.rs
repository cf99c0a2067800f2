//! The shared-state store every mechanism runs on: Envoy shared data in
//! production, an in-memory map with injectable conflicts in tests.
//!
//! Semantics follow proxy-wasm: `get` returns the bytes and a CAS token;
//! `set` with a token fails with `CasMismatch` if anyone wrote the key since;
//! `set` without a token writes unconditionally (used only to create keys).
//!
//! [`Remembering`] wraps a store so that a VM writing the same key again and
//! again (one worker, or a quiet moment) can skip the read before each write.

#[cfg(test)]
pub(crate) mod memory;
mod remembering;
mod slot;
#[cfg(test)]
mod tests;

pub use remembering::Remembering;
pub use slot::{get_slot_by_text, KeyText, SlotKey, SmallEntry, SMALL};

/// One stored value and its CAS token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub bytes: Vec<u8>,
    pub cas: Option<u32>,
    /// Answered from this VM's memory of its own last write, without asking
    /// the host (see [`Store::get_for_update`]).
    pub remembered: bool,
}

impl Entry {
    /// An entry read from the host.
    pub fn read(bytes: Vec<u8>, cas: Option<u32>) -> Self {
        Entry {
            bytes,
            cas,
            remembered: false,
        }
    }
}

/// A store error. A conflict is an ordinary outcome, not a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Someone wrote the key since it was read.
    CasMismatch,
    /// The host refused the call.
    Unavailable,
}

/// Key-value storage with compare-and-swap.
pub trait Store {
    /// The value of `key`, or `None` if it was never written.
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError>;
    /// Writes `value`; with `cas`, only if the key is unchanged since read.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
    /// Like `get`, for a caller that will write the key back with the
    /// returned CAS token: the answer may come from memory (`remembered`)
    /// and be out of date, which that write then reveals by failing with
    /// `CasMismatch`. A caller that decides *not* to write after a
    /// remembered answer must read again with `get` before acting on it.
    fn get_for_update(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.get(key)
    }

    /// `get_for_update` of a slot's key (`fresh`: `get`), its value inline
    /// (see [`SmallEntry`]): the same key as its text, which a store may
    /// keep by number.
    fn get_slot(&self, key: SlotKey, fresh: bool) -> Result<Option<SmallEntry>, StoreError> {
        get_slot_by_text(self, key, fresh)
    }

    /// `set` of a slot's key.
    fn set_slot(&self, key: SlotKey, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.set(&key.text(), value, cas)
    }
}

/// What a read-modify-write does with the value it found.
pub enum Update<B, T> {
    /// Write these bytes (by CAS against the value found), then return `T`.
    Write(B, T),
    /// Leave the key as it is and return `T`.
    Keep(T),
}

/// Updates `key` by compare-and-swap: reads it (from memory where the store
/// can, see `get_for_update`), lets `decide` choose from the value found
/// (`None`: never written), writes; on a conflict reads and decides again,
/// at most `max_retries` times, then fails with `CasMismatch`. A remembered
/// value that proves out of date, or that `decide` would keep (nothing
/// would check it), is read again from the host, uncounted. `decide` may
/// run more than once.
pub fn update<B: AsRef<[u8]>, T>(
    store: &dyn Store,
    key: &str,
    max_retries: u32,
    mut decide: impl FnMut(Option<&Entry>) -> Update<B, T>,
) -> Result<T, StoreError> {
    let mut conflicts = 0;
    let mut fresh = false;
    loop {
        let found = if fresh {
            store.get(key)?
        } else {
            store.get_for_update(key)?
        };
        let remembered = found.as_ref().is_some_and(|e| e.remembered);
        let cas = found.as_ref().and_then(|e| e.cas);
        match decide(found.as_ref()) {
            Update::Keep(_) if remembered => fresh = true,
            Update::Keep(t) => return Ok(t),
            Update::Write(bytes, t) => match store.set(key, bytes.as_ref(), cas) {
                Ok(()) => return Ok(t),
                Err(StoreError::CasMismatch) if remembered => fresh = true,
                Err(StoreError::CasMismatch) if conflicts < max_retries => conflicts += 1,
                Err(e) => return Err(e),
            },
        }
    }
}
