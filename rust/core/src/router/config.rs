//! The Router's configuration: policy choice and its parameters, SLOs, the PD-mode cost model.
//! Validated once at construction so the hot path never re-checks it.

use super::RouterError;

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

/// A worker's part in serving: unified (prefill and decode), prefill-only or decode-only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Both,
    Prefill,
    Decode,
}

impl Role {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "both" => Some(Role::Both),
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }
}

/// How the decode worker is chosen in PD mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeRule {
    /// Lowest predicted TPOT with the request, then most free KV blocks.
    Tpot,
    /// The seed 003 chapter's score, the highest 0.5 (1 - ITL / target) + 0.3 bandwidth
    /// + 0.2 (1 - batch / 256) among workers with KV room (headroom `kv_headroom`, 20% by default).
    Score,
}

impl DecodeRule {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "tpot" => Some(DecodeRule::Tpot),
            "score" => Some(DecodeRule::Score),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DecodeRule::Tpot => "tpot",
            DecodeRule::Score => "score",
        }
    }
}

/// Where the Router's TTFT prediction (queueing delay + prefill time per worker) comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TtftModel {
    /// The registered `prefill_tokens_per_s` and the virtual-time FIFO queue (the seed's model;
    /// exact for engines that prefill at that speed one request at a time, as the simulator's do).
    Configured,
    /// The same virtual-time queue, with each worker's prefill time learned online from the
    /// prefills the router sees finish (`prefill_done`): overhead + seconds_per_token * uncached
    /// tokens, see `PrefillFit`; the configured speed until it has `PrefillFit::MIN_SAMPLES`
    /// measurements of that worker.
    Learned,
}

impl TtftModel {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "configured" => Some(TtftModel::Configured),
            "learned" => Some(TtftModel::Learned),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            TtftModel::Configured => "configured",
            TtftModel::Learned => "learned",
        }
    }
}

