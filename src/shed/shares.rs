//! Guaranteed shares per class (`priority.shares`) by virtual clocks, so
//! that the order holds across Envoy's workers too: each waiter gets a
//! *turn*, a virtual time; waiters are admitted in order of their turns,
//! on this worker and, through the claims in the shared entry, across
//! workers. Turns are start tags, as in start-time fair queueing: a class's
//! turns are `SCALE / share` apart, so while every class keeps waiters,
//! each is admitted in proportion to its share; a class with nobody waiting
//! takes nothing (its share flows to the others); a class that starts
//! waiting again starts at the turn being served, with at most one step of
//! credit; a client that comes back soon after its last admission
//! waits only what is left of its class's step; and a waiter that leaves
//! before its turn (it waited its limit, or its client went) while later
//! turns of its class wait leaves its turn to its class's next arrival.

/// Virtual milliseconds between a class's turns at a share of 1%:
/// `SCALE / share`.
pub const SCALE: u64 = 100_000;
/// The step of a class with share 0: it goes when nobody else waits.
const NEVER: u64 = 1 << 40;
/// The most turns a class is owed by waiters that left (see `left`).
const MAX_OWED: usize = 16;

/// Per-worker virtual clocks of one shedder, indexed by `Class as usize`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clocks {
    /// The turn of the last waiter of each class admitted here.
    admitted: [Option<u64>; 3],
    /// The turn of the last waiter admitted here, or claimed next by
    /// another worker.
    serving: u64,
    /// Per class, the turns owed to it by waiters that left here without
    /// being admitted (see `left`), earliest first.
    owed: [Owed; 3],
}

impl Clocks {
    /// The turn being served, as seen at `now_ms`: the clock is its floor.
    pub fn base(&self, now_ms: u64) -> u64 {
        now_ms.max(self.serving)
    }

    /// The turn of an arrival of `class` at `now_ms`, whose class's newest
    /// waiter here has turn `newest`: one step after the class's last turn
    /// still live (waiting here, or admitted here), but never more than
    /// one step before the turn being served; or a turn the class is owed
    /// (see `left`). Beyond those, the turns of waiters that left without
    /// being admitted (shed or gone) are not owed: a class shed a lot would
    /// otherwise run ever further behind. A class with share 0 goes after
    /// everyone.
    pub fn next(&self, shares: [u32; 3], class: usize, now_ms: u64, newest: Option<u64>) -> u64 {
        let base = self.base(now_ms);
        let share = shares.get(class).copied().unwrap_or(0);
        let Some(step) = SCALE.checked_div(u64::from(share)) else {
            return base.saturating_add(NEVER);
        };
        if let Some(t) = self.owed(class, now_ms) {
            return t;
        }
        // A place taken while nobody waited is charged up to the turn
        // being served: at most one step of delay for the class, however
        // many it took (in light load every request takes one).
        let admitted = self.admitted.get(class).copied().flatten();
        let last = admitted.map(|t| t.min(base)).max(newest);
        match last {
            // A class that comes back a little late keeps its pace: up to
            // one step of credit (else every lag would cost it a share of
            // its turns, the more the more often its turns come round).
            Some(t) => t.saturating_add(step).max(base.saturating_sub(step)),
            None => base,
        }
    }

    /// The turn a waiter of `class` left unused here, if one is owed:
    /// the earliest such turn, or the turn being served once that has
    /// come round (the class goes first).
    fn owed(&self, class: usize, now_ms: u64) -> Option<u64> {
        let base = self.base(now_ms);
        self.owed.get(class)?.first().map(|t| t.max(base))
    }

    /// A waiter of `class` with `turn` left here without being admitted
    /// (it waited its limit, or its client went): the class is owed the
    /// turn, given to one of its next arrivals here, earliest first (at
    /// most `MAX_OWED` kept, the earliest). A waiter that waits its limit
    /// out is most often its class's first, whose turn was about to come:
    /// without this, a class whose waiters reach their limit more often
    /// than others' (as `shed_early`'s estimate errs) gets less than its
    /// share.
    pub fn left(&mut self, class: usize, turn: u64, now_ms: u64) {
        if self.share0(turn, now_ms) {
            return;
        }
        if let Some(o) = self.owed.get_mut(class) {
            o.add(turn);
        }
    }

    /// A request of `class` took the turn `next` gave it (`turn`), by
    /// queueing or by a free place: an owed turn is paid, and so are the
    /// others that have come round meanwhile (at most one goes at the turn
    /// being served: a class that comes back after its owed turns have
    /// passed, idle since, has one turn of credit, not a burst).
    pub fn paid(&mut self, class: usize, turn: u64) {
        if let Some(o) = self.owed.get_mut(class) {
            o.pay(turn);
        }
    }

