//! A queue-mode shedder's shared entry and its bytes: slots in flight,
//! requests waiting on all workers, and each waiting worker's best waiter
//! (its claim), which keeps the queue's order global across workers.
//!
//! Layout (little-endian): in flight (8 bytes), waiting (8), admissions
//! ever (8, wrapping; `shed_early` reads its rate off it), with shares the
//! turn of the last admission of each class (3 x 8), then one
//! 57-byte claim per waiting worker (class, since, worker tag, seen, and
//! by class the worker's waiters and its newest waiter's turn), sorted
//! best first. Anything else
//! decodes as corrupt and is never trusted.

use super::config::Class;
use crate::codec::Reader;

/// A worker's most deserving waiter, announced in the shared entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub class: Class,
    pub since_ms: u64,
    /// The announcing worker's tag (random per worker VM).
    pub worker: u32,
    /// When its worker last wrote it: a claim not rewritten for
    /// [`CLAIM_TTL_MS`] is dead (see `Shared`).
    pub seen_ms: u64,
    /// How many wait on its worker, by class (`Class as usize`).
    pub counts: [u32; 3],
    /// With shares, the turn of the newest waiter of each class on its
    /// worker (0: none): a class's next turn comes one step after its
    /// newest on any worker, so that a class waiting on several workers
    /// gets no more turns than one waiting on a single worker.
    pub newest: [u64; 3],
}

impl Claim {
    /// Whether this waiter goes before `other`: a higher class, or the
    /// same class and waiting since earlier.
    pub fn before(&self, other: &Claim) -> bool {
        self.class > other.class || (self.class == other.class && self.since_ms < other.since_ms)
    }

    /// Whether both name the same waiter (whenever they were written).
    pub fn same(&self, other: &Claim) -> bool {
        (self.class, self.since_ms, self.worker) == (other.class, other.since_ms, other.worker)
    }

    /// The order claims are kept in: best first, then by worker.
    pub fn order(&self, other: &Claim) -> std::cmp::Ordering {
        other
            .class
            .cmp(&self.class)
            .then(self.since_ms.cmp(&other.since_ms))
            .then(self.worker.cmp(&other.worker))
    }
}

/// A queue-mode shedder's shared entry: slots in flight, requests waiting
/// on all workers, and each waiting worker's best waiter (its claim).
///
/// The claims keep the queue global across workers: a worker may admit
/// its own waiter only if no other worker claims one that goes before it.
/// Without them, a worker whose requests end would hand their slots to
/// its own waiters forever while another worker's waited out `max_wait`.
/// Every change a worker makes to the entry also sets its own claim to
/// its best waiter after the change (none once its queue is empty), so
/// the claims follow the queues (unless a write fails: then until the
/// worker's next write). A worker with waiters polls every millisecond
/// and rewrites its claim at least every [`CLAIM_REFRESH_MS`]; a claim
/// not rewritten for [`CLAIM_TTL_MS`] (or dated that far ahead) is
/// ignored and dropped, so a worker that stops (its VM gone, or stalled)
/// holds the others back for that long at most. At most [`MAX_CLAIMS`]
/// are kept, the best ones: a worker left out has only waiters that go
/// after all of them, which none of those workers lets in early.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Shared {
    pub inflight: u64,
    pub waiting: u64,
    /// Admissions so far, direct and from the queue, on every worker
    /// (wrapping): `shed_early`'s rate.
    pub admitted: u64,
    /// With shares, the turn of the last waiter of each class admitted on
    /// any worker (`Class as usize`; 0: none): a class's next turn comes
    /// after it, whichever worker it arrives on.
    pub last: [u64; 3],
    /// Sorted by `Claim::order` (with shares: by turn, then worker), one
    /// per worker.
    pub claims: Vec<Claim>,
}

/// A worker with waiters rewrites its claim at least this often...
pub const CLAIM_REFRESH_MS: u64 = 10;
/// ...and a claim not rewritten for this long is dead (see `Shared`).
pub const CLAIM_TTL_MS: u64 = 50;

/// Claims kept in a shared entry, at most (see `Shared`).
pub const MAX_CLAIMS: usize = 64;

/// Encoded size of the counters before the claims.
const HEADER_LEN: usize = 48;

/// Encoded size of one claim: class, since, worker, seen, counts, newest.
const CLAIM_LEN: usize = 57;

pub fn encode_shared(v: &Shared) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + CLAIM_LEN * v.claims.len());
    out.extend_from_slice(&v.inflight.to_le_bytes());
    out.extend_from_slice(&v.waiting.to_le_bytes());
    out.extend_from_slice(&v.admitted.to_le_bytes());
    for t in v.last {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for c in &v.claims {
        out.push(c.class as u8);
        out.extend_from_slice(&c.since_ms.to_le_bytes());
        out.extend_from_slice(&c.worker.to_le_bytes());
        out.extend_from_slice(&c.seen_ms.to_le_bytes());
        for n in c.counts {
            out.extend_from_slice(&n.to_le_bytes());
        }
        for t in c.newest {
            out.extend_from_slice(&t.to_le_bytes());
        }
    }
    out
}

pub fn decode_shared(bytes: &[u8]) -> Option<Shared> {
    let mut r = Reader(bytes);
    let (inflight, waiting, admitted) = (r.u64().ok()?, r.u64().ok()?, r.u64().ok()?);
    // Counts of requests, never near 2^32 (`max` is at most 1,000,000,
    // a queue per worker at most 100,000): more is not ours, and kept it
    // would overflow the next count up.
    if inflight > u64::from(u32::MAX) || waiting > u64::from(u32::MAX) {
        return None;
    }
    let last = [r.u64().ok()?, r.u64().ok()?, r.u64().ok()?];
    if r.0.len() % CLAIM_LEN != 0 || r.0.len() / CLAIM_LEN > MAX_CLAIMS {
        return None;
    }
    let mut claims = Vec::with_capacity(r.0.len() / CLAIM_LEN);
    while !r.0.is_empty() {
        let [class] = r.take::<1>().ok()?;
        claims.push(Claim {
            class: [Class::Sheddable, Class::Default, Class::Critical]
                .get(usize::from(class))
                .copied()?,
            since_ms: r.u64().ok()?,
            worker: r.u32().ok()?,
            seen_ms: r.u64().ok()?,
            counts: [r.u32().ok()?, r.u32().ok()?, r.u32().ok()?],
            newest: [r.u64().ok()?, r.u64().ok()?, r.u64().ok()?],
        });
    }
    // Written sorted, by `Claim::order` (or, for a shedder with shares, by
    // turn and worker): anything else is not ours.
    let by_class = claims
        .windows(2)
        .all(|w| matches!(w, [a, b] if a.order(b).is_lt()));
    let by_turn = || {
        claims
            .windows(2)
            .all(|w| matches!(w, [a, b] if (a.since_ms, a.worker) < (b.since_ms, b.worker)))
    };
    if !by_class && !by_turn() {
        return None;
    }
    Some(Shared {
        inflight,
        waiting,
        admitted,
        last,
        claims,
    })
}
