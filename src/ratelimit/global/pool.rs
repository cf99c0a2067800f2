//! A global rule's tokens for one key, held by this Envoy: the 96-bit
//! state of the key's slot. Tokens were paid for at the rate-limit service
//! before they were put here, and are good until the end of the service's
//! window they were counted in; a request spends them with the limiter's
//! CAS transaction, as it charges a bucket.
//!
//! Layout of the state: bits 0-31 the tokens, bits 32-94 the end of their
//! window (ms since the Unix epoch), bit 95 set when the service said the
//! key is over its limit until that time.

use crate::ratelimit::bucket::BucketAnswer;

const NS_PER_MS: u64 = 1_000_000;

/// One key's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pool {
    pub tokens: u32,
    pub until_ms: u64,
    pub blocked: bool,
}

impl Pool {
    pub fn decode(state: u128) -> Pool {
        Pool {
            tokens: state as u32,
            until_ms: ((state >> 32) as u64) & ((1 << 63) - 1),
            blocked: (state >> 95) & 1 == 1,
        }
    }

    pub fn encode(&self) -> u128 {
        u128::from(self.tokens)
            | u128::from(self.until_ms & ((1 << 63) - 1)) << 32
            | u128::from(self.blocked) << 95
    }

    /// The tokens still good at `now_ms`.
    pub fn live(&self, now_ms: u64) -> u32 {
        if now_ms < self.until_ms {
            self.tokens
        } else {
            0
        }
    }

    /// A grant of `hits` tokens good until `until_ms`, over the pool `old`
    /// of the same key (or `None`: the slot held another key's, or nothing).
    /// Tokens of the same service window add up; tokens of an earlier
    /// window are dropped. Returns the pool and the live tokens dropped.
    pub fn grant(old: Option<Pool>, hits: u32, until_ms: u64, now_ms: u64) -> (Pool, u32) {
        let fresh = Pool {
            tokens: hits,
            until_ms,
            blocked: false,
        };
        let Some(old) = old else {
            return (fresh, 0);
        };
        let live = old.live(now_ms);
        if live == 0 {
            return (fresh, 0);
        }
        if same_window(old.until_ms, until_ms) {
            let pool = Pool {
                tokens: live.saturating_add(hits),
                until_ms: old.until_ms.min(until_ms),
                blocked: false,
            };
            return (pool, 0);
        }
        (fresh, live)
    }

    /// The service refused the key until `until_ms`: tokens of the same
    /// window stay spendable (they were paid for) until their own end, the
    /// earlier of the two; the pool then refuses until that time.
    pub fn block(old: Option<Pool>, until_ms: u64, now_ms: u64) -> (Pool, u32) {
        let live = old.map_or(0, |o| o.live(now_ms));
        let kept = old.filter(|o| live > 0 && same_window(o.until_ms, until_ms));
        let pool = Pool {
            tokens: kept.map_or(0, |_| live),
            until_ms: kept.map_or(until_ms, |o| o.until_ms.min(until_ms)),
            blocked: true,
        };
        (pool, if kept.is_some() { 0 } else { live })
    }
}

/// Whether two window ends name the same service window (clocks and the
/// round trip blur them by up to a second).
fn same_window(a_ms: u64, b_ms: u64) -> bool {
    a_ms.abs_diff(b_ms) <= 1_000
}

/// How a global rule decides on its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpec {
    /// The fleet-wide quota and window the RateLimit headers announce.
    pub quota: u64,
    pub window_ns: u64,
    /// How soon a request refused for want of tokens (not over the limit:
    /// the pool is being filled) is told to come back.
    pub retry_ns: u64,
}

impl PoolSpec {
    /// Spends `cost` tokens, or refuses: until the reset when the service
    /// said the key is over its limit, else for `retry_ns`.
    pub fn decide(&self, state: u128, now_ns: u64, cost: u64) -> BucketAnswer {
        let pool = Pool::decode(state);
        let now_ms = now_ns / NS_PER_MS;
        let live = u64::from(pool.live(now_ms));
        let to_reset = pool
            .until_ms
            .saturating_sub(now_ms)
            .saturating_mul(NS_PER_MS);
        let full_in_ns = if to_reset > 0 {
            to_reset
        } else {
            self.window_ns
        };
        if live >= cost {
            let left = live - cost;
            let new = Pool {
                tokens: left as u32,
                ..pool
            };
            return BucketAnswer::Allow {
                new_tat: new.encode(),
                remaining: left,
                full_in_ns,
                delay_ns: 0,
            };
        }
        let wait_ns = if pool.blocked && to_reset > 0 {
            to_reset
        } else {
            self.retry_ns
        };
        BucketAnswer::Deny {
            wait_ns,
            remaining: live,
            full_in_ns,
        }
    }
}
