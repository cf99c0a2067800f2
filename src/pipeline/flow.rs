//! A stream's way through the stages: what the pipeline keeps of it, the
//! run of the stages on a request (each lets it go on, holds it paused, or
//! answers it), and the exactly-once release when it ends.

use super::stage::{Cx, Stage, Step, StreamId};
use crate::header::Headers;
use crate::reply::Rejection;
use crate::request::RequestView;
use crate::time::Instant;

/// What the pipeline keeps of a stream while a stage holds something for
/// it, it is paused, or headers wait for its response.
#[derive(Debug, Default)]
pub(super) struct StreamState {
    pub(super) id: StreamId,
    /// Bit `i`: stage `i` holds something for this stream.
    pub(super) holds: u64,
    /// The stage that paused the stream (a resume goes on after it).
    pub(super) paused_at: Option<usize>,
    /// When the request arrived, kept once a stage paused it: later
    /// stages see how long it waited (`Cx::waited`).
    pub(super) arrived: Option<Instant>,
    pub(super) response_headers: Headers,
}

impl StreamState {
    pub(super) fn new(id: StreamId) -> Self {
        StreamState {
            id,
            ..StreamState::default()
        }
    }

    /// Whether anything of it is left to keep.
    pub(super) fn worth_keeping(&self) -> bool {
        self.holds != 0 || self.paused_at.is_some() || !self.response_headers.is_empty()
    }
}

/// The pipeline's verdict on the current request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    /// Answer it with this local reply.
    Reply(Rejection),
    /// Pause it: it waits in a queue.
    Pause,
}

/// Runs the stages from `from` on a request: each may let it go on, hold
/// it (paused; resumed later through `Pipeline::resume`) or answer it, which
/// releases at once what the earlier stages hold for it.
pub(super) fn run(
    stages: &mut [Box<dyn Stage>],
    cx: &mut Cx<'_, '_>,
    stream: &mut StreamState,
    req: &dyn RequestView,
    from: usize,
) -> Verdict {
    for i in from..stages.len() {
        let Some(stage) = stages.get_mut(i) else {
            break;
        };
        cx.stage = i;
        let d = stage.request(cx, stream.id, req);
        if d.held {
            stream.holds |= 1 << i;
        }
        match d.step {
            Step::Continue => {
                if !d.response_headers.is_empty() {
                    stream.response_headers = d.response_headers;
                }
            }
            Step::Pause => {
                // Headers for the response, if it goes on from here.
                if !d.response_headers.is_empty() {
                    stream.response_headers = d.response_headers;
                }
                stream.paused_at = Some(i);
                if stream.arrived.is_none() {
                    // The first pause is in the call the request arrived in.
                    stream.arrived = Some(cx.now());
                }
                tell_holders(stages, cx, stream, i, |s, cx, id| s.waiting(cx, id));
                return Verdict::Pause;
            }
            Step::Reply(r) => {
                release(stages, cx, stream);
                return Verdict::Reply(r);
            }
        }
    }
    if stream.arrived.is_some() {
        tell_holders(stages, cx, stream, stages.len(), |s, cx, id| {
            s.departed(cx, id)
        });
    }
    Verdict::Continue
}

/// Tells each stage before `upto` that holds something for the stream
/// (only streams that wait somewhere get here).
fn tell_holders(
    stages: &mut [Box<dyn Stage>],
    cx: &mut Cx<'_, '_>,
    stream: &StreamState,
    upto: usize,
    tell: fn(&mut dyn Stage, &mut Cx<'_, '_>, StreamId),
) {
    for (i, stage) in stages.iter_mut().enumerate().take(upto) {
        if stream.holds & (1 << i) != 0 {
            cx.stage = i;
            tell(stage.as_mut(), cx, stream.id);
        }
    }
}

/// Tells every stage holding something for the stream that it ended, and
/// forgets that they did: the only way a hold bit is cleared after the
/// request, so the release happens once.
pub(super) fn release(
    stages: &mut [Box<dyn Stage>],
    cx: &mut Cx<'_, '_>,
    stream: &mut StreamState,
) {
    let holds = std::mem::take(&mut stream.holds);
    for (i, stage) in stages.iter_mut().enumerate() {
        if holds & (1 << i) != 0 {
            cx.stage = i;
            stage.end(cx, stream.id);
        }
    }
}

/// Calls `f` on each stage in order, the context told which stage it
/// calls (whose lines it reaches), until one fails.
pub(super) fn try_each<R>(
    stages: &mut [Box<dyn Stage>],
    cx: &mut Cx<'_, '_>,
    mut f: impl FnMut(&mut dyn Stage, &mut Cx<'_, '_>) -> Result<(), R>,
) -> Result<(), R> {
    for (i, stage) in stages.iter_mut().enumerate() {
        cx.stage = i;
        f(stage.as_mut(), cx)?;
    }
    Ok(())
}

/// `try_each` for calls that cannot fail.
pub(super) fn each(
    stages: &mut [Box<dyn Stage>],
    cx: &mut Cx<'_, '_>,
    mut f: impl FnMut(&mut dyn Stage, &mut Cx<'_, '_>),
) {
    let _ = try_each::<()>(stages, cx, |s, cx| {
        f(s, cx);
        Ok(())
    });
}
