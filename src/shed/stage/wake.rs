//! Wake-ups of queued streams: after a release and on ticks, each queue
//! resumes the streams a slot is left to (through the shedders after it,
//! then upstream) and sheds the others, or answers those whose deadline
//! passed (the workers whose waiters were left a slot are signalled as
//! each call's `Report` comes back: `ShedStage::report`).

use super::{Rest, ShedStage};
use crate::pipeline::stage::{Cx, Effect, Step, StreamId};
use crate::reply::Rejection;
use crate::shed::{ShedderId, Wake};
use crate::time::Instant;

impl ShedStage {
    /// Resumes or sheds queued streams (after a release, and on ticks).
    pub(super) fn wake(&mut self, cx: &mut Cx<'_, '_>) {
        if self.waking {
            self.wake_again = true;
            return;
        }
        self.waking = true;
        loop {
            self.wake_round(cx);
            if !std::mem::take(&mut self.wake_again) {
                break;
            }
        }
        self.waking = false;
    }

    pub(super) fn wake_round(&mut self, cx: &mut Cx<'_, '_>) {
        for s in self.shedders.ids() {
            let sh = &self.shedders;
            if sh.queued(cx, s) == 0 && !sh.overloaded(s) && !sh.has_retries() {
                continue;
            }
            let now = cx.now().as_ms();
            let store = cx.store();
            let (wakes, report) = self.shedders.wake(cx, store, now, s);
            self.report(cx, report);
            let m = self.metrics(s);
            for w in wakes {
                if let Some(m) = m {
                    cx.add(m.queued, -1);
                }
                match w {
                    Wake::Resume {
                        id,
                        waited_ms,
                        slot,
                    } => {
                        let id = StreamId(id);
                        if let Some(m) = m {
                            cx.record(m.queue_ms, waited_ms);
                        }
                        if slot {
                            self.hold(cx, id, s);
                        }
                        match self.rest.remove(&id) {
                            Some(rest) => self.pass_rest(cx, id, rest),
                            None => self.go_on(cx, id),
                        }
                    }
                    Wake::Shed { waiter } => {
                        self.shed_other(cx, s, waiter.class, StreamId(waiter.id))
                    }
                    Wake::Expired { waiter } => self.expired(cx, s, StreamId(waiter.id)),
                }
            }
        }
        cx.tick_changed = true;
    }

    /// A stream out of one shedder's queue goes through the later shedders
    /// that match it, as it would have on arrival: each may admit it, queue
    /// it (again) or shed it. Admitted by all, it goes on.
    pub(super) fn pass_rest(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, rest: Rest) {
        let now = cx.now().as_ms();
        let until = cx.wait_until(id).map(Instant::as_ms);
        let mut watched = Vec::new();
        match self.arrive(cx, (id, now), &rest.classes, until, &mut watched) {
            None => {
                self.watch(id, watched, now);
                self.go_on(cx, id);
            }
            Some(Step::Reply(rejection)) => {
                for s in watched {
                    self.shedders.abandoned(s);
                }
                cx.effects.push(Effect::Reply {
                    stream: id,
                    rejection,
                });
            }
            // Queued again, at a later shedder.
            Some(_) => self.watch(id, watched, now),
        }
    }

    /// A stream that waited goes on now (the pipeline reduces its
    /// deadline headers by the wait); an adaptive limit's latency sample
    /// starts here, not at a slot taken before a wait at another shedder.
    pub(super) fn go_on(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        if self.adaptive && self.held.contains_key(&id) {
            let now_ns = cx.now().as_ns();
            self.admitted_ns.insert(id, now_ns);
        }
        cx.effects.push(Effect::Resume { stream: id });
    }

    /// Answers a queued stream whose deadline passed while it waited.
    pub(super) fn expired(&mut self, cx: &mut Cx<'_, '_>, s: ShedderId, id: StreamId) {
        let rejection = self.deadline_answer(cx, s, id);
        cx.effects.push(Effect::Reply {
            stream: id,
            rejection,
        });
    }

    /// The answer to stream `id`, whose deadline passes (or, with
    /// `shed_early`, would pass) in shedder `s`'s queue, counted: the
    /// answer says how much time it truly has left.
    pub(super) fn deadline_answer(
        &self,
        cx: &mut Cx<'_, '_>,
        s: ShedderId,
        id: StreamId,
    ) -> Rejection {
        let name = self.shedders.get(s).map_or("", |r| r.spec.name.as_str());
        cx.deadline_answer(id, &format!("shed/{name}"))
    }
}
