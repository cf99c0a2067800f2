//! The bytes of one slot in shared data.
//!
//! Layout (29 bytes, little-endian): version `1`, the fingerprint of the key
//! that last charged the slot (8 bytes, for collision accounting), the
//! scaled TAT (16 bytes), and a 32-bit check over the rest. Anything else,
//! whatever its origin (another plugin sharing the vm_id, a bug, an older
//! format), decodes as `Corrupt` and is never trusted.

/// One slot's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub fingerprint: u64,
    pub tat: u128,
}

/// Why bytes were not a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

const VERSION: u8 = 1;
/// Encoded size of a slot.
pub const SLOT_LEN: usize = 29;

fn check(body: &[u8]) -> u32 {
    // FNV-1a: detects truncation and stray writes, not an adversary (an
    // adversary able to write shared data owns the proxy anyway).
    body.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

impl Slot {
    /// The encoded bytes.
    pub fn encode(&self) -> [u8; SLOT_LEN] {
        let mut body = [0u8; 25];
        let fields = std::iter::once(VERSION)
            .chain(self.fingerprint.to_le_bytes())
            .chain(self.tat.to_le_bytes());
        for (dst, src) in body.iter_mut().zip(fields) {
            *dst = src;
        }
        let mut out = [0u8; SLOT_LEN];
        for (dst, src) in out
            .iter_mut()
            .zip(body.into_iter().chain(check(&body).to_le_bytes()))
        {
            *dst = src;
        }
        out
    }

    /// Decodes bytes written by `encode`.
    pub fn decode(bytes: &[u8]) -> Result<Slot, Corrupt> {
        let field = |range: std::ops::Range<usize>| bytes.get(range).ok_or(Corrupt);
        if bytes.len() != SLOT_LEN || bytes.first() != Some(&VERSION) {
            return Err(Corrupt);
        }
        let c: [u8; 4] = field(25..29)?.try_into().map_err(|_| Corrupt)?;
        if u32::from_le_bytes(c) != check(field(0..25)?) {
            return Err(Corrupt);
        }
        let fp: [u8; 8] = field(1..9)?.try_into().map_err(|_| Corrupt)?;
        let tat: [u8; 16] = field(9..25)?.try_into().map_err(|_| Corrupt)?;
        Ok(Slot {
            fingerprint: u64::from_le_bytes(fp),
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
                fingerprint: r.next_u64(),
                tat: ((r.next_u64() as u128) << 64) | r.next_u64() as u128,
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
        assert_eq!(Slot::decode(&good[..28]), Err(Corrupt));
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
