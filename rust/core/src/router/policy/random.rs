//! "random": a uniformly random worker from the router's seeded generator.
//! The baseline every other policy must beat.

use super::{Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        (ctx.rng.below(cands.len() as u64) as usize, Reason::Random)
    }
}
