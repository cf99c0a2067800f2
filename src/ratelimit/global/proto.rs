//! The few protobuf messages of Envoy's rate-limit service
//! (`envoy.service.ratelimit.v3`), encoded and decoded by hand: a request
//! is a domain, descriptors of key/value entries and `hits_addend`; of a
//! response only the codes, the limit, what remains and the time to the
//! reset are read. Unknown fields are skipped, as protobuf requires.

/// `RateLimitResponse.Code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Unknown,
    Ok,
    OverLimit,
}

impl Code {
    fn of(v: u64) -> Code {
        match v {
            1 => Code::Ok,
            2 => Code::OverLimit,
            _ => Code::Unknown,
        }
    }
}

/// What one descriptor's status says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Status {
    pub code: Option<Code>,
    /// `current_limit`: requests per unit, and the unit in ms (0 if the
    /// unit has no fixed length or is absent).
    pub limit: Option<(u64, u64)>,
    pub remaining: Option<u64>,
    /// `duration_until_reset`, in ms (rounded up).
    pub reset_ms: Option<u64>,
}

/// A decoded `RateLimitResponse`: the overall code and the first status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    pub overall: Code,
    pub status: Status,
}

/// Why a response could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_bytes(out: &mut Vec<u8>, tag: u64, bytes: &[u8]) {
    varint(out, tag << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Encodes a `RateLimitRequest` with one descriptor of these entries.
/// Values that are not UTF-8 are sent with their invalid bytes replaced
/// (protobuf strings must be UTF-8).
pub fn request(domain: &str, entries: &[(&str, &[u8])], hits: u32) -> Vec<u8> {
    let mut descriptor = Vec::new();
    for (key, value) in entries {
        let mut entry = Vec::new();
        field_bytes(&mut entry, 1, key.as_bytes());
        field_bytes(&mut entry, 2, String::from_utf8_lossy(value).as_bytes());
        field_bytes(&mut descriptor, 1, &entry);
    }
    let mut out = Vec::with_capacity(domain.len() + descriptor.len() + 16);
    field_bytes(&mut out, 1, domain.as_bytes());
    field_bytes(&mut out, 2, &descriptor);
    varint(&mut out, 3 << 3);
    varint(&mut out, u64::from(hits));
    out
}

/// A protobuf reader over one message's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self.bytes.get(self.at).ok_or(Malformed)?;
            self.at += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Malformed)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self.at.checked_add(n).ok_or(Malformed)?;
        let s = self.bytes.get(self.at..end).ok_or(Malformed)?;
        self.at = end;
        Ok(s)
    }

    /// The next field: its number and value (fixed-width ones as bytes).
    fn next(&mut self) -> Option<Result<(u64, Value<'a>), Malformed>> {
        if self.at >= self.bytes.len() {
            return None;
        }
        Some(self.field())
    }

    fn field(&mut self) -> Result<(u64, Value<'a>), Malformed> {
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Value::Int(self.varint()?),
            1 => Value::Bytes(self.take(8)?),
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|_| Malformed)?;
                Value::Bytes(self.take(n)?)
            }
            5 => Value::Bytes(self.take(4)?),
            _ => return Err(Malformed),
        };
        Ok((key >> 3, value))
    }
}

/// The length of a `RateLimit.Unit` in ms (0: none fixed, or unknown).
fn unit_ms(unit: u64) -> u64 {
    const S: u64 = 1_000;
    match unit {
        1 => S,
        2 => 60 * S,
        3 => 3_600 * S,
        4 => 86_400 * S,
        7 => 7 * 86_400 * S,
        _ => 0,
    }
}

fn status(bytes: &[u8]) -> Result<Status, Malformed> {
    let mut s = Status::default();
    let mut r = Reader::new(bytes);
    while let Some(f) = r.next() {
        match f? {
            (1, Value::Int(c)) => s.code = Some(Code::of(c)),
            (2, Value::Bytes(b)) => {
                let (mut per, mut unit) = (0, 0);
                let mut l = Reader::new(b);
                while let Some(f) = l.next() {
                    match f? {
                        (1, Value::Int(v)) => per = v,
                        (2, Value::Int(v)) => unit = unit_ms(v),
                        _ => {}
                    }
                }
                s.limit = Some((per, unit));
            }
            (3, Value::Int(v)) => s.remaining = Some(v),
            (4, Value::Bytes(b)) => {
                let (mut secs, mut nanos) = (0u64, 0u64);
                let mut d = Reader::new(b);
                while let Some(f) = d.next() {
                    match f? {
                        (1, Value::Int(v)) => secs = v,
                        (2, Value::Int(v)) => nanos = v & 0xffff_ffff,
                        _ => {}
                    }
                }
                // Negative durations (two's complement) are not trusted.
                if secs < 1 << 40 && nanos < 1_000_000_000 {
                    s.reset_ms = Some(secs * 1_000 + nanos.div_ceil(1_000_000));
                }
            }
            _ => {}
        }
    }
    // proto3 never writes a zero: a status that states its limit but no
    // `limit_remaining` has none left (not "unknown").
    if s.limit.is_some() && s.remaining.is_none() {
        s.remaining = Some(0);
    }
    Ok(s)
}

/// Decodes a `RateLimitResponse`.
pub fn response(bytes: &[u8]) -> Result<Response, Malformed> {
    let mut overall = Code::Unknown;
    let mut first = None;
    let mut r = Reader::new(bytes);
    while let Some(f) = r.next() {
        match f? {
            (1, Value::Int(c)) => overall = Code::of(c),
            (2, Value::Bytes(b)) if first.is_none() => first = Some(status(b)?),
            _ => {}
        }
    }
    Ok(Response {
        overall,
        status: first.unwrap_or_default(),
    })
}
