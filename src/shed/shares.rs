//! Guaranteed shares per class (`priority.shares`) by virtual clocks, so
//! that the order holds across Envoy's workers too: each waiter gets a
//! *turn*, a virtual time; waiters are admitted in order of their turns,
//! on this worker and, through the claims in the shared entry, across
//! workers. A class's turns advance by `SCALE / share` per arrival, so
//! while every class keeps waiters, each is admitted in proportion to its
//! share; a class with nobody waiting takes nothing (its share flows to
//! the others); and a class that starts waiting again starts from the turn
//! being served, never from credit saved up while idle.

/// Virtual milliseconds a class's turns advance per arrival at a share of
/// 1%: `SCALE / share`.
const SCALE: u64 = 100_000;
/// The step of a class with share 0: it goes when nobody else waits.
const NEVER: u64 = 1 << 40;

/// Per-worker virtual clocks of one shedder, indexed by `Class as usize`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clocks {
    /// The last turn given to each class.
    last: [u64; 3],
    /// The turn of the last waiter admitted here.
    serving: u64,
}

impl Clocks {
    /// The turn of an arrival of `class` at `now_ms`, with `queued` of its
    /// class already waiting here: one step after the class's last turn,
    /// but never more than `queued` steps past the turn being served (the
    /// turns of waiters that left without being admitted, shed or gone,
    /// are not owed: a class shed a lot would otherwise run ever further
    /// behind), and never before it.
    pub fn turn(&mut self, shares: [u32; 3], class: usize, now_ms: u64, queued: u64) -> u64 {
        let step = shares
            .get(class)
            .and_then(|&s| SCALE.checked_div(u64::from(s)))
            .unwrap_or(NEVER);
        let Some(last) = self.last.get_mut(class) else {
            return now_ms;
        };
        let base = now_ms.max(self.serving);
        let owed = (*last).min(base.saturating_add(queued.saturating_mul(step)));
        let turn = owed.max(base).saturating_add(step);
        *last = turn;
        turn
    }

    /// A waiter with `turn` was admitted here: new turns start after it.
    pub fn served(&mut self, turn: u64) {
        self.serving = self.serving.max(turn);
    }

    /// Another worker claims `turn` as the next it serves: new turns here
    /// start after it too, so that every worker's turns stay comparable;
    /// unless it is the turn of a class with share 0 (far ahead of anything
    /// served), which would put every class here behind it.
    pub fn seen(&mut self, turn: u64, now_ms: u64) {
        if turn < self.serving.max(now_ms).saturating_add(NEVER / 2) {
            self.served(turn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const SHARES: [u32; 3] = [15, 35, 50]; // sheddable, default, critical

    /// Every class keeps `backlog` waiters; the earliest turn is admitted
    /// and its class sends another (a closed loop).
    fn run(shares: [u32; 3], active: [bool; 3], n: usize) -> [usize; 3] {
        let mut c = Clocks::default();
        let mut waiting: Vec<(u64, usize)> = Vec::new();
        for (class, &on) in active.iter().enumerate() {
            for _ in 0..4 {
                if on {
                    waiting.push((c.turn(shares, class, 0, 4), class));
                }
            }
        }
        let mut got = [0; 3];
        for _ in 0..n {
            waiting.sort_by_key(|&(t, class)| (t, 2 - class));
            let (t, class) = waiting.remove(0);
            c.served(t);
            got[class] += 1;
            waiting.push((c.turn(shares, class, 0, 4), class));
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
            t = c.turn(SHARES, 0, 0, 0);
            c.served(t);
        }
        // Critical, idle so far, gets a turn just after the one served,
        // not 100 turns of credit.
        let crit = c.turn(SHARES, 2, 0, 0);
        assert!(crit > t && crit <= t + SCALE / 50, "{crit} vs {t}");
        // Another worker's clock ahead: new turns start after it.
        c.served(crit + 10 * SCALE);
        assert!(c.turn(SHARES, 1, 0, 0) > crit + 10 * SCALE);
        // ...but not after a share-0 class's turn, far ahead of any other.
        let far = c.turn([0, 50, 50], 0, 0, 0);
        c.seen(far, 0);
        assert!(c.turn(SHARES, 2, 0, 0) < far);
    }

    #[test]
    fn turns_of_waiters_that_left_are_not_owed() {
        let mut c = Clocks::default();
        // A class whose waiters keep being shed (nobody of it waiting when
        // the next arrives) stays one step past the turn being served.
        let mut t = 0;
        for _ in 0..100 {
            t = c.turn(SHARES, 0, 0, 0);
        }
        assert_eq!(t, SCALE / 15);
    }

    #[test]
    fn a_zero_share_goes_last() {
        let got = run([0, 50, 50], [true; 3], 100);
        assert_eq!(got[0], 0);
    }
}
