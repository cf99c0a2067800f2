//! The seam between the limiter and its counting algorithms: a rule's
//! state is one 96-bit number in a slot, and each algorithm says how to
//! decide on it, how full it is, and how to merge two states (a key's two
//! slots in a bounded table only ever grow, by merging).

use super::bucket::{BucketAnswer, BucketSpec};
use super::global::pool::{Pool, PoolSpec};
use super::window::WindowSpec;

/// A rule's counting algorithm and its validated parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// A token bucket (GCRA): the state is the theoretical arrival time.
    Bucket(BucketSpec),
    /// A sliding window: the state is two fixed-window counts.
    Window(WindowSpec),
    /// A global rule's tokens from the rate-limit service: the state is
    /// the key's pool (one slot per key, never merged).
    Pool(PoolSpec),
}

impl Algorithm {
    /// Decides on a request of `cost`; `slack_ns` is how long a token
    /// bucket may make it wait for its turn (shaping; 0 refuses instead).
    pub fn decide(&self, state: u128, now_ns: u64, cost: u64, slack_ns: u64) -> BucketAnswer {
        match self {
            Algorithm::Bucket(b) => b.decide_within(state, now_ns, cost, slack_ns),
            Algorithm::Window(w) => w.decide(state, now_ns, cost),
            Algorithm::Pool(p) => p.decide(state, now_ns, cost),
        }
    }

    /// How full a state is at `now_ns`, comparable between two states of
    /// one rule: a decision rests on the emptiest of a key's slots.
    pub fn level(&self, state: u128, now_ns: u64) -> u128 {
        match self {
            Algorithm::Bucket(_) | Algorithm::Pool(_) => state,
            Algorithm::Window(w) => w.level(state, now_ns),
        }
    }

    /// Whether a state still counts something at `now_ns` (a slot charged
    /// by another key and not yet empty is a collision).
    pub fn busy(&self, state: u128, now_ns: u64) -> bool {
        match self {
            Algorithm::Bucket(b) => state > b.scaled_now(now_ns),
            Algorithm::Window(w) => w.level(state, now_ns) > 0,
            Algorithm::Pool(_) => Pool::decode(state).live(now_ns / 1_000_000) > 0,
        }
    }

    /// A state that admits nothing at `now_ns` (fail-closed recovery).
    pub fn exhausted(&self, now_ns: u64) -> u128 {
        match self {
            Algorithm::Bucket(b) => b.empty_tat(now_ns),
            Algorithm::Window(w) => w.exhausted(now_ns),
            // An empty pool: no tokens (corrupt state never admits).
            Algorithm::Pool(_) => 0,
        }
    }

    /// The smallest state at least as full as both, from now on.
    pub fn merge(&self, a: u128, b: u128) -> u128 {
        match self {
            Algorithm::Bucket(_) | Algorithm::Pool(_) => a.max(b),
            Algorithm::Window(w) => w.merge(a, b),
        }
    }

    /// The quota the RateLimit headers announce: the burst, or the limit.
    pub fn quota(&self) -> u64 {
        match self {
            Algorithm::Bucket(b) => b.burst,
            Algorithm::Window(w) => w.limit,
            Algorithm::Pool(p) => p.quota,
        }
    }

    /// Nanoseconds the headers' window describes: the time an empty bucket
    /// takes to refill, or the window.
    pub fn window_ns(&self) -> u128 {
        match self {
            Algorithm::Bucket(b) => {
                (b.burst as u128 * b.period_ns as u128).div_ceil(b.rate as u128)
            }
            Algorithm::Window(w) => u128::from(w.window_ns),
            Algorithm::Pool(p) => u128::from(p.window_ns),
        }
    }
}
