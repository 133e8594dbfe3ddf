//! "ttft": minimum predicted TTFT = queueing delay + uncached tokens / prefill speed (+ transfer).
//! The seed's and Mooncake Conductor's rule.

use super::{pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct Ttft;

impl Policy for Ttft {
    fn name(&self) -> &'static str {
        "ttft"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        for c in cands.iter_mut() {
            c.score = c.predicted_ttft;
        }
        let i = pick_min(ctx, cands, |_| true, |c| (c.predicted_ttft, 0.0)).expect("non-empty");
        (i, Reason::Ttft)
    }
}
