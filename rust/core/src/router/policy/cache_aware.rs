//! "cache_aware": SGLang router's rule. Imbalanced (max_load - min_load > abs threshold AND
//! max_load > rel threshold * min_load, load = in-flight requests) -> least loaded; else the
//! best-overlap worker if its matched fraction exceeds `cache_threshold`; else least loaded.

use super::{finite_nonneg, pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

#[derive(Clone, Debug, PartialEq)]
pub struct CacheAware {
    /// Route to the best-overlap worker when matched tokens / prompt tokens exceed this.
    pub cache_threshold: f64,
    /// The load gap (in-flight requests) beyond which the system counts as imbalanced ...
    pub balance_abs_threshold: f64,
    /// ... when also max_load > this * min_load.
    pub balance_rel_threshold: f64,
}

impl Default for CacheAware {
    /// SGLang router's defaults.
    fn default() -> Self {
        CacheAware { cache_threshold: 0.3, balance_abs_threshold: 64.0, balance_rel_threshold: 1.5 }
    }
}

impl CacheAware {
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(format!("cache_threshold must be in [0, 1], got {}", self.cache_threshold));
        }
        finite_nonneg("balance_abs_threshold", self.balance_abs_threshold)?;
        finite_nonneg("balance_rel_threshold", self.balance_rel_threshold)
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for c in cands.iter() {
            let l = c.in_flight as f64;
            lo = lo.min(l);
            hi = hi.max(l);
        }
        let imbalanced = hi - lo > self.balance_abs_threshold && hi > self.balance_rel_threshold * lo;
        let least_loaded = |ctx: &mut Ctx<'_>, cands: &mut [Candidate]| {
            for c in cands.iter_mut() {
                c.score = c.in_flight as f64;
            }
            pick_min(ctx, cands, |_| true, |c| (c.in_flight as f64, 0.0)).expect("non-empty")
        };
        if imbalanced {
            return (least_loaded(ctx, cands), Reason::Balance);
        }
        let best_overlap = cands.iter().map(|c| c.overlap_blocks).max().unwrap_or(0);
        let matched = (best_overlap as u64 * ctx.block_size as u64).min(ctx.num_tokens);
        if ctx.num_tokens > 0 && matched as f64 / ctx.num_tokens as f64 > self.cache_threshold {
            for c in cands.iter_mut() {
                c.score = -(c.overlap_blocks as f64);
            }
            let i = pick_min(ctx, cands, |_| true, |c| (-(c.overlap_blocks as f64), c.in_flight as f64)).expect("non-empty");
            return (i, Reason::Cache);
        }
        (least_loaded(ctx, cands), Reason::LeastLoad)
    }
}
