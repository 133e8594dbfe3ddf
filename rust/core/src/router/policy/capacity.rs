//! "capacity" (the default): capacity-aware placement. slack's cost (queueing delay, the prefill
//! compute the choice spends, the queueing it imposes on later requests) plus, on the same time
//! scale, the recompute the placement is expected to cause later through the prefix cache it fills:
//!
//!   capacity cost = prefill_weight * reuse * t_block * (evicted + fill * duplicated_into_free)
//!
//! (`t_block` = one block's prefill time on that worker.)
//!
//! - `evicted`: cached blocks the worker's LRU must drop to store the blocks it lacks (its
//!   configured `prefix_cache_blocks`; occupancy = the cached blocks the index holds for it, or the
//!   engine's reported `kv_usage` when that is larger: vLLM counts cached blocks no request holds
//!   as free, so its usage alone reads a full LRU as nearly empty). An evicted block costs
//!   `t_block` (its prefill time there) if it is asked for again.
//! - `duplicated_into_free`: blocks of this prompt already resident on another worker that this
//!   worker would store again into free space. A copy evicts nothing now, but it takes room that
//!   a distinct block would otherwise use; `fill` (the occupied fraction) is the chance that room
//!   is needed before it is freed.
//! - `reuse` = p / (1 - p), p = how likely an *evicted* block is to be asked for again, measured
//!   (`router::evicted`): the fraction of the engines' recent evictions (their removals, from the
//!   index's removal log) whose block a later prompt asked for again past every worker's cached
//!   prefix (decaying averages over the load window; p capped at 0.95). An evicted block that is
//!   asked for again is recomputed, and storing it again evicts another block that comes back
//!   with the same chance: the expected recompute of one eviction is p + p^2 + ... = p / (1 - p)
//!   blocks. Where evictions are not asked for again the term vanishes and the rule is slack.
//!   Until 2026-12-03 p was the arriving prompts' hit fraction, which is the hot blocks' reuse,
//!   not the LRU tail's: with agents' shared tool prefixes it was about 0.93 (13 blocks of
//!   recompute per eviction) while the blocks actually evicted came back a third of the time
//!   (0.33 at the end of an agent 32/s run; seed chat 80/s, whose conversations return, 0.95).
//!
//! No constant is fitted: the weight is slack's `prefill_weight` (recompute later is compute,
//! as the prefill now is). Workers without `prefix_cache_blocks` are charged nothing.

use super::slack::{Slack, ADMISSION_WORK_FACTOR};
use super::{Ctx, Needs, Policy};
use crate::router::decision::{Candidate, Reason};

/// slack's weights (its `eviction_weight` stays 0 unless set in Rust: the capacity charge is the
/// eviction cost this policy is built around).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Capacity {
    pub slack: Slack,
}

impl Policy for Capacity {
    fn name(&self) -> &'static str {
        "capacity"
    }
    fn needs(&self) -> Needs {
        Needs { evictions: true, usage_occupancy: true, eviction_reuse: true, ..self.slack.eviction_needs() }
    }
    fn default_admission_work_factor(&self) -> f64 {
        ADMISSION_WORK_FACTOR
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let scale = ctx.ttft_slo.unwrap_or(1.0);
        let best = cands.iter().map(|c| c.overlap_blocks as u64).max().unwrap_or(0);
        let bs = ctx.block_size as f64;
        let p = ctx.reuse.clamp(0.0, 0.95);
        let reuse = p / (1.0 - p);
        for c in cands.iter_mut() {
            let mut cost = self.slack.cost(c, scale);
            if p > 0.0 && c.stored_blocks > 0 {
                let dup = (best - c.overlap_blocks as u64).min(c.stored_blocks);
                let dup_free = dup.saturating_sub(c.evicted_blocks);
                let t_block = bs / c.prefill_speed;
                cost += self.slack.prefill_weight * reuse * t_block * (c.evicted_blocks as f64 + c.cache_fill * dup_free as f64);
            }
            c.score = cost;
        }
        (self.slack.pick(ctx, cands), Reason::Capacity)
    }
}
