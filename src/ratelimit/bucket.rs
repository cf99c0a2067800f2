//! Token-bucket arithmetic as GCRA (generic cell rate algorithm): a bucket's
//! whole state is one number, the theoretical arrival time (TAT).
//!
//! Time is kept *scaled*: one nanosecond is `rate` units, so one token is
//! exactly `period_ns` units and no rounding ever happens. A bucket with TAT
//! at or before `now` is full; each token moves the TAT one `period_ns`
//! further; a request of `cost` tokens fits if the new TAT stays within
//! `burst` tokens of `now`.
//!
//! Invariants (property-tested): over any interval the admitted cost never
//! exceeds `burst + rate * elapsed / period`; a request refused with wait `W`
//! is admitted at `now + W` and would still be refused at `now + W - 1`.

/// A validated token bucket: `rate` tokens per `period_ns`, holding `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSpec {
    pub rate: u64,
    pub period_ns: u64,
    pub burst: u64,
}

/// The outcome of asking a bucket for `cost` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketAnswer {
    /// Admitted; the state becomes `new_tat`.
    Allow {
        new_tat: u128,
        /// Whole tokens left after this request.
        remaining: u64,
        /// Nanoseconds until the bucket is full again.
        full_in_ns: u64,
        /// Shaping: nanoseconds the request must be held before it goes on
        /// (its reserved turn); 0 when it may go at once.
        delay_ns: u64,
    },
    /// Refused; the state is unchanged.
    Deny {
        /// Nanoseconds until this same request would be admitted.
        wait_ns: u64,
        /// Whole tokens available now (fewer than the cost).
        remaining: u64,
        /// Nanoseconds until the bucket is full again.
        full_in_ns: u64,
    },
}

impl BucketAnswer {
    /// Whether the request was admitted.
    pub fn allowed(&self) -> bool {
        matches!(self, BucketAnswer::Allow { .. })
    }
    /// Whole tokens left.
    pub fn remaining(&self) -> u64 {
        match *self {
            BucketAnswer::Allow { remaining, .. } | BucketAnswer::Deny { remaining, .. } => {
                remaining
            }
        }
    }
    /// Nanoseconds until the bucket is full.
    pub fn full_in_ns(&self) -> u64 {
        match *self {
            BucketAnswer::Allow { full_in_ns, .. } | BucketAnswer::Deny { full_in_ns, .. } => {
                full_in_ns
            }
        }
    }
}

impl BucketSpec {
    /// `now_ns` in scaled units.
    pub fn scaled_now(&self, now_ns: u64) -> u128 {
        (now_ns as u128).saturating_mul(self.rate as u128)
    }

    /// The TAT of a bucket that is empty at `now_ns` (used for fail-closed
    /// recovery of corrupt state).
    pub fn empty_tat(&self, now_ns: u64) -> u128 {
        self.scaled_now(now_ns)
            .saturating_add((self.burst as u128).saturating_mul(self.period_ns as u128))
    }

