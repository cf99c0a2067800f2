//! Deadlines in the pipeline, first of all: a request with less time left
//! than `min_remaining` is refused before any mechanism spends anything.

use super::config::DeadlineSpec;
use crate::config::{Common, ConfigError};
use crate::pipeline::stage::{Cx, Decision, Stage, Step, StreamId};
use crate::pipeline::telemetry::{Kind, MetricId, Registry};
use crate::request::RequestView;

/// The deadline stage of one configuration.
pub struct DeadlineStage {
    spec: DeadlineSpec,
    refused: MetricId,
}

/// The stage, if the configuration has a `deadlines` section.
pub fn build(
    spec: Option<&DeadlineSpec>,
    common: &Common,
    reg: &mut Registry,
) -> Result<Option<Box<dyn Stage>>, ConfigError> {
    let Some(spec) = spec.cloned() else {
        return Ok(None);
    };
    let refused = reg.labelled(
        Kind::Counter,
        "sluice_deadline_refused_total",
        &[("domain", common.domain.as_str())],
    );
    Ok(Some(Box::new(DeadlineStage { spec, refused })))
}

impl Stage for DeadlineStage {
    fn request(
        &mut self,
        cx: &mut Cx<'_, '_>,
        _stream: StreamId,
        req: &dyn RequestView,
    ) -> Decision {
        match super::read(&self.spec, req) {
            Some(d) if d.remaining_ms <= self.spec.min_remaining_ms => {
                cx.add(self.refused, 1);
                let r = super::reply::rejection("deadline", self.spec.status, d.remaining_ms);
                Decision::of(Step::Reply(r), false)
            }
            _ => Decision::pass(),
        }
    }
}
