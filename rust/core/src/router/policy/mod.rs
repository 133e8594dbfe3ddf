//! Routing policies: one small file per policy behind the `Policy` trait, built from `PolicyConfig`.
//! Shared here: `PolicyConfig` (each policy with its own parameters) and the tie-break (`pick_min`),
//! so every policy breaks ties alike.

mod cache_aware;
mod cache_only;
mod capacity;
mod cost;
mod least_load;
mod node_score;
mod random;
mod round_robin;
mod slack;
mod ttft;

pub use cache_aware::CacheAware;
pub use capacity::Capacity;
pub use cost::Cost;
pub use slack::Slack;

use super::decision::{Candidate, Reason};
use crate::random::RandomSource;

/// How remaining ties between equally scored workers are broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TieBreak {
    /// Lower load first (queueing delay, then in-flight requests), then rotate among the rest,
    /// so equal scores never pile onto one worker.
    Rotate,
    /// The lowest worker id, as the seed's `min(range(N), key=...)` does.
    Lowest,
}

impl TieBreak {
    pub const NAMES: &'static [&'static str] = &["rotate", "lowest"];
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "rotate" => Some(TieBreak::Rotate),
            "lowest" => Some(TieBreak::Lowest),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            TieBreak::Rotate => "rotate",
            TieBreak::Lowest => "lowest",
        }
    }
}

/// A policy and its own parameters. `PolicyConfig::named` gives a policy with its defaults.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyConfig {
    Random,
    RoundRobin,
    LeastLoad,
    CacheOnly,
    CacheAware(CacheAware),
    Ttft,
    NodeScore,
    Cost(Cost),
    Capacity(Capacity),
    Slack(Slack),
}

impl Default for PolicyConfig {
    /// "capacity" (docs/router.md says why it is the default).
    fn default() -> Self {
        PolicyConfig::Capacity(Capacity::default())
    }
}

impl PolicyConfig {
    /// Every policy's name, as `named` accepts them.
    pub const NAMES: &'static [&'static str] =
        &["random", "round_robin", "least_load", "cache_only", "cache_aware", "ttft", "cost", "node_score", "capacity", "slack"];

    /// The policy called `name`, with its default parameters.
    pub fn named(name: &str) -> Option<Self> {
        Some(match name {
            "random" => PolicyConfig::Random,
            "round_robin" => PolicyConfig::RoundRobin,
            "least_load" => PolicyConfig::LeastLoad,
            "cache_only" => PolicyConfig::CacheOnly,
            "cache_aware" => PolicyConfig::CacheAware(CacheAware::default()),
            "ttft" => PolicyConfig::Ttft,
            "node_score" => PolicyConfig::NodeScore,
            "cost" => PolicyConfig::Cost(Cost::default()),
            "capacity" => PolicyConfig::Capacity(Capacity::default()),
            "slack" => PolicyConfig::Slack(Slack::default()),
            _ => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        self.build().name()
    }

    /// The policy itself.
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyConfig::Random => Box::new(random::Random),
            PolicyConfig::RoundRobin => Box::new(round_robin::RoundRobin),
            PolicyConfig::LeastLoad => Box::new(least_load::LeastLoad),
            PolicyConfig::CacheOnly => Box::new(cache_only::CacheOnly),
            PolicyConfig::CacheAware(p) => Box::new(p.clone()),
            PolicyConfig::Ttft => Box::new(ttft::Ttft),
            PolicyConfig::NodeScore => Box::new(node_score::NodeScore),
            PolicyConfig::Cost(p) => Box::new(p.clone()),
            PolicyConfig::Capacity(p) => Box::new(p.clone()),
            PolicyConfig::Slack(p) => Box::new(p.clone()),
        }
    }

    /// Checks the parameters: `Err` names the first bad one and what was expected.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            PolicyConfig::CacheAware(p) => p.validate(),
            PolicyConfig::Cost(p) => p.validate(),
            PolicyConfig::Capacity(p) => p.slack.validate(),
            PolicyConfig::Slack(p) => p.validate(),
            _ => Ok(()),
        }
    }
}

/// `Ok` when `v` is a finite number >= 0, else the message saying so.
pub(crate) fn finite_nonneg(name: &str, v: f64) -> Result<(), String> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} must be a finite number >= 0, got {v}"))
    }
}

