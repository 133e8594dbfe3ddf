//! "round_robin": the next worker in id order after the previous choice.
//! Ignores load and cache; a second baseline.

use super::{Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct RoundRobin;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let i = (*ctx.rr % cands.len() as u64) as usize;
        *ctx.rr = ctx.rr.wrapping_add(1);
        (i, Reason::RoundRobin)
    }
}
