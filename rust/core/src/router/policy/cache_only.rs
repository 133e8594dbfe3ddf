//! "cache_only": the longest prefix overlap, ties by smaller `busy_until`.
//! The seed's `max(range(N), key=lambda j: (hit(j), -busy[j]))`.

use super::{pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct CacheOnly;

impl Policy for CacheOnly {
    fn name(&self) -> &'static str {
        "cache_only"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        for c in cands.iter_mut() {
            c.score = -(c.overlap_blocks as f64);
        }
        let i = pick_min(ctx, cands, |_| true, |c| (-(c.overlap_blocks as f64), c.busy_until)).expect("non-empty");
        (i, Reason::Cache)
    }
}
