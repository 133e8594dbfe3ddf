//! The Router's configuration, typed and nested: the policy with its own parameters, admission,
//! decode, PD transfer, the cache view between KV events. Defaults live here once; validated once.

pub use super::policy::TieBreak;
use super::policy::{finite_nonneg, PolicyConfig};
use super::RouterError;

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
    /// The seed documents' score, the highest 0.5 (1 - ITL / target) + 0.3 bandwidth
    /// + 0.2 (1 - batch / 256) among workers with KV room (headroom `kv_headroom`, 20% by default).
    Score,
}

impl DecodeRule {
    pub const NAMES: &'static [&'static str] = &["tpot", "score"];
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
    pub const NAMES: &'static [&'static str] = &["configured", "learned"];
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

/// Everything a Router is configured with; `Default` is the "simulator" preset (`Preset`).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Tokens per KV block (the engines' block size).
    pub block_size: usize,
    /// Seed of the block hashes (Dynamo's default 1337).
    pub hash_seed: u64,
    /// Seed of the Router's default random source (`crate::random`).
    pub seed: u64,
    pub tie_break: TieBreak,
    /// The policy, with its own parameters.
    pub policy: PolicyConfig,
    pub admission: AdmissionConfig,
    pub decode: DecodeConfig,
    pub pd: PdConfig,
    pub cache_view: CacheViewConfig,
    /// Where predicted TTFT comes from: the registered speeds in the simulator preset (its engines
    /// run at them), learned in the presets a deployment runs (`Preset`), where nobody knows them.
    pub ttft_model: TtftModel,
    /// Bounded token share (`share.rs`): a worker whose prompt tokens routed over the load window
    /// have reached this many times the prefill workers' mean (this request counted), and lead it
    /// by 8 requests of this one's size, is chosen only when every worker has. None: no bound. >= 1.
    pub token_share_bound: Option<f64>,
}

/// Whether a request is admitted: the SLOs, early rejection, size-aware shedding under overload.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionConfig {
    /// TTFT target in seconds; with `reject`, requests predicted to miss it are turned away.
    pub ttft_slo: Option<f64>,
    /// Early rejection: a request predicted to miss an SLO (or with no decode room) is not admitted.
    pub reject: bool,
    /// Size-aware admission: a request is admissible on a worker only when predicted TTFT +
    /// this * min(its prefill work, the queueing delay) keeps the TTFT SLO, so that under overload
    /// the expensive requests are turned away first and the queue keeps room for the many cheap
    /// (cached) ones; an idle worker still takes any prompt. 0: predicted TTFT <= SLO (the seed's
    /// rule). None: the policy's default (`Policy::default_admission_work_factor`).
    pub work_factor: Option<f64>,
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
    /// estimator's noise around capacity does not turn long prompts away. 0: the estimate itself.
    pub shed_load_sigmas: f64,
    /// Time constant (seconds) of the offered-load estimate (an exponentially decaying average).
    /// None: 5 x `ttft_slo`, or 10 s without one — a few SLOs, the horizon a queue lives for.
    pub load_window_s: Option<f64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            ttft_slo: None,
            reject: true,
            work_factor: None,
            shed_load_threshold: 1.0,
            shed_load_ramp: 1.0,
            shed_load_sigmas: 2.0,
            load_window_s: None,
        }
    }
}

impl AdmissionConfig {
    /// Time constant of the offered-load estimate, seconds.
    pub fn load_window(&self) -> f64 {
        self.load_window_s.unwrap_or(self.ttft_slo.map_or(10.0, |s| 5.0 * s))
    }

    /// The admission factor in force at offered load `rho` (fraction of prefill capacity), given
    /// the full factor `f` (`work_factor` or the policy's default).
    pub fn factor_at(&self, f: f64, rho: f64) -> f64 {
        if f == 0.0 || rho >= self.shed_load_threshold + self.shed_load_ramp {
            return f;
        }
        if rho < self.shed_load_threshold {
            return 0.0;
        }
        f * (rho - self.shed_load_threshold) / self.shed_load_ramp
    }
}

