//! A hash map with a fast, unkeyed hash, for per-VM maps whose keys a
//! client cannot choose (shared-data keys of slots, breaker keys that are
//! already keyed SipHash outputs): a few instructions per word where the
//! standard map's SipHash-1-3 spends rounds, on every request.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// Multiply-rotate hashing, eight bytes a step (as rustc's FxHasher).
/// Not resistant to chosen keys: use only where clients cannot pick them.
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

const K: u64 = 0x9e37_79b9_7f4a_7c15;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        let mut w = [0u8; 8];
        if let Some(dst) = w.get_mut(..rest.len()) {
            dst.copy_from_slice(rest);
        }
        self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
    }

    fn write_u8(&mut self, b: u8) {
        self.add(u64::from(b));
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn finish(&self) -> u64 {
        // One more multiply and fold: hashbrown takes the bucket from the
        // low bits and a 7-bit tag from the top of the hash cut to the
        // platform's width (32 bits on wasm32), and slot keys that differ
        // only in their last digits differ only in the high bytes of the
        // last word.
        let h = (self.0 ^ (self.0 >> 32)).wrapping_mul(K);
        h ^ (h >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn tells_apart_keys_that_differ_in_length_or_one_byte() {
        let hash = |b: &[u8]| {
            let mut h = FastHasher::default();
            h.write(b);
            h.finish()
        };
        let keys: Vec<Vec<u8>> = (0..2000u32)
            .map(|i| format!("sl1f2e3d4c/{i}").into_bytes())
            .chain([
                b"".to_vec(),
                b"\0".to_vec(),
                b"\0\0".to_vec(),
                b"12345678".to_vec(),
            ])
            .collect();
        let distinct: std::collections::HashSet<u64> = keys.iter().map(|k| hash(k)).collect();
        assert_eq!(distinct.len(), keys.len());
    }

    /// Buckets (low 11 bits) and 32-bit tags (top 7 bits of the low 32)
    /// the keys use, as hashbrown would pick them on wasm32.
    fn spread(keys: impl Iterator<Item = Vec<u8>>) -> (usize, usize) {
        let mut buckets = std::collections::HashSet::new();
        let mut tags = std::collections::HashSet::new();
        for k in keys {
            let mut h = FastHasher::default();
            h.write(&k);
            let v = h.finish();
            buckets.insert(v & 2047);
            tags.insert((v as u32) >> 25);
        }
        (buckets.len(), tags.len())
    }

    #[test]
    fn slot_keys_differing_only_in_their_last_digits_spread_like_random_ones() {
        // 1,024 keys in 2,048 buckets: random placement fills about 806.
        for (first, step) in [(0u32, 1u32), (1000, 7), (9000, 1), (123_456, 13)] {
            let keys =
                (0..1024u32).map(|i| format!("sl1f2e3d4c/{}", first + i * step).into_bytes());
            let (buckets, tags) = spread(keys);
            assert!(buckets > 740, "{first}+{step}: {buckets} buckets");
            assert!(tags > 120, "{first}+{step}: {tags} tags");
        }
    }

    #[test]
    fn a_map_with_it_finds_what_it_holds() {
        let mut m: FastMap<(usize, u64), u32> = FastMap::default();
        for i in 0..1000u32 {
            m.insert((i as usize % 3, u64::from(i) << 40), i);
        }
        assert_eq!(m.len(), 1000);
        for i in 0..1000u32 {
            assert_eq!(m.get(&(i as usize % 3, u64::from(i) << 40)), Some(&i));
        }
    }
}
