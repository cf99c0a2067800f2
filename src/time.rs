//! Time as it crosses from one module to another: an [`Instant`] on the
//! host's clock and a [`Duration`], each one `u64` of nanoseconds in a
//! newtype (as `governor`'s `Nanos`), so a time is never mistaken for a
//! count or for a time in another unit, at no cost: plain integer
//! arithmetic on one `u64`, nothing 128-bit (cheap on wasm32).
//!
//! Conversions to milliseconds round down; from milliseconds, and every
//! sum, saturate at `u64::MAX` nanoseconds (the year 2554) rather than
//! wrap; a difference saturates at zero. Inside a mechanism, times may stay
//! integers named by their unit (`now_ms`), converted where they cross an
//! interface (`cx.now().as_ms()`).

use crate::duration::{NS_PER_MS, NS_PER_S};

/// A moment: nanoseconds since the Unix epoch, as the host's clock reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

/// A length of time, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(u64);

impl Instant {
    /// The clock's zero, the Unix epoch.
    pub const EPOCH: Instant = Instant(0);

    pub const fn from_ns(ns: u64) -> Self {
        Instant(ns)
    }

    /// `ms` milliseconds after the epoch (saturating).
    pub const fn from_ms(ms: u64) -> Self {
        Instant(ms.saturating_mul(NS_PER_MS))
    }

    pub const fn as_ns(self) -> u64 {
        self.0
    }

    /// Whole milliseconds since the epoch, rounded down.
    pub const fn as_ms(self) -> u64 {
        self.0 / NS_PER_MS
    }

    /// `d` later, at most the last representable instant.
    pub const fn saturating_add(self, d: Duration) -> Self {
        Instant(self.0.saturating_add(d.0))
    }

    /// `d` earlier, at least the epoch.
    pub const fn saturating_sub(self, d: Duration) -> Self {
        Instant(self.0.saturating_sub(d.0))
    }

    /// `d` later, if representable.
    pub const fn checked_add(self, d: Duration) -> Option<Self> {
        match self.0.checked_add(d.0) {
            Some(ns) => Some(Instant(ns)),
            None => None,
        }
    }

    /// The time from `earlier` to this instant; zero if `earlier` is later
    /// (another worker's clock, read a little ahead).
    pub const fn since(self, earlier: Instant) -> Duration {
        Duration(self.0.saturating_sub(earlier.0))
    }
}

impl Duration {
    pub const ZERO: Duration = Duration(0);
    /// The longest representable (about 584 years): "without end".
    pub const MAX: Duration = Duration(u64::MAX);

    pub const fn from_ns(ns: u64) -> Self {
        Duration(ns)
    }

    /// `ms` milliseconds (saturating).
    pub const fn from_ms(ms: u64) -> Self {
        Duration(ms.saturating_mul(NS_PER_MS))
    }

    /// `s` seconds (saturating).
    pub const fn from_secs(s: u64) -> Self {
        Duration(s.saturating_mul(NS_PER_S))
    }

    pub const fn as_ns(self) -> u64 {
        self.0
    }

    /// Whole milliseconds, rounded down.
    pub const fn as_ms(self) -> u64 {
        self.0 / NS_PER_MS
    }

    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    pub const fn saturating_add(self, d: Duration) -> Self {
        Duration(self.0.saturating_add(d.0))
    }

    /// Zero if `d` is longer.
    pub const fn saturating_sub(self, d: Duration) -> Self {
        Duration(self.0.saturating_sub(d.0))
    }

    pub const fn checked_sub(self, d: Duration) -> Option<Self> {
        match self.0.checked_sub(d.0) {
            Some(ns) => Some(Duration(ns)),
            None => None,
        }
    }
}

/// For the host's API (tick periods, call timeouts).
impl From<Duration> for std::time::Duration {
    fn from(d: Duration) -> Self {
        std::time::Duration::from_nanos(d.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn conversions_to_milliseconds_round_down_and_from_them_are_exact() {
        let t = Instant::from_ns(1_700_000_000_123_999_999);
        assert_eq!(t.as_ms(), 1_700_000_000_123);
        assert_eq!(t.as_ns(), 1_700_000_000_123_999_999);
        assert_eq!(
            Instant::from_ms(t.as_ms()).as_ns(),
            1_700_000_000_123_000_000
        );
        assert_eq!(Duration::from_ns(1_999_999).as_ms(), 1);
        assert_eq!(Duration::from_ms(250).as_ns(), 250_000_000);
        assert_eq!(Duration::from_secs(2), Duration::from_ms(2_000));
        assert_eq!(Duration::from_ns(999_999).as_ms(), 0);
        assert_eq!(
            std::time::Duration::from(Duration::from_ms(1_500)),
            std::time::Duration::from_millis(1_500)
        );
    }

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        let max = Instant::from_ns(u64::MAX);
        assert_eq!(Instant::from_ms(u64::MAX), max);
        assert_eq!(Duration::from_ms(u64::MAX), Duration::MAX);
        assert_eq!(Duration::from_secs(u64::MAX), Duration::MAX);
        assert_eq!(max.saturating_add(Duration::from_ns(1)), max);
        assert_eq!(max.checked_add(Duration::from_ns(1)), None);
        let t = Instant::from_ms(10);
        assert_eq!(
            t.checked_add(Duration::from_ms(5)),
            Some(Instant::from_ms(15))
        );
        assert_eq!(t.saturating_sub(Duration::from_ms(11)), Instant::EPOCH);
        assert_eq!(t.since(Instant::from_ms(4)), Duration::from_ms(6));
        assert_eq!(
            t.since(Instant::from_ms(11)),
            Duration::ZERO,
            "a clock behind"
        );
        assert_eq!(
            Duration::MAX.saturating_add(Duration::from_ns(1)),
            Duration::MAX
        );
        let d = Duration::from_ms(3);
        assert_eq!(d.saturating_sub(Duration::from_ms(4)), Duration::ZERO);
        assert_eq!(d.checked_sub(Duration::from_ms(4)), None);
        assert_eq!(
            d.checked_sub(Duration::from_ms(1)),
            Some(Duration::from_ms(2))
        );
        assert!(Duration::ZERO.is_zero() && !d.is_zero());
    }

    #[test]
    fn whole_millisecond_instants_order_as_their_milliseconds() {
        // A time limit kept in whole milliseconds is up at `now` exactly
        // when it is in milliseconds (`until_ms <= now_ms`).
        for now_ns in [0, 999_999, 1_000_000, 1_700_000_000_000_500_000] {
            let now = Instant::from_ns(now_ns);
            for until_ms in [0, 1, now.as_ms(), now.as_ms() + 1] {
                assert_eq!(Instant::from_ms(until_ms) <= now, until_ms <= now.as_ms());
            }
        }
    }
}