    fn ns_ceil(&self, scaled: u128) -> u64 {
        let rate = self.rate as u128;
        let ns = scaled / rate + u128::from(scaled % rate != 0);
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    fn tokens_floor(&self, scaled: u128) -> u64 {
        u64::try_from(scaled / self.period_ns as u128).unwrap_or(u64::MAX)
    }

    /// Decides whether `cost` tokens (at most `burst`) are available at
    /// `now_ns` for a bucket whose state is `tat`.
    pub fn decide(&self, tat: u128, now_ns: u64, cost: u64) -> BucketAnswer {
        self.decide_within(tat, now_ns, cost, 0)
    }

    /// As `decide`, but a request whose tokens come within `slack_ns` is
    /// admitted with its turn reserved: it takes the tokens now (the state
    /// moves past the burst) and must wait `delay_ns` before it goes on
    /// (shaping). Requests reserving in turn are spaced exactly one cost's
    /// refill apart.
    pub fn decide_within(&self, tat: u128, now_ns: u64, cost: u64, slack_ns: u64) -> BucketAnswer {
        let now = self.scaled_now(now_ns);
        let period = self.period_ns as u128;
        let base = tat.max(now);
        let new_tat = base.saturating_add((cost as u128).saturating_mul(period));
        let limit = now.saturating_add((self.burst as u128).saturating_mul(period));
        let slack = (slack_ns as u128).saturating_mul(self.rate as u128);
        if new_tat <= limit.saturating_add(slack) {
            BucketAnswer::Allow {
                new_tat,
                remaining: self.tokens_floor(limit.saturating_sub(new_tat)),
                full_in_ns: self.ns_ceil(new_tat - now),
                delay_ns: self.ns_ceil(new_tat.saturating_sub(limit)),
            }
        } else {
            BucketAnswer::Deny {
                wait_ns: self.ns_ceil(new_tat - limit),
                remaining: self.tokens_floor(limit.saturating_sub(base)),
                full_in_ns: self.ns_ceil(base - now),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = 1_000_000_000;

    fn spec(rate: u64, period_ns: u64, burst: u64) -> BucketSpec {
        BucketSpec {
            rate,
            period_ns,
            burst,
        }
    }

    #[test]
    fn a_full_bucket_admits_exactly_burst_then_refuses() {
        let b = spec(10, S, 5);
        let now = 1_000 * S;
        let mut tat = 0;
        for i in 0..5 {
            match b.decide(tat, now, 1) {
                BucketAnswer::Allow {
                    new_tat, remaining, ..
                } => {
                    assert_eq!(remaining, 4 - i);
                    tat = new_tat;
                }
                d => panic!("request {i} refused: {d:?}"),
            }
        }
        match b.decide(tat, now, 1) {
            BucketAnswer::Deny {
                wait_ns,
                remaining,
                full_in_ns,
            } => {
                assert_eq!(wait_ns, S / 10);
                assert_eq!(remaining, 0);
                assert_eq!(full_in_ns, S / 2);
            }
            a => panic!("admitted beyond burst: {a:?}"),
        }
    }

    #[test]
    fn refill_is_exact_for_rates_that_do_not_divide_the_period() {
        // 3 per second: a token every 333,333,333.33 ns.
        let b = spec(3, S, 3);
        let now = 5 * S;
        let BucketAnswer::Allow { new_tat, .. } = b.decide(0, now, 3) else {
            panic!()
        };
        let BucketAnswer::Deny { wait_ns, .. } = b.decide(new_tat, now, 1) else {
            panic!()
        };
        assert_eq!(wait_ns, 333_333_334);
        assert!(!b.decide(new_tat, now + wait_ns - 1, 1).allowed());
        assert!(b.decide(new_tat, now + wait_ns, 1).allowed());
        // After exactly one second all 3 tokens are back, not a nanosecond before.
        assert!(b.decide(new_tat, now + S, 3).allowed());
        assert!(!b.decide(new_tat, now + S - 1, 3).allowed());
    }

    #[test]
    fn time_going_backwards_never_grants_tokens() {
        let b = spec(1, S, 2);
        let BucketAnswer::Allow { new_tat, .. } = b.decide(0, 100 * S, 2) else {
            panic!()
        };
        assert!(!b.decide(new_tat, 50 * S, 1).allowed());
    }

    #[test]
    fn property_never_admits_more_than_burst_plus_refill() {
        let mut rng = SplitMix(42);
        for _case in 0..300 {
            // Rates up to u32::MAX, more than one token per nanosecond too.
            let rate = match rng.below(3) {
                0 => u64::from(u32::MAX) - rng.below(1000),
                _ => 1 + rng.below(1000),
            };
            let period_ns = [1, S / 10, S, 60 * S][rng.below(4) as usize];
            let burst = 1 + rng.below(50);
            let b = spec(rate, period_ns, burst);
            let start = 1_700_000_000 * S + rng.below(S);
            let (mut now, mut tat, mut admitted) = (start, 0u128, 0u128);
            for _ in 0..400 {
                now += rng.below(period_ns / rate * 3 + 2);
                let cost = 1 + rng.below(burst);
                if let BucketAnswer::Allow { new_tat, .. } = b.decide(tat, now, cost) {
                    tat = new_tat;
                    admitted += cost as u128;
                }
                let elapsed = (now - start) as u128;
                // admitted <= burst + rate * elapsed / period, in integers.
                let bound = burst as u128 * period_ns as u128 + rate as u128 * elapsed;
                assert!(
                    admitted * period_ns as u128 <= bound,
                    "{b:?} admitted {admitted}"
                );
            }
        }
    }

    #[test]
    fn property_refused_with_wait_w_succeeds_at_w_and_not_before() {
        let mut rng = SplitMix(7);
        for _case in 0..2000 {
            let rate = 1 + rng.below(10_000);
            let period_ns = [S, 60 * S, 7 * S / 3][rng.below(3) as usize];
            let burst = 1 + rng.below(100);
            let b = spec(rate, period_ns, burst);
            let now = 10_000 * S + rng.below(S);
            // A random partly drained state.
            let tat = b.scaled_now(now) + rng.below(burst * 2) as u128 * period_ns as u128;
            let cost = 1 + rng.below(burst);
            if let BucketAnswer::Deny { wait_ns, .. } = b.decide(tat, now, cost) {
                assert!(wait_ns >= 1);
                assert!(
                    b.decide(tat, now + wait_ns, cost).allowed(),
                    "{b:?} cost {cost}"
                );
                assert!(
                    !b.decide(tat, now + wait_ns - 1, cost).allowed(),
                    "{b:?} cost {cost}"
                );
            }
        }
    }
}
