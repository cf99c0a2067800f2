//! The stage's side of the adaptive limits: a latency sample per response
//! (from admission), the fast tick asked for while samples wait to be
//! merged, and on the tick the limits shared, read back and reported.

use super::ShedStage;
use crate::pipeline::stage::{Cx, StreamId};

impl ShedStage {
    /// Adaptive limits: a response's latency since admission is a sample
    /// for each adaptive shedder whose slot the stream holds.
    pub(super) fn sample(&mut self, cx: &mut Cx<'_, '_>, id: StreamId) {
        let Some(since) = self.admitted_ns.remove(&id) else {
            return;
        };
        let now_ns = cx.now().as_ns();
        let latency_us = now_ns.saturating_sub(since) / 1_000;
        for &s in self.held.get(&id).map_or(&[][..], |h| &h[..]) {
            self.shedders.sample(s, latency_us, now_ns / 1_000_000);
        }
    }

    /// An adaptive limit's samples to merge soon ([`Shedders::merge_soon`])
    /// need the fast tick: asked after every arrival, response and end
    /// (an op on the shared entry may have found the limit in full use, a
    /// response adds a sample); the pipeline changes the tick only if
    /// that changes what its stages want.
    pub(super) fn ask_merge_soon(&self, cx: &mut Cx<'_, '_>) {
        if self.adaptive && self.shedders.merge_soon() {
            cx.tick_changed = true;
        }
    }

    /// Adaptive limits (on the tick): shares this worker's samples, reads
    /// the limits back, and reports them.
    pub(super) fn adapt(&mut self, cx: &mut Cx<'_, '_>) {
        if !self.adaptive {
            return;
        }
        let now = cx.now().as_ms();
        let report = self.shedders.adapt(cx.store(), now);
        self.report(cx, report);
        for s in self.shedders.ids() {
            if let Some((limit, floor)) = self.metrics(s).and_then(|m| m.adaptive) {
                cx.record(limit, self.shedders.limit(s).unwrap_or(0));
                if let Some(f) = self.shedders.floor_us(s) {
                    cx.record(floor, f / 1_000);
                }
            }
        }
    }
}
