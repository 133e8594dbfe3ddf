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
    /// Most requests the engine runs at once (vLLM `max_num_seqs`, SGLang `max_running_requests`);
    /// a unified worker with this many in flight has no seat: a new request waits there for one
    /// to finish, so it is chosen only when no worker has a seat. None: unknown (never full).
    pub max_running: Option<u32>,
}

impl Default for WorkerSpec {
    fn default() -> Self {
        WorkerSpec {
            role: Role::Both,
            prefill_tokens_per_s: 20_000.0,
            kv_capacity_blocks: None,
            decode_tokens_per_s: None,
            prefix_cache_blocks: None,
            max_running: None,
        }
    }
}

/// An online fit of one worker's prefill time as `overhead + seconds_per_token * uncached tokens`,
/// from the prefills the router sees finish (`prefill_done`): each one's *service time* is its
/// finish minus the later of its routing and the previous finish there (the engine was busy with
/// it from then on), regressed on its uncached tokens by exponentially weighted least squares (a
/// sample's weight decays by `1 - 1 / MEMORY` per later sample: a memory of ~64 requests per worker).
/// Why service time, not TTFT: TTFT = queueing + own work, and the queue is already modelled
/// (the virtual-time queue, corrected by `prefill_done`); what the router lacks is the work per
/// token. Over a busy period the service times sum to its length, so an engine that batches
/// prefills (several finish close together) still gets its true throughput; on a FIFO engine of
/// speed S (the simulator's) the fit is exactly `(0, 1 / S)`. The intercept holds what does not
/// scale with tokens (HTTP, scheduling, the first decode step, running decodes' share).
#[derive(Clone, Debug)]
pub struct PrefillFit {
    /// A sample's weight decays by this per later sample.
    keep: f64,
    weight: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    syy: f64,
    samples: u64,
    /// (overhead seconds, seconds per token) once fitted from `MIN_SAMPLES` measurements.
    pub fitted: Option<(f64, f64)>,
}

impl PrefillFit {
    /// Measurements before the fit replaces the configured model (two parameters, and noisy TTFTs).
    pub const MIN_SAMPLES: u64 = 16;
    /// A fitted slope is used only when it is this many standard errors above 0: where prefill
    /// time shows no dependence on the tokens (an engine so fast that HTTP and scheduling jitter
    /// is all one measures), the configured slope stays and only the overhead is learned.
    pub const MIN_SLOPE_T: f64 = 3.0;
    /// One worker's memory, samples.
    pub const MEMORY: f64 = 64.0;

    /// A fit that remembers ~`samples` measurements (a sample's weight decays by
    /// `1 - 1 / samples` per later one).
    pub fn with_memory(samples: f64) -> Self {
        PrefillFit {
            keep: 1.0 - 1.0 / samples.max(1.0),
            weight: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            syy: 0.0,
            samples: 0,
            fitted: None,
        }
    }

    /// Adds one measurement: `x` uncached tokens served in `secs` seconds; `prior_spt` = the
    /// configured seconds per token, the slope kept when the samples show no evidence of another.
    pub fn add(&mut self, x: f64, secs: f64, prior_spt: f64) {
        if !(x.is_finite() && secs.is_finite() && secs >= 0.0) {
            return;
        }
        let k = self.keep;
        self.weight = self.weight * k + 1.0;
        self.sx = self.sx * k + x;
        self.sy = self.sy * k + secs;
        self.sxx = self.sxx * k + x * x;
        self.sxy = self.sxy * k + x * secs;
        self.syy = self.syy * k + secs * secs;
        self.samples += 1;
        if self.samples >= Self::MIN_SAMPLES {
            self.fitted = Some(self.solve(prior_spt));
        }
    }

