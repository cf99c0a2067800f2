//! The core's `Store` over Envoy shared data, through this VM's
//! [`Remembering`] layer.

use crate::store::{Entry, Remembering, Store, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

/// Envoy shared data (scoped by the plugin's vm_id), remembering this VM's
/// own writes (see [`Remembering`]).
pub struct SharedData;

/// The host calls themselves.
#[derive(Default)]
struct Host;

impl Store for Host {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Ok(Some(Entry::read(bytes, cas))),
            Ok((None, Some(cas))) => Ok(Some(Entry::read(Vec::new(), Some(cas)))),
            Ok((None, None)) => Ok(None),
            Err(_) => Err(StoreError::Unavailable),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(_) => Err(StoreError::Unavailable),
        }
    }
}

std::thread_local! {
    /// One per VM: versions are learnt from every key this VM touches.
    static STORE: Remembering<Host> = Remembering::default();
}

/// Drops what this VM remembers of its writes (at configuration).
pub fn forget() {
    STORE.with(Remembering::forget);
}

/// Forgets remembered versions, and keys not written lately. Run on every
/// tick (every 100 ms or faster), so a remembered version is never old
/// enough for Envoy's 32-bit version counter to have wrapped around.
pub fn age() {
    STORE.with(Remembering::age);
}

/// (reads skipped, remembered answers out of date) since the last call.
pub fn take_counts() -> (u64, u64) {
    STORE.with(Remembering::take_counts)
}

impl Store for SharedData {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        STORE.with(|s| s.get(key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        STORE.with(|s| s.set(key, value, cas))
    }

    fn get_for_update(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        STORE.with(|s| s.get_for_update(key))
    }
}
