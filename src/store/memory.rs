//! A store with Envoy's semantics, plus hooks that simulate other
//! workers writing between our read and our write.
use super::{Entry, Store, StoreError};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

type Hook = Box<dyn FnMut(&MemoryStore, &str)>;

#[derive(Default)]
pub struct MemoryStore {
    pub map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    pub next_cas: Cell<u32>,
    /// Called before each `set`, to interleave a concurrent writer.
    pub before_set: RefCell<Option<Hook>>,
    pub sets: Cell<u32>,
    pub gets: Cell<u32>,
    pub fail_all: Cell<bool>,
}

impl MemoryStore {
    /// Versions come from one counter for all keys, as in Envoy: it
    /// only grows, wraps around at 2^32 and skips 0.
    pub fn raw_set(&self, key: &str, value: &[u8]) {
        let cas = self.next_cas.get().wrapping_add(1).max(1);
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
        self.gets.set(self.gets.get() + 1);
        Ok(self
            .map
            .borrow()
            .get(key)
            .map(|(b, c)| Entry::read(b.clone(), Some(*c))))
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

/// A worker's view of a store it does not own (a test's hook).
impl<T: Store> Store for std::rc::Weak<T> {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.upgrade().ok_or(StoreError::Unavailable)?.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.upgrade()
            .ok_or(StoreError::Unavailable)?
            .set(key, value, cas)
    }
}

/// `n` workers' access to one store: the store itself, or each
/// worker's own `Remembering` layer over it (as each Envoy worker VM
/// has).
pub fn views(
    store: &std::rc::Rc<MemoryStore>,
    n: usize,
    remembering: bool,
) -> Vec<std::rc::Rc<dyn Store>> {
    (0..n)
        .map(|_| -> std::rc::Rc<dyn Store> {
            if remembering {
                std::rc::Rc::new(crate::store::Remembering::new(store.clone()))
            } else {
                store.clone()
            }
        })
        .collect()
}

/// Several simulated workers' stores over one map.
impl<T: Store + ?Sized> Store for std::rc::Rc<T> {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        (**self).set(key, value, cas)
    }
    fn get_for_update(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        (**self).get_for_update(key)
    }
}
