//! A small deterministic mutator for the stable pass: bit flips, byte
//! changes, truncations, insertions of interesting bytes, splices of two
//! inputs and duplicated spans, from a seeded generator.

/// SplitMix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn word(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.word() % n as u64) as usize
        }
    }
}

const INTERESTING: [&[u8]; 12] = [
    b"0",
    b"-1",
    b"18446744073709551616",
    b"\xff",
    b"\x00",
    b"1e400",
    b"\"",
    b"{}",
    b"[]",
    b"\xc3\x28",
    b"99999999999999999999m",
    b"0.0000001",
];

/// One to four mutations of `input`, `other` the splice partner.
pub fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(7) {
            0 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = at.min(v.len() - 1);
                v[i] = rng.word() as u8;
            }
            2 => v.truncate(at),
            3 => {
                let s = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(at..at, s.iter().copied());
            }
            4 => {
                let from = rng.below(other.len() + 1);
                v.truncate(at);
                v.extend_from_slice(&other[from..]);
            }
            5 if !v.is_empty() => {
                let start = rng.below(v.len());
                let end = (start + 1 + rng.below(16)).min(v.len());
                let span = v[start..end].to_vec();
                v.splice(at..at, span);
            }
            _ if !v.is_empty() => {
                let start = rng.below(v.len());
                let end = (start + 1 + rng.below(8)).min(v.len());
                v.drain(start..end);
            }
            _ => v.push(rng.word() as u8),
        }
    }
    v
}
