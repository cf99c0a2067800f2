//! The bytes of one slot in shared data.
//!
//! Layout (21 bytes, little-endian): version `2`, the tag of the key that
//! last charged the slot (4 bytes, for collision accounting), the scaled TAT
//! (12 bytes: 96 bits hold any validated rate for thousands of years), and a
//! 32-bit check over the rest. 21 bytes fit Envoy's short-string buffer, so
//! a slot costs no extra allocation in Envoy's shared-data map. Anything else,
//! whatever its origin (another plugin sharing the vm_id, a bug, an older
//! format), decodes as `Corrupt` and is never trusted.

use crate::codec::{check, Corrupt};

/// One slot's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub fingerprint: u32,
    pub tat: u128,
}

const VERSION: u8 = 2;
/// Encoded size of a slot.
pub const SLOT_LEN: usize = 21;
/// Largest storable TAT (2^96 - 1); larger values are clamped.
pub const MAX_TAT: u128 = (1 << 96) - 1;

/// The value of a table's "complete" marker: a version byte, the number
/// of slots, and the check. A marker that does not decode to the table's
/// length (corrupt, or another length) means the table is checked again.
pub fn table_marker(len: u32) -> [u8; 9] {
    let mut out = [0u8; 9];
    let (body, sum) = out.split_at_mut(5);
    let (head, n) = body.split_at_mut(1);
    head.copy_from_slice(&[VERSION]);
    n.copy_from_slice(&len.to_le_bytes());
    sum.copy_from_slice(&check(body).to_le_bytes());
    out
}

impl Slot {
    /// The encoded bytes.
    pub fn encode(&self) -> [u8; SLOT_LEN] {
        let mut out = [0u8; SLOT_LEN];
        let tat = self.tat.min(MAX_TAT).to_le_bytes();
        let (body, sum) = out.split_at_mut(17);
        let (head, rest) = body.split_at_mut(1);
        let (fp, t) = rest.split_at_mut(4);
        head.copy_from_slice(&[VERSION]);
        fp.copy_from_slice(&self.fingerprint.to_le_bytes());
        t.copy_from_slice(tat.get(..12).unwrap_or(&[0; 12]));
        sum.copy_from_slice(&check(body).to_le_bytes());
        out
    }

    /// Decodes bytes written by `encode`.
    pub fn decode(bytes: &[u8]) -> Result<Slot, Corrupt> {
        let field = |range: std::ops::Range<usize>| bytes.get(range).ok_or(Corrupt);
        if bytes.len() != SLOT_LEN || bytes.first() != Some(&VERSION) {
            return Err(Corrupt);
        }
        crate::codec::checked_body(bytes, 17)?;
        let fp: [u8; 4] = field(1..5)?.try_into().map_err(|_| Corrupt)?;
        let mut tat = [0u8; 16];
        for (dst, src) in tat.iter_mut().zip(field(5..17)?) {
            *dst = *src;
        }
        Ok(Slot {
            fingerprint: u32::from_le_bytes(fp),
            tat: u128::from_le_bytes(tat),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trips_random_slots() {
        let mut r = SplitMix(3);
        for _ in 0..1000 {
            let s = Slot {
                fingerprint: r.next_u64() as u32,
                tat: (((r.next_u64() as u128) << 64) | r.next_u64() as u128) & MAX_TAT,
            };
            assert_eq!(Slot::decode(&s.encode()), Ok(s));
        }
    }

    #[test]
    fn rejects_wrong_length_version_and_any_single_bit_flip() {
        let good = Slot {
            fingerprint: 5,
            tat: 123_456_789,
        }
        .encode();
        assert_eq!(Slot::decode(&good[..20]), Err(Corrupt));
        let huge = Slot {
            fingerprint: 1,
            tat: u128::MAX,
        }
        .encode();
        assert_eq!(Slot::decode(&huge).map(|s| s.tat), Ok(MAX_TAT));
        assert_eq!(Slot::decode(&[]), Err(Corrupt));
        assert_eq!(
            Slot::decode(b"hello world, not a slot at all"),
            Err(Corrupt)
        );
        for byte in 0..SLOT_LEN {
            for bit in 0..8 {
                let mut bad = good;
                bad[byte] ^= 1 << bit;
                assert_eq!(Slot::decode(&bad), Err(Corrupt), "byte {byte} bit {bit}");
            }
        }
    }
}
