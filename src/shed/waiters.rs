//! Where a shedder's waiters wait: in the pipeline's wait list, one line
//! per shedder and class (see `line`), in order of their turns with
//! shares and of their arrival without. The shedders read and change
//! their lines through [`Waiters`]: the pipeline's (through `Cx`) in the
//! stage, a `WaitList` of their own in unit tests. The lines have no time
//! limit: the shedders expire their waiters themselves (their limits
//! change with CoDel, and a deadline passes in the same round as a limit).

use super::config::Class;
use super::local::Queued;
use super::ShedderId;
use crate::pipeline::stage::{Cx, StreamId};
use crate::pipeline::wait::{LineId, Wait};
use crate::time::Instant;

/// A shedder's lines on this worker, as its logic reads and changes them.
pub trait Waiters {
    /// Whether nobody waits on this worker, in any line.
    fn nobody(&self) -> bool;
    /// The waiters of `line`, in order (the first is served first).
    fn each(&self, line: LineId) -> impl Iterator<Item = (u32, Wait)> + '_;
    /// The last waiter of `line`.
    fn last(&self, line: LineId) -> Option<(u32, Wait)>;
    /// How many wait in `line`.
    fn count(&self, line: LineId) -> usize;
    /// Where stream `id` waits, if it does.
    fn waiter(&self, id: u32) -> Option<Wait>;
    /// Stream `id` waits in `line` from `since_ms` (the time of the call),
    /// placed by `key`, until its caller's deadline if it sent one.
    fn join(&mut self, id: u32, line: LineId, key: u64, times: (u64, Option<u64>));
    /// Takes stream `id` out, if it waits.
    fn leave(&mut self, id: u32) -> Option<Wait>;
    /// When the caller of waiter `id` gives up (ms), if it sent a deadline.
    fn deadline_ms(&self, id: u32, w: &Wait) -> Option<u64>;
}

/// The pipeline's lines of the shed stage. The deadline is the stream's
/// (`Cx::wait_until_ms`), the one it arrived with.
impl Waiters for Cx<'_, '_> {
    fn nobody(&self) -> bool {
        self.nobody_waits()
    }

    fn each(&self, line: LineId) -> impl Iterator<Item = (u32, Wait)> + '_ {
        self.each_in(line).map(|(s, w)| (s.0, w))
    }

    fn last(&self, line: LineId) -> Option<(u32, Wait)> {
        self.last_in(line).map(|(s, w)| (s.0, w))
    }

    fn count(&self, line: LineId) -> usize {
        self.count_in(line)
    }

    fn waiter(&self, id: u32) -> Option<Wait> {
        Cx::waiter(self, StreamId(id))
    }

    /// It waits from the call's time (`Cx::now`), as `Cx::wait` takes it.
    fn join(&mut self, id: u32, line: LineId, key: u64, _times: (u64, Option<u64>)) {
        self.wait(StreamId(id), line, key, None);
    }

    fn leave(&mut self, id: u32) -> Option<Wait> {
        Cx::leave(self, StreamId(id))
    }

    fn deadline_ms(&self, id: u32, _w: &Wait) -> Option<u64> {
        self.wait_until(StreamId(id)).map(Instant::as_ms)
    }
}

/// A list of the shedders' own (unit tests): a waiter's deadline is kept
/// as its time limit, which nothing there acts on.
#[cfg(test)]
impl Waiters for crate::pipeline::wait::WaitList {
    fn nobody(&self) -> bool {
        self.is_empty()
    }

    fn each(&self, line: LineId) -> impl Iterator<Item = (u32, Wait)> + '_ {
        self.each_in(line)
    }

    fn last(&self, line: LineId) -> Option<(u32, Wait)> {
        self.last_in(line)
    }

    fn count(&self, line: LineId) -> usize {
        self.count_in(line)
    }

    fn waiter(&self, id: u32) -> Option<Wait> {
        crate::pipeline::wait::WaitList::waiter(self, id)
    }

    fn join(&mut self, id: u32, line: LineId, key: u64, (since_ms, until_ms): (u64, Option<u64>)) {
        let waiter = Wait {
            line,
            key,
            since: Instant::from_ms(since_ms),
            until: until_ms.map(Instant::from_ms),
        };
        crate::pipeline::wait::WaitList::join(self, id, waiter);
    }

    fn leave(&mut self, id: u32) -> Option<Wait> {
        crate::pipeline::wait::WaitList::leave(self, id)
    }

    fn deadline_ms(&self, _id: u32, w: &Wait) -> Option<u64> {
        w.until.map(Instant::as_ms)
    }
}

/// The classes, in the order of `Class as usize`.
pub(super) const CLASSES: [Class; 3] = [Class::Sheddable, Class::Default, Class::Critical];

/// The line of shedder `s`'s waiters of class `class` (`Class as usize`).
pub(super) fn line(s: ShedderId, class: usize) -> LineId {
    u64::from(s.0) * 3 + class as u64
}

/// The shedder of a line's waiters.
pub(super) fn shedder_of(line: LineId) -> ShedderId {
    ShedderId(u32::try_from(line / 3).unwrap_or(u32::MAX))
}

/// The class of a line's waiters.
pub(super) fn class_of(line: LineId) -> Class {
    CLASSES
        .get((line % 3) as usize)
        .copied()
        .unwrap_or(Class::Default)
}

/// A waiter's key in its line: with shares its turn; without, 0 (first in,
/// first out).
pub(super) fn key(shares: bool, turn_ms: u64) -> u64 {
    if shares {
        turn_ms
    } else {
        0
    }
}

/// A waiter's turn: its key with shares, its arrival without.
pub(super) fn turn(shares: bool, w: &Wait) -> u64 {
    if shares {
        w.key
    } else {
        w.since.as_ms()
    }
}

/// How many wait at shedder `s` on this worker.
pub(super) fn waiting(w: &impl Waiters, s: ShedderId) -> usize {
    if w.nobody() {
        return 0;
    }
    (0..3).map(|c| w.count(line(s, c))).sum()
}

/// Waiter `id`, as the shedders answer of it.
pub(super) fn queued(w: &impl Waiters, shares: bool, (id, wait): (u32, Wait)) -> Queued {
    Queued {
        id,
        class: class_of(wait.line),
        since_ms: wait.since.as_ms(),
        turn_ms: turn(shares, &wait),
        deadline_ms: w.deadline_ms(id, &wait),
    }
}
