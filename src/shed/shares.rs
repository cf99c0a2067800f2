//! Guaranteed shares per class (`priority.shares`) by virtual clocks, so
//! that the order holds across Envoy's workers too: each waiter gets a
//! *turn*, a virtual time; waiters are admitted in order of their turns,
//! on this worker and, through the claims in the shared entry, across
//! workers. Turns are start tags, as in start-time fair queueing: a class's
//! turns are `SCALE / share` apart, so while every class keeps waiters,
//! each is admitted in proportion to its share; a class with nobody waiting
//! takes nothing (its share flows to the others); a class that starts
//! waiting again starts at the turn being served, never from credit saved
//! up while idle; and a client that comes back soon after its last
//! admission waits only what is left of its class's step.

/// Virtual milliseconds between a class's turns at a share of 1%:
/// `SCALE / share`.
pub const SCALE: u64 = 100_000;
/// The step of a class with share 0: it goes when nobody else waits.
const NEVER: u64 = 1 << 40;

/// Per-worker virtual clocks of one shedder, indexed by `Class as usize`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clocks {
    /// The turn of the last waiter of each class admitted here.
    admitted: [Option<u64>; 3],
    /// The turn of the last waiter admitted here, or claimed next by
    /// another worker.
    serving: u64,
}

impl Clocks {
    /// The turn being served, as seen at `now_ms`: turns never fall behind
    /// the clock.
    pub fn base(&self, now_ms: u64) -> u64 {
        now_ms.max(self.serving)
    }

    /// The turn of an arrival of `class` at `now_ms`, whose class's newest
    /// waiter here has turn `newest`: one step after the class's last turn
    /// still live (waiting, or admitted here), but never before the turn
    /// being served. The turns of waiters that left without being admitted
    /// (shed or gone) are not owed: a class shed a lot would otherwise run
    /// ever further behind. A class with share 0 goes after everyone.
    pub fn next(&self, shares: [u32; 3], class: usize, now_ms: u64, newest: Option<u64>) -> u64 {
        let base = self.base(now_ms);
        let share = shares.get(class).copied().unwrap_or(0);
        let Some(step) = SCALE.checked_div(u64::from(share)) else {
            return base.saturating_add(NEVER);
        };
        let last = self.admitted.get(class).copied().flatten().max(newest);
        match last {
            // A class that comes back a little late keeps its pace: up to
            // one step of credit (else every lag would cost it a share of
            // its turns, the more the more often its turns come round).
            Some(t) => t.saturating_add(step).max(base.saturating_sub(step)),
            None => base,
        }
    }

    /// A waiter of `class` with `turn` was admitted here: new turns start
    /// at it, and its class's next one step after it.
    pub fn served(&mut self, class: usize, turn: u64) {
        self.serving = self.serving.max(turn);
        if let Some(a) = self.admitted.get_mut(class) {
            *a = Some(a.map_or(turn, |t| t.max(turn)));
        }
    }

    /// Another worker claims `turn` as the next it serves: new turns here
    /// start at it too, so that every worker's turns stay comparable;
    /// unless it is the turn of a class with share 0 (far ahead of anything
    /// served), which would put every class here behind it.
    pub fn seen(&mut self, turn: u64, now_ms: u64) {
        if turn < self.serving.max(now_ms).saturating_add(NEVER / 2) {
            self.serving = self.serving.max(turn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const SHARES: [u32; 3] = [15, 35, 50]; // sheddable, default, critical

    /// The turn of an arrival of `class`, given who waits.
    fn turn(c: &Clocks, shares: [u32; 3], class: usize, waiting: &[(u64, usize)]) -> u64 {
        let newest = waiting.iter().filter(|w| w.1 == class).map(|w| w.0).max();
        c.next(shares, class, 0, newest)
    }

    /// Every class keeps 4 waiters; the earliest turn is admitted and its
    /// class sends another (a closed loop).
    fn run(shares: [u32; 3], active: [bool; 3], n: usize) -> [usize; 3] {
        let c0 = Clocks::default();
        let mut c = c0;
        let mut waiting: Vec<(u64, usize)> = Vec::new();
        for (class, &on) in active.iter().enumerate() {
            for _ in 0..4 {
                if on {
                    let t = turn(&c, shares, class, &waiting);
                    waiting.push((t, class));
                }
            }
        }
        let mut got = [0; 3];
        for _ in 0..n {
            waiting.sort_by_key(|&(t, class)| (t, 2 - class));
            let (t, class) = waiting.remove(0);
            c.served(class, t);
            got[class] += 1;
            let t = turn(&c, shares, class, &waiting);
            waiting.push((t, class));
        }
        got
    }

    #[test]
    fn every_class_gets_its_share_when_all_wait() {
        let got = run(SHARES, [true; 3], 1000);
        assert!((140..=160).contains(&got[0]), "{got:?}");
        assert!((340..=360).contains(&got[1]), "{got:?}");
        assert!((490..=510).contains(&got[2]), "{got:?}");
    }

    #[test]
    fn an_idle_share_flows_to_the_others() {
        let got = run(SHARES, [true, true, false], 1000);
        assert_eq!(got[2], 0);
        assert!((280..=320).contains(&got[0]), "15:35 of all: {got:?}");
    }

    #[test]
    fn a_class_back_from_idle_starts_at_the_turn_being_served() {
        let mut c = Clocks::default();
        let mut t = 0;
        for _ in 0..100 {
            t = c.next(SHARES, 0, 0, None);
            c.served(0, t);
        }
        assert_eq!(t, 99 * (SCALE / 15));
        // Critical, idle so far, gets the turn being served, not 100
        // turns of credit.
        assert_eq!(c.next(SHARES, 2, 0, None), t);
        // Another worker's clock ahead: new turns start at it.
        c.seen(t + 10 * SCALE, 0);
        assert_eq!(c.next(SHARES, 1, 0, None), t + 10 * SCALE);
        // ...but not at a share-0 class's turn, far ahead of any other.
        let far = c.next([0, 50, 50], 0, 0, None);
        assert!(far > t + 10 * SCALE + (1 << 30));
        c.seen(far, 0);
        assert!(c.next(SHARES, 2, 0, None) < far);
        // The clock itself is a floor.
        assert_eq!(c.next(SHARES, 2, far, None), far);
    }

    #[test]
    fn turns_of_waiters_that_left_are_not_owed() {
        let mut c = Clocks::default();
        c.served(0, 1_000);
        // Sheddable waiters that were shed never count: with nobody of its
        // class waiting, an arrival's turn is one step after its class's
        // last admission...
        assert_eq!(c.next(SHARES, 0, 0, None), 1_000 + SCALE / 15);
        // ...or after its newest waiter.
        assert_eq!(c.next(SHARES, 0, 0, Some(9_000)), 9_000 + SCALE / 15);
        // A client back soon after its admission waits only what is left
        // of its step: the turn being served has moved on meanwhile.
        c.seen(5_000, 0);
        assert_eq!(c.next(SHARES, 0, 0, None), 1_000 + SCALE / 15);
        // Back late, it keeps at most one step of credit, never more.
        c.seen(50_000, 0);
        assert_eq!(c.next(SHARES, 0, 0, None), 50_000 - SCALE / 15);
    }

    #[test]
    fn a_zero_share_goes_last() {
        let got = run([0, 50, 50], [true; 3], 100);
        assert_eq!(got[0], 0);
    }
}
