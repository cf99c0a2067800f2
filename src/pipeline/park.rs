//! Streams paused by a stage before the last (a request waiting for a
//! place at a concurrency limit): the later stages have not seen the
//! request yet, and see it only when the stage lets it go on. While a
//! stream is parked, the pipeline keeps what its stages hold for it (the
//! host's `Stream` carries only the `PARKED` bit), so that a stage's
//! `Resume` can become an [`Effect::Continue`]: the host makes the stream
//! current again and calls [`Pipeline::resume`] with its request. Whatever
//! happens next (through, refused by a later stage, paused again), what
//! the stream holds is merged back into the host's `Stream` at its next
//! call, and released exactly once, as for any stream.

use super::{run, Effect, Env, Outcome, Pipeline, Stream, StreamId, Verdict, PARKED};
use crate::request::RequestView;

/// A parked stream: the first stage that has yet to see it, and what the
/// stages before hold for it.
pub(super) struct Parked {
    next: usize,
    stream: Stream,
}

impl Pipeline {
    /// Stage `at` paused the stream: parks it if later stages have yet to
    /// see it.
    pub(super) fn park(&mut self, stream: &mut Stream, at: usize) {
        if at + 1 >= self.stages.len() {
            return;
        }
        let kept = Stream {
            id: stream.id,
            holds: std::mem::replace(&mut stream.holds, PARKED),
            response_headers: std::mem::take(&mut stream.response_headers),
        };
        self.parked.insert(
            stream.id,
            Parked {
                next: at + 1,
                stream: kept,
            },
        );
    }

    /// Moves what a parked stream's stages hold back into the host's
    /// `Stream` (when it gets its response, or ends).
    pub(super) fn unpark(&mut self, stream: &mut Stream) {
        stream.holds &= !PARKED;
        if let Some(p) = self.parked.remove(&stream.id) {
            stream.holds |= p.stream.holds;
            if !p.stream.response_headers.is_empty() {
                stream.response_headers = p.stream.response_headers;
            }
        }
    }

    /// A stage's `Resume` of a parked stream that later stages have yet to
    /// see becomes a `Continue`.
    pub(super) fn route(&self, effects: &mut [Effect]) {
        let len = self.stages.len();
        for e in effects.iter_mut() {
            let Effect::Resume {
                stream,
                set_headers,
            } = e
            else {
                continue;
            };
            if self.parked.get(stream).is_some_and(|p| p.next < len) {
                *e = Effect::Continue {
                    stream: *stream,
                    set_headers: std::mem::take(set_headers),
                };
            }
        }
    }

    /// A parked stream goes on (an [`Effect::Continue`]): the stages after
    /// the one that paused it decide on its request, as in `request`. A
    /// refusal releases what every stage holds for it at once.
    pub fn resume(
        &mut self,
        env: &mut Env<'_>,
        id: StreamId,
        req: &dyn RequestView,
    ) -> (Verdict, Outcome) {
        let Some(Parked { next, mut stream }) = self.parked.remove(&id) else {
            // Not parked (any more): nothing to decide.
            return (Verdict::Continue, Outcome::default());
        };
        let ((verdict, at), out) =
            self.with_cx(env, |stages, cx| run(stages, cx, &mut stream, next, req));
        if !matches!(verdict, Verdict::Reply(_)) {
            // Kept until the host's `Stream` takes it back.
            let next = at.saturating_add(1).min(self.stages.len());
            self.parked.insert(id, Parked { next, stream });
        }
        (verdict, out)
    }
}
