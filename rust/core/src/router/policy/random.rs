//! "random": a uniformly random worker, `random.Random(seed).randrange(n)` per decision (CPython's
//! MT19937), so `Router(policy="random", seed=1)` makes the seed chapter's own draws.

use super::{Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        (ctx.py_rng.randbelow(cands.len() as u64) as usize, Reason::Random)
    }
}
