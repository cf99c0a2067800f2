//! Sliding-window counting: two fixed-window counters weighted by the
//! overlap, O(1) per key, as the rate-limiting literature's production
//! default for plan-style quotas ("1,000 requests per hour, rolling").
//!
//! Windows are fixed intervals of `window_ns` since the Unix epoch, the same
//! in every VM. A slot's state is three numbers packed into the slot's 96
//! bits: the index of the window it was last charged in (32 bits: windows
//! are at least a second long), that window's count and the one before
//! (32 bits each: limits are at most `u32::MAX`). At offset `e` into window
//! `i` the estimated count of the last `W` nanoseconds is
//! `previous * (W - e) / W + current`, and a request of `cost` is admitted
//! if the estimate plus its cost stays within the limit. All arithmetic is
//! on integers scaled by `W`, so no rounding ever admits too much.
//!
//! The estimate assumes the previous window's requests were spread evenly.
//! The true count in the last `W` nanoseconds (a sliding log) is at most
//! `limit + previous * e / W` (property-tested below): never twice the
//! limit in a short span around a boundary, as a fixed window allows, but
//! up to that much in one window length when the previous window's
//! requests all came at its very end.

use super::bucket::BucketAnswer;

/// A validated sliding-window rule: `limit` per `window_ns`, rolling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpec {
    pub limit: u64,
    pub window_ns: u64,
}

/// A slot's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counters {
    index: u64,
    previous: u64,
    current: u64,
}

const MASK: u128 = 0xffff_ffff;

fn unpack(state: u128) -> Counters {
    Counters {
        index: ((state >> 64) & MASK) as u64,
        previous: ((state >> 32) & MASK) as u64,
        current: (state & MASK) as u64,
    }
}

fn pack(c: Counters) -> u128 {
    let field = |v: u64| u128::from(v) & MASK;
    (field(c.index) << 64) | (field(c.previous) << 32) | field(c.current)
}

impl Counters {
    /// The counters as of window `index` (at least theirs).
    fn rolled(self, index: u64) -> Counters {
        if index <= self.index {
            self
        } else if index == self.index + 1 {
            Counters {
                index,
                previous: self.current,
                current: 0,
            }
        } else {
            Counters {
                index,
                previous: 0,
                current: 0,
            }
        }
    }
}

impl WindowSpec {
    /// The counters at `now_ns`, the time they are judged at (`now_ns`, or
    /// the start of their window if a slot was charged in a window that has
    /// not begun here yet: another worker's clock read a little later), and
    /// the offset into that window.
    fn view(&self, state: u128, now_ns: u64) -> (Counters, u64, u64) {
        let w = self.window_ns;
        let stored = unpack(state);
        let at = now_ns.max(stored.index.saturating_mul(w));
        let c = stored.rolled(at / w);
        (c, at, at - c.index.saturating_mul(w))
    }

    /// The estimate scaled by the window length: `previous * (W - e) +
    /// current * W`.
    fn scaled(&self, c: Counters, e: u64) -> u128 {
        let w = u128::from(self.window_ns);
        u128::from(c.previous) * (w - u128::from(e).min(w)) + u128::from(c.current) * w
    }

    /// How full a slot is at `now_ns`: the decision rests on the emptiest
    /// of a key's slots.
    pub fn level(&self, state: u128, now_ns: u64) -> u128 {
        let (c, _, e) = self.view(state, now_ns);
        self.scaled(c, e)
    }

    /// A state that admits nothing now (fail-closed recovery of a corrupt
    /// slot): the current window full.
    pub fn exhausted(&self, now_ns: u64) -> u128 {
        pack(Counters {
            index: now_ns / self.window_ns,
            previous: 0,
            current: self.limit,
        })
    }

    /// The smallest state at least as full as both, at any time from now on
    /// (both rolled to the later window, then the larger of each count).
    pub fn merge(&self, a: u128, b: u128) -> u128 {
        let (a, b) = (unpack(a), unpack(b));
        let index = a.index.max(b.index);
        let (a, b) = (a.rolled(index), b.rolled(index));
        pack(Counters {
            index,
            previous: a.previous.max(b.previous),
            current: a.current.max(b.current),
        })
    }

