//! The bytes of one bulkhead slot: version `1`, the requests in flight
//! (little-endian u32) and the 32-bit check. Anything else is corrupt and
//! never trusted.

use crate::codec::{check, checked_body, Corrupt, Reader};

const VERSION: u8 = 1;
const BODY: usize = 1 + 4;

/// Encodes a count of requests in flight.
pub fn encode(in_flight: u32) -> [u8; BODY + 4] {
    let mut out = [0u8; BODY + 4];
    let (body, sum) = out.split_at_mut(BODY);
    let (head, n) = body.split_at_mut(1);
    head.copy_from_slice(&[VERSION]);
    n.copy_from_slice(&in_flight.to_le_bytes());
    sum.copy_from_slice(&check(body).to_le_bytes());
    out
}

/// Decodes bytes written by `encode`.
pub fn decode(bytes: &[u8]) -> Result<u32, Corrupt> {
    let mut r = Reader(checked_body(bytes, BODY)?);
    if r.take::<1>()? != [VERSION] {
        return Err(Corrupt);
    }
    r.u32()
}
