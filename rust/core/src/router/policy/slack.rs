//! "slack" (the default until 2026-12-03; the default "capacity" is this plus a cache charge):
//! among workers predicted to keep the TTFT SLO, the one whose choice costs least =
//! queue_weight * queueing delay + prefill_weight * (uncached prefill + transfer time).
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

use super::{admission_ttft, finite_nonneg, pick_min_by, Ctx, Needs, Policy};
use crate::router::decision::{Candidate, Reason};

#[derive(Clone, Debug, PartialEq)]
pub struct Slack {
    /// Weight of the queueing delay a worker would impose.
    pub queue_weight: f64,
    /// Weight of the uncached prefill time (the compute the choice spends, which every later
    /// request on that worker waits for).
    pub prefill_weight: f64,
    /// Weight of the queueing the choice imposes on later requests there, modelled as
    /// work * (queue + work) / ttft_slo (convex: the same work hurts more on a worker near the SLO).
    pub pressure_weight: f64,
    /// Weight of `evict_time`, the prefill seconds of cached blocks a worker's full prefix cache
    /// would evict to store the request (workers registered with `prefix_cache_blocks`).
    /// 0 (the default): not charged, and occupancy is not looked up.
    pub eviction_weight: f64,
    /// Fraction of the TTFT SLO held back as a safety margin when judging feasibility.
    pub slo_margin: f64,
}

impl Default for Slack {
    fn default() -> Self {
        Slack { queue_weight: 0.2, prefill_weight: 1.0, pressure_weight: 8.0, eviction_weight: 0.0, slo_margin: 0.0 }
    }
}

/// Size-aware admission's factor for the slack family (`AdmissionConfig::work_factor`).
pub(super) const ADMISSION_WORK_FACTOR: f64 = 2.0;

impl Slack {
    pub fn validate(&self) -> Result<(), String> {
        finite_nonneg("queue_weight", self.queue_weight)?;
        finite_nonneg("prefill_weight", self.prefill_weight)?;
        finite_nonneg("pressure_weight", self.pressure_weight)?;
        finite_nonneg("eviction_weight", self.eviction_weight)?;
        if !(0.0..1.0).contains(&self.slo_margin) {
            return Err(format!("slo_margin must be in [0, 1), got {}", self.slo_margin));
        }
        Ok(())
    }

    /// What charging `eviction_weight` needs measured.
    pub(super) fn eviction_needs(&self) -> Needs {
        let charged = self.eviction_weight > 0.0;
        Needs { evictions: charged, evict_time: charged, ..Needs::default() }
    }
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

    /// The lowest `score` among workers predicted to keep the SLO, else over all. Ties
    /// (typically idle workers that hold the same prefix, or none of it) go to the least loaded
    /// (queueing delay, then requests in flight), then to the worker idle the longest (the
    /// smallest raw `busy_until`; the seed's `cache_only` tie rule), then rotate. Why idle
    /// longest: the worker that has computed nothing for the longest time has the coldest
    /// cache, so the blocks its LRU drops to store this request are the least recently used in
    /// the pool, the least likely to be asked for again. Rotating instead spreads new sessions
    /// evenly over warm and cold caches alike (measured: agent 400-block 4/s, 10 seeds, 90.25 ->
    /// 91.13%, see docs/router.md).
    pub fn pick(&self, ctx: &mut Ctx<'_>, cands: &[Candidate]) -> usize {
        let limit = ctx.ttft_slo.map_or(f64::INFINITY, |s| s * (1.0 - self.slo_margin));
        // Costs and times compared to the nanosecond, idle-since to the microsecond: values that
        // differ by float rounding alone (a learned speed equal to the configured one up to the
        // last bits) are equal, so their ties go by load, then coldness, then rotation.
        let key = |c: &Candidate| ((c.score * 1e9).round(), (c.predicted_ttft * 1e9).round());
        let load = |c: &Candidate| ((c.queue_delay * 1e9).round(), c.in_flight as f64, (c.busy_until * 1e6).round());
        let f = ctx.admission_work_factor;
        let feasible = |c: &Candidate| admission_ttft(c, f) <= limit;
        if let Some(i) = pick_min_by(ctx.tie_break, ctx.rotation, cands, feasible, key, load) {
            return i;
        }
        pick_min_by(ctx.tie_break, ctx.rotation, cands, |_| true, key, load).expect("non-empty")
    }
}

impl Policy for Slack {
    fn name(&self) -> &'static str {
        "slack"
    }
    fn needs(&self) -> Needs {
        self.eviction_needs()
    }
    fn default_admission_work_factor(&self) -> f64 {
        ADMISSION_WORK_FACTOR
    }
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason) {
        let scale = ctx.ttft_slo.unwrap_or(1.0);
        for c in cands.iter_mut() {
            c.score = self.cost(c, scale);
        }
        (self.pick(ctx, cands), Reason::Slack)
    }
}
