//! "least_load": the seed's shortest queue, minimum raw `busy_until`.
//! Compared raw (not clamped at now), so among idle workers the one idle longest wins.

use super::{pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct LeastLoad;

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        for c in cands.iter_mut() {
            c.score = c.busy_until;
        }
        let i = pick_min(ctx, cands, |_| true, |c| (c.busy_until, 0.0)).expect("non-empty");
        (i, Reason::LeastLoad)
    }
}
