//! Deadlines in the pipeline, first of all: a request with less time left
//! than `min_remaining` is refused before any mechanism spends anything.

use super::config::DeadlineSpec;
use crate::config::ConfigError;
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::request::RequestView;
use crate::time::Duration;

/// The deadline stage of one configuration.
pub struct DeadlineStage {
    min_remaining: Duration,
}

/// The stage, if the configuration has a `deadlines` section (the pipeline
/// reads each request's deadline: see `pipeline/deadline.rs`).
pub fn build(spec: Option<&DeadlineSpec>) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    Ok(spec.map(|s| {
        Box::new(DeadlineStage {
            min_remaining: s.min_remaining,
        }) as Box<dyn Stage>
    }))
}

impl Stage for DeadlineStage {
    fn request(
        &mut self,
        cx: &mut Cx<'_, '_>,
        stream: StreamId,
        _req: &dyn RequestView,
    ) -> Decision {
        match cx.deadline_left(stream) {
            Some(left) if left <= self.min_remaining => {
                Decision::of(Step::Reply(cx.deadline_answer(stream, "deadline")), false)
            }
            _ => Decision::pass(),
        }
    }
}
