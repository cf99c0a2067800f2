//! Shaping by delay: the requests this worker holds until their reserved
//! turn (see `Limiter::evaluate_shaped`). A turn is reserved in shared
//! data by the same CAS that charges a token bucket, so two requests, on
//! any workers, never get the same turn; this list only remembers, per
//! worker, when each held request may go.

use super::Reservation;
use crate::hash::FastMap;
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

/// The requests one worker holds (in order of their turns in the
/// pipeline's wait list), and how many per rule.
#[derive(Debug, Default)]
pub struct HeldList {
    held: FastMap<StreamId, Held>,
    per_rule: Vec<u32>,
}

impl HeldList {
    pub fn new(rules: usize) -> Self {
        HeldList {
            held: FastMap::default(),
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
        self.held.insert(h.stream, h);
    }

    /// Whether `stream` is held here.
    pub fn contains(&self, stream: StreamId) -> bool {
        self.held.contains_key(&stream)
    }

    /// Takes out a held stream (its turn came, or it ended before), if held.
    pub fn take(&mut self, stream: StreamId) -> Option<Held> {
        let h = self.held.remove(&stream)?;
        for &r in &h.rules {
            if let Some(n) = self.per_rule.get_mut(r) {
                *n = n.saturating_sub(1);
            }
        }
        Some(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn held(stream: u32, due_ns: u64, rules: Vec<usize>) -> Held {
        Held {
            stream: StreamId(stream),
            since_ns: 0,
            due_ns,
            rules,
            reservations: Vec::new(),
        }
    }

    #[test]
    fn counts_per_rule_and_releases_each_once() {
        // (The order of turns is the pipeline's wait list's, by due time.)
        let mut l = HeldList::new(2);
        l.hold(held(1, 30, vec![0]));
        l.hold(held(2, 10, vec![0, 1]));
        l.hold(held(3, 20, vec![1]));
        assert_eq!((l.count(0), l.count(1)), (2, 2));
        let due: Vec<_> = [2, 3]
            .iter()
            .filter_map(|&s| l.take(StreamId(s)))
            .map(|h| h.stream.0)
            .collect();
        assert_eq!(due, vec![2, 3]);
        assert_eq!((l.count(0), l.count(1)), (1, 0));
        assert!(l.take(StreamId(2)).is_none(), "released once");
        assert_eq!(l.take(StreamId(1)).map(|h| h.stream.0), Some(1));
        assert!(l.is_empty());
        assert_eq!(l.count(0), 0);
    }
}
