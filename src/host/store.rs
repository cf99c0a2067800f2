//! The core's `Store` over Envoy shared data.

use crate::store::{Entry, Store, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

/// Envoy shared data (scoped by the plugin's vm_id).
pub struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Ok(Some(Entry { bytes, cas })),
            Ok((None, Some(cas))) => Ok(Some(Entry {
                bytes: Vec::new(),
                cas: Some(cas),
            })),
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
