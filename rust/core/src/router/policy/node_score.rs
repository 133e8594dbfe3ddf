//! "node_score": the seed documents' prefill node selection, the highest
//! 0.4 x (1 - load) + 0.3 x (1 - queue depth / 10) + 0.2 x compute capacity + 0.1 x model present.
//!
//! The seed documents do not define its terms; here, with what the Router knows: load = the worker's
//! queueing delay as a fraction of the TTFT SLO (1 s without one), capped at 1; queue depth =
//! requests waiting for or in prefill there (ours, or the engine's `waiting` when larger);
//! compute capacity = prefill speed / the fastest candidate's; model present = 1 (a Router serves
//! one model, so every worker has it). The rule is cache-blind: it is in the comparison because
//! the seed's system uses it, not because it is expected to win.

use super::{pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct NodeScore;

impl Policy for NodeScore {
    fn name(&self) -> &'static str {
        "node_score"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let horizon = ctx.ttft_slo.unwrap_or(1.0);
        let fastest = cands.iter().map(|c| c.prefill_speed).fold(0.0, f64::max);
        for c in cands.iter_mut() {
            let load = (c.queue_delay / horizon).min(1.0);
            let depth = c.queued as f64 / 10.0;
            let capacity = if fastest > 0.0 { c.prefill_speed / fastest } else { 1.0 };
            let score = 0.4 * (1.0 - load) + 0.3 * (1.0 - depth) + 0.2 * capacity + 0.1;
            // Lower is better for pick_min and `explain`.
            c.score = -score;
        }
        let i = pick_min(ctx, cands, |_| true, |c| (c.score, c.predicted_ttft)).expect("non-empty");
        (i, Reason::NodeScore)
    }
}