    /// Decides whether a request of `cost` (at most the limit) fits.
    pub fn decide(&self, state: u128, now_ns: u64, cost: u64) -> BucketAnswer {
        let (c, at, e) = self.view(state, now_ns);
        let w = u128::from(self.window_ns);
        let limit = u128::from(self.limit) * w;
        let estimate = self.scaled(c, e);
        let needed = u128::from(cost) * w;
        let ahead = at - now_ns;
        if estimate + needed <= limit {
            let after = Counters {
                current: c.current + cost,
                ..c
            };
            BucketAnswer::Allow {
                new_tat: pack(after),
                remaining: to_u64((limit - estimate - needed) / w),
                full_in_ns: ahead.saturating_add(self.empty_in(after, e)),
                delay_ns: 0,
            }
        } else {
            BucketAnswer::Deny {
                wait_ns: ahead.saturating_add(self.wait(c, e, cost)),
                remaining: to_u64(limit.saturating_sub(estimate) / w),
                full_in_ns: ahead.saturating_add(self.empty_in(c, e)),
            }
        }
    }

    /// Nanoseconds from offset `e` until the estimate is zero.
    fn empty_in(&self, c: Counters, e: u64) -> u64 {
        let w = self.window_ns;
        if c.current > 0 {
            (2 * w).saturating_sub(e)
        } else if c.previous > 0 {
            w - e
        } else {
            0
        }
    }

    /// Nanoseconds from offset `e` until a request of `cost`, refused now,
    /// fits: the first moment the weighted count is low enough, never
    /// earlier.
    fn wait(&self, c: Counters, e: u64, cost: u64) -> u64 {
        let w = u128::from(self.window_ns);
        // Within this window, as the previous window's weight falls:
        // previous * (W - e') <= (limit - current - cost) * W.
        if let Some(room) = self.limit.checked_sub(c.current + cost) {
            if c.previous > 0 {
                let span = u128::from(room) * w / u128::from(c.previous);
                if span >= 1 {
                    let at = w - span.min(w);
                    return to_u64(at.saturating_sub(u128::from(e)).max(1));
                }
            }
        }
        // In the next window, where this one's count is the previous:
        // current * (W - e'') <= (limit - cost) * W; at its end, nothing.
        let to_next = w - u128::from(e);
        let room = u128::from(self.limit.saturating_sub(cost)) * w;
        let into = match room.checked_div(u128::from(c.current)) {
            Some(span) => w - span.min(w),
            None => 0,
        };
        to_u64(to_next + into)
    }
}

