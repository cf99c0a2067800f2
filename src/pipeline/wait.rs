//! Waiting: the one list of the streams paused on this worker, whichever
//! stage paused them. A stage says what a stream waits in (a line of its
//! own: a limit's place, a rule, a due time) and until when; the pipeline
//! keeps the lines in order, takes a stream out exactly once (its stage
//! let it go, its time ran out, or it ended, however it ended), tells the
//! stage when its time ran out, and keeps the fast tick while anyone
//! waits. What a waiter waits *for* (a free place, its turn, tokens) stays
//! the stage's.
//!
//! Memory: one entry per paused stream, each removed at the latest when
//! its stream ends.

use crate::hash::FastMap;
use crate::time::Instant;
use std::collections::{BTreeMap, BTreeSet};

/// A stage's number for one of its lines.
pub type LineId = u64;

/// Where and how a stream waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// The stage's line it waits in.
    pub line: LineId,
    /// Its place: a line is kept in order of this key, and in order of
    /// arrival among equal keys (a stage that gives the arrival time gets
    /// first in, first out; a turn or a due time orders by that).
    pub key: u64,
    /// When it started waiting here.
    pub since: Instant,
    /// When the pipeline takes it out and tells its stage
    /// (`Stage::timed_out`), if ever.
    pub until: Option<Instant>,
}

#[derive(Debug)]
struct Spot {
    stage: usize,
    waiter: Wait,
    /// Its place among equal keys: the order it joined in.
    seq: u64,
}

/// A line: its streams by (key, order of joining).
type Line = BTreeMap<(u64, u64), u32>;

/// The waiters of one pipeline (one worker), by stage and line. Joining,
/// leaving and a time running out each cost a logarithm of the waiters,
/// whatever the line's length; a tick with nobody's time up costs one
/// look at the earliest time limit.
#[derive(Debug, Default)]
pub struct WaitList {
    /// Each line's streams, in order of their keys.
    lines: FastMap<(usize, LineId), Line>,
    of: FastMap<u32, Spot>,
    /// The waiters with a time limit, earliest first.
    limits: BTreeSet<(Instant, u32)>,
    /// Joins so far (each waiter's `seq`).
    joined: u64,
}

impl WaitList {
    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.of.is_empty()
    }

    /// Streams waiting.
    pub fn len(&self) -> usize {
        self.of.len()
    }

    /// Puts `stream` in stage `stage`'s line, after every waiter whose key
    /// is not greater. A stream already waiting stays where it is (false).
    pub(super) fn push(&mut self, stage: usize, stream: u32, waiter: Wait) -> bool {
        if self.of.contains_key(&stream) {
            return false;
        }
        let seq = self.joined;
        self.joined = self.joined.wrapping_add(1);
        let line = self.lines.entry((stage, waiter.line)).or_default();
        line.insert((waiter.key, seq), stream);
        if let Some(until) = waiter.until {
            self.limits.insert((until, stream));
        }
        self.of.insert(stream, Spot { stage, waiter, seq });
        true
    }

    /// Where `stream` waits, if it does: its stage and how.
    pub(super) fn get(&self, stream: u32) -> Option<(usize, Wait)> {
        self.of.get(&stream).map(|e| (e.stage, e.waiter))
    }

    /// Takes `stream` out, if it waits.
    pub(super) fn remove(&mut self, stream: u32) -> Option<(usize, Wait)> {
        let e = self.of.remove(&stream)?;
        self.unlist(stream, &e);
        Some((e.stage, e.waiter))
    }

    /// Takes a stream that left `of` out of its line and its time limit.
    fn unlist(&mut self, stream: u32, e: &Spot) {
        let key = (e.stage, e.waiter.line);
        if let Some(line) = self.lines.get_mut(&key) {
            line.remove(&(e.waiter.key, e.seq));
            if line.is_empty() {
                self.lines.remove(&key);
            }
        }
        if let Some(until) = e.waiter.until {
            self.limits.remove(&(until, stream));
        }
    }

    /// The streams of a line, in order.
    pub(super) fn line(
        &self,
        stage: usize,
        line: LineId,
    ) -> impl Iterator<Item = (u32, Wait)> + '_ {
        self.lines
            .get(&(stage, line))
            .into_iter()
            .flat_map(|l| l.values())
            .filter_map(|s| Some((*s, self.of.get(s)?.waiter)))
    }

    /// The last stream of a line (the greatest key, the newest among equal ones).
    pub(super) fn last(&self, stage: usize, line: LineId) -> Option<(u32, Wait)> {
        let (_, s) = self.lines.get(&(stage, line))?.last_key_value()?;
        Some((*s, self.of.get(s)?.waiter))
    }

    /// How many wait in a line.
    pub(super) fn count(&self, stage: usize, line: LineId) -> usize {
        self.lines.get(&(stage, line)).map_or(0, Line::len)
    }

    /// The lines of a stage where someone waits, in order of their ids.
    pub(super) fn lines_of(&self, stage: usize) -> Vec<LineId> {
        let mut out: Vec<LineId> = self
            .lines
            .keys()
            .filter(|(s, _)| *s == stage)
            .map(|(_, l)| *l)
            .collect();
        out.sort_unstable();
        out
    }

    /// Takes out every waiter whose time is up at `now`: (stage, stream,
    /// waiter), in order of their time (then of their stream ids).
    pub(super) fn expired(&mut self, now: Instant) -> Vec<(usize, u32, Wait)> {
        let mut out = Vec::new();
        while let Some(&(until, s)) = self.limits.first() {
            if until > now {
                break;
            }
            self.limits.pop_first();
            if let Some(e) = self.of.remove(&s) {
                self.unlist(s, &e);
                out.push((e.stage, s, e.waiter));
            }
        }
        out
    }
}

