//! Deadlines: how long the caller will still wait, read from the request
//! (`grpc-timeout`, Envoy's `x-envoy-expected-rq-timeout-ms`, or a
//! configured header). A request whose deadline cannot be met (already
//! passed, or less left than `min_remaining`) is refused at once; a queued
//! request never waits past its deadline (see the shedders); and a request
//! that waited in sluice goes upstream with its deadline header reduced by
//! the wait, so the next hop sees the true budget.

pub mod config;
pub mod reply;
pub mod stage;
#[cfg(test)]
mod tests;

use crate::request::RequestView;
use config::{DeadlineSpec, Format};

/// A request's deadline: the header it came in, and the milliseconds the
/// caller still had when it arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deadline {
    pub header: String,
    pub format: Format,
    pub remaining_ms: u64,
    /// The other configured deadline headers the request carries (each
    /// with what it said): after a wait they are reduced too, so that no
    /// header the next hop may read overstates the time left.
    pub also: Vec<(String, Format, u64)>,
}

impl Deadline {
    /// The header's value once `waited_ms` have passed here, in the format
    /// it came in (`grpc-timeout` in milliseconds, `<n>m`, or in the finest
    /// of seconds, minutes and hours that fits gRPC's 8 digits, rounded
    /// down).
    pub fn reduced(&self, waited_ms: u64) -> String {
        reduced(self.format, self.remaining_ms, waited_ms)
    }
}

/// A deadline header's value, `remaining_ms` less `waited_ms`, in `format`.
fn reduced(format: Format, remaining_ms: u64, waited_ms: u64) -> String {
    let left = remaining_ms.saturating_sub(waited_ms);
    match format {
        Format::GrpcTimeout => grpc_timeout(left),
        Format::Millis => left.to_string(),
    }
}

/// `ms` as a `grpc-timeout` value: at most 8 digits (gRPC's limit, which
/// `parse_grpc_timeout` holds incoming values to as well), in the finest
/// unit that fits, rounded down.
fn grpc_timeout(ms: u64) -> String {
    const MAX: u64 = 99_999_999;
    for (unit, per) in [("m", 1), ("S", 1_000), ("M", 60_000), ("H", 3_600_000)] {
        if ms / per <= MAX {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{MAX}H")
}

/// The request headers a stream that waited `waited_ms` in sluice goes on
/// with: every deadline header it carries reduced by the wait, each in its
/// own format, when the configuration propagates deadlines (`spec`) and the
/// request sent one (`d`).
pub fn resume_headers(
    spec: Option<&DeadlineSpec>,
    d: Option<&Deadline>,
    waited_ms: u64,
) -> Vec<(String, String)> {
    match (spec, d) {
        (Some(s), Some(d)) if s.propagate && waited_ms > 0 => {
            let mut out = Vec::with_capacity(1 + d.also.len());
            out.push((d.header.clone(), d.reduced(waited_ms)));
            for (header, format, remaining_ms) in &d.also {
                out.push((header.clone(), reduced(*format, *remaining_ms, waited_ms)));
            }
            out
        }
        _ => Vec::new(),
    }
}

/// The request's deadline: the first configured deadline header it
/// carries that parses, with the others that parse after it (a malformed
/// one is ignored, as if absent).
pub fn read(spec: &DeadlineSpec, req: &dyn RequestView) -> Option<Deadline> {
    let mut found = spec.headers.iter().filter_map(|(header, format)| {
        let v = req.header(header)?;
        let text = crate::request::first_value(&v)?;
        let remaining_ms = match format {
            Format::GrpcTimeout => parse_grpc_timeout(text)?,
            Format::Millis => text.parse::<u64>().ok()?,
        };
        Some((header, *format, remaining_ms))
    });
    let (header, format, remaining_ms) = found.next()?;
    Some(Deadline {
        header: header.clone(),
        format,
        remaining_ms,
        also: found.map(|(h, f, ms)| (h.clone(), f, ms)).collect(),
    })
}

/// gRPC's `grpc-timeout`: at most 8 digits and a unit, `H` (hours), `M`
/// (minutes), `S`, `m` (milliseconds), `u` (microseconds) or `n`
/// (nanoseconds); in whole milliseconds, rounded down.
pub fn parse_grpc_timeout(text: &str) -> Option<u64> {
    let split = text.len().checked_sub(1)?;
    let (digits, unit) = text.split_at_checked(split)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => n * 3_600_000,
        "M" => n * 60_000,
        "S" => n * 1_000,
        "m" => n,
        "u" => n / 1_000,
        "n" => n / 1_000_000,
        _ => return None,
    })
}
