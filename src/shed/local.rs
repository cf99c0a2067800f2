//! What one worker keeps of a shedder: what it measures and remembers
//! between ops on the shared entry (CoDel, its lease of slots, adaptive
//! samples, turns by class, its view of the other workers' waiters). Its
//! waiters wait in the pipeline's wait list, one line per class (see
//! `waiters.rs`).

use super::adaptive::{Auto, Samples};
use super::codec::{Claim, Shared};
use super::codel::Codel;
use super::config::{self, Class};
use super::early::Rate;
use super::shares::Clocks;

/// A queued request: the host's stream id, its class, when it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queued {
    pub id: u32,
    pub class: Class,
    pub since_ms: u64,
    /// Its turn: with shares a virtual time (see `shares`), else `since_ms`.
    pub turn_ms: u64,
    /// When the caller's deadline passes (ms), if it sent one.
    pub deadline_ms: Option<u64>,
}

/// The order of waiters by turn (with shares): the earliest turn first, a
/// higher class first on a tie.
pub(super) fn by_turn(turn: u64, class: Class) -> (u64, usize) {
    (turn, 2 - class as usize)
}

/// How long a waiter of `class` may wait: `max_wait`, or less for its
/// class while CoDel says overloaded (strict priority only: with shares,
/// a shorter wait would shed a class before its share comes round).
pub(super) fn wait_limit(codel: &Codel, class: Class, by_class: bool, max_wait: u64) -> u64 {
    match codel.threshold(class) {
        Some(t) if by_class => t.min(max_wait),
        _ => max_wait,
    }
    .max(1)
}

/// Per-worker state of one shedder.
pub(super) struct OnWorker {
    pub(super) codel: Codel,
    pub(super) floor_current: Option<u64>,
    pub(super) floor_previous: Option<u64>,
    pub(super) floor_rotated_ms: u64,
    /// Free slots this worker took from the shared counter ahead of need
    /// (counted there as in flight): used and refilled without a store
    /// round trip, given back on every tick.
    pub(super) lease: u64,
    /// Whether the shared counter looked far from the limit, with nobody
    /// waiting, when last seen: only then may released slots be kept.
    pub(super) calm: bool,
    /// Adaptive limit: latency samples since the last tick, and the limit
    /// and floor last read from the shared entry.
    pub(super) samples: Samples,
    /// When the first of those samples came (ms; none: no sample yet).
    pub(super) first_sample_ms: Option<u64>,
    /// Whether an op on the shared entry since the last merge found the
    /// adaptive limit in full use ([`Shedders::merge_soon`]).
    pub(super) full: bool,
    pub(super) auto: Option<Auto>,
    /// Turns by class, with shares.
    pub(super) clocks: Clocks,
    /// The shared count of admissions (every worker's) as this worker saw
    /// it lately (for `shed_early`).
    pub(super) rate: Rate,
    /// The other workers' waiters, as their claims said when this worker
    /// last read the entry (shares: see `turn_of` and `places`).
    pub(super) elsewhere: Elsewhere,
}

impl OnWorker {
    pub(super) fn new(spec: &config::ShedderSpec, now_ms: u64) -> Self {
        OnWorker {
            codel: Codel::new(
                spec.target_ms,
                spec.interval_ms,
                now_ms,
                spec.concurrency.is_some(),
            ),
            floor_current: None,
            floor_previous: None,
            floor_rotated_ms: now_ms,
            lease: 0,
            calm: false,
            samples: Samples::default(),
            first_sample_ms: None,
            full: false,
            auto: spec
                .concurrency
                .as_ref()
                .and_then(|c| c.adaptive)
                .map(|a| Auto::new(&a, now_ms)),
            clocks: Clocks::default(),
            rate: Rate::new(now_ms),
            elsewhere: Elsewhere::default(),
        }
    }
}

/// What the shared entry says of the other workers' waiters, by class
/// (`Class as usize`): how many and the newest one's turn (0: none), from
/// their live claims; and, with shares, the turn of the class's last
/// admission on any worker.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Elsewhere {
    pub(super) counts: [u64; 3],
    pub(super) newest: [u64; 3],
    pub(super) last: [u64; 3],
}

impl Elsewhere {
    pub(super) fn of(entry: &Shared, live: impl Fn(&Claim) -> bool) -> Self {
        let mut e = Elsewhere {
            last: entry.last,
            ..Elsewhere::default()
        };
        for c in entry.claims.iter().filter(|c| live(c)) {
            for (n, m) in e.counts.iter_mut().zip(c.counts) {
                *n += u64::from(m);
            }
            for (t, u) in e.newest.iter_mut().zip(c.newest) {
                *t = (*t).max(u);
            }
        }
        e
    }
}
