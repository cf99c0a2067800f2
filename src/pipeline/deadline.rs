//! Time budgets: a request's deadline, read once on its arrival from the
//! headers the `deadlines` section names (`grpc-timeout`, Envoy's
//! `x-envoy-expected-rq-timeout-ms`, or others), kept by the pipeline for
//! the stream's life. Stages ask the pipeline how long a stream may still
//! wait ([`super::Cx::wait_until`]) and for the answer to one whose
//! deadline passed while it waited ([`super::Cx::deadline_answer`]); the
//! pipeline sends the request upstream, after any wait, with every deadline
//! header it carries reduced by the wait (`propagate`).

use super::telemetry::MetricId;
use super::telemetry::{Declared, Kind};
use crate::hash::FastMap;
use crate::reply::{json_str, Detail, Rejection};
use crate::request::RequestView;
use crate::time::{Duration, Instant};

/// The metrics of deadlines.
pub const METRICS: &[Declared] = &[Declared {
    name: "sluice_deadline_refused_total",
    kind: Kind::Counter,
    labels: &["domain"],
}];

/// How a deadline header is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// gRPC's `grpc-timeout`: digits and a unit (`100m`, `2S`).
    GrpcTimeout,
    /// Milliseconds as a decimal integer.
    Millis,
}

/// The validated `deadlines` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadlineSpec {
    /// Headers to read, in order; the first present and valid wins.
    pub headers: Vec<(String, Format)>,
    pub min_remaining: Duration,
    pub propagate: bool,
    pub status: u32,
}

impl DeadlineSpec {
    /// How long a request with deadline `d` may wait in sluice from its
    /// arrival: until it has only `min_remaining` left, when it could no
    /// longer be served in time by the operator's own measure (and would
    /// have been refused had it arrived so), in milliseconds.
    pub fn wait_ms(&self, d: &Deadline) -> u64 {
        d.remaining_ms.saturating_sub(self.min_remaining.as_ms())
    }
}

/// A request's deadline: the header it came in, and the milliseconds the
/// caller still had when it arrived (as the header said: in milliseconds,
/// as `grpc-timeout`'s 99,999,999 hours do not fit a `u64` of nanoseconds).
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
/// (nanoseconds); in whole milliseconds, a part of one rounded up, as
/// Envoy's router reads it (the timeout it sets for the request is that
/// rounded-up one): `999u` has 1 ms left, not none.
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
        "u" => n.div_ceil(1_000),
        "n" => n.div_ceil(1_000_000),
        _ => return None,
    })
}

/// gRPC status DEADLINE_EXCEEDED.
pub const GRPC_DEADLINE_EXCEEDED: u32 = 4;

/// The answer to a request whose deadline cannot be met; `by` names the
/// mechanism (`deadline`, or `shed/<shedder>` for a wait cut short).
pub fn rejection(by: &str, status: u32, remaining_ms: u64) -> Rejection {
    Rejection {
        status,
        headers: vec![("x-sluice-deadline", "exceeded".into())],
        grpc_status: GRPC_DEADLINE_EXCEEDED,
        detail: Detail::Text {
            body: format!(
                "{{\"error\":\"deadline_exceeded\",\"by\":{},\"remaining_ms\":{remaining_ms}}}",
                json_str(by)
            ),
            grpc_message: format!("deadline exceeded ({by}); {remaining_ms} ms were left"),
            reason: by.to_string(),
        },
    }
}

/// What the pipeline keeps of a stream's deadline.
#[derive(Debug)]
struct Budget {
    deadline: Deadline,
    /// When the stream arrived.
    arrived: Instant,
    /// Until when it may wait in sluice: `min_remaining` before its
    /// caller's deadline (a whole millisecond).
    until: Instant,
}

/// The deadlines of one configuration: its `deadlines` section, the
/// counter of refusals for a deadline, and the budget of every stream
/// alive that sent one (forgotten at its end).
/// (Streams by id: the host's stream context id, `stage::StreamId`.)
#[derive(Debug)]
pub struct Budgets {
    spec: DeadlineSpec,
    refused: MetricId,
    of: FastMap<u32, Budget>,
}

impl Budgets {
    /// `refused` counts `sluice_deadline_refused_total`.
    pub fn new(spec: DeadlineSpec, refused: MetricId) -> Self {
        Budgets {
            spec,
            refused,
            of: FastMap::default(),
        }
    }

    /// Reads the deadline of a request arriving at `now`, once.
    pub(super) fn arrive(&mut self, id: u32, req: &dyn RequestView, now: Instant) {
        if let Some(deadline) = read(&self.spec, req) {
            let until_ms = now.as_ms().saturating_add(self.spec.wait_ms(&deadline));
            let budget = Budget {
                deadline,
                arrived: now,
                until: Instant::from_ms(until_ms),
            };
            self.of.insert(id, budget);
        }
    }

    /// The stream ended.
    pub(super) fn end(&mut self, id: u32) {
        if !self.of.is_empty() {
            self.of.remove(&id);
        }
    }

    /// Streams with a budget kept.
    pub(super) fn kept(&self) -> usize {
        self.of.len()
    }

    /// Until when stream `id` may wait, if it sent a deadline.
    pub(super) fn until(&self, id: u32) -> Option<Instant> {
        self.of.get(&id).map(|b| b.until)
    }

    /// The request headers stream `id` goes upstream with at `now` after
    /// waiting since its arrival: every deadline header it carries reduced
    /// by the wait, in whole milliseconds as the clock read them (with
    /// `propagate`).
    pub(super) fn headers_after_wait(&self, id: u32, now: Instant) -> Vec<(String, String)> {
        match self.of.get(&id) {
            Some(b) => resume_headers(
                Some(&self.spec),
                Some(&b.deadline),
                now.as_ms().saturating_sub(b.arrived.as_ms()),
            ),
            None => Vec::new(),
        }
    }

    /// The time stream `id` has left at `now` (ms), if it sent a deadline:
    /// what it had on arrival, less the time since.
    fn left_ms(&self, id: u32, now: Instant) -> Option<u64> {
        let b = self.of.get(&id)?;
        let since = now.as_ms().saturating_sub(b.arrived.as_ms());
        Some(b.deadline.remaining_ms.saturating_sub(since))
    }

    /// The time stream `id` has left at `now`, if it sent a deadline.
    pub(super) fn left(&self, id: u32, now: Instant) -> Option<Duration> {
        self.left_ms(id, now).map(Duration::from_ms)
    }

    /// The answer to stream `id`, whose deadline cannot be met at `now`:
    /// the configured status and the time it truly has left; `by` names
    /// what refused it. Returns the counter to add to.
    pub(super) fn answer(&self, id: u32, by: &str, now: Instant) -> (Rejection, MetricId) {
        let left = self.left_ms(id, now).unwrap_or(0);
        (rejection(by, self.spec.status, left), self.refused)
    }
}
