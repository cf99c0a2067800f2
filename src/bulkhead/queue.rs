//! The requests waiting for a place on one worker, for limits with a
//! `max_wait`: one first-in first-out line per place (a limit's table
//! slot, which the keys sharing it share), so that the waiters of a key are
//! served in the order they came. Memory: at most `queue` waiters per
//! place, each removed exactly once (admitted, timed out, or gone).

use crate::hash::FastMap;
use crate::pipeline::stage::StreamId;
use std::collections::VecDeque;

/// A limit's index and a slot of its table.
pub type Place = (usize, u32);

/// A request waiting for a place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    /// The places of the limits the request matches, in order, from the
    /// first it waited for (`None`: its key is missing and the limit
    /// skips it); it waits for `places[at]`.
    pub places: Vec<(usize, Option<u32>)>,
    pub at: usize,
    /// When it arrived (ms).
    pub since_ms: u64,
    /// When it must have its places by: its arrival plus `max_wait`, or
    /// its deadline if that comes first (`by_deadline`).
    pub until_ms: u64,
    pub by_deadline: bool,
}

impl Waiter {
    /// The place it waits for.
    pub fn place(&self) -> Option<Place> {
        match self.places.get(self.at) {
            Some(&(b, Some(slot))) => Some((b, slot)),
            _ => None,
        }
    }
}

/// This worker's waiters.
#[derive(Default)]
pub struct Queues {
    lines: FastMap<Place, VecDeque<StreamId>>,
    waiters: FastMap<StreamId, Waiter>,
}

impl Queues {
    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Whether stream `id` waits here.
    pub fn contains(&self, id: StreamId) -> bool {
        self.waiters.contains_key(&id)
    }

    /// Requests waiting at `place`.
    pub fn waiting_at(&self, place: Place) -> usize {
        self.lines.get(&place).map_or(0, VecDeque::len)
    }

    /// Puts stream `id` at the end of its place's line.
    pub fn push(&mut self, id: StreamId, w: Waiter) {
        let Some(place) = w.place() else {
            return;
        };
        self.lines.entry(place).or_default().push_back(id);
        self.waiters.insert(id, w);
    }

    /// Takes stream `id` out of the queues (its client went away), if it
    /// waited.
    pub fn cancel(&mut self, id: StreamId) -> Option<Waiter> {
        let w = self.waiters.remove(&id)?;
        if let Some(place) = w.place() {
            if let Some(line) = self.lines.get_mut(&place) {
                line.retain(|&x| x != id);
                if line.is_empty() {
                    self.lines.remove(&place);
                }
            }
        }
        Some(w)
    }

    /// Takes out the first waiter at `place`.
    pub fn pop(&mut self, place: Place) -> Option<(StreamId, Waiter)> {
        let line = self.lines.get_mut(&place)?;
        let id = line.pop_front();
        if line.is_empty() {
            self.lines.remove(&place);
        }
        let id = id?;
        let w = self.waiters.remove(&id)?;
        Some((id, w))
    }

    /// Takes out every waiter whose time is up at `now_ms`, in the order
    /// of their lines.
    pub fn expired(&mut self, now_ms: u64) -> Vec<(StreamId, Waiter)> {
        let mut out = Vec::new();
        let waiters = &mut self.waiters;
        self.lines.retain(|_, line| {
            line.retain(|id| {
                let due = waiters.get(id).is_none_or(|w| now_ms >= w.until_ms);
                if due {
                    if let Some(w) = waiters.remove(id) {
                        out.push((*id, w));
                    }
                }
                !due
            });
            !line.is_empty()
        });
        out
    }

    /// The places someone waits at.
    pub fn places(&self) -> Vec<Place> {
        let mut p: Vec<Place> = self.lines.keys().copied().collect();
        // One per key with waiters: can be thousands (not a short list).
        p.sort_unstable();
        p
    }
}