fn to_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_700_000_000 * S;

    fn spec(limit: u64, window_ns: u64) -> WindowSpec {
        WindowSpec { limit, window_ns }
    }

    #[test]
    fn packing_round_trips() {
        let c = Counters {
            index: u64::from(u32::MAX),
            previous: 7,
            current: u64::from(u32::MAX),
        };
        assert_eq!(unpack(pack(c)), c);
        assert!(pack(c) < 1 << 96, "fits the slot's 96 bits");
    }

    #[test]
    fn a_boundary_burst_is_not_admitted_twice() {
        let s = spec(10, 10 * S);
        // Window-aligned start, then 10 just before the boundary.
        let start = (T0 / (10 * S) + 1) * 10 * S;
        let mut state = 0;
        let before = start + 10 * S - S / 100;
        for i in 0..10 {
            match s.decide(state, before, 1) {
                BucketAnswer::Allow { new_tat, .. } => state = new_tat,
                d => panic!("{i}: {d:?}"),
            }
        }
        assert!(!s.decide(state, before, 1).allowed());
        // Just after the boundary, the previous window weighs almost fully.
        let after = start + 10 * S + S / 100;
        assert!(!s.decide(state, after, 1).allowed());
        // At a tenth of the way in, one request's worth has slid out.
        let tenth = start + 11 * S;
        let BucketAnswer::Allow { new_tat, .. } = s.decide(state, tenth, 1) else {
            panic!("a tenth in, one fits")
        };
        assert!(!s.decide(new_tat, tenth, 1).allowed());
    }

    #[test]
    fn states_from_a_window_not_begun_here_are_judged_at_its_start() {
        let s = spec(4, S);
        let now = T0 + S / 2;
        let ahead = pack(Counters {
            index: now / S + 1,
            previous: 4,
            current: 0,
        });
        let BucketAnswer::Deny { wait_ns, .. } = s.decide(ahead, now, 1) else {
            panic!("the previous window is full at the next window's start")
        };
        assert!(wait_ns > S / 2);
        assert!(s.decide(ahead, now + wait_ns, 1).allowed());
        assert!(!s.decide(ahead, now + wait_ns - 1, 1).allowed());
    }

    #[test]
    fn property_refused_with_wait_w_is_admitted_at_w_and_not_before() {
        let mut rng = SplitMix(11);
        for _case in 0..3000 {
            let w = [S, 7 * S / 3, 60 * S, 3_600 * S][rng.below(4) as usize];
            let limit = 1 + rng.below(1000);
            let s = spec(limit, w);
            let now = T0 + rng.below(w * 3);
            let index = now / w - rng.below(3);
            let state = pack(Counters {
                index,
                previous: rng.below(limit + 1),
                current: rng.below(limit + 1),
            });
            let cost = 1 + rng.below(limit);
            if let BucketAnswer::Deny { wait_ns, .. } = s.decide(state, now, cost) {
                assert!(wait_ns >= 1);
                assert!(
                    s.decide(state, now + wait_ns, cost).allowed(),
                    "{s:?} {:?} cost {cost} at {now}+{wait_ns}",
                    unpack(state)
                );
                assert!(
                    !s.decide(state, now + wait_ns - 1, cost).allowed(),
                    "{s:?} {:?} cost {cost}",
                    unpack(state)
                );
            }
        }
    }

    /// Random arrivals against one key, compared with a sliding log of what
    /// was admitted: the estimate's error and the excess over the limit in
    /// any span of one window length stay within the documented bounds.
    #[test]
    fn property_the_estimate_stays_within_its_bound_of_a_sliding_log() {
        let mut rng = SplitMix(5);
        for case in 0..200 {
            let w = [S, 10 * S, 60 * S][rng.below(3) as usize];
            let limit = 1 + rng.below(50);
            let s = spec(limit, w);
            let mut now = T0 + rng.below(w);
            let mut state = 0u128;
            let mut log: Vec<(u64, u64)> = Vec::new();
            // Bursty gaps: sometimes long pauses, sometimes tight bursts.
            for _ in 0..600 {
                now += match rng.below(4) {
                    0 => rng.below(w),
                    1 => rng.below(w / 10),
                    _ => rng.below(w / limit + 1),
                };
                let cost = 1 + rng.below(limit.min(3));
                if let BucketAnswer::Allow { new_tat, .. } = s.decide(state, now, cost) {
                    state = new_tat;
                    log.push((now, cost));
                }
                // The true count of the last window length, (now - W, now].
                let truth: u64 = log
                    .iter()
                    .filter(|(t, _)| *t + w > now)
                    .map(|(_, c)| c)
                    .sum();
                let start = now / w * w;
                let e = now - start;
                let previous: u64 = log
                    .iter()
                    .filter(|(t, _)| *t < start && *t + w >= start)
                    .map(|(_, c)| c)
                    .sum();
                let estimate = s.level(state, now);
                let (w128, truth128) = (u128::from(w), u128::from(truth));
                let prev_e = u128::from(previous) * u128::from(e);
                // truth - prev*e/W <= estimate <= truth + prev*(W-e)/W
                assert!(
                    truth128 * w128 <= estimate + prev_e,
                    "case {case}: log {truth} above the estimate by more than the bound"
                );
                assert!(
                    estimate <= truth128 * w128 + u128::from(previous) * (w128 - u128::from(e)),
                    "case {case}: estimate above the log by more than the bound"
                );
                // The limit is never exceeded by more than previous * e / W.
                assert!(
                    truth128 * w128 <= u128::from(limit) * w128 + prev_e,
                    "case {case}: {truth} in one window, limit {limit}"
                );
            }
        }
    }

    #[test]
    fn merge_is_at_least_as_full_as_either_from_now_on() {
        let mut rng = SplitMix(9);
        let s = spec(100, 10 * S);
        for _ in 0..2000 {
            let base = T0 / (10 * S);
            let mut st = || {
                pack(Counters {
                    index: base + rng.below(3),
                    previous: rng.below(101),
                    current: rng.below(101),
                })
            };
            let (a, b) = (st(), st());
            let m = s.merge(a, b);
            for k in 0..40 {
                let now = (base + 2) * 10 * S + k * S / 2;
                assert!(s.level(m, now) >= s.level(a, now).max(s.level(b, now)));
            }
        }
    }
}
