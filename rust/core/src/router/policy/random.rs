//! "random": a uniformly random worker, one `below(n)` of the Router's random source per decision
//! (by default CPython's `random.Random(seed).randrange(n)`, so `Router(policy="random", seed=1)`
//! makes the seed's own draws).

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