/// A list of one stage's own, outside a pipeline (that stage's unit
/// tests): the stage's lines, read and changed as through `Cx`.
#[cfg(test)]
impl WaitList {
    pub(crate) fn join(&mut self, stream: u32, waiter: Wait) -> bool {
        self.push(0, stream, waiter)
    }

    pub(crate) fn leave(&mut self, stream: u32) -> Option<Wait> {
        self.remove(stream).map(|(_, w)| w)
    }

    pub(crate) fn waiter(&self, stream: u32) -> Option<Wait> {
        self.get(stream).map(|(_, w)| w)
    }

    pub(crate) fn each_in(&self, line: LineId) -> impl Iterator<Item = (u32, Wait)> + '_ {
        self.line(0, line)
    }

    pub(crate) fn last_in(&self, line: LineId) -> Option<(u32, Wait)> {
        self.last(0, line)
    }

    pub(crate) fn count_in(&self, line: LineId) -> usize {
        self.count(0, line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn w(line: LineId, key: u64, until_ms: Option<u64>) -> Wait {
        Wait {
            line,
            key,
            since: Instant::EPOCH,
            until: until_ms.map(Instant::from_ms),
        }
    }

    #[test]
    fn lines_keep_key_order_then_arrival_order_and_each_stream_leaves_once() {
        let mut l = WaitList::default();
        assert!(l.push(0, 1, w(7, 10, None)));
        assert!(l.push(0, 2, w(7, 5, None)));
        assert!(l.push(0, 3, w(7, 10, None)));
        assert!(l.push(1, 4, w(7, 0, None)));
        assert!(!l.push(0, 1, w(8, 0, None)), "one place per stream");
        let order: Vec<u32> = l.line(0, 7).map(|(s, _)| s).collect();
        assert_eq!(order, [2, 1, 3]);
        assert_eq!(
            l.last(0, 7).map(|(s, _)| s),
            Some(3),
            "the newest of the greatest key"
        );
        assert_eq!(l.last(0, 8), None);
        assert_eq!((l.count(0, 7), l.count(1, 7), l.len()), (3, 1, 4));
        assert_eq!(l.remove(1).map(|(st, x)| (st, x.key)), Some((0, 10)));
        assert_eq!(l.remove(1), None);
        assert_eq!(l.lines_of(0), [7]);
        l.remove(2);
        l.remove(3);
        assert!(l.lines_of(0).is_empty(), "an empty line is forgotten");
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn a_waiter_leaves_from_the_middle_of_a_long_line_once_and_its_time_limit_with_it() {
        let mut l = WaitList::default();
        for s in 0..1_000u32 {
            assert!(l.push(0, s, w(1, u64::from(s % 10), Some(5))));
        }
        for s in (0..1_000u32).filter(|s| s % 3 == 0) {
            assert!(l.remove(s).is_some());
            assert!(l.remove(s).is_none());
        }
        let order: Vec<u32> = l.line(0, 1).map(|(s, _)| s).collect();
        let mut want: Vec<u32> = (0..1_000u32).filter(|s| s % 3 != 0).collect();
        want.sort_by_key(|s| (s % 10, *s));
        assert_eq!(order, want, "by key, then in order of joining");
        assert_eq!(l.last(0, 1).map(|(s, _)| s), want.last().copied());
        assert!(l.expired(Instant::from_ms(4)).is_empty());
        let out = l.expired(Instant::from_ms(5));
        assert_eq!(out.len(), want.len(), "the removed ones are not timed out");
        assert!(l.is_empty() && l.lines_of(0).is_empty());
        assert!(l.limits.is_empty());
    }

    #[test]
    fn waiters_whose_time_is_up_are_taken_out_in_order_of_their_time() {
        let mut l = WaitList::default();
        l.push(0, 1, w(1, 0, Some(30)));
        l.push(0, 2, w(1, 1, Some(10)));
        l.push(1, 3, w(2, 0, None));
        l.push(1, 4, w(2, 1, Some(31)));
        let out: Vec<u32> = l
            .expired(Instant::from_ms(30))
            .into_iter()
            .map(|(_, s, _)| s)
            .collect();
        assert_eq!(out, [2, 1]);
        assert!(l.expired(Instant::from_ms(30)).is_empty());
        assert_eq!(l.len(), 2);
        assert_eq!(l.get(4).map(|(st, _)| st), Some(1));
    }
}
