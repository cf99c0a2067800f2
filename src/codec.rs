//! The bytes of one slot in shared data.
//!
//! Layout (21 bytes, little-endian): version `2`, the tag of the key that
//! last charged the slot (4 bytes, for collision accounting), the scaled TAT
//! (12 bytes: 96 bits hold any validated rate for thousands of years), and a
//! 32-bit check over the rest. 21 bytes fit Envoy's short-string buffer, so
//! a slot costs no extra allocation in Envoy's shared-data map. Anything else,
//! whatever its origin (another plugin sharing the vm_id, a bug, an older
//! format), decodes as `Corrupt` and is never trusted.

/// One slot's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub fingerprint: u32,
    pub tat: u128,
}

/// Why bytes were not what they should be (a slot, a breaker state...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

/// Reads little-endian fields in order from encoded bytes (the breaker
/// states' and shedder entries' codecs).
pub(crate) struct Reader<'a>(pub &'a [u8]);

impl Reader<'_> {
    pub fn take<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        let (head, rest) = self.0.split_at_checked(N).ok_or(Corrupt)?;
        self.0 = rest;
        head.try_into().map_err(|_| Corrupt)
    }
    pub fn u32(&mut self) -> Result<u32, Corrupt> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Result<u64, Corrupt> {
        self.take::<8>().map(u64::from_le_bytes)
    }
}

const VERSION: u8 = 2;
/// Encoded size of a slot.
pub const SLOT_LEN: usize = 21;
/// Largest storable TAT (2^96 - 1); larger values are clamped.
pub const MAX_TAT: u128 = (1 << 96) - 1;

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
        let c: [u8; 4] = field(17..21)?.try_into().map_err(|_| Corrupt)?;
        if u32::from_le_bytes(c) != check(field(0..17)?) {
            return Err(Corrupt);
        }
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