/// Everything a Router is configured with; `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Tokens per KV block (the engines' block size).
    pub block_size: usize,
    /// Seed of the block hashes (Dynamo's default 1337).
    pub hash_seed: u64,
    /// Policy name; see `policy::POLICIES`.
    pub policy: String,
    pub tie_break: TieBreak,
    /// Seed of the random choices ("random", "cost" with a temperature).
    pub seed: u64,
    /// TTFT target in seconds; with `reject`, requests predicted to miss it are turned away.
    pub ttft_slo: Option<f64>,
    /// TPOT target in seconds; decode workers predicted to miss it are not chosen.
    pub tpot_slo: Option<f64>,
    /// Size-aware admission: a request is admissible on a worker only when predicted TTFT +
    /// this * min(its prefill work, the queueing delay) keeps the TTFT SLO, so that under overload
    /// the expensive requests are turned away first and the queue keeps room for the many cheap
    /// (cached) ones; an idle worker still takes any prompt. 0: predicted TTFT <= SLO (the seed's rule).
    /// None: the policy's default (2 for "slack" and "capacity", 0 for the others).
    pub admission_work_factor: Option<f64>,
    /// Size-aware admission is for overload only: the factor applies in full while the offered
    /// prefill load (uncached tokens per second of the arriving requests, at their cheapest
    /// worker, over the pool's prefill capacity; see `load_window_s`) is at least
    /// `shed_load_threshold + shed_load_ramp`, not at all below `shed_load_threshold`, and
    /// linearly in between. Below capacity every request the prediction admits is served, so
    /// turning long prompts away buys nothing. 0 and 0: always in full.
    pub shed_load_threshold: f64,
    /// See `shed_load_threshold`.
    pub shed_load_ramp: f64,
    /// Shed only on evident overload: the offered load compared with `shed_load_threshold` is the
    /// estimate minus this many of its standard errors (arrivals as a compound Poisson stream:
    /// the decaying average has variance rate * E[tokens^2] / (2 * window)), so that the
    /// estimator's noise around capacity does not turn long prompts away. Default 2 (a one-sided
    /// ~98% bound); 0: the estimate itself (the previous rule).
    pub shed_load_sigmas: f64,
    /// Time constant (seconds) of the offered-load estimate (an exponentially decaying average).
    /// None: 5 x `ttft_slo`, or 10 s without one — a few SLOs, the horizon a queue lives for.
    pub load_window_s: Option<f64>,
    /// Early rejection: a request predicted to miss an SLO (or with no decode room) is not admitted.
    pub reject: bool,
    /// "cache_aware": route to the best-overlap worker when matched tokens / prompt tokens exceed this.
    pub cache_threshold: f64,
    /// "cache_aware": the load gap (in-flight requests) beyond which the system counts as imbalanced ...
    pub balance_abs_threshold: f64,
    /// ... when also max_load > this * min_load.
    pub balance_rel_threshold: f64,
    /// "cost": weight of the prefill blocks against decode blocks (Dynamo's `prefill_load_scale`).
    pub prefill_load_scale: f64,
    /// "cost": softmax temperature over normalised costs; 0 takes the minimum.
    pub temperature: f64,
    /// "slack" and "capacity" (the default policy): weight of the queueing delay a worker would impose.
    pub queue_weight: f64,
    /// "slack": weight of the uncached prefill time (the compute the choice spends, which every
    /// later request on that worker waits for).
    pub prefill_weight: f64,
    /// "slack": weight of the queueing the choice imposes on later requests there, modelled as
    /// work * (queue + work) / ttft_slo (convex: the same work hurts more on a worker near the SLO).
    pub pressure_weight: f64,
    /// "slack": weight of `evict_time`, the prefill seconds of cached blocks a worker's full prefix
    /// cache would evict to store the request (workers registered with `prefix_cache_blocks`).
    /// 0 (the default): not charged, and occupancy is not looked up.
    pub eviction_weight: f64,
    /// "slack": fraction of the TTFT SLO held back as a safety margin when judging feasibility.
    pub slo_margin: f64,
    /// A decode worker has room when used + need * (1 + headroom) <= capacity.
    pub kv_headroom: f64,
    /// Decode step time at batch size 0; TPOT(b) = decode_step_s + b / decode_tokens_per_s.
    pub decode_step_s: f64,
    /// PD mode: how the decode worker is chosen.
    pub decode_rule: DecodeRule,
    /// KV cache bytes per token (for PD transfer time and prefix fetches).
    pub kv_bytes_per_token: f64,
    /// Bytes on the wire per byte of KV moved (1: uncompressed; 0.5: fp8 from 16-bit KV, the seed
    /// 003 chapter's compressed transfer).
    pub kv_compression: f64,
    /// KV transfer link bandwidth, bytes per second.
    pub link_bytes_per_s: f64,
    /// KV transfer latency per transfer, seconds.
    pub link_latency_s: f64,
    /// PD mode: prompts with at most this many uncached tokens prefill on their decode worker (0: off).
    pub local_prefill_max_tokens: u64,
    /// PD mode, conditional disaggregation: when the best disaggregated prefill would queue longer
    /// than this many seconds (the prefill pool is the bottleneck) and prefilling on the decode
    /// worker reaches the first token sooner, do that. None: off.
    pub prefill_busy_queue_s: Option<f64>,
    /// Record the routed prefix in the index at once (approximate mode, without KV events).
    pub optimistic_insert: bool,
    /// Count a routed request's full blocks as cached on its prefill worker until the engine's KV
    /// events can have reported them (see `pending.rs`): a policy sees, per worker, the longer of
    /// the index's overlap and this pending one.
    pub pending_prefixes: bool,
    /// Seconds a pending prefix outlives its request's `prefill_done` (or `finished`): the lag
    /// of the engine's KV events behind the prefill that computed the blocks.
    pub pending_grace_s: f64,
    /// Seconds a tracked request's prefix stays pending when its prefill is never reported (a
    /// caller that never calls `prefill_done` / `finished` / `cancel`): bounds the memory.
    pub pending_ttl_s: f64,
    /// Correct a queued request's predicted prefill when a removal arrives for blocks it was
    /// routed as holding (see `stale.rs`): the event lag can hide an eviction from the routing.
    pub stale_overlaps: bool,
    /// Where predicted TTFT comes from (default: the registered speeds; see `TtftModel::Learned`
    /// and docs/router.md for why learning is not the default yet).
    pub ttft_model: TtftModel,
    /// Bounded token share (`share.rs`): a worker whose prompt tokens routed over the load window
    /// have reached this many times the prefill workers' mean (this request counted), and lead it
    /// by 8 requests of this one's size, is chosen only when every worker has. None (the Router's
    /// default): no bound. >= 1.
    pub token_share_bound: Option<f64>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            block_size: 64,
            hash_seed: crate::hash::DEFAULT_SEED,
            policy: "capacity".to_string(),
            tie_break: TieBreak::Rotate,
            seed: 0,
            ttft_slo: None,
            tpot_slo: None,
            reject: true,
            admission_work_factor: None,
            shed_load_threshold: 1.0,
            shed_load_ramp: 1.0,
            shed_load_sigmas: 2.0,
            load_window_s: None,
            cache_threshold: 0.3,
            balance_abs_threshold: 64.0,
            balance_rel_threshold: 1.5,
            prefill_load_scale: 1.0,
            temperature: 0.0,
            queue_weight: 0.2,
            prefill_weight: 1.0,
            pressure_weight: 8.0,
            slo_margin: 0.0,
            eviction_weight: 0.0,
            kv_headroom: 0.2,
            decode_step_s: 0.01,
            // Llama-3-70B-like: 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
            kv_bytes_per_token: 327_680.0,
            kv_compression: 1.0,
            decode_rule: DecodeRule::Tpot,
            // 200 Gb/s RDMA, 1 ms setup (seed 003's estimate).
            link_bytes_per_s: 25e9,
            link_latency_s: 0.001,
            local_prefill_max_tokens: 0,
            prefill_busy_queue_s: None,
            optimistic_insert: false,
            pending_prefixes: true,
            pending_grace_s: 1.0,
            pending_ttl_s: 60.0,
            stale_overlaps: true,
            token_share_bound: None,
            ttft_model: TtftModel::Configured,
        }
    }
}

fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<(), RouterError> {
    if ok {
        Ok(())
    } else {
        Err(RouterError::InvalidConfig(msg()))
    }
}

fn finite_nonneg(name: &str, v: f64) -> Result<(), RouterError> {
    check(v.is_finite() && v >= 0.0, || format!("{name} must be a finite number >= 0, got {v}"))
}

impl RouterConfig {
    /// `admission_work_factor`, or the policy's default when unset.
    pub fn admission_factor(&self) -> f64 {
        self.admission_work_factor.unwrap_or(if matches!(self.policy.as_str(), "slack" | "capacity") { 2.0 } else { 0.0 })
    }

    /// Time constant of the offered-load estimate, seconds.
    pub fn load_window(&self) -> f64 {
        self.load_window_s.unwrap_or(self.ttft_slo.map_or(10.0, |s| 5.0 * s))
    }

    /// The admission factor in force at offered load `rho` (fraction of prefill capacity).
    pub fn admission_factor_at(&self, rho: f64) -> f64 {
        let f = self.admission_factor();
        if f == 0.0 || rho >= self.shed_load_threshold + self.shed_load_ramp {
            return f;
        }
        if rho < self.shed_load_threshold {
            return 0.0;
        }
        f * (rho - self.shed_load_threshold) / self.shed_load_ramp
    }

