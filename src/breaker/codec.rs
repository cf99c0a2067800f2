//! The bytes of one breaker key's state in shared data: version `1`, the
//! fields in order (little-endian), a 32-bit FNV-1a check. Anything else is
//! corrupt and never trusted.

use super::{Phase, State, BUCKETS};
use crate::codec::{Corrupt, Reader};

const VERSION: u8 = 2;
const BODY: usize = 1 + 1 + 4 + 8 + 4 + 4 + 8 + 4 + 4 + 8 + BUCKETS * 8;

fn check(body: &[u8]) -> u32 {
    body.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

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
    let (body, c) = bytes.split_at_checked(BODY).ok_or(Corrupt)?;
    let c: [u8; 4] = c.try_into().map_err(|_| Corrupt)?;
    if u32::from_le_bytes(c) != check(body) {
        return Err(Corrupt);
    }
    let mut r = Reader(body);
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