    fn solve(&self, prior_spt: f64) -> (f64, f64) {
        let (mx, my) = (self.sx / self.weight, self.sy / self.weight);
        let vxx = self.sxx / self.weight - mx * mx;
        let cxy = self.sxy / self.weight - mx * my;
        // A slope needs spread in x (1% of its mean), a positive covariance and evidence (its
        // t statistic at least MIN_SLOPE_T); a line whose intercept comes out negative is refitted
        // through the origin (least squares with the overhead held at 0). Without evidence the
        // configured slope stays and the intercept takes the rest of the mean, when there is a
        // rest; when the configured slope alone predicts more than was measured, the engine is
        // faster than it says, and the samples are all work: the slope through the origin. (Same-
        // length prompts give no spread at all; keeping the prior there kept its error for good.)
        if vxx > (0.01 * mx).powi(2) && vxx > 0.0 && cxy > 0.0 {
            let b = cxy / vxx;
            let vyy = self.syy / self.weight - my * my;
            // Residual variance per unit weight, and the slope's standard error over ~weight samples.
            let resid = (vyy - cxy * cxy / vxx).max(0.0);
            let se = (resid / (vxx * (self.weight - 2.0).max(1.0))).sqrt();
            if b >= Self::MIN_SLOPE_T * se {
                let a = my - b * mx;
                return if a >= 0.0 { (a, b) } else { (0.0, self.sxy / self.sxx) };
            }
        }
        let rest = my - prior_spt * mx;
        if rest >= 0.0 || self.sxx <= 0.0 {
            (rest.max(0.0), prior_spt)
        } else {
            (0.0, self.sxy / self.sxx)
        }
    }

    /// Measurements taken so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

impl Default for PrefillFit {
    fn default() -> Self {
        PrefillFit::with_memory(Self::MEMORY)
    }
}

/// The pool's fits (learned model): one over every prefill worker's samples, with each sample's
/// tokens in units of its worker's registered speed (x = tokens / `prefill_tokens_per_s`, so the
/// slope is how much slower, or faster, the engines run than registered), and one over every
/// decode sample. A worker with no fit of its own predicts with the pool's
/// (`WorkerLoad::pooled_prefill`, `pooled_decode`), and the pool's slope is the prior its own fit
/// keeps until its samples show another. Why: a worker predicted at the registered prior while
/// its peers are measured looks slower (or faster) than it is for as long as it has no samples,
/// and a slower-looking worker is sent nothing, so it never gets any: in the AISimulate race's
/// tuning half (agent, 16 workers, 40/s) 5 of 16 identical engines served no request at all, at
/// the prior's 20,000 tokens/s beside peers measured at 32,000-48,000, and the rest carried
/// their load (TTFT p99 1.8x Dynamo's).
#[derive(Clone, Debug)]
pub struct PoolFit {
    pub prefill: PrefillFit,
    pub decode: PrefillFit,
}

impl PoolFit {
    /// The pool remembers this many samples (the fleet's, not one worker's).
    pub const MEMORY: f64 = 256.0;

    /// The prefill seconds per token the pool predicts for a worker registered at
    /// `registered_tokens_per_s`, with its overhead; None before the pool has a fit.
    pub fn prefill_for(&self, registered_tokens_per_s: f64) -> Option<(f64, f64)> {
        self.prefill.fitted.map(|(a, ratio)| (a, ratio / registered_tokens_per_s))
    }
}

impl Default for PoolFit {
    fn default() -> Self {
        PoolFit { prefill: PrefillFit::with_memory(Self::MEMORY), decode: PrefillFit::with_memory(Self::MEMORY) }
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
    /// The learned prefill time (`TtftModel::Learned`); unused while `prefill_fit.fitted` is None.
    pub prefill_fit: PrefillFit,
    /// The learned decode step (`TtftModel::Learned`), the same fit over finished requests' mean
    /// inter-token latency (`Router::output_done`) against the decode batch they ran in:
    /// `step + per_request * batch`; unused while `decode_fit.fitted` is None.
    pub decode_fit: PrefillFit,
    /// The pool's prefill fit for this worker (`PoolFit`), used while `prefill_fit` has none.
    pub pooled_prefill: Option<(f64, f64)>,
    /// The pool's decode step, used while `decode_fit` has none.
    pub pooled_decode: Option<(f64, f64)>,
    /// How late prefills here have finished beyond the virtual queue's prediction, seconds, an
    /// average over the last ~16 (`TtftModel::Learned`; 0 otherwise): what the queue does not
    /// see (an engine waiting for KV room or a seat before it starts a prefill), added to the
    /// queueing delay a new request is predicted.
    pub lateness: f64,
    /// When the last prefill here finished (`prefill_done`, `finished`); -inf before any.
    pub last_prefill_done: f64,
    /// Prompt tokens routed here, decaying over the load window (`RouterConfig::token_share_bound`;
    /// as of the router's last route, see `share.rs`).
    pub routed_tokens: f64,
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
            prefill_fit: PrefillFit::default(),
            decode_fit: PrefillFit::default(),
            pooled_prefill: None,
            pooled_decode: None,
            lateness: 0.0,
            last_prefill_done: f64::NEG_INFINITY,
            routed_tokens: 0.0,
        }
    }