    pub fn validate(&self) -> Result<(), RouterError> {
        check(self.block_size >= 1, || format!("block_size must be >= 1, got {}", self.block_size))?;
        check(super::policy::POLICIES.contains(&self.policy.as_str()), || {
            format!("unknown policy {:?}; expected one of {}", self.policy, super::policy::POLICIES.join(", "))
        })?;
        for (name, slo) in [("ttft_slo", self.ttft_slo), ("tpot_slo", self.tpot_slo)] {
            if let Some(v) = slo {
                check(v.is_finite() && v > 0.0, || format!("{name} must be a finite number > 0 seconds, got {v}"))?;
            }
        }
        check((0.0..=1.0).contains(&self.cache_threshold), || format!("cache_threshold must be in [0, 1], got {}", self.cache_threshold))?;
        finite_nonneg("balance_abs_threshold", self.balance_abs_threshold)?;
        finite_nonneg("balance_rel_threshold", self.balance_rel_threshold)?;
        finite_nonneg("prefill_load_scale", self.prefill_load_scale)?;
        finite_nonneg("temperature", self.temperature)?;
        finite_nonneg("queue_weight", self.queue_weight)?;
        finite_nonneg("prefill_weight", self.prefill_weight)?;
        finite_nonneg("pressure_weight", self.pressure_weight)?;
        if let Some(f) = self.admission_work_factor {
            finite_nonneg("admission_work_factor", f)?;
        }
        finite_nonneg("shed_load_threshold", self.shed_load_threshold)?;
        finite_nonneg("shed_load_ramp", self.shed_load_ramp)?;
        finite_nonneg("shed_load_sigmas", self.shed_load_sigmas)?;
        finite_nonneg("eviction_weight", self.eviction_weight)?;
        if let Some(w) = self.load_window_s {
            check(w.is_finite() && w > 0.0, || format!("load_window_s must be a finite number > 0 seconds, got {w}"))?;
        }
        check((0.0..1.0).contains(&self.slo_margin), || format!("slo_margin must be in [0, 1), got {}", self.slo_margin))?;
        finite_nonneg("kv_headroom", self.kv_headroom)?;
        finite_nonneg("decode_step_s", self.decode_step_s)?;
        finite_nonneg("kv_bytes_per_token", self.kv_bytes_per_token)?;
        check(self.kv_compression.is_finite() && self.kv_compression > 0.0 && self.kv_compression <= 1.0, || {
            format!("kv_compression must be in (0, 1] (bytes sent per KV byte), got {}", self.kv_compression)
        })?;
        check(self.link_bytes_per_s.is_finite() && self.link_bytes_per_s > 0.0, || {
            format!("link_bytes_per_s must be a finite number > 0, got {}", self.link_bytes_per_s)
        })?;
        finite_nonneg("link_latency_s", self.link_latency_s)?;
        if let Some(q) = self.prefill_busy_queue_s {
            finite_nonneg("prefill_busy_queue_s", q)?;
        }
        if let Some(b) = self.token_share_bound {
            check(b.is_finite() && b >= 1.0, || format!("token_share_bound must be a finite number >= 1 (times the mean share), got {b}"))?;
        }
        finite_nonneg("pending_grace_s", self.pending_grace_s)?;
        check(self.pending_ttl_s.is_finite() && self.pending_ttl_s > 0.0, || {
            format!("pending_ttl_s must be a finite number > 0 seconds, got {}", self.pending_ttl_s)
        })?;
        Ok(())
    }

    /// Whether routing charges what a placement evicts from a worker's prefix cache (policy
    /// "capacity", or `eviction_weight` > 0), and so needs the workers' cache occupancy.
    pub fn charges_evictions(&self) -> bool {
        self.policy == "capacity" || self.eviction_weight > 0.0
    }

    /// Whether the router reads the index's removal log: pending prefixes end at a removal,
    /// "capacity" measures how often an evicted block is asked for again, and a removal can show a
    /// queued request's overlap stale.
    pub fn reads_removals(&self) -> bool {
        self.pending_prefixes || self.policy == "capacity" || self.stale_overlaps
    }

    /// Seconds to move `tokens` tokens of KV cache over the link (0 tokens: nothing to move).
    pub fn transfer_time(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        tokens as f64 * self.kv_bytes_per_token * self.kv_compression / self.link_bytes_per_s + self.link_latency_s
    }
}
