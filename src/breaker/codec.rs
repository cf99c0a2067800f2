//! The bytes of one breaker key's state in shared data: version `2`, the
//! fields in order (little-endian), a 32-bit FNV-1a check. Anything else is
//! corrupt and never trusted.

use super::{Phase, State, BUCKETS};
use crate::codec::{check, checked_body, Corrupt, Reader};

const VERSION: u8 = 2;
const BODY: usize = 1 + 1 + 4 + 8 + 4 + 4 + 8 + 4 + 4 + 8 + BUCKETS * 8;

/// Encodes a state.
pub fn encode(s: &State) -> Vec<u8> {
    let mut out = Vec::with_capacity(BODY + 4);
    out.push(VERSION);
    out.push(match s.phase {
        Phase::Closed => 0,
        Phase::Open => 1,
        Phase::HalfOpen => 2,
    });
    out.extend_from_slice(&s.trips.to_le_bytes());
    out.extend_from_slice(&s.until_ms.to_le_bytes());
    out.extend_from_slice(&s.in_flight.to_le_bytes());
    out.extend_from_slice(&s.probe_successes.to_le_bytes());
    out.extend_from_slice(&s.probe_deadline_ms.to_le_bytes());
    out.extend_from_slice(&s.consecutive.to_le_bytes());
    out.extend_from_slice(&s.epoch.to_le_bytes());
    out.extend_from_slice(&s.base_bucket.to_le_bytes());
    for (ok, bad) in s.buckets {
        out.extend_from_slice(&ok.to_le_bytes());
        out.extend_from_slice(&bad.to_le_bytes());
    }
    let c = check(&out);
    out.extend_from_slice(&c.to_le_bytes());
    out
}

/// Decodes bytes written by `encode`.
pub fn decode(bytes: &[u8]) -> Result<State, Corrupt> {
    let mut r = Reader(checked_body(bytes, BODY)?);
    if r.take::<1>()? != [VERSION] {
        return Err(Corrupt);
    }
    let phase = match r.take::<1>()? {
        [0] => Phase::Closed,
        [1] => Phase::Open,
        [2] => Phase::HalfOpen,
        _ => return Err(Corrupt),
    };
    let mut s = State {
        phase,
        trips: r.u32()?,
        until_ms: r.u64()?,
        in_flight: r.u32()?,
        probe_successes: r.u32()?,
        probe_deadline_ms: r.u64()?,
        consecutive: r.u32()?,
        epoch: r.u32()?,
        base_bucket: r.u64()?,
        buckets: [(0, 0); BUCKETS],
    };
    for b in s.buckets.iter_mut() {
        *b = (r.u32()?, r.u32()?);
    }
    Ok(s)
}

/// Encodes a breaker's count of keys not closed (its `open` record): the
/// count (8 bytes, little-endian) and the check.
pub fn encode_count(n: u64) -> Vec<u8> {
    let mut out = n.to_le_bytes().to_vec();
    let c = check(&out);
    out.extend_from_slice(&c.to_le_bytes());
    out
}

/// Decodes bytes written by `encode_count`.
pub fn decode_count(bytes: &[u8]) -> Result<u64, Corrupt> {
    Reader(checked_body(bytes, 8)?).u64()
}