    /// Predicted wait before a new prefill starts: `max(busy_until - now, 0)`, as the seed has it.
    #[inline]
    pub fn queue_delay(&self, now: f64) -> f64 {
        (self.busy_until - now).max(0.0)
    }

    /// The learned prefill model, (overhead seconds, seconds per token): this worker's own fit,
    /// else the pool's; None: nothing measured yet (the registered speed predicts).
    #[inline]
    pub fn prefill_model(&self) -> Option<(f64, f64)> {
        self.prefill_fit.fitted.or(self.pooled_prefill)
    }

    /// Seconds to prefill `uncached_tokens` here (learned model: its overhead included).
    #[inline]
    pub fn prefill_time(&self, uncached_tokens: u64) -> f64 {
        match self.prefill_model() {
            Some((overhead, spt)) => overhead + spt * uncached_tokens as f64,
            None => uncached_tokens as f64 / self.spec.prefill_tokens_per_s,
        }
    }

    /// Seconds of compute for `tokens` tokens here, without a request's fixed overhead (what
    /// recomputing evicted or fetched blocks costs).
    #[inline]
    pub fn token_time(&self, tokens: u64) -> f64 {
        tokens as f64 / self.prefill_speed()
    }

    /// Prefill tokens per second: learned, or as registered.
    #[inline]
    pub fn prefill_speed(&self) -> f64 {
        match self.prefill_model() {
            Some((_, spt)) if spt > 0.0 => 1.0 / spt,
            _ => self.spec.prefill_tokens_per_s,
        }
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

    /// The engine step a new prefill here runs in, on a unified worker (role "both") whose decode
    /// step is known (`decode_model`: learned, or `decode_step_s + in_flight / decode_tokens_per_s`
    /// from the registered speed). On a unified engine
    /// (vLLM, SGLang with chunked prefill) every step runs each decoding request's next token beside
    /// the prefill, and the first token comes at the end of that step; the requests in flight here
    /// (queued ones included: the queue is FIFO, so by then they decode too) set its length.
    /// Latency, not occupancy: it does not advance `busy_until`. 0 on prefill and decode workers
    /// (PD mode, including a decode worker's local prefill, which the simulator models without it)
    /// and while the decode step is unknown (the seed's prefill instances).
    #[inline]
    pub fn step_time(&self, decode_step_s: f64) -> f64 {
        match self.decode_model(decode_step_s) {
            Some((step, per_request)) if self.spec.role == Role::Both => step + self.in_flight() as f64 * per_request,
            _ => 0.0,
        }
    }

    /// The decode step as (seconds at batch 0, seconds per running request): learned
    /// (`decode_fit`, else the pool's), else from the registered `decode_tokens_per_s`; None: unknown.
    #[inline]
    pub fn decode_model(&self, decode_step_s: f64) -> Option<(f64, f64)> {
        match self.decode_fit.fitted.or(self.pooled_decode) {
            Some(fit) => Some(fit),
            None => self.spec.decode_tokens_per_s.map(|r| (decode_step_s, 1.0 / r)),
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

    /// Whether one more request finds a seat among the engine's running requests (`max_running`).
    #[inline]
    pub fn has_seat(&self) -> bool {
        self.spec.max_running.map_or(true, |m| self.in_flight() < m)
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
        self.decode_model(decode_step_s).map(|(step, per_request)| step + (self.batch() as f64 + 1.0) * per_request)
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
    /// Its prefill time came from a learned model (the worker's fit or the pool's), not the
    /// registered prior: only then is its lateness the queue's miss (`WorkerLoad::lateness`).
    pub modelled: bool,
    pub kv_blocks: u64,
    pub prefill_pending: bool,
    /// When it was routed (the router's clock): with `prefill_done`, one sample of the learned
    /// prefill time.
    pub routed_at: f64,
    /// When its first token came (`prefill_done`; -inf before), and its decode worker's batch
    /// then: with `output_done`, one sample of the learned decode step.
    pub first_token_at: f64,
    pub batch_at_first: u32,
    /// Its entry in the router's pending prefixes, if one was recorded.
    pub pending: Option<u64>,
    /// Blocks it was routed as holding on `prefill_worker` (lowered by stale-overlap corrections).
    pub overlap_blocks: u32,
    /// Its stale-overlap checkpoints (`stale.rs`), dropped with its prefill.
    pub checkpoints: crate::router::stale::Held,
}
