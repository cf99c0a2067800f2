//! SipHash-1-3 with a 128-bit key: the keyed hash that places callers in a
//! rule's slot table. Keyed with a secret shared by all VMs of one Envoy, so
//! a client cannot choose key values that land on another caller's slots.

/// An incremental SipHash-1-3 hasher.
pub struct SipHasher13 {
    v: [u64; 4],
    tail: u64,
    ntail: usize,
    length: usize,
}

impl SipHasher13 {
    /// A hasher keyed with `(k0, k1)`.
    pub fn new(k0: u64, k1: u64) -> Self {
        Self {
            v: [
                k0 ^ 0x736f_6d65_7073_6575,
                k1 ^ 0x646f_7261_6e64_6f6d,
                k0 ^ 0x6c79_6765_6e65_7261,
                k1 ^ 0x7465_6462_7974_6573,
            ],
            tail: 0,
            ntail: 0,
            length: 0,
        }
    }

    #[inline]
    fn round(&mut self) {
        let v = &mut self.v;
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    }

    #[inline]
    fn compress(&mut self, m: u64) {
        self.v[3] ^= m;
        self.round();
        self.v[0] ^= m;
    }

    /// Feeds bytes.
    pub fn write(&mut self, bytes: &[u8]) {
        self.length = self.length.wrapping_add(bytes.len());
        for &b in bytes {
            self.tail |= (b as u64) << (8 * self.ntail);
            self.ntail += 1;
            if self.ntail == 8 {
                let m = self.tail;
                self.compress(m);
                self.tail = 0;
                self.ntail = 0;
            }
        }
    }

    /// Feeds a length-prefixed field, so that field boundaries cannot be
    /// forged by values containing separators.
    pub fn write_field(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }

    /// Finishes and returns the 64-bit hash.
    pub fn finish(mut self) -> u64 {
        let b = ((self.length as u64 & 0xff) << 56) | self.tail;
        self.compress(b);
        self.v[2] ^= 0xff;
        for _ in 0..3 {
            self.round();
        }
        self.v[0] ^ self.v[1] ^ self.v[2] ^ self.v[3]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn hash(k0: u64, k1: u64, data: &[u8]) -> u64 {
        let mut h = SipHasher13::new(k0, k1);
        h.write(data);
        h.finish()
    }

    #[test]
    fn matches_the_standard_library_siphash13_with_zero_keys() {
        // std's DefaultHasher is SipHash-1-3 keyed with (0, 0).
        use std::hash::Hasher;
        for data in [&b""[..], b"a", b"abcdefgh", b"abcdefghijklmnopq"] {
            let mut std_h = std::collections::hash_map::DefaultHasher::new();
            std_h.write(data);
            assert_eq!(hash(0, 0, data), std_h.finish(), "{data:?}");
        }
    }

    #[test]
    fn split_writes_equal_one_write_and_keys_matter() {
        let mut h = SipHasher13::new(1, 2);
        h.write(b"hello ");
        h.write(b"world, this is long");
        assert_eq!(h.finish(), hash(1, 2, b"hello world, this is long"));
        assert_ne!(hash(1, 2, b"x"), hash(2, 1, b"x"));
    }

    #[test]
    fn length_prefixed_fields_cannot_be_forged() {
        let mut a = SipHasher13::new(3, 4);
        a.write_field(b"ab");
        a.write_field(b"c");
        let mut b = SipHasher13::new(3, 4);
        b.write_field(b"a");
        b.write_field(b"bc");
        assert_ne!(a.finish(), b.finish());
    }
}