    /// The turn of the last request of `class` admitted here, as `next`
    /// counts it (no later than the turn being served).
    pub fn admitted(&self, class: usize, now_ms: u64) -> Option<u64> {
        let base = self.base(now_ms);
        self.admitted
            .get(class)
            .copied()
            .flatten()
            .map(|t| t.min(base))
    }

    /// A waiter of `class` with `turn` was admitted here from the queue:
    /// new turns start at it, and its class's next one step after it. A
    /// share-0 turn (far ahead of any other) moves nothing: it would put
    /// every class behind it.
    pub fn served(&mut self, class: usize, turn: u64, now_ms: u64) {
        self.seen(turn, now_ms);
        self.last(class, turn, now_ms);
    }

    /// A request of `class` took a free place with `turn` while nobody
    /// waited: its class's next turn comes after it; the turn being served
    /// stays (nobody was passed over).
    pub fn took(&mut self, class: usize, turn: u64, now_ms: u64) {
        self.paid(class, turn);
        self.last(class, turn, now_ms);
    }

    /// `turn` is the last of `class` admitted here.
    fn last(&mut self, class: usize, turn: u64, now_ms: u64) {
        if self.share0(turn, now_ms) {
            return;
        }
        if let Some(a) = self.admitted.get_mut(class) {
            *a = Some(a.map_or(turn, |t| t.max(turn)));
        }
    }

    /// Whether `turn` is a share-0 turn (as far ahead as only those are).
    fn share0(&self, turn: u64, now_ms: u64) -> bool {
        turn >= self.base(now_ms).saturating_add(NEVER / 2)
    }

    /// Another worker claims `turn` as the next it serves: new turns here
    /// start at it too, so that every worker's turns stay comparable;
    /// unless it is the turn of a class with share 0 (far ahead of anything
    /// served), which would put every class here behind it.
    pub fn seen(&mut self, turn: u64, now_ms: u64) {
        if !self.share0(turn, now_ms) {
            self.serving = self.serving.max(turn);
        }
    }
}

/// Up to `MAX_OWED` turns owed to a class, earliest first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Owed {
    turns: [u64; MAX_OWED],
    n: usize,
}

impl Owed {
    fn first(&self) -> Option<u64> {
        self.turns.get(..self.n)?.first().copied()
    }

    /// Adds `turn` in order; when full, it replaces the latest if earlier.
    fn add(&mut self, turn: u64) {
        if self.n == MAX_OWED {
            match self.turns.last() {
                Some(&last) if turn < last => self.n -= 1,
                _ => return,
            }
        }
        let kept = self.turns.get(..self.n).unwrap_or_default();
        let at = kept.iter().position(|&t| t > turn).unwrap_or(self.n);
        if let Some(tail) = self.turns.get_mut(at..=self.n) {
            tail.rotate_right(1);
            if let Some(first) = tail.first_mut() {
                *first = turn;
                self.n += 1;
            }
        }
    }

