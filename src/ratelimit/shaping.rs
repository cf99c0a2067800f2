//! Shaping by delay: the requests this worker holds until their reserved
//! turn (see `Limiter::evaluate_shaped`). A turn is reserved in shared
//! data by the same CAS that charges a token bucket, so two requests, on
//! any workers, never get the same turn; this list only remembers, per
//! worker, when each held request may go.

use super::Reservation;
use crate::pipeline::stage::StreamId;

/// One held request.
#[derive(Debug)]
pub struct Held {
    pub stream: StreamId,
    /// When it arrived and when its turn comes (ns since the epoch).
    pub since_ns: u64,
    pub due_ns: u64,
    /// The shaping rules holding it (their `max_delayed` counts it).
    pub rules: Vec<usize>,
    /// Its charges, given back if it leaves before its turn.
    pub reservations: Vec<Reservation>,
}

/// The requests one worker holds, and how many per rule.
#[derive(Debug, Default)]
pub struct HeldList {
    held: Vec<Held>,
    per_rule: Vec<u32>,
}

impl HeldList {
    pub fn new(rules: usize) -> Self {
        HeldList {
            held: Vec::new(),
            per_rule: vec![0; rules],
        }
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// How many requests rule `rule` holds on this worker.
    pub fn count(&self, rule: usize) -> u32 {
        self.per_rule.get(rule).copied().unwrap_or(0)
    }

    pub fn hold(&mut self, h: Held) {
        for &r in &h.rules {
            if let Some(n) = self.per_rule.get_mut(r) {
                *n += 1;
            }
        }
        self.held.push(h);
    }

    fn forget(&mut self, i: usize) -> Held {
        let h = self.held.swap_remove(i);
        for &r in &h.rules {
            if let Some(n) = self.per_rule.get_mut(r) {
                *n = n.saturating_sub(1);
            }
        }
        h
    }

    /// Whether `stream` is held here.
    pub fn contains(&self, stream: StreamId) -> bool {
        self.held.iter().any(|h| h.stream == stream)
    }

    /// Takes out a held stream (it ended before its turn), if held.
    pub fn take(&mut self, stream: StreamId) -> Option<Held> {
        let i = self.held.iter().position(|h| h.stream == stream)?;
        Some(self.forget(i))
    }

    /// Takes out every request whose turn has come, earliest first.
    pub fn due(&mut self, now_ns: u64) -> Vec<Held> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.held.len() {
            if self.held.get(i).is_some_and(|h| h.due_ns <= now_ns) {
                out.push(self.forget(i));
            } else {
                i += 1;
            }
        }
        out.sort_by_key(|h| h.due_ns);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn held(stream: StreamId, due_ns: u64, rules: Vec<usize>) -> Held {
        Held {
            stream,
            since_ns: 0,
            due_ns,
            rules,
            reservations: Vec::new(),
        }
    }

    #[test]
    fn releases_in_turn_order_and_counts_per_rule() {
        let mut l = HeldList::new(2);
        l.hold(held(1, 30, vec![0]));
        l.hold(held(2, 10, vec![0, 1]));
        l.hold(held(3, 20, vec![1]));
        assert_eq!((l.count(0), l.count(1)), (2, 2));
        let due: Vec<_> = l.due(25).iter().map(|h| h.stream).collect();
        assert_eq!(due, vec![2, 3]);
        assert_eq!((l.count(0), l.count(1)), (1, 0));
        assert!(l.take(2).is_none(), "released once");
        assert_eq!(l.take(1).map(|h| h.stream), Some(1));
        assert!(l.is_empty());
        assert_eq!(l.count(0), 0);
    }
}
