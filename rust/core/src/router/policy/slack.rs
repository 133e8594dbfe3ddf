//! "slack" (the default): among workers predicted to keep the TTFT SLO, the one whose choice costs
//! least = queue_weight * queueing delay + prefill_weight * (uncached prefill + transfer time).
//!
//! Why: "ttft" minimises this request's wait only, so under load it buys a few ms by recomputing a
//! whole cached conversation on an idle worker; that compute delays every later request there and
//! lowers the hit rate exactly when capacity is scarce. Charging the prefill time more than the
//! queueing delay (prefill_weight > queue_weight) prices in the delay the choice imposes on later
//! requests, while the SLO constraint keeps cache affinity from building hot spots: a worker whose
//! queue would break the SLO is not eligible however good its overlap. When no worker keeps the
//! SLO (or none is set) it degrades to the same cost over all workers; the router's SLO check then
//! falls back to minimum TTFT or rejects. With `eviction_weight` (off by default) a worker whose
//! full prefix cache would evict cached blocks to store this request is charged their recompute.

use super::{admission_ttft, pick_min, Ctx, Policy};
use crate::router::decision::{Candidate, Reason};

pub struct Slack {
    pub queue_weight: f64,
    pub prefill_weight: f64,
    pub pressure_weight: f64,
    pub eviction_weight: f64,
    pub slo_margin: f64,
}

impl Slack {
    /// The cost of placing the request on `c` (seconds), `scale` = the TTFT SLO (1 without one).
    #[inline]
    pub fn cost(&self, c: &Candidate, scale: f64) -> f64 {
        // The step the prefill runs in (unified engines with a known decode speed) is engine time
        // before the first token, like the prefill: a worker whose decodes make it long is charged.
        let work = c.prefill_time + c.transfer_time + c.step_time;
        self.queue_weight * c.queue_delay
            + self.prefill_weight * work
            + self.pressure_weight * work * (c.queue_delay + work) / scale
            + self.eviction_weight * c.evict_time
    }

    /// The lowest `score` among workers predicted to keep the SLO, else over all.
    pub fn pick(&self, ctx: &mut Ctx<'_>, cands: &[Candidate]) -> usize {
        let limit = ctx.ttft_slo.map_or(f64::INFINITY, |s| s * (1.0 - self.slo_margin));
        let key = |c: &Candidate| (c.score, c.predicted_ttft);
        let f = ctx.admission_work_factor;
        let feasible = |c: &Candidate| admission_ttft(c, f) <= limit;
        if let Some(i) = pick_min(ctx, cands, feasible, key) {
            return i;
        }
        pick_min(ctx, cands, |_| true, key).expect("non-empty")
    }
}

impl Policy for Slack {
    fn name(&self) -> &'static str {
        "slack"
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let scale = ctx.ttft_slo.unwrap_or(1.0);
        for c in cands.iter_mut() {
            c.score = self.cost(c, scale);
        }
        (self.pick(ctx, cands), Reason::Slack)
    }
}
