//! The table-hash seed every worker of an Envoy shares (per domain), so
//! all of them place a key in the same slots: read from the store, or, if
//! missing or corrupt, created from `fresh` random bytes and read back.
//! Two workers that both find it missing at the same moment could each
//! read back their own write (the store has no "create if absent"): the
//! wasm host configures each VM on its worker at start, so the window is
//! the first configuration's; the native host creates it once, on the
//! main thread.

use crate::store::Store;
use log::warn;

/// The seed's key in the store.
fn key(domain: &str) -> String {
    format!("sluice/seed/{domain}")
}

fn decode(b: &[u8]) -> Option<(u64, u64)> {
    let a: [u8; 8] = b.get(..8)?.try_into().ok()?;
    let c: [u8; 8] = b.get(8..16)?.try_into().ok()?;
    (b.len() == 16).then(|| (u64::from_le_bytes(a), u64::from_le_bytes(c)))
}

/// The shared seed of `domain`; `None` if the store fails.
pub fn shared_seed(store: &dyn Store, domain: &str, fresh: [u8; 16]) -> Option<(u64, u64)> {
    let key = key(domain);
    if let Ok(Some(entry)) = store.get(&key) {
        if let Some(seed) = decode(&entry.bytes) {
            return Some(seed);
        }
        warn!("sluice: shared seed {key} is corrupt; replacing it");
    }
    store.set(&key, &fresh, None).ok()?;
    decode(&store.get(&key).ok()??.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn the_first_seed_stays_and_a_corrupt_one_is_replaced() {
        let store = MemoryStore::default();
        let first = shared_seed(&store, "d", [1; 16]);
        assert_eq!(first, Some((0x0101_0101_0101_0101, 0x0101_0101_0101_0101)));
        assert_eq!(shared_seed(&store, "d", [2; 16]), first, "kept");
        assert_ne!(shared_seed(&store, "other", [3; 16]), first, "per domain");
        store.set(&key("d"), b"short", None).ok();
        assert_eq!(
            shared_seed(&store, "d", [4; 16]),
            Some((0x0404_0404_0404_0404, 0x0404_0404_0404_0404))
        );
    }
}
