//! The two hashes sluice uses, both from well-kept crates:
//!
//! - [`Keyed`]: SipHash-1-3 (`siphasher`) with a 128-bit key, over
//!   length-prefixed fields. It places callers in a rule's slot table, keyed
//!   with a secret shared by all VMs of one Envoy, so a client cannot choose
//!   key values that land on another caller's slots; and it derives state ids.
//! - [`FastMap`]: a hash map with foldhash's fast, unkeyed hash, for per-VM
//!   maps whose keys a client cannot choose (shared-data keys of slots,
//!   breaker keys that are already keyed SipHash outputs, stream ids).

use siphasher::sip::SipHasher13;
use std::collections::HashMap;
use std::hash::Hasher;

/// A `HashMap` with foldhash's fast hash and a fixed seed. Not resistant to
/// chosen keys: use it only where clients cannot pick them.
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// SipHash-1-3 keyed with `(k0, k1)`, fed length-prefixed fields.
pub struct Keyed(SipHasher13);

impl Keyed {
    /// A hasher keyed with `(k0, k1)`.
    pub fn new((k0, k1): (u64, u64)) -> Self {
        Keyed(SipHasher13::new_with_keys(k0, k1))
    }

    /// Feeds raw bytes (markers and tags of fixed length).
    pub fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// Feeds a length-prefixed field, so that field boundaries cannot be
    /// forged by values containing separators.
    pub fn field(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }

    /// Finishes and returns the 64-bit hash.
    pub fn finish(self) -> u64 {
        self.0.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn fields(key: (u64, u64), parts: &[&[u8]]) -> u64 {
        let mut h = Keyed::new(key);
        for p in parts {
            h.field(p);
        }
        h.finish()
    }

    #[test]
    fn keyed_hashes_equal_the_hand_written_siphash13_it_replaced() {
        // Outputs of sluice's former SipHash-1-3: client-to-slot placement
        // and state ids are unchanged by the switch to `siphasher`.
        assert_eq!(
            fields((11, 22), &[b"x-tenant", b"acme"]),
            0x8e4e_5666_e0cd_86df
        );
        let id = fields(
            (0x736c_7569_6365, 0x7275_6c65),
            &[b"default", b"per-client"],
        );
        assert_eq!(id, 0x36b2_30f1_c648_f1a2);
        assert_eq!(fields((1, 2), &[b""]), 0xeaa6_1813_3278_7411);
        let mut raw = SipHasher13::new_with_keys(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);
        raw.write(&(0u8..15).collect::<Vec<_>>());
        assert_eq!(raw.finish(), 0xd320_d86d_2a51_9956);
    }

    #[test]
    fn matches_the_standard_library_siphash13_with_zero_keys() {
        // std's DefaultHasher is SipHash-1-3 keyed with (0, 0).
        for data in [&b""[..], b"a", b"abcdefgh", b"abcdefghijklmnopq"] {
            let mut std_h = std::collections::hash_map::DefaultHasher::new();
            std_h.write(data);
            let mut ours = SipHasher13::new_with_keys(0, 0);
            ours.write(data);
            assert_eq!(ours.finish(), std_h.finish(), "{data:?}");
        }
    }

    #[test]
    fn length_prefixed_fields_cannot_be_forged_and_keys_matter() {
        assert_ne!(
            fields((3, 4), &[b"ab", b"c"]),
            fields((3, 4), &[b"a", b"bc"])
        );
        assert_ne!(fields((1, 2), &[b"x"]), fields((2, 1), &[b"x"]));
    }

    /// Buckets (low 11 bits) and 32-bit tags (top 7 bits of the low 32)
    /// the keys use, as hashbrown would pick them on wasm32.
    fn spread(keys: impl Iterator<Item = Vec<u8>>) -> (usize, usize) {
        use std::hash::BuildHasher;
        let state = foldhash::fast::FixedState::default();
        let mut buckets = std::collections::HashSet::new();
        let mut tags = std::collections::HashSet::new();
        for k in keys {
            let v = state.hash_one(&k);
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
