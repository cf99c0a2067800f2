//! Waiting for a place. A place freed on this worker goes straight to the
//! first waiter for it (handed over: the shared count does not move, so no
//! new arrival on another worker can slip in between); a place freed on
//! another worker is found by polling the shared slots of the places
//! someone waits for on each (fast, 1 ms) tick. A waiter whose `max_wait`
//! or deadline passes is answered then, and its places given back. Each
//! waiter leaves its line exactly once: granted, timed out, or gone.

use super::queue::{Pending, Place};
use super::stage::{BulkheadStage, Took};
use super::Admission;
use crate::pipeline::stage::{Cx, Effect, StreamId};

impl BulkheadStage {
    /// Gives back every slot the stream holds: each goes to the first
    /// waiter for it on this worker, if any, else back to the shared count.
    /// A waiter that then fails at a later limit gives its own back too.
    pub(super) fn release(&mut self, cx: &mut Cx<'_, '_>, first: StreamId) {
        let mut next = Some(first);
        let mut refused: Vec<StreamId> = Vec::new();
        while let Some(id) = next.take().or_else(|| refused.pop()) {
            let Some(slots) = self.held.remove(&id) else {
                continue;
            };
            for (b, slot) in slots {
                self.count(cx, b, |m| m.in_flight, -1);
                if !self.queues.is_empty() {
                    if let Some((w_id, w)) = self.first_waiter(cx, (b, slot), &mut refused) {
                        refused.extend(self.granted(cx, w_id, w, true));
                        continue;
                    }
                }
                let failed = self.bulkheads.release(cx.store(), b, slot);
                self.count_failures(cx, failed);
            }
        }
    }

    /// The first waiter at `place` whose time is not up; those whose time
    /// is up are answered on the way, and added to `out` (their places
    /// must be given back).
    fn first_waiter(
        &mut self,
        cx: &mut Cx<'_, '_>,
        place: Place,
        out: &mut Vec<StreamId>,
    ) -> Option<(StreamId, Pending)> {
        let now = cx.now().as_ms();
        while let Some((id, w)) = self.queues.pop(cx, place) {
            if now < w.until_ms {
                return Some((id, w));
            }
            self.time_out(cx, id, w);
            out.push(id);
        }
        None
    }

    /// Stream `id` got the place it waited for (`holds`: a counted one;
    /// not when the store failed and it goes without). It goes on to its
    /// other limits: resumed when it has them all, back in line at one
    /// that is full, or refused by one. Returns it if refused (its places
    /// must then be given back).
    pub(super) fn granted(
        &mut self,
        cx: &mut Cx<'_, '_>,
        id: StreamId,
        mut w: Pending,
        holds: bool,
    ) -> Option<StreamId> {
        if let Some((b, slot)) = w.place() {
            self.count(cx, b, |m| m.queued, -1);
            self.count(cx, b, |m| m.queued_admitted, 1);
            if holds {
                self.held.entry(id).or_default().push((b, slot));
                self.count(cx, b, |m| m.in_flight, 1);
            }
        }
        cx.tick_changed = true;
        while let Some(&(b, slot)) = w.places.get(w.at + 1) {
            w.at += 1;
            match self.take(cx, id, b, slot) {
                Took::Yes => {}
                Took::Wait => {
                    self.park(cx, id, w);
                    return None;
                }
                Took::No => {
                    if let Some(rejection) = self.rejection(cx, b) {
                        cx.effects.push(Effect::Reply {
                            stream: id,
                            rejection,
                        });
                    }
                    return Some(id);
                }
            }
        }
        cx.effects.push(Effect::Resume { stream: id });
        None
    }

    /// A waiter's time is up: it is answered (a missed deadline as such,
    /// else as over the limit); the caller gives back the places it took
    /// at earlier limits.
    pub(super) fn time_out(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, w: Pending) {
        let Some((b, _)) = w.place() else {
            return;
        };
        self.count(cx, b, |m| m.queued, -1);
        self.count(cx, b, |m| m.timed_out, 1);
        let rejection = if w.by_deadline {
            let name = self.bulkheads.rules.get(b).map_or("", |r| &r.spec.name);
            Some(cx.deadline_answer(id, &format!("bulkhead/{name}")))
        } else {
            self.rejection(cx, b)
        };
        if let Some(rejection) = rejection {
            cx.effects.push(Effect::Reply {
                stream: id,
                rejection,
            });
        }
        cx.tick_changed = true;
    }

    /// Takes a waiting stream out of line (its client went away).
    pub(super) fn cancel(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        if let Some((b, _)) = self.queues.cancel(cx, id).and_then(|w| w.place()) {
            self.count(cx, b, |m| m.queued, -1);
            cx.tick_changed = true;
        }
    }

    /// On each tick while anyone waits (those whose time is up were
    /// answered already, see `timed_out`): lets in, first come first
    /// served, as many at each place as the shared count has room for.
    pub(super) fn wake(&mut self, cx: &mut Cx<'_, '_>) {
        for (b, slot) in self.queues.places(cx) {
            while self.queues.waiting_at(cx, (b, slot)) > 0 {
                let (got, failed) = self.bulkheads.take(cx.store(), b, slot);
                self.count_failures(cx, failed);
                let holds = match got {
                    Admission::Full => break,
                    Admission::Holds { .. } => true,
                    Admission::Free => false,
                };
                let Some((id, w)) = self.queues.pop(cx, (b, slot)) else {
                    if holds {
                        let failed = self.bulkheads.release(cx.store(), b, slot);
                        self.count_failures(cx, failed);
                    }
                    break;
                };
                if let Some(r) = self.granted(cx, id, w, holds) {
                    self.release(cx, r);
                }
            }
        }
        cx.tick_changed = true;
    }
}