/// Decode: the TPOT model and target, and how a decode worker is chosen (PD mode).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeConfig {
    /// TPOT target in seconds; decode workers predicted to miss it are not chosen.
    pub tpot_slo: Option<f64>,
    /// Decode step time at batch size 0; TPOT(b) = step_s + b / decode_tokens_per_s.
    pub step_s: f64,
    /// A decode worker has room when used + need * (1 + headroom) <= capacity.
    pub kv_headroom: f64,
    /// PD mode: how the decode worker is chosen.
    pub rule: DecodeRule,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        DecodeConfig { tpot_slo: None, step_s: 0.01, kv_headroom: 0.2, rule: DecodeRule::Tpot }
    }
}

/// PD mode: the KV transfer's cost model, and when a prompt prefills on its decode worker instead.
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    /// KV cache bytes per token (for PD transfer time and prefix fetches).
    pub kv_bytes_per_token: f64,
    /// Bytes on the wire per byte of KV moved (1: uncompressed; 0.5: fp8 from 16-bit KV, the seed
    /// seed documents' compressed transfer).
    pub kv_compression: f64,
    /// KV transfer link bandwidth, bytes per second.
    pub link_bytes_per_s: f64,
    /// KV transfer latency per transfer, seconds.
    pub link_latency_s: f64,
    /// Prompts with at most this many uncached tokens prefill on their decode worker (0: off).
    pub local_prefill_max_tokens: u64,
    /// Conditional disaggregation: when the best disaggregated prefill would queue longer than
    /// this many seconds (the prefill pool is the bottleneck) and prefilling on the decode worker
    /// reaches the first token sooner, do that. None: off.
    pub prefill_busy_queue_s: Option<f64>,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            // Llama-3-70B-like: 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes.
            kv_bytes_per_token: 327_680.0,
            kv_compression: 1.0,
            // 200 Gb/s RDMA, 1 ms setup (seed 003's estimate).
            link_bytes_per_s: 25e9,
            link_latency_s: 0.001,
            local_prefill_max_tokens: 0,
            prefill_busy_queue_s: None,
        }
    }
}

impl PdConfig {
    /// Seconds to move `tokens` tokens of KV cache over the link (0 tokens: nothing to move).
    pub fn transfer_time(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        tokens as f64 * self.kv_bytes_per_token * self.kv_compression / self.link_bytes_per_s + self.link_latency_s
    }
}

/// The Router's view of the engines' caches between their KV events.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheViewConfig {
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
}

impl Default for CacheViewConfig {
    fn default() -> Self {
        CacheViewConfig {
            optimistic_insert: false,
            pending_prefixes: true,
            pending_grace_s: 1.0,
            pending_ttl_s: 60.0,
            stale_overlaps: true,
        }
    }
}

/// Where a Router runs, when that changes what a good default is. Each preset is the "simulator"
/// defaults with the few values its entry point needs changed, and says why. Every preset but the
/// simulator's learns the engines' prefill speed (`TtftModel::Learned`): a deployment is not told it,
/// and a registered guess (`WorkerSpec`'s default) would decide queueing and rejections wrongly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// The simulator (and `Router()`): 64-token blocks, the seed's; no token-share bound.
    Simulator,
    /// `kvroute serve` with KV events: the engines' block size is vLLM's default, 16.
    Gateway,
    /// `kvroute serve` without KV events (approximate mode): coarser 64-token text blocks, and no
    /// pending prefixes or stale-overlap corrections (the gateway stores each routed prefix in the
    /// index itself, and a removal is its own TTL dropping a guess, not an engine's eviction).
    GatewayApprox,
    /// Behind a host router (LiteLLM, Ray Serve): 16-token blocks, and a token-share bound of 1.25:
    /// the engines are unified, a prompt's tokens stay on its engine as KV for its whole decode,
    /// and a cache-affine policy would otherwise let one popular prefix family hold most of the
    /// pool's running KV (docs/router.md, "Bounded token share").
    HostRouter,
}

impl Preset {
    pub const NAMES: &'static [&'static str] = &["simulator", "gateway", "gateway_approx", "host_router"];
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "simulator" => Preset::Simulator,
            "gateway" => Preset::Gateway,
            "gateway_approx" => Preset::GatewayApprox,
            "host_router" => Preset::HostRouter,
            _ => return None,
        })
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            block_size: 64,
            hash_seed: crate::hash::DEFAULT_SEED,
            seed: 0,
            tie_break: TieBreak::Rotate,
            policy: PolicyConfig::default(),
            admission: AdmissionConfig::default(),
            decode: DecodeConfig::default(),
            pd: PdConfig::default(),
            cache_view: CacheViewConfig::default(),
            ttft_model: TtftModel::Configured,
            token_share_bound: None,
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

