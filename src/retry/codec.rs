//! The bytes of one retry budget's shared state: version `1`, the window
//! the counts belong to, first tries and retries admitted in it and in the
//! window before (little-endian), and the 32-bit check. Anything else is
//! corrupt and never trusted.

use super::Counts;
use crate::codec::{check, checked_body, Corrupt, Reader};

const VERSION: u8 = 1;
const BODY: usize = 1 + 8 * 5;

/// Encodes the counts.
pub fn encode(c: &Counts) -> Vec<u8> {
    let mut out = Vec::with_capacity(BODY + 4);
    out.push(VERSION);
    for v in [c.window, c.tries, c.retries, c.prev_tries, c.prev_retries] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let sum = check(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes bytes written by `encode`.
pub fn decode(bytes: &[u8]) -> Result<Counts, Corrupt> {
    let mut r = Reader(checked_body(bytes, BODY)?);
    if r.take::<1>()? != [VERSION] {
        return Err(Corrupt);
    }
    Ok(Counts {
        window: r.u64()?,
        tries: r.u64()?,
        retries: r.u64()?,
        prev_tries: r.u64()?,
        prev_retries: r.u64()?,
    })
}
