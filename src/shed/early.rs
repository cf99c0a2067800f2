//! `concurrency.shed_early`: the wait an arrival can expect, from its place
//! in line and the rate at which this worker admitted requests lately
//! (Little's law), so that one that would wait past its limit is shed at
//! once instead of waiting the limit out first.

/// Admissions (direct and from the queue) on this worker, counted over two
/// windows: the one running and the one before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rate {
    /// When the running window started (ms).
    start_ms: u64,
    /// Admissions in the running window.
    count: u64,
    /// Admissions in the window before, and its length (0: none yet).
    prev_count: u64,
    prev_len_ms: u64,
}

impl Rate {
    pub fn new(now_ms: u64) -> Self {
        Rate {
            start_ms: now_ms,
            ..Rate::default()
        }
    }

    /// Starts a new window once the running one is `window_ms` old; a
    /// window that ended more than a window ago counts as empty.
    fn roll(&mut self, now_ms: u64, window_ms: u64) {
        let age = now_ms.saturating_sub(self.start_ms);
        if age < window_ms {
            return;
        }
        self.prev_count = if age < 2 * window_ms { self.count } else { 0 };
        self.prev_len_ms = window_ms;
        self.count = 0;
        self.start_ms = now_ms;
    }

    /// A request was admitted at `now_ms`.
    pub fn admitted(&mut self, now_ms: u64, window_ms: u64) {
        self.roll(now_ms, window_ms);
        self.count = self.count.saturating_add(1);
    }

    /// The wait (ms) of an arrival that `needs` admissions here, its own
    /// included, before it is admitted: that many at the rate of the last
    /// one to two windows. `None` while there is no full window to go by
    /// yet, or no admission in it (the arrival then waits, as without
    /// `shed_early`: nothing admitted lately says nothing of how long a
    /// wait would be, as with an upstream slower than two windows).
    pub fn expected_wait_ms(&mut self, now_ms: u64, window_ms: u64, needs: u64) -> Option<u64> {
        self.roll(now_ms, window_ms);
        if self.prev_len_ms == 0 {
            return None;
        }
        let span = self
            .prev_len_ms
            .saturating_add(now_ms.saturating_sub(self.start_ms));
        let n = self.prev_count.saturating_add(self.count);
        if n == 0 {
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
        r.admitted(1_010, 100);
        assert_eq!(r.expected_wait_ms(1_050, 100, 6), None);
    }

    #[test]
    fn the_wait_is_the_place_in_line_over_the_rate() {
        let mut r = Rate::new(0);
        // 10 admissions per 100 ms: one every 10 ms.
        for i in 0..10 {
            r.admitted(i * 10, 100);
        }
        // At 100 the window rolls: 10 in the last 100 ms.
        assert_eq!(r.expected_wait_ms(100, 100, 1), Some(10));
        assert_eq!(r.expected_wait_ms(100, 100, 5), Some(50));
        // Halfway through the next window, 5 more: 15 in 150 ms.
        for i in 0..5 {
            r.admitted(100 + i * 10, 100);
        }
        assert_eq!(r.expected_wait_ms(150, 100, 3), Some(30));
    }

    #[test]
    fn no_admission_lately_is_no_estimate() {
        let mut r = Rate::new(0);
        r.admitted(5, 100);
        // Two windows later with nothing admitted since: nothing to go by
        // (an upstream slower than two windows, or a worker that got no
        // traffic), not an endless wait.
        assert_eq!(r.expected_wait_ms(250, 100, 1), None);
        // The rate comes back with admissions.
        for t in 250..260 {
            r.admitted(t, 100);
        }
        assert!(r.expected_wait_ms(360, 100, 1).is_some_and(|w| w <= 20));
    }

    #[test]
    fn a_slower_upstream_means_longer_waits() {
        let mut fast = Rate::new(0);
        let mut slow = Rate::new(0);
        for i in 0..40 {
            fast.admitted(i * 5, 100);
            slow.admitted(i * 20, 100);
        }
        let f = fast.expected_wait_ms(200, 100, 4);
        let s = slow.expected_wait_ms(800, 100, 4);
        assert!(f < s, "{f:?} vs {s:?}");
    }
}
