//! Admission: a request runs through the shedders that match it, each
//! admitting it (with a slot held by stream, or let through and watched),
//! queueing it or shedding it; and the release of what a stream held (its
//! slots, its place in a queue) when it ends or is shed.

use super::{Rest, ShedStage};
use crate::pipeline::stage::{Cx, Effect, Step, StreamId};
use crate::reply::Rejection;
use crate::shed::{waiters, Arrival, Class, ShedderId};

impl ShedStage {
    /// The shed answer for a request of `class` at shedder `s`, counted.
    /// Every id comes from these shedders (`classify`, `ids`); one that
    /// did not would still be answered, with the default status (503).
    pub(super) fn answer(&self, cx: &mut Cx<'_, '_>, s: ShedderId, class: Class) -> Rejection {
        let x = self.shedders.get(s);
        let (name, status) = x.map_or(("", 503), |x| (x.spec.name.as_str(), x.spec.status));
        let r = crate::shed::reply::rejection(name, class.name(), status, self.jitter_ns, cx.rng);
        if let Some(&id) = x.and_then(|x| x.metrics.shed.get(class as usize)) {
            cx.add(id, 1);
        }
        r
    }

    /// Answers another (queued) stream with the shed reply.
    pub(super) fn shed_other(
        &self,
        cx: &mut Cx<'_, '_>,
        s: ShedderId,
        class: Class,
        stream: StreamId,
    ) {
        let rejection = self.answer(cx, s, class);
        cx.effects.push(Effect::Reply { stream, rejection });
    }

    pub(super) fn hold(&mut self, cx: &mut Cx<'_, '_>, id: StreamId, s: ShedderId) {
        self.held.entry(id).or_default().push(s);
        if let Some(m) = self.metrics(s) {
            cx.add(m.in_flight, 1);
        }
        if self.adaptive {
            let now = cx.now().as_ns();
            self.admitted_ns.entry(id).or_insert(now);
        }
    }

    /// Let through with no slot: a latency-mode shedder watches its answer.
    pub(super) fn let_through(&mut self, s: ShedderId, watched: &mut Vec<ShedderId>) {
        let latency = self
            .shedders
            .get(s)
            .is_some_and(|r| r.spec.concurrency.is_none());
        if latency {
            self.shedders.started(s);
            watched.push(s);
        }
    }

    /// Latency-mode shedders that let a stream through watch its response.
    pub(super) fn watch(&mut self, id: StreamId, watched: Vec<ShedderId>, now: u64) {
        if !watched.is_empty() {
            self.watched
                .entry(id)
                .or_insert_with(|| (Vec::new(), now))
                .0
                .extend(watched);
        }
    }

    /// Releases the stream's slots and takes it out of any queue, then
    /// lets waiters in.
    pub(super) fn finish(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        self.rest.remove(&id);
        if self.adaptive {
            self.admitted_ns.remove(&id);
        }
        let store = cx.store();
        let slots = self.held.remove(&id).unwrap_or_default();
        for &s in &slots {
            let report = self.shedders.release(cx, store, s);
            self.report(cx, report);
            if let Some(m) = self.metrics(s) {
                cx.add(m.in_flight, -1);
            }
        }
        let mut cancelled = false;
        // It waits in one line at most: its shedder's.
        let waits_at = if cx.nobody_waits() {
            None
        } else {
            cx.waiter(id).map(|w| waiters::shedder_of(w.line))
        };
        if let Some(s) = waits_at {
            let (gone, report) = self.shedders.cancel(cx, store, s, id.0);
            self.report(cx, report);
            if gone {
                cancelled = true;
                if let Some(m) = self.metrics(s) {
                    cx.add(m.queued, -1);
                }
            }
        }
        if !slots.is_empty() || cancelled {
            self.wake(cx);
        }
    }

    /// Runs the request's shedders; `Some(step)` when one sheds or queues
    /// it. `watched` gets the latency-mode shedders that let it through.
    pub(super) fn arrive(
        &mut self,
        cx: &mut Cx<'_, '_>,
        (id, now): (StreamId, u64),
        classes: &[(ShedderId, Class)],
        until: Option<u64>,
        watched: &mut Vec<ShedderId>,
    ) -> Option<Step> {
        for (k, &(s, class)) in classes.iter().enumerate() {
            let store = cx.store();
            let (arrival, report) =
                self.shedders
                    .arrive_until(cx, store, now, s, (id.0, class), until);
            self.report(cx, report);
            match arrival {
                Arrival::Admit { slot: true } => self.hold(cx, id, s),
                Arrival::Admit { slot: false } => self.let_through(s, watched),
                Arrival::Shed => {
                    self.finish(cx, id);
                    return Some(Step::Reply(self.answer(cx, s, class)));
                }
                Arrival::Expired => {
                    self.finish(cx, id);
                    return Some(Step::Reply(self.deadline_answer(cx, s, id)));
                }
                Arrival::Queue { evicted } => {
                    let queued = self.metrics(s).map(|m| m.queued);
                    if let Some(m) = queued {
                        cx.add(m, 1);
                    }
                    cx.tick_changed = true;
                    if let Some(w) = evicted {
                        if let Some(m) = queued {
                            cx.add(m, -1);
                        }
                        self.shed_other(cx, s, w.class, StreamId(w.id));
                    }
                    // The shedders after this one see it when it leaves
                    // the queue (`pass_rest`).
                    if let Some(more) = classes.get(k + 1..).filter(|m| !m.is_empty()) {
                        let rest = Rest {
                            classes: more.to_vec(),
                        };
                        self.rest.insert(id, rest);
                    }
                    return Some(Step::Pause);
                }
            }
        }
        None
    }
}