    /// Removes the turns up to `turn` (the one taken and any before it).
    fn pay(&mut self, turn: u64) {
        let Some(kept) = self.turns.get_mut(..self.n) else {
            return;
        };
        let gone = kept.iter().take_while(|&&t| t <= turn).count();
        kept.rotate_left(gone);
        self.n -= gone;
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
        let mut c = Clocks::default();
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
            c.served(class, t, 0);
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
            c.served(0, t, 0);
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
    fn turns_of_waiters_that_left_are_not_owed_beyond_the_newest() {
        let mut c = Clocks::default();
        c.served(0, 1_000, 0);
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
    fn a_turn_left_while_later_ones_wait_goes_to_the_next_arrival() {
        let mut c = Clocks::default();
        let step = SCALE / 35;
        c.served(1, 1_000, 0);
        // Default waits at 1,000 + step and + 2 steps; the first waits its
        // limit out: its class is owed its turn, not yet come round.
        c.left(1, 1_000 + step, 0);
        assert_eq!(c.next(SHARES, 1, 0, Some(1_000 + 2 * step)), 1_000 + step);
        // Still owed while the arrival given it is not queued (shed at
        // once); paid once one takes it.
        assert_eq!(c.next(SHARES, 1, 0, Some(1_000 + 2 * step)), 1_000 + step);
        c.paid(1, 1_000 + step);
        assert_eq!(
            c.next(SHARES, 1, 0, Some(1_000 + 2 * step)),
            1_000 + 3 * step
        );
        // Several owed: each once, earliest first.
        c.left(1, 1_000 + 3 * step, 0);
        c.left(1, 1_000 + 2 * step, 0);
        assert_eq!(c.next(SHARES, 1, 0, None), 1_000 + 2 * step);
        c.paid(1, 1_000 + 2 * step);
        assert_eq!(c.next(SHARES, 1, 0, None), 1_000 + 3 * step);
        // Those that have come round meanwhile (the class was idle since):
        // one goes at the turn being served, the others are dropped, so a
        // class coming back gets one turn of credit, not a burst.
        c.left(1, 1_000 + 2 * step, 0);
        c.seen(1_000 + 5 * step, 0);
        assert_eq!(c.next(SHARES, 1, 0, None), 1_000 + 5 * step);
        c.paid(1, 1_000 + 5 * step);
        assert_eq!(c.next(SHARES, 1, 0, None), 1_000 + 4 * step);
        // At most MAX_OWED are kept, the earliest; a share-0 turn is never
        // owed.
        c.seen(200_000, 0);
        for i in (0..MAX_OWED as u64 + 6).rev() {
            c.left(1, 300_000 + i, 0);
        }
        for i in 0..MAX_OWED as u64 {
            assert_eq!(c.next(SHARES, 1, 0, None), 300_000 + i);
            c.paid(1, 300_000 + i);
        }
        assert_eq!(c.next(SHARES, 1, 0, None), 200_000 - step);
        let far = c.next([0, 50, 50], 0, 0, None);
        c.left(0, far, 0);
        assert_eq!(c.next([0, 50, 50], 0, 0, None), far);
    }

    #[test]
    fn a_zero_share_goes_last() {
        let got = run([0, 50, 50], [true; 3], 100);
        assert_eq!(got[0], 0);
    }

    /// What `Shedders::admit_at_once` does for an arrival with nobody
    /// waiting: its class's next turn, then `took(class, turn)`.
    fn direct(c: &mut Clocks, shares: [u32; 3], class: usize, now: u64) {
        let t = c.next(shares, class, now, None);
        c.took(class, t, now);
    }

    #[test]
    fn a_share0_admission_does_not_move_the_clock() {
        let shares = [50, 0, 50]; // default has share 0
        let mut c = Clocks::default();
        let now = 1_700_000_000_000;
        direct(&mut c, shares, 1, now);
        // One request of the share-0 class, admitted at a free place, put
        // this worker's clock 2^40 virtual ms ahead: every turn here is now
        // past what another worker's `seen` accepts (NEVER / 2 ahead).
        let crit = c.next(shares, 2, now, None);
        let mut other = Clocks::default();
        other.seen(crit, now);
        assert!(
            other.base(now) >= crit - SCALE,
            "another worker ignores this worker's critical turn {} (its own base {})",
            crit - now,
            other.base(now) - now
        );
    }

    #[test]
    fn many_share0_admissions_leave_the_shares_intact() {
        let shares = [50, 0, 50]; // sheddable 50, default 0, critical 50
        let mut c = Clocks::default();
        let now = 1_700_000_000_000;
        // 2^24 direct admissions of the share-0 class (4.7 hours at 1,000
        // a second of light load).
        for _ in 0..(1u32 << 24) {
            direct(&mut c, shares, 1, now);
        }
        // Then overload from every class, 4 waiters each (as `run`).
        let mut waiting: Vec<(u64, usize)> = Vec::new();
        for class in 0..3 {
            for _ in 0..4 {
                let t = turn(&c, shares, class, &waiting);
                waiting.push((t, class));
            }
        }
        let mut got = [0; 3];
        for _ in 0..200 {
            waiting.sort_by_key(|&(t, class)| (t, 2 - class));
            let (t, class) = waiting.remove(0);
            c.served(class, t, now);
            got[class] += 1;
            let t = turn(&c, shares, class, &waiting);
            waiting.push((t, class));
        }
        assert!(
            got[0] >= 80 && got[1] == 0,
            "admitted sheddable/default/critical {got:?}, base {}",
            c.base(now)
        );
    }

    #[test]
    fn light_load_keeps_turns_within_what_other_workers_accept() {
        let shares = [1, 49, 50]; // sheddable 1%: a step of 100,000
        let (mut a, mut b) = (Clocks::default(), Clocks::default());
        let now = 1_700_000_000_000;
        // Light load: 5.6 million sheddable requests admitted directly on
        // worker A (1.5 hours at 1,000 a second); worker B sees a quarter
        // as many critical ones.
        for i in 0..5_600_000 {
            direct(&mut a, shares, 0, now);
            if i % 4 == 0 {
                direct(&mut b, shares, 2, now);
            }
        }
        // Overload starts: A's first critical waiter claims its turn; B,
        // seeing it, should move its clock up to it.
        let crit_a = a.next(shares, 2, now, None);
        b.seen(crit_a, now);
        assert!(
            b.base(now) + SCALE >= crit_a,
            "B ignores A's claim: A's turns are {} ahead of B's",
            crit_a - b.base(now)
        );
    }

    #[test]
    fn turns_fall_at_most_one_step_behind_the_turn_being_served() {
        let mut c = Clocks::default();
        c.served(0, 1_000, 0);
        let now = 1_000_000;
        let t = c.next(SHARES, 0, now, None);
        assert_eq!(t, now - SCALE / 15);
    }
}
