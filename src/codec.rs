//! What every shared-data codec shares: the `Corrupt` error, a reader of
//! little-endian fields, and the 32-bit check that closes a record. Each
//! mechanism's `codec.rs` lays out its own record with these.

/// Why bytes were not what they should be (a slot, a breaker state...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt;

/// Reads little-endian fields in order from encoded bytes.
pub struct Reader<'a>(pub &'a [u8]);

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

/// The check closing a record: FNV-1a over its body. It detects truncation
/// and stray writes, not an adversary (an adversary able to write shared
/// data owns the proxy anyway).
pub fn check(body: &[u8]) -> u32 {
    body.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

/// Splits a record into its body and checks the 32-bit check that follows
/// it; the body must be exactly `len` bytes.
pub fn checked_body(bytes: &[u8], len: usize) -> Result<&[u8], Corrupt> {
    let (body, c) = bytes.split_at_checked(len).ok_or(Corrupt)?;
    let c: [u8; 4] = c.try_into().map_err(|_| Corrupt)?;
    if u32::from_le_bytes(c) == check(body) {
        Ok(body)
    } else {
        Err(Corrupt)
    }
}
