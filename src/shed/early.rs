//! `concurrency.shed_early`: the wait an arrival can expect, from its place
//! in line and the rate at which the shedder admitted requests lately on
//! every worker (Little's law), so that one that would wait past its limit
//! is shed at once instead of waiting the limit out first.
//!
//! The rate is read off the shared entry's count of admissions (every
//! worker's, direct and from the queue), which each worker sees whenever it
//! reads the entry: a worker that admitted little itself judges by the
//! same rate as the others, so it is not held to what it got before.

/// The shared admissions count as this worker saw it, over two windows:
/// the one running and the one before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rate {
    /// When the running window started (ms), and the count then.
    start_ms: u64,
    start_count: u64,
    /// The window before: when it started and the count then (`None`: no
    /// full window seen yet, or it ended more than a window ago).
    prev: Option<(u64, u64)>,
    /// The latest count seen.
    last: u64,
    /// Whether any count was seen.
    seen: bool,
}

impl Rate {
    pub fn new(now_ms: u64) -> Self {
        Rate {
            start_ms: now_ms,
            ..Rate::default()
        }
    }

    /// Starts a new window once the running one is `window_ms` old; a
    /// window that ended more than a window ago counts as nothing to go by.
    fn roll(&mut self, now_ms: u64, window_ms: u64) {
        let age = now_ms.saturating_sub(self.start_ms);
        if age < window_ms {
            return;
        }
        self.prev = (age < 2 * window_ms && self.seen).then_some((self.start_ms, self.start_count));
        self.start_ms = now_ms;
        self.start_count = self.last;
    }

    /// The shared entry said `count` admissions at `now_ms`. The first
    /// count seen starts the first window; a window started after a quiet
    /// spell starts at the count seen now (what the other workers admitted
    /// meanwhile is not this window's).
    pub fn saw(&mut self, now_ms: u64, count: u64, window_ms: u64) {
        if !self.seen {
            self.seen = true;
            self.start_ms = now_ms;
            self.start_count = count;
        }
        self.last = count;
        self.roll(now_ms, window_ms);
    }

    /// The wait (ms) of an arrival that `needs` admissions, its own
    /// included, before it is admitted: that many at the rate of the last
    /// one to two windows. `None` while there is no full window to go by
    /// yet, or no admission in it (the arrival then waits, as without
    /// `shed_early`: nothing admitted lately says nothing of how long a
    /// wait would be, as with an upstream slower than two windows).
    pub fn expected_wait_ms(&mut self, now_ms: u64, window_ms: u64, needs: u64) -> Option<u64> {
        self.roll(now_ms, window_ms);
        let (since_ms, count) = self.prev?;
        let span = now_ms.saturating_sub(since_ms);
        let n = self.last.wrapping_sub(count);
        // A count gone back (the entry rebuilt) says nothing either.
        if n == 0 || n > u64::MAX / 2 {
            return None;
        }
        Some(needs.saturating_mul(span) / n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn no_estimate_before_a_full_window() {
        let mut r = Rate::new(1_000);
        r.saw(1_010, 5, 100);
        r.saw(1_050, 9, 100);
        assert_eq!(r.expected_wait_ms(1_050, 100, 6), None);
    }

    #[test]
    fn the_wait_is_the_place_in_line_over_the_rate() {
        let mut r = Rate::new(0);
        // 10 admissions per 100 ms (on all workers): one every 10 ms.
        for i in 0..=10 {
            r.saw(i * 10, 1_000 + i, 100);
        }
        // At 100 the window rolled: 10 in the 100 ms since.
        assert_eq!(r.expected_wait_ms(100, 100, 1), Some(10));
        assert_eq!(r.expected_wait_ms(100, 100, 5), Some(50));
        // Halfway through the next window, 5 more: 15 in 150 ms.
        for i in 11..=15 {
            r.saw(i * 10, 1_000 + i, 100);
        }
        assert_eq!(r.expected_wait_ms(150, 100, 3), Some(30));
    }

    #[test]
    fn no_admission_lately_is_no_estimate() {
        let mut r = Rate::new(0);
        r.saw(5, 7, 100);
        r.saw(120, 8, 100);
        // Two windows later with nothing seen since: nothing to go by (an
        // upstream slower than two windows), not an endless wait.
        assert_eq!(r.expected_wait_ms(350, 100, 1), None);
        // Nor with a count that did not move.
        r.saw(460, 8, 100);
        r.saw(560, 8, 100);
        assert_eq!(r.expected_wait_ms(570, 100, 1), None);
        // The rate comes back with admissions.
        for t in 570..580 {
            r.saw(t, 8 + t - 569, 100);
        }
        r.saw(670, 20, 100);
        assert!(r.expected_wait_ms(680, 100, 1).is_some_and(|w| w <= 20));
    }

    #[test]
    fn the_first_window_starts_at_the_first_count_seen() {
        // Created at 0; first count seen at 150 (1,000), then at 160
        // (1,010) and 260 (1,110): 10 admissions every 10 ms.
        let mut r = Rate::new(0);
        r.saw(150, 1_000, 100);
        r.saw(160, 1_010, 100);
        assert_eq!(r.expected_wait_ms(160, 100, 1), None, "no full window yet");
        r.saw(250, 1_100, 100);
        r.saw(260, 1_110, 100);
        assert_eq!(r.expected_wait_ms(260, 100, 1), Some(1));
    }

    #[test]
    fn after_a_quiet_spell_the_window_starts_at_the_count_seen_then() {
        // Seen at 0 and 100 (100 admissions), then nothing until 1,000,
        // while the other workers admitted 900 more: the window that
        // starts then starts at 1,000, not at 100.
        let mut r = Rate::new(0);
        r.saw(0, 0, 100);
        r.saw(100, 100, 100);
        r.saw(1_000, 1_000, 100);
        r.saw(1_100, 1_010, 100);
        // 10 in the 100 ms since: one every 10 ms.
        assert_eq!(r.expected_wait_ms(1_100, 100, 1), Some(10));
    }

    #[test]
    fn a_count_that_goes_back_is_no_estimate() {
        let mut r = Rate::new(0);
        r.saw(0, 500, 100);
        r.saw(100, 520, 100);
        r.saw(150, 3, 100); // the entry was rebuilt
        assert_eq!(r.expected_wait_ms(150, 100, 1), None);
    }

    #[test]
    fn a_slower_upstream_means_longer_waits() {
        let mut fast = Rate::new(0);
        let mut slow = Rate::new(0);
        for i in 0..=40 {
            fast.saw(i * 5, i, 100);
            slow.saw(i * 20, i, 100);
        }
        let f = fast.expected_wait_ms(200, 100, 4);
        let s = slow.expected_wait_ms(800, 100, 4);
        assert!(f < s, "{f:?} vs {s:?}");
    }
}
