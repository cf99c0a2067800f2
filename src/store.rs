//! The shared-state store the limiter runs on: Envoy shared data in
//! production, an in-memory map with injectable conflicts in tests.
//!
//! Semantics follow proxy-wasm: `get` returns the bytes and a CAS token;
//! `set` with a token fails with `CasMismatch` if anyone wrote the key since;
//! `set` without a token writes unconditionally (used only to create keys).

/// One stored value and its CAS token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub bytes: Vec<u8>,
    pub cas: Option<u32>,
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
}

#[cfg(test)]
pub(crate) mod memory {
    //! A store with Envoy's semantics, plus hooks that simulate other
    //! workers writing between our read and our write.
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    type Hook = Box<dyn FnMut(&MemoryStore, &str)>;

    #[derive(Default)]
    pub struct MemoryStore {
        pub map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        next_cas: Cell<u32>,
        /// Called before each `set`, to interleave a concurrent writer.
        pub before_set: RefCell<Option<Hook>>,
        pub sets: Cell<u32>,
        pub fail_all: Cell<bool>,
    }

    impl MemoryStore {
        pub fn raw_set(&self, key: &str, value: &[u8]) {
            let cas = self.next_cas.get() + 1;
            self.next_cas.set(cas);
            self.map
                .borrow_mut()
                .insert(key.to_string(), (value.to_vec(), cas));
        }
    }

    impl Store for MemoryStore {
        fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
            if self.fail_all.get() {
                return Err(StoreError::Unavailable);
            }
            Ok(self.map.borrow().get(key).map(|(b, c)| Entry {
                bytes: b.clone(),
                cas: Some(*c),
            }))
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if self.fail_all.get() {
                return Err(StoreError::Unavailable);
            }
            let hook = self.before_set.borrow_mut().take();
            if let Some(mut hook) = hook {
                hook(self, key);
                *self.before_set.borrow_mut() = Some(hook);
            }
            self.sets.set(self.sets.get() + 1);
            let current = self.map.borrow().get(key).map(|(_, c)| *c);
            if let (Some(want), Some(have)) = (cas, current) {
                if want != have {
                    return Err(StoreError::CasMismatch);
                }
            }
            self.raw_set(key, value);
            Ok(())
        }
    }
}
