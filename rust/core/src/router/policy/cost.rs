//! "cost": Dynamo's KV router cost, `prefill_load_scale * max(prefill_blocks - overlap, 0) +
//! decode_blocks`, where both block counts include this request; softmax sampling with a temperature.

use super::{finite_nonneg, pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

#[derive(Clone, Debug, PartialEq)]
pub struct Cost {
    /// Weight of the prefill blocks against decode blocks (Dynamo's `prefill_load_scale`).
    pub prefill_load_scale: f64,
    /// Softmax temperature over normalised costs; 0 takes the minimum.
    pub temperature: f64,
}

impl Default for Cost {
    /// Dynamo's defaults.
    fn default() -> Self {
        Cost { prefill_load_scale: 1.0, temperature: 0.0 }
    }
}

impl Cost {
    pub fn validate(&self) -> Result<(), String> {
        finite_nonneg("prefill_load_scale", self.prefill_load_scale)?;
        finite_nonneg("temperature", self.temperature)
    }
}

impl Policy for Cost {
    fn name(&self) -> &'static str {
        "cost"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let bs = ctx.block_size as u64;
        let request_blocks = ctx.num_tokens.div_ceil(bs);
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for c in cands.iter_mut() {
            let prefill_blocks = c.prefill_tokens.div_ceil(bs) + request_blocks;
            let decode_blocks = c.decode_blocks + request_blocks;
            let uncached = prefill_blocks.saturating_sub(c.overlap_blocks as u64);
            c.score = self.prefill_load_scale * uncached as f64 + decode_blocks as f64;
            lo = lo.min(c.score);
            hi = hi.max(c.score);
        }
        if self.temperature <= 0.0 || hi <= lo {
            return (pick_min(ctx, cands, |_| true, |c| (c.score, 0.0)).expect("non-empty"), Reason::Cost);
        }
        // Softmax over costs normalised to [0, 1], so the temperature means the same at any scale.
        let weight = |c: &Candidate| (-((c.score - lo) / (hi - lo)) / self.temperature).exp();
        let total: f64 = cands.iter().map(weight).sum();
        let mut x = ctx.rng.unit() * total;
        for (i, c) in cands.iter().enumerate() {
            x -= weight(c);
            if x < 0.0 {
                return (i, Reason::Cost);
            }
        }
        (cands.len() - 1, Reason::Cost)
    }
}
