//! The per-worker load model: a virtual-time prefill queue (`busy_until`), in-flight requests,
//! decode batch and KV blocks in use, corrected by engine-reported metrics when they arrive.

use super::config::Role;
use crate::WorkerId;

/// Static description of a worker, given at registration.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    pub role: Role,
    /// Prefill throughput, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// KV cache capacity in blocks; None: unbounded (never the reason for a rejection).
    pub kv_capacity_blocks: Option<u64>,
    /// Saturated decode throughput over the whole batch, tokens per second; None: TPOT unknown.
    pub decode_tokens_per_s: Option<f64>,
    /// Prefix-cache capacity in blocks (the engine's reusable KV pool); None: unknown, and the
    /// router never charges a placement for the cached blocks it would evict.
    pub prefix_cache_blocks: Option<u64>,
}

impl Default for WorkerSpec {
    fn default() -> Self {
        WorkerSpec {
            role: Role::Both,
            prefill_tokens_per_s: 20_000.0,
            kv_capacity_blocks: None,
            decode_tokens_per_s: None,
            prefix_cache_blocks: None,
        }
    }
}

/// Latest engine-reported metrics (vLLM's `num_requests_waiting` / `running`, KV usage fraction).
#[derive(Clone, Copy, Debug, Default)]
pub struct Observed {
    pub waiting: Option<u32>,
    pub running: Option<u32>,
    pub kv_usage: Option<f64>,
}

/// One worker's load as the router keeps it.
#[derive(Clone, Debug)]
pub struct WorkerLoad {
    pub id: WorkerId,
    pub spec: WorkerSpec,
    /// Virtual time at which the worker's prefill queue drains (the seed's `busy[i]`).
    pub busy_until: f64,
    /// Requests in flight that occupy this worker (prefilling here, or decoding here).
    pub active: u32,
    /// Requests routed here whose prefill has not finished.
    pub prefilling: u32,
    /// Their uncached prompt tokens.
    pub prefill_tokens: u64,
    /// Requests decoding here (or admitted to decode here).
    pub decoding: u32,
    /// KV blocks those requests hold or will hold.
    pub decode_blocks: u64,
    pub observed: Observed,
}

impl WorkerLoad {
    pub fn new(id: WorkerId, spec: WorkerSpec) -> Self {
        WorkerLoad {
            id,
            spec,
            busy_until: 0.0,
            active: 0,
            prefilling: 0,
            prefill_tokens: 0,
            decoding: 0,
            decode_blocks: 0,
            observed: Observed::default(),
        }
    }

    /// Predicted wait before a new prefill starts: `max(busy_until - now, 0)`, as the seed has it.
    #[inline]
    pub fn queue_delay(&self, now: f64) -> f64 {
        (self.busy_until - now).max(0.0)
    }

    /// Seconds to prefill `uncached_tokens` here.
    #[inline]
    pub fn prefill_time(&self, uncached_tokens: u64) -> f64 {
        uncached_tokens as f64 / self.spec.prefill_tokens_per_s
    }

    /// Requests in flight: our own count, or the engine's report when it shows more.
    #[inline]
    pub fn in_flight(&self) -> u32 {
        let own = self.active;
        match (self.observed.waiting, self.observed.running) {
            (None, None) => own,
            (w, r) => own.max(w.unwrap_or(0) + r.unwrap_or(0)),
        }
    }

    /// Decode batch size: our own count, or the engine's running count when larger.
    #[inline]
    pub fn batch(&self) -> u32 {
        self.decoding.max(self.observed.running.unwrap_or(0))
    }

    /// KV blocks in use: our reservations, or the engine's usage when it reports more.
    #[inline]
    pub fn kv_used(&self) -> u64 {
        match (self.observed.kv_usage, self.spec.kv_capacity_blocks) {
            (Some(u), Some(cap)) => self.decode_blocks.max((u * cap as f64).round() as u64),
            _ => self.decode_blocks,
        }
    }

    /// Free KV blocks (u64::MAX when capacity is unbounded).
    #[inline]
    pub fn kv_free(&self) -> u64 {
        match self.spec.kv_capacity_blocks {
            Some(cap) => cap.saturating_sub(self.kv_used()),
            None => u64::MAX,
        }
    }

    /// Whether `need` more blocks fit with the configured headroom.
    #[inline]
    pub fn kv_fits(&self, need: u64, headroom: f64) -> bool {
        match self.spec.kv_capacity_blocks {
            Some(_) => need as f64 * (1.0 + headroom) <= self.kv_free() as f64,
            None => true,
        }
    }

    /// Predicted TPOT with one more sequence in the batch (None when decode speed is unknown).
    #[inline]
    pub fn tpot_with_one_more(&self, decode_step_s: f64) -> Option<f64> {
        self.spec.decode_tokens_per_s.map(|r| decode_step_s + (self.batch() as f64 + 1.0) / r)
    }

    /// Queues `work` seconds of prefill arriving at `now`; returns the predicted finish time.
    /// Exactly the seed's `busy[i] = max(busy[i], t) + work`.
    #[inline]
    pub fn enqueue_prefill(&mut self, now: f64, work: f64) -> f64 {
        self.busy_until = self.busy_until.max(now) + work;
        self.busy_until
    }
}

/// What the router remembers about an admitted request, for its lifecycle calls.
#[derive(Clone, Copy, Debug)]
pub struct InFlight {
    pub prefill_worker: WorkerId,
    pub decode_worker: WorkerId,
    pub uncached_tokens: u64,
    /// Prefill seconds it added to `prefill_worker`'s queue.
    pub work: f64,
    /// Predicted prefill finish (virtual time).
    pub done_at: f64,
    /// The worker's cumulative `prefill_done` correction when this request was queued: later
    /// corrections already moved `done_at` by the difference.
    pub shift_at: f64,
    pub kv_blocks: u64,
    pub prefill_pending: bool,
}
