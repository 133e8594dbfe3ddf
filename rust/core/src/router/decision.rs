//! What a routing call returns (`Decision`) and the per-worker figures policies score (`Candidate`).
//! Reasons and paths are closed enums so callers can match on them; names are the Python strings.

use crate::WorkerId;

/// Why the worker was chosen, or why the request was turned away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Best prefix overlap won ("cache_only", "cache_aware" below the balance threshold).
    Cache,
    /// "cache_aware" saw imbalance and took the least-loaded worker.
    Balance,
    LeastLoad,
    Random,
    RoundRobin,
    /// Minimum predicted TTFT.
    Ttft,
    /// Minimum Dynamo cost.
    Cost,
    /// "slack": cheapest prefill among workers that keep the TTFT SLO.
    Slack,
    /// The seed documents' weighted node score.
    NodeScore,
    /// Capacity-aware placement: slack's cost plus the recompute the cache it fills will cause.
    Capacity,
    /// The caller named the worker.
    Pinned,
    /// The policy's choice would miss the TTFT SLO; the minimum-TTFT worker was taken instead.
    SloFallback,
    /// PD mode: prefilled on the decode worker because the prompt is short.
    ShortPrompt,
    /// PD mode: prefilled on the decode worker because it reaches the first token sooner.
    PrefillPoolBusy,
    RejectedTtft,
    RejectedDecode,
    RejectedTpot,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Cache => "cache",
            Reason::Balance => "balance",
            Reason::LeastLoad => "least_load",
            Reason::Random => "random",
            Reason::RoundRobin => "round_robin",
            Reason::Ttft => "ttft",
            Reason::Cost => "cost",
            Reason::Slack => "slack",
            Reason::NodeScore => "node_score",
            Reason::Capacity => "capacity",
            Reason::Pinned => "pinned",
            Reason::SloFallback => "slo_fallback",
            Reason::ShortPrompt => "short_prompt",
            Reason::PrefillPoolBusy => "prefill_pool_busy",
            Reason::RejectedTtft => "rejected_ttft",
            Reason::RejectedDecode => "rejected_decode",
            Reason::RejectedTpot => "rejected_tpot",
        }
    }
    pub fn is_rejection(self) -> bool {
        matches!(self, Reason::RejectedTtft | Reason::RejectedDecode | Reason::RejectedTpot)
    }
}

/// How the request is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// One worker prefills and decodes.
    Unified,
    /// PD mode: prefill worker, KV transfer, decode worker.
    Disaggregated,
    /// PD mode, conditional disaggregation: the decode worker prefills itself.
    Local,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Unified => "unified",
            Path::Disaggregated => "disaggregated",
            Path::Local => "local",
        }
    }
}

/// One prefill candidate as policies see it. Times are seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Candidate {
    pub worker: WorkerId,
    /// Leading prompt blocks this worker already holds (index match depth).
    pub overlap_blocks: u32,
    pub uncached_tokens: u64,
    pub busy_until: f64,
    /// `max(busy_until - now, 0)`.
    pub queue_delay: f64,
    /// Uncached tokens / prefill speed.
    pub prefill_time: f64,
    /// KV transfer to the decode worker (PD mode), else 0.
    pub transfer_time: f64,
    /// A unified worker (role "both") registered with `decode_tokens_per_s`: the engine step the
    /// prefill runs in also runs the requests decoding there, `decode_step_s + in_flight /
    /// decode_tokens_per_s`; else 0.
    pub step_time: f64,
    /// queue_delay + prefill_time + transfer_time + step_time.
    pub predicted_ttft: f64,
    pub in_flight: u32,
    /// Requests waiting for (or in) prefill here: our own count, or the engine's report when larger.
    pub queued: u32,
    /// The worker's prefill speed, tokens per second.
    pub prefill_speed: f64,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// Prefill seconds' worth of cached blocks this worker's LRU would evict to store the
    /// request's uncached blocks (0 while its prefix cache has room, or its size is unknown).
    pub evict_time: f64,
    /// Capacity-aware placement ("capacity"; workers with `prefix_cache_blocks`): full blocks the
    /// worker would store for this prompt (those it lacks), how many of them its prefix cache can
    /// only take by evicting cached blocks, and its cache's occupied fraction (engine-reported
    /// `kv_usage` when known, else the index's count); all 0 when not computed.
    pub stored_blocks: u64,
    pub evicted_blocks: u64,
    pub cache_fill: f64,
    /// The policy's score (lower is better), for `explain`.
    pub score: f64,
}

/// Per-worker figures behind a decision (`route(..., explain=True)`).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerBreakdown {
    pub worker: WorkerId,
    pub overlap_blocks: u32,
    pub queue_delay: f64,
    pub prefill_time: f64,
    pub transfer_time: f64,
    pub step_time: f64,
    pub predicted_ttft: f64,
    pub in_flight: u32,
    pub score: f64,
}

impl From<&Candidate> for WorkerBreakdown {
    fn from(c: &Candidate) -> Self {
        WorkerBreakdown {
            worker: c.worker,
            overlap_blocks: c.overlap_blocks,
            queue_delay: c.queue_delay,
            prefill_time: c.prefill_time,
            transfer_time: c.transfer_time,
            step_time: c.step_time,
            predicted_ttft: c.predicted_ttft,
            in_flight: c.in_flight,
            score: c.score,
        }
    }
}

/// The outcome of one `route` call.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Prefill (or unified) worker; for a rejection, the worker that was judged.
    pub worker: WorkerId,
    /// PD mode: the decode worker.
    pub decode_worker: Option<WorkerId>,
    pub overlap_blocks: u32,
    /// Prompt tokens (including a trailing partial block).
    pub num_tokens: u64,
    pub uncached_tokens: u64,
    pub queue_delay: f64,
    pub predicted_ttft: f64,
    pub predicted_tpot: Option<f64>,
    /// The prefill worker's `busy_until` after admission (unchanged for a rejection).
    pub busy_until: f64,
    pub admitted: bool,
    pub reason: Reason,
    pub path: Path,
    /// Hot-prefix relief: a worker holding a longer prefix than `worker` from which pulling the
    /// extra blocks is predicted cheaper than recomputing them.
    pub fetch_from: Option<WorkerId>,
    pub request_id: Option<u64>,
    pub explain: Option<Vec<WorkerBreakdown>>,
}