fn nonneg(name: &str, v: f64) -> Result<(), RouterError> {
    finite_nonneg(name, v).map_err(RouterError::InvalidConfig)
}

impl RouterConfig {
    /// The defaults for an entry point (see `Preset`).
    pub fn preset(preset: Preset) -> Self {
        let mut c = RouterConfig::default();
        if preset != Preset::Simulator {
            c.ttft_model = TtftModel::Learned;
        }
        match preset {
            Preset::Simulator => {}
            Preset::Gateway => c.block_size = 16,
            Preset::GatewayApprox => {
                c.cache_view.pending_prefixes = false;
                c.cache_view.stale_overlaps = false;
            }
            Preset::HostRouter => {
                c.block_size = 16;
                c.token_share_bound = Some(1.25);
            }
        }
        c
    }

    /// The admission work factor in force: `admission.work_factor`, or the policy's default.
    pub fn admission_work_factor(&self) -> f64 {
        self.admission.work_factor.unwrap_or_else(|| self.policy.build().default_admission_work_factor())
    }

    /// This config with the values left to a rule filled in (the admission work factor, the load
    /// window), as a Router uses them.
    pub fn resolved(&self) -> RouterConfig {
        let mut c = self.clone();
        c.admission.work_factor = Some(self.admission_work_factor());
        c.admission.load_window_s = Some(self.admission.load_window());
        c
    }

    pub fn validate(&self) -> Result<(), RouterError> {
        check(self.block_size >= 1, || format!("block_size must be >= 1, got {}", self.block_size))?;
        self.policy.validate().map_err(RouterError::InvalidConfig)?;
        let a = &self.admission;
        for (name, slo) in [("ttft_slo", a.ttft_slo), ("tpot_slo", self.decode.tpot_slo)] {
            if let Some(v) = slo {
                check(v.is_finite() && v > 0.0, || format!("{name} must be a finite number > 0 seconds, got {v}"))?;
            }
        }
        if let Some(f) = a.work_factor {
            nonneg("admission_work_factor", f)?;
        }
        nonneg("shed_load_threshold", a.shed_load_threshold)?;
        nonneg("shed_load_ramp", a.shed_load_ramp)?;
        nonneg("shed_load_sigmas", a.shed_load_sigmas)?;
        if let Some(w) = a.load_window_s {
            check(w.is_finite() && w > 0.0, || format!("load_window_s must be a finite number > 0 seconds, got {w}"))?;
        }
        nonneg("kv_headroom", self.decode.kv_headroom)?;
        nonneg("decode_step_s", self.decode.step_s)?;
        let pd = &self.pd;
        nonneg("kv_bytes_per_token", pd.kv_bytes_per_token)?;
        check(pd.kv_compression.is_finite() && pd.kv_compression > 0.0 && pd.kv_compression <= 1.0, || {
            format!("kv_compression must be in (0, 1] (bytes sent per KV byte), got {}", pd.kv_compression)
        })?;
        check(pd.link_bytes_per_s.is_finite() && pd.link_bytes_per_s > 0.0, || {
            format!("link_bytes_per_s must be a finite number > 0, got {}", pd.link_bytes_per_s)
        })?;
        nonneg("link_latency_s", pd.link_latency_s)?;
        if let Some(q) = pd.prefill_busy_queue_s {
            nonneg("prefill_busy_queue_s", q)?;
        }
        if let Some(b) = self.token_share_bound {
            check(b.is_finite() && b >= 1.0, || format!("token_share_bound must be a finite number >= 1 (times the mean share), got {b}"))?;
        }
        let v = &self.cache_view;
        nonneg("pending_grace_s", v.pending_grace_s)?;
        check(v.pending_ttl_s.is_finite() && v.pending_ttl_s > 0.0, || {
            format!("pending_ttl_s must be a finite number > 0 seconds, got {}", v.pending_ttl_s)
        })?;
        Ok(())
    }
}