/// What a policy needs the router to measure for it, beyond overlap and load. The router reads
/// the index's occupancy and removal log only for policies that ask (both cost time per route).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// Per worker with a `prefix_cache_blocks` size, the blocks a placement would evict
    /// (`Candidate::evicted_blocks`, `cache_fill`), from the index's count of its cached blocks.
    pub evictions: bool,
    /// That occupancy raised by the engine's reported KV usage when it is higher (blocks held by
    /// running requests but not, or not yet, cached).
    pub usage_occupancy: bool,
    /// `Candidate::evict_time`: the prefill seconds of what a placement evicts.
    pub evict_time: bool,
    /// `Ctx::reuse`: how often the engines' evicted blocks are asked for again (the removal log).
    pub eviction_reuse: bool,
}

/// Mutable routing state a policy may advance (under the router's lock).
pub struct Ctx<'a> {
    pub tie_break: TieBreak,
    pub rotation: &'a mut u64,
    pub rr: &'a mut u64,
    /// The Router's random source (see `crate::random`).
    pub rng: &'a mut dyn RandomSource,
    pub num_tokens: u64,
    pub block_size: usize,
    pub ttft_slo: Option<f64>,
    /// The admission work factor in force (see `AdmissionConfig::work_factor`).
    pub admission_work_factor: f64,
    /// How likely an evicted block is to be asked for again (`Needs::eviction_reuse`).
    pub reuse: f64,
}

/// The figure admission compares with the TTFT SLO: predicted TTFT plus `factor` times the part of
/// the request's work that competes with an existing queue, min(work, queueing delay). On an idle
/// worker that is 0, so a long prompt is never refused for its length alone.
#[inline]
pub fn admission_ttft(c: &Candidate, factor: f64) -> f64 {
    if factor == 0.0 {
        c.predicted_ttft
    } else {
        c.predicted_ttft + factor * (c.prefill_time + c.transfer_time).min(c.queue_delay)
    }
}

/// Chooses one of `cands` (never empty, ordered by worker id) and says why; may fill `score`.
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    fn choose(&self, ctx: &mut Ctx<'_>, cands: &mut [Candidate]) -> (usize, Reason);
    /// What the router must measure for this policy (nothing beyond overlap and load by default).
    fn needs(&self) -> Needs {
        Needs::default()
    }
    /// The admission work factor when the config leaves it unset (`AdmissionConfig::work_factor`).
    fn default_admission_work_factor(&self) -> f64 {
        0.0
    }
}

/// Index of the candidate with the smallest `key` among those `allowed`, ties broken per
/// `ctx.tie_break` (load = queueing delay, then in-flight requests). Allocation-free.
pub fn pick_min(
    ctx: &mut Ctx<'_>,
    cands: &[Candidate],
    allowed: impl Fn(&Candidate) -> bool,
    key: impl Fn(&Candidate) -> (f64, f64),
) -> Option<usize> {
    pick_min_by(ctx.tie_break, ctx.rotation, cands, allowed, key, |c| (c.queue_delay, c.in_flight as f64))
}

/// `pick_min` over any items: the first minimum in slice order for `TieBreak::Lowest` (the seed's
/// `min(range(N), key=...)`); for `Rotate`, among exact ties the least `load`, then the
/// `rotation`-th of those (advancing `rotation`), so ties never collapse onto one worker.
pub fn pick_min_by<T, L: PartialOrd + Copy>(
    tie_break: TieBreak,
    rotation: &mut u64,
    items: &[T],
    allowed: impl Fn(&T) -> bool,
    key: impl Fn(&T) -> (f64, f64),
    load: impl Fn(&T) -> L,
) -> Option<usize> {
    // Keys and loads compare lexicographically (tuples' `PartialOrd`; a NaN is never smaller).
    let mut best: Option<(usize, (f64, f64))> = None;
    for (i, c) in items.iter().enumerate() {
        if !allowed(c) {
            continue;
        }
        let k = key(c);
        if best.map_or(true, |(_, b)| k < b) {
            best = Some((i, k));
        }
    }
    let (first, bk) = best?;
    if tie_break == TieBreak::Lowest {
        return Some(first);
    }
    let tied = |c: &T| allowed(c) && key(c) == bk;
    let mut min_load = load(&items[first]);
    let mut count = 0u64;
    for c in items.iter().filter(|c| tied(c)) {
        let l = load(c);
        if l < min_load {
            min_load = l;
            count = 1;
        } else if l == min_load {
            count += 1;
        }
    }
    let nth = if count <= 1 {
        0
    } else {
        let n = *rotation % count;
        *rotation = rotation.wrapping_add(1);
        n
    };
    items.iter().enumerate().filter(|(_, c)| tied(c) && load(c) == min_load).nth(nth as usize).map(|(i, _)| i)
}
