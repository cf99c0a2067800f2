//! The requests waiting for a place on one worker, for limits with a
//! `max_wait`: one first-in first-out line per place (a limit's table
//! slot, which the keys sharing it share) in the pipeline's wait list, so
//! that the waiters of a key are served in the order they came. Memory: at
//! most `queue` waiters per place, each removed exactly once (admitted,
//! timed out, or gone).

use crate::hash::FastMap;
use crate::pipeline::stage::{Cx, StreamId};
use crate::pipeline::wait::LineId;
use crate::time::Instant;

/// A limit's index and a slot of its table.
pub type Place = (usize, u32);

/// A request waiting for a place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
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

impl Pending {
    /// The place it waits for.
    pub fn place(&self) -> Option<Place> {
        match self.places.get(self.at) {
            Some(&(b, Some(slot))) => Some((b, slot)),
            _ => None,
        }
    }
}

/// The line of a place in the pipeline's wait list.
fn line_of((b, slot): Place) -> LineId {
    ((b as u64) << 32) | u64::from(slot)
}

/// The place of a line.
fn place_of(line: LineId) -> Place {
    ((line >> 32) as usize, line as u32)
}

/// This worker's waiters: in the pipeline's wait list, one line per
/// place, first come first served (`Cx::wait`); here, what each waits for.
#[derive(Default)]
pub struct Queues {
    waiters: FastMap<StreamId, Pending>,
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
    pub fn waiting_at(&self, cx: &Cx<'_, '_>, place: Place) -> usize {
        cx.count_in(line_of(place))
    }

    /// Puts stream `id` at the end of its place's line, until its time
    /// is up (`until_ms`: the pipeline then calls `Stage::timed_out`).
    pub fn push(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, w: Pending) {
        let Some(place) = w.place() else {
            return;
        };
        cx.wait(id, line_of(place), 0, Some(Instant::from_ms(w.until_ms)));
        self.waiters.insert(id, w);
    }

    /// Takes stream `id` out of the queues (its client went away, or its
    /// time is up and the pipeline took it out of line), if it waited.
    pub fn cancel(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) -> Option<Pending> {
        cx.leave(id);
        self.waiters.remove(&id)
    }

    /// Takes out the first waiter at `place`.
    pub fn pop(&mut self, cx: &mut Cx<'_, '_>, place: Place) -> Option<(StreamId, Pending)> {
        let (id, _) = cx.first_in(line_of(place))?;
        cx.leave(id);
        let w = self.waiters.remove(&id)?;
        Some((id, w))
    }

    /// The places someone waits at, in order.
    pub fn places(&self, cx: &Cx<'_, '_>) -> Vec<Place> {
        cx.lines().into_iter().map(place_of).collect()
    }
}
