//! Routing policies: one small file per policy behind the `Policy` trait, built by name.
//! Shared here: the tie-break (`pick_min`) and a tiny seeded PRNG, so every policy breaks ties alike.

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

use super::config::{RouterConfig, TieBreak};
use super::decision::{Candidate, Reason};

/// Policy names accepted by `make_policy` (and `RouterConfig::policy`).
pub const POLICIES: &[&str] =
    &["random", "round_robin", "least_load", "cache_only", "cache_aware", "ttft", "cost", "node_score", "capacity", "slack"];

/// Mutable routing state a policy may advance (under the router's lock).
pub struct Ctx<'a> {
    pub tie_break: TieBreak,
    pub rotation: &'a mut u64,
    pub rr: &'a mut u64,
    pub rng: &'a mut Rng,
    /// CPython's `random.Random(seed)`, for "random" (`randrange(n)` per decision, as the seed draws).
    pub py_rng: &'a mut crate::sim::PyRandom,
    pub num_tokens: u64,
    pub block_size: usize,
    pub ttft_slo: Option<f64>,
    /// See `RouterConfig::admission_work_factor`.
    pub admission_work_factor: f64,
    /// Recent fraction of arriving prompt blocks that were cached somewhere ("capacity").
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
}

/// Builds a policy by name with its parameters from `cfg`.
pub fn make_policy(cfg: &RouterConfig) -> Option<Box<dyn Policy>> {
    Some(match cfg.policy.as_str() {
        "random" => Box::new(random::Random),
        "round_robin" => Box::new(round_robin::RoundRobin),
        "least_load" => Box::new(least_load::LeastLoad),
        "cache_only" => Box::new(cache_only::CacheOnly),
        "cache_aware" => Box::new(cache_aware::CacheAware {
            cache_threshold: cfg.cache_threshold,
            balance_abs_threshold: cfg.balance_abs_threshold,
            balance_rel_threshold: cfg.balance_rel_threshold,
        }),
        "ttft" => Box::new(ttft::Ttft),
        "node_score" => Box::new(node_score::NodeScore),
        "cost" => Box::new(cost::Cost { prefill_load_scale: cfg.prefill_load_scale, temperature: cfg.temperature }),
        "capacity" => Box::new(capacity::Capacity {
            slack: slack::Slack {
                queue_weight: cfg.queue_weight,
                prefill_weight: cfg.prefill_weight,
                pressure_weight: cfg.pressure_weight,
                eviction_weight: 0.0,
                slo_margin: cfg.slo_margin,
            },
        }),
        "slack" => Box::new(slack::Slack {
            queue_weight: cfg.queue_weight,
            prefill_weight: cfg.prefill_weight,
            pressure_weight: cfg.pressure_weight,
            eviction_weight: cfg.eviction_weight,
            slo_margin: cfg.slo_margin,
        }),
        _ => return None,
    })
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

/// SplitMix64: a small, seeded, well-mixed generator (enough for routing choices).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform in 0..n (n > 0), without modulo bias worth caring about for n << 2^64.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}
