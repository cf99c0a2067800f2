//! The shared-data records of global rules: the leader's lease, the
//! rate-limit service's breaker, and the demand the workers report to the
//! leader. Each closes with the 32-bit check; anything else is corrupt.

use crate::codec::{check, checked_body, Corrupt, Reader};

const VERSION: u8 = 1;

fn close(mut body: Vec<u8>) -> Vec<u8> {
    let c = check(&body);
    body.extend_from_slice(&c.to_le_bytes());
    body
}

/// The fields of a record of `len` bytes before its check, after its
/// version byte (what `close` sealed).
fn open(bytes: &[u8], len: usize) -> Result<Reader<'_>, Corrupt> {
    let mut r = Reader(checked_body(bytes, len)?);
    if r.take::<1>()? != [VERSION] {
        return Err(Corrupt);
    }
    Ok(r)
}

/// The lease of the VM that speaks to the service for this Envoy, with
/// the version of the configuration it belongs to (`Config::version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub owner: u64,
    pub until_ms: u64,
    pub config: u64,
}

impl Lease {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![VERSION];
        b.extend_from_slice(&self.owner.to_le_bytes());
        b.extend_from_slice(&self.until_ms.to_le_bytes());
        b.extend_from_slice(&self.config.to_le_bytes());
        close(b)
    }

    pub fn decode(bytes: &[u8]) -> Result<Lease, Corrupt> {
        let mut r = open(bytes, 25)?;
        Ok(Lease {
            owner: r.u64()?,
            until_ms: r.u64()?,
            config: r.u64()?,
        })
    }
}

/// The version of the newest configuration started with these global
/// rules (`Config::version`).
pub fn encode_newest(config: u64) -> Vec<u8> {
    let mut b = vec![VERSION];
    b.extend_from_slice(&config.to_le_bytes());
    close(b)
}

pub fn decode_newest(bytes: &[u8]) -> Result<u64, Corrupt> {
    open(bytes, 9)?.u64()
}

/// The state of the breaker on a rate-limit service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HealthState {
    #[default]
    Closed,
    /// Not called until `until_ms`; then one probe.
    Open,
    /// One probe is out (until `until_ms`, its deadline).
    HalfOpen,
}

/// The breaker on one rate-limit service, shared by the VMs of an Envoy:
/// the leader writes it, every VM reads it on its tick to know whether its
/// global rules are served by the service or by their backstop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Health {
    pub state: HealthState,
    /// Failed calls in a row.
    pub failures: u32,
    pub until_ms: u64,
}

impl Health {
    pub fn encode(&self) -> Vec<u8> {
        let state = match self.state {
            HealthState::Closed => 0u8,
            HealthState::Open => 1,
            HealthState::HalfOpen => 2,
        };
        let mut b = vec![VERSION, state];
        b.extend_from_slice(&self.failures.to_le_bytes());
        b.extend_from_slice(&self.until_ms.to_le_bytes());
        close(b)
    }

    pub fn decode(bytes: &[u8]) -> Result<Health, Corrupt> {
        let body = checked_body(bytes, 14)?;
        let mut r = Reader(body);
        let [v, s] = r.take::<2>()?;
        let state = match (v, s) {
            (VERSION, 0) => HealthState::Closed,
            (VERSION, 1) => HealthState::Open,
            (VERSION, 2) => HealthState::HalfOpen,
            _ => return Err(Corrupt),
        };
        Ok(Health {
            state,
            failures: r.u32()?,
            until_ms: r.u64()?,
        })
    }

    /// Whether the rules are served by their backstop.
    pub fn down(&self) -> bool {
        self.state != HealthState::Closed
    }
}

/// A key's demand: which rule, the key's hash, how many requests wanted
/// tokens since the last report, and the key's parts (the descriptor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    pub rule: u8,
    pub fingerprint: u64,
    pub count: u32,
    pub values: Vec<Vec<u8>>,
}

/// Largest demand record (bytes): the keys beyond wait for the next report.
pub const MAX_WANTS_LEN: usize = 256 * 1024;
/// Longest key part sent to the service (longer ones are cut: keys that
/// share their first bytes then share one count at the service, which only
/// refuses more).
pub const MAX_VALUE_LEN: usize = 1024;

/// Encodes demand records; returns the bytes and the positions of those
/// that did not fit.
pub fn encode_wants<'a>(wants: impl Iterator<Item = &'a Want>) -> (Vec<u8>, Vec<usize>) {
    let mut b = vec![VERSION];
    let mut left_out = Vec::new();
    for (i, w) in wants.enumerate() {
        let size = 14
            + w.values
                .iter()
                .map(|v| 2 + v.len().min(MAX_VALUE_LEN))
                .sum::<usize>();
        if b.len() + size + 4 > MAX_WANTS_LEN || w.values.len() > 255 {
            left_out.push(i);
            continue;
        }
        b.push(w.rule);
        b.extend_from_slice(&w.fingerprint.to_le_bytes());
        b.extend_from_slice(&w.count.to_le_bytes());
        b.push(w.values.len() as u8);
        for v in &w.values {
            let v = v.get(..MAX_VALUE_LEN).unwrap_or(v);
            b.extend_from_slice(&(v.len() as u16).to_le_bytes());
            b.extend_from_slice(v);
        }
    }
    (close(b), left_out)
}

/// Decodes what `encode_wants` wrote.
pub fn decode_wants(bytes: &[u8]) -> Result<Vec<Want>, Corrupt> {
    let mut r = open(bytes, bytes.len().checked_sub(4).ok_or(Corrupt)?)?;
    let mut out = Vec::new();
    while !r.0.is_empty() {
        let [rule] = r.take::<1>()?;
        let fingerprint = r.u64()?;
        let count = r.u32()?;
        let [n] = r.take::<1>()?;
        let mut values = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let len = u16::from_le_bytes(r.take::<2>()?) as usize;
            let (v, rest) = r.0.split_at_checked(len).ok_or(Corrupt)?;
            values.push(v.to_vec());
            r.0 = rest;
        }
        out.push(Want {
            rule,
            fingerprint,
            count,
            values,
        });
    }
    Ok(out)
}
