//! The Router: picks the worker (and in PD mode the decode worker) for each request from prefix
//! overlap in the `KvIndex` and its own per-worker load model, and keeps that model up to date.
//!
//! Concurrency. Hashing and the index match run outside any router lock on thread-local scratch
//! (the expensive part; many threads in parallel); scoring and the load update happen under one
//! short mutex over O(workers) state, so concurrent routes see each other's queue growth.

pub mod config;
mod decide;
pub mod decision;
pub mod decode_worker;
mod evicted;
pub mod load;
pub mod params;
pub mod pending;
pub mod policy;
mod share;
pub mod stale;

#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::index::{KvIndex, MatchScratch, Matches, Removal, Since, Tier, WorkerId, ANY_TIER};
use crate::random::{PyRandom, RandomSource};
pub use config::{AdmissionConfig, CacheViewConfig, DecodeConfig, DecodeRule, PdConfig, Preset, Role, RouterConfig, TieBreak, TtftModel};
pub use decision::{Candidate, Decision, Path, Reason, WorkerBreakdown};
use evicted::EvictedReuse;
pub use load::{InFlight, Observed, PoolFit, PrefillFit, WorkerLoad, WorkerSpec};
use pending::PendingPrefixes;
use policy::Policy;
pub use policy::{Needs, PolicyConfig};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RouterError {
    #[error("no workers to route to: {0}")]
    NoWorkers(String),
    #[error("unknown worker {0}: register it with add_worker first")]
    UnknownWorker(WorkerId),
    #[error("worker {0} is already registered; remove_worker it first to change its role or speeds")]
    DuplicateWorker(WorkerId),
    #[error("unknown request {0}: never routed with this request_id, or already finished or cancelled")]
    UnknownRequest(u64),
    #[error("request {0} is already in flight; request ids must be unique until finished or cancelled")]
    DuplicateRequest(u64),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("invalid router config: {0}")]
    InvalidConfig(String),
}

/// One routing request. Give `tokens`, or `hashes` (sequence hashes of the full blocks) with
/// `num_tokens` (the prompt length, since a partial last block is prefill work without a hash).
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteRequest<'a> {
    pub tokens: Option<&'a [u32]>,
    pub hashes: Option<&'a [u64]>,
    pub num_tokens: Option<u64>,
    /// Seconds on the caller's clock; None: seconds since the router was created.
    pub now: Option<f64>,
    /// Track the request for `prefill_done` / `finished` / `cancel`; untracked requests only
    /// advance the virtual-time queue.
    pub request_id: Option<u64>,
    /// The request's output cap (its `max_tokens`): decode KV is reserved for it, or for what
    /// finished requests reported producing (`Router::output_done`: mean + 2 SD) when lower.
    pub output_tokens: Option<u64>,
    pub explain: bool,
    /// Route to this worker (a session pin, or a caller's own choice); load and SLO checks still apply.
    pub pin: Option<WorkerId>,
    /// The identity the prompt's KV is keyed under (`crate::hash::identity_root`: LoRA adapter,
    /// cache salt), for a prompt given as `tokens`; `hashes` carry theirs already.
    pub identity: Option<u64>,
    /// Route only among these workers (those serving the request's model); ids not registered
    /// (e.g. taken out as unhealthy) are ignored. `None`: every worker.
    pub workers: Option<&'a [WorkerId]>,
}

struct State {
    /// Sorted by id: id order is the tie-break order and the seed's index order.
    workers: Vec<WorkerLoad>,
    pos: HashMap<WorkerId, usize>,
    requests: HashMap<u64, InFlight>,
    /// Per-worker cumulative correction applied by `prefill_done`, see `InFlight::shift_at`.
    shifts: Vec<f64>,
    cands: Vec<Candidate>,
    overlaps: Vec<u32>,
    /// Per worker (same order), whether the request may go there (`RouteRequest::workers`).
    allowed: Vec<bool>,
    /// Per worker (same order), the blocks the index holds for it: read once per route, only when
    /// the capacity charge needs it (`occupancy_slots` is the read's scratch).
    indexed_blocks: Vec<u64>,
    occupancy_slots: Vec<u32>,
    rotation: u64,
    rr: u64,
    rng: Box<dyn RandomSource>,
    /// Offered prefill load: decaying average of arriving uncached tokens per second.
    offered_rate: f64,
    /// The same average of squared tokens: with `offered_rate`, the estimate's standard error.
    offered_sq: f64,
    offered_at: Option<f64>,
    /// How likely a block an engine evicts is asked for again ("capacity"; fed by the removal log).
    evicted: EvictedReuse,
    /// Prefixes routed but not yet confirmed by KV events (`RouterConfig::pending_prefixes`).
    pending: PendingPrefixes,
    pending_alive: Vec<WorkerId>,
    /// Where this router is in the index's removal log (`RouterConfig::reads_removals`).
    removal_cursor: u64,
    /// Blocks pending requests were routed as holding (`RouterConfig::stale_overlaps`).
    checkpoints: stale::Checkpoints,
    /// Scratch: (request, overlap at most) from the removals read in one `drain_removals`.
    corrections: Vec<(u64, u32)>,
    /// When the workers' `routed_tokens` were last decayed (`RouterConfig::token_share_bound`).
    routed_at: Option<f64>,
    /// The output lengths finished requests reported (`Router::output_done`).
    outputs: OutputLength,
    /// The pool's learned prefill and decode fits (`TtftModel::Learned`).
    pool: PoolFit,
}

/// The output tokens finished requests produced, as a decaying mean and spread (a memory of ~256
/// requests): what a request is expected to add to its KV, where its `max_tokens` is only a cap.
/// Engines allocate output blocks as tokens come, so reserving the whole cap for every request
/// overstates the pool's use several times over (clients send caps far above what they get) and
/// turns cache-holding workers away as full: in the AISimulate race's tuning half (agent, 16
/// workers, 54/s, clients' cap 4096) goodput 94.2% -> 99.9%. The mean alone under-reserves: long
/// outputs filled pools and engines preempted (agent 8 workers 20/s: 31 preemptions, goodput
/// 99.8% -> 97.7%); mean + 2 SD keeps both (99.5%, `python benches/bench_aisim.py`).
#[derive(Clone, Copy, Debug, Default)]
struct OutputLength {
    samples: u64,
    weight: f64,
    sum: f64,
    sum_sq: f64,
}

impl OutputLength {
    const KEEP: f64 = 1.0 - 1.0 / 256.0;
    /// Reports before the learned length replaces the cap.
    const MIN_SAMPLES: u64 = 16;
    /// Standard deviations above the mean reserved: requests longer than the mean hold more KV
    /// for longer, and an engine whose pool runs out preempts.
    const SPREAD: f64 = 2.0;

    fn add(&mut self, tokens: u64) {
        self.samples += 1;
        self.weight = self.weight * Self::KEEP + 1.0;
        self.sum = self.sum * Self::KEEP + tokens as f64;
        self.sum_sq = self.sum_sq * Self::KEEP + (tokens as f64).powi(2);
    }

    /// The output tokens to reserve KV for: the request's cap (`max_tokens`), or the learned mean
    /// when that is lower; without a cap, the learned mean (0 before any report).
    fn expected(&self, cap: Option<u64>) -> u64 {
        let learned = (self.samples >= Self::MIN_SAMPLES).then(|| {
            let mean = self.sum / self.weight;
            let sd = (self.sum_sq / self.weight - mean * mean).max(0.0).sqrt();
            (mean + Self::SPREAD * sd).ceil() as u64
        });
        match (cap, learned) {
            (Some(c), Some(m)) => c.min(m),
            (Some(c), None) => c,
            (None, m) => m.unwrap_or(0),
        }
    }
}

/// Prefills the learned lateness (`WorkerLoad::lateness`) averages over.
const LATENESS_MEMORY: f64 = 16.0;

/// The factor that decays an exponentially weighted quantity last updated at `*at` to `now` (time
/// constant `tau`; 1 before any update, and for a clock that stepped back), and moves `*at` forward to `now`.
/// The one decay behind the offered load, the evicted-block reuse and the token share.
fn decay_since(at: &mut Option<f64>, now: f64, tau: f64) -> f64 {
    let dt = at.map_or(0.0, |t| (now - t).max(0.0));
    *at = Some(at.map_or(now, |t| t.max(now)));
    (-dt / tau).exp()
}

#[derive(Default)]
struct Scratch {
    hashes: Vec<u64>,
    match_scratch: MatchScratch,
    matches: Matches,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

pub struct Router {
    cfg: RouterConfig,
    policy: Box<dyn Policy>,
    /// What the policy needs measured (`Policy::needs`).
    needs: Needs,
    /// `RouterConfig::admission_work_factor`, resolved once.
    admission_work_factor: f64,
    /// Whether the router reads the index's removal log: pending prefixes end at a removal, a
    /// removal can show a queued request's overlap stale, and a policy may measure evictions' reuse.
    reads_removals: bool,
    index: Arc<KvIndex>,
    state: Mutex<State>,
    epoch: Instant,
}

impl Drop for Router {
    fn drop(&mut self) {
        if self.reads_removals {
            self.index.unsubscribe_removals();
        }
    }
}

fn check_time(now: f64, what: &str) -> Result<f64, RouterError> {
    if now.is_finite() && now >= 0.0 {
        Ok(now)
    } else {
        Err(RouterError::InvalidArgument(format!("{what} must be a finite number of seconds >= 0, got {now}")))
    }
}

impl Router {
    /// A router over `index` (shared with whatever feeds it KV events), or a fresh index.
    /// Its random choices come from `PyRandom::new(cfg.seed)` (see `with_random`).
    pub fn new(cfg: RouterConfig, index: Option<Arc<KvIndex>>) -> Result<Self, RouterError> {
        let rng = Box::new(PyRandom::new(cfg.seed));
        Self::with_random(cfg, index, rng)
    }

    /// A router that draws its random choices ("random", "cost" with a temperature) from `rng`.
    pub fn with_random(cfg: RouterConfig, index: Option<Arc<KvIndex>>, rng: Box<dyn RandomSource>) -> Result<Self, RouterError> {
        cfg.validate()?;
        let policy = cfg.policy.build();
        let needs = policy.needs();
        let admission_work_factor = cfg.admission.work_factor.unwrap_or_else(|| policy.default_admission_work_factor());
        let view = &cfg.cache_view;
        let reads_removals = view.pending_prefixes || view.stale_overlaps || needs.eviction_reuse;
        let index = index.unwrap_or_else(|| Arc::new(KvIndex::new(None)));
        // Pending prefixes end at the engine's removals, and "capacity" learns from them how often
        // an evicted block comes back: the index logs them for this router.
        let removal_cursor = if reads_removals { index.subscribe_removals() } else { 0 };
        Ok(Router {
            policy,
            needs,
            admission_work_factor,
            reads_removals,
            index,
            state: Mutex::new(State {
                workers: Vec::new(),
                pos: HashMap::new(),
                requests: HashMap::new(),
                shifts: Vec::new(),
                cands: Vec::new(),
                overlaps: Vec::new(),
                allowed: Vec::new(),
                indexed_blocks: Vec::new(),
                occupancy_slots: Vec::new(),
                rotation: 0,
                rr: 0,
                rng,
                offered_rate: 0.0,
                offered_sq: 0.0,
                offered_at: None,
                evicted: EvictedReuse::default(),
                pending: PendingPrefixes::default(),
                pending_alive: Vec::new(),
                removal_cursor,
                checkpoints: stale::Checkpoints::default(),
                corrections: Vec::new(),
                routed_at: None,
                outputs: OutputLength::default(),
                pool: PoolFit::default(),
            }),
            epoch: Instant::now(),
            cfg,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Seconds since the router was created (the default clock).
    pub fn clock(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    fn now(&self, now: Option<f64>) -> Result<f64, RouterError> {
        match now {
            Some(t) => check_time(t, "now"),
            None => Ok(self.clock()),
        }
    }

    // ---- workers ---------------------------------------------------------------------

    pub fn add_worker(&self, id: WorkerId, spec: WorkerSpec) -> Result<(), RouterError> {
        let sp = spec.prefill_tokens_per_s;
        if !(sp.is_finite() && sp > 0.0) {
            return Err(RouterError::InvalidArgument(format!("prefill_tokens_per_s must be a finite number > 0, got {sp}")));
        }
        if let Some(d) = spec.decode_tokens_per_s {
            if !(d.is_finite() && d > 0.0) {
                return Err(RouterError::InvalidArgument(format!("decode_tokens_per_s must be a finite number > 0 or None, got {d}")));
            }
        }
        let mut st = self.state.lock();
        if st.pos.contains_key(&id) {
            return Err(RouterError::DuplicateWorker(id));
        }
        let at = st.workers.partition_point(|w| w.id < id);
        let mut w = WorkerLoad::new(id, spec);
        // A worker joining a measured pool predicts with the pool's fits until it has its own.
        (w.pooled_prefill, w.pooled_decode) = (st.pool.prefill_for(sp), st.pool.decode.fitted);
        st.workers.insert(at, w);
        st.shifts.insert(at, 0.0);
        Self::reindex(&mut st);
        Ok(())
    }

    /// Stops routing to `id`. Its in-flight requests can still be finished or cancelled (their
    /// bookkeeping on it is dropped); the index is left alone (it may be shared and event-fed).
    pub fn remove_worker(&self, id: WorkerId) -> Result<(), RouterError> {
        let mut st = self.state.lock();
        let at = *st.pos.get(&id).ok_or(RouterError::UnknownWorker(id))?;
        st.workers.remove(at);
        st.shifts.remove(at);
        st.pending.remove_worker(id);
        Self::reindex(&mut st);
        Ok(())
    }

    /// Sets worker `id`'s prefix-cache size in KV blocks (None: unknown) once it is learned from the
    /// engine itself (vLLM's `cache_config_info`); its load and in-flight requests are kept.
    pub fn set_prefix_cache_blocks(&self, id: WorkerId, blocks: Option<u64>) -> Result<(), RouterError> {
        let mut st = self.state.lock();
        let at = *st.pos.get(&id).ok_or(RouterError::UnknownWorker(id))?;
        st.workers[at].spec.prefix_cache_blocks = blocks;
        Self::reindex(&mut st);
        Ok(())
    }

    fn reindex(st: &mut State) {
        let State { workers, pos, evicted, .. } = st;
        pos.clear();
        pos.extend(workers.iter().enumerate().map(|(i, w)| (w.id, i)));
        evicted.set_capacity(workers.iter().filter_map(|w| w.spec.prefix_cache_blocks).sum());
    }

    /// Registered worker ids, ascending.
    pub fn workers(&self) -> Vec<WorkerId> {
        self.state.lock().workers.iter().map(|w| w.id).collect()
    }

    /// A snapshot of one worker's load.
    pub fn load(&self, id: WorkerId) -> Result<WorkerLoad, RouterError> {
        let st = self.state.lock();
        let at = *st.pos.get(&id).ok_or(RouterError::UnknownWorker(id))?;
        Ok(st.workers[at].clone())
    }

    /// Number of tracked in-flight requests.
    pub fn num_in_flight(&self) -> usize {
        self.state.lock().requests.len()
    }

    /// Distinct (block, worker) pairs counted as pending at `now` (see `pending_prefixes`);
    /// expired entries are dropped first.
    pub fn num_pending_blocks(&self, now: Option<f64>) -> Result<usize, RouterError> {
        let now = self.now(now)?;
        let mut st = self.state.lock();
        self.drain_removals(&mut st, now);
        Ok(st.pending.num_blocks())
    }

    /// Folds in engine-reported metrics; `queue_delay` (seconds of queued prefill the engine
    /// reports) resets the virtual-time queue to `now + queue_delay`.
    pub fn observe(&self, id: WorkerId, observed: Observed, queue_delay: Option<f64>, now: Option<f64>) -> Result<(), RouterError> {
        if let Some(u) = observed.kv_usage {
            if !(0.0..=1.0).contains(&u) {
                return Err(RouterError::InvalidArgument(format!("kv_usage must be a fraction in [0, 1], got {u}")));
            }
        }
        let qd = queue_delay.map(|q| check_time(q, "queue_delay")).transpose()?;
        let now = self.now(now)?;
        let mut st = self.state.lock();
        let at = *st.pos.get(&id).ok_or(RouterError::UnknownWorker(id))?;
        let w = &mut st.workers[at];
        let o = &mut w.observed;
        o.waiting = observed.waiting.or(o.waiting);
        o.running = observed.running.or(o.running);
        o.kv_usage = observed.kv_usage.or(o.kv_usage);
        if let Some(q) = qd {
            w.busy_until = now + q;
        }
        Ok(())
    }

    // ---- lifecycle -------------------------------------------------------------------

    /// The request's prefill finished at `now`. The worker's virtual queue is corrected by how far
    /// the prediction was off (FIFO: later requests there move by the same amount).
    pub fn prefill_done(&self, request_id: u64, now: Option<f64>) -> Result<(), RouterError> {
        let now = self.now(now)?;
        let mut st = self.state.lock();
        let rec = *st.requests.get(&request_id).ok_or(RouterError::UnknownRequest(request_id))?;
        if !rec.prefill_pending {
            return Err(RouterError::InvalidArgument(format!("prefill_done called twice for request {request_id}")));
        }
        Self::finish_prefill(&mut st, &rec, now, self.cfg.ttft_model == TtftModel::Learned);
        st.checkpoints.remove(request_id, &rec.checkpoints);
        let batch = st.pos.get(&rec.decode_worker).map_or(0, |&d| st.workers[d].batch());
        let r = st.requests.get_mut(&request_id).expect("present");
        r.prefill_pending = false;
        (r.first_token_at, r.batch_at_first) = (now, batch);
        if let Some(tag) = rec.pending {
            st.pending.expire_at(tag, now + self.cfg.cache_view.pending_grace_s);
        }
        Ok(())
    }

    /// `measured`: `now` is when the first token came (`prefill_done`), so the request is one
    /// sample of the learned prefill time: served from the later of its routing and the
    /// previous finish there, until now.
    fn finish_prefill(st: &mut State, rec: &InFlight, now: f64, measured: bool) {
        let Some(&at) = st.pos.get(&rec.prefill_worker) else { return };
        let shift = st.shifts[at];
        if measured {
            let w = &st.workers[at];
            let (x, registered) = (rec.uncached_tokens as f64, w.spec.prefill_tokens_per_s);
            let served = now - rec.routed_at.max(w.last_prefill_done);
            // The prior a worker's own fit keeps without slope evidence: the pool's slope, else
            // the registered speed.
            let prior = st.pool.prefill_for(registered).map_or(1.0 / registered, |(_, spt)| spt);
            st.pool.prefill.add(x / registered, served, 1.0);
            st.workers[at].prefill_fit.add(x, served, prior);
            Self::share_pool(st);
        }
        let w = &mut st.workers[at];
        w.last_prefill_done = w.last_prefill_done.max(now);
        w.prefilling = w.prefilling.saturating_sub(1);
        w.prefill_tokens = w.prefill_tokens.saturating_sub(rec.uncached_tokens);
        if rec.prefill_worker != rec.decode_worker {
            w.active = w.active.saturating_sub(1);
        }
        // How late it finished against the queue's prediction (corrected since it was queued).
        let delta = now - (rec.done_at + (shift - rec.shift_at));
        // Against a learned prediction only: before a fit, a miss is the prior's error, which the
        // fit corrects.
        if measured && rec.modelled {
            w.lateness += (delta.max(0.0) - w.lateness) / LATENESS_MEMORY;
        }
        if w.prefilling == 0 {
            w.busy_until = now;
        } else {
            w.busy_until = (w.busy_until + delta).max(now);
            st.shifts[at] = shift + delta;
        }
    }

    /// Hands the pool's fits to every worker (each uses them while it has none of its own).
    fn share_pool(st: &mut State) {
        let State { workers, pool, .. } = st;
        for w in workers.iter_mut() {
            (w.pooled_prefill, w.pooled_decode) = (pool.prefill_for(w.spec.prefill_tokens_per_s), pool.decode.fitted);
        }
    }

    fn release_decode(st: &mut State, rec: &InFlight) {
        let Some(&at) = st.pos.get(&rec.decode_worker) else { return };
        let w = &mut st.workers[at];
        w.active = w.active.saturating_sub(1);
        w.decoding = w.decoding.saturating_sub(1);
        w.decode_blocks = w.decode_blocks.saturating_sub(rec.kv_blocks);
    }

    /// Request `request_id`, still in flight (before its `finished`), produced `tokens` output
    /// tokens by `now` (the response's usage). The Router reserves decode KV for what requests
    /// produce (mean + 2 SD, decaying over ~256 reports), capped by each request's
    /// `output_tokens` (its `max_tokens`), instead of the whole cap, once 16 have been reported.
    /// With the learned TTFT model, its mean inter-token latency since `prefill_done` is one
    /// sample of its decode worker's step (`WorkerLoad::decode_fit`).
    pub fn output_done(&self, request_id: u64, tokens: u64, now: Option<f64>) -> Result<(), RouterError> {
        let now = self.now(now)?;
        let mut st = self.state.lock();
        let rec = *st.requests.get(&request_id).ok_or(RouterError::UnknownRequest(request_id))?;
        st.outputs.add(tokens);
        if self.cfg.ttft_model == TtftModel::Learned && rec.first_token_at.is_finite() && tokens >= 2 {
            if let Some(&at) = st.pos.get(&rec.decode_worker) {
                let w = &st.workers[at];
                let itl = (now - rec.first_token_at) / (tokens - 1) as f64;
                let batch = (rec.batch_at_first as f64 + w.batch() as f64) / 2.0;
                // Prior slope: the pool's, else 0 (without evidence that the batch matters, a
                // constant step).
                let prior = st.pool.decode.fitted.map_or(0.0, |(_, b)| b);
                st.workers[at].decode_fit.add(batch, itl, prior);
                st.pool.decode.add(batch, itl, 0.0);
                Self::share_pool(&mut st);
            }
        }
        Ok(())
    }

    /// The request completed (its KV is released); finishes its prefill too if still pending.
    pub fn finished(&self, request_id: u64, now: Option<f64>) -> Result<(), RouterError> {
        let now = self.now(now)?;
        let mut st = self.state.lock();
        let rec = st.requests.remove(&request_id).ok_or(RouterError::UnknownRequest(request_id))?;
        if rec.prefill_pending {
            Self::finish_prefill(&mut st, &rec, now, false);
            st.checkpoints.remove(request_id, &rec.checkpoints);
            if let Some(tag) = rec.pending {
                st.pending.expire_at(tag, now + self.cfg.cache_view.pending_grace_s);
            }
        }
        Self::release_decode(&mut st, &rec);
        Ok(())
    }

    /// The request was abandoned: a still-queued prefill is taken out of the virtual queue.
    pub fn cancel(&self, request_id: u64, now: Option<f64>) -> Result<(), RouterError> {
        let now = self.now(now)?;
        let mut st = self.state.lock();
        let rec = st.requests.remove(&request_id).ok_or(RouterError::UnknownRequest(request_id))?;
        if rec.prefill_pending {
            st.checkpoints.remove(request_id, &rec.checkpoints);
            if let Some(tag) = rec.pending {
                st.pending.remove(tag);
            }
            if let Some(&at) = st.pos.get(&rec.prefill_worker) {
                let w = &mut st.workers[at];
                w.prefilling = w.prefilling.saturating_sub(1);
                w.prefill_tokens = w.prefill_tokens.saturating_sub(rec.uncached_tokens);
                if rec.prefill_worker != rec.decode_worker {
                    w.active = w.active.saturating_sub(1);
                }
                w.busy_until = (w.busy_until - rec.work).max(now.min(w.busy_until));
            }
        }
        Self::release_decode(&mut st, &rec);
        Ok(())
    }

    // ---- routing ---------------------------------------------------------------------

    /// Routes one request. Rejections (`admitted == false`) leave all load state untouched.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Decision, RouterError> {
        let now = self.now(req.now)?;
        let bs = self.cfg.block_size;
        let num_tokens = match (req.tokens, req.hashes) {
            (Some(_), Some(_)) => return Err(RouterError::InvalidArgument("give tokens or hashes, not both".into())),
            (None, Some(_)) if req.identity.is_some() => {
                return Err(RouterError::InvalidArgument("an identity applies to tokens; hashes already carry theirs".into()))
            }
            (None, None) => return Err(RouterError::InvalidArgument("give the prompt as tokens, or as hashes with num_tokens".into())),
            (Some(t), None) => {
                if let Some(n) = req.num_tokens {
                    if n != t.len() as u64 {
                        return Err(RouterError::InvalidArgument(format!("num_tokens = {n} but {} tokens were given", t.len())));
                    }
                }
                t.len() as u64
            }
            (None, Some(h)) => {
                let full = h.len() as u64 * bs as u64;
                let n = req.num_tokens.unwrap_or(full);
                // The hashes may key only a prefix of the prompt (a chat's text before its first
                // media part), so the prompt may be longer than they are; never shorter.
                if n < full {
                    return Err(RouterError::InvalidArgument(format!(
                        "num_tokens = {n} is shorter than {} hashes of {bs}-token blocks ({full} tokens)",
                        h.len(),
                    )));
                }
                n
            }
        };
        if num_tokens == 0 {
            return Err(RouterError::InvalidArgument("empty prompt: a request needs at least one token".into()));
        }
        SCRATCH.with_borrow_mut(|s| {
            let Scratch { hashes, match_scratch, matches } = s;
            let hs: &[u64] = match req.tokens {
                Some(t) => {
                    hashes.clear();
                    crate::hash::extend_sequence_hashes(hashes, t, bs, self.cfg.hash_seed, req.identity);
                    hashes
                }
                None => req.hashes.expect("checked"),
            };
            self.index.match_into(hs, ANY_TIER, match_scratch, matches);
            let d = self.decide(now, num_tokens, req, hs, matches)?;
            if self.cfg.cache_view.optimistic_insert && d.admitted && !hs.is_empty() {
                // Best effort: an index at its capacity limit only forgets this guess (later
                // matches come out shorter, never wrong); the decision itself stands.
                let _ = self.index.store(d.worker, hs, None, Tier::Device);
                if let Some(dw) = d.decode_worker {
                    if dw != d.worker {
                        let _ = self.index.store(dw, hs, None, Tier::Device);
                    }
                }
            }
            Ok(d)
        })
    }

    /// A removal showed that pending request `id` holds at most `pos` of the blocks it was routed
    /// as holding: its extra prefill joins its predicted work and moves the requests queued behind
    /// it on that worker (FIFO), as a late `prefill_done` would, but now rather than when it ends.
    fn correct_overlap(st: &mut State, bs: u64, id: u64, pos: u32, now: f64, window: f64) {
        let Some(rec) = st.requests.get(&id).copied() else { return };
        if !rec.prefill_pending || pos >= rec.overlap_blocks || now - rec.routed_at > window {
            return;
        }
        let Some(&at) = st.pos.get(&rec.prefill_worker) else { return };
        let tokens = (rec.overlap_blocks - pos) as u64 * bs;
        let extra = st.workers[at].token_time(tokens);
        let shift = st.shifts[at];
        let end = |r: &InFlight| r.done_at + (shift - r.shift_at);
        let mine = end(&rec);
        for (other, r) in st.requests.iter_mut() {
            if *other != id && r.prefill_pending && r.prefill_worker == rec.prefill_worker && end(r) >= mine {
                r.done_at += extra;
            }
        }
        let r = st.requests.get_mut(&id).expect("present");
        r.done_at += extra;
        r.work += extra;
        r.uncached_tokens += tokens;
        r.overlap_blocks = pos;
        let w = &mut st.workers[at];
        w.busy_until = w.busy_until.max(now) + extra;
        w.prefill_tokens += tokens;
    }

    /// Reads the blocks the engines reported removed since the last look (the index's removal
    /// log): they no longer count as pending, and ("capacity") they are evictions whose reuse is
    /// measured. Then drops pending entries past their expiry.
    fn drain_removals(&self, st: &mut State, now: f64) {
        if !self.reads_removals {
            return;
        }
        let (pend, evict, tau) = (self.cfg.cache_view.pending_prefixes, self.needs.eviction_reuse, self.cfg.admission.load_window());
        let stale = self.cfg.cache_view.stale_overlaps;
        let State { pending, evicted, removal_cursor, checkpoints, corrections, requests, .. } = st;
        corrections.clear();
        let lost = self.index.removals_since(removal_cursor, |r| match r {
            Removal::Block(w, h) => {
                if pend {
                    pending.void_block(w, h);
                }
                if evict {
                    evicted.evicted(h, now, tau);
                }
                if stale {
                    checkpoints.removed(w, h, |id, pos| corrections.push((id, pos)));
                }
            }
            Removal::Worker(w) => {
                if pend {
                    pending.void_worker(w)
                }
                if stale {
                    let on_w = requests.iter().filter(|(_, r)| r.prefill_pending && r.prefill_worker == w && r.overlap_blocks > 0);
                    corrections.extend(on_w.map(|(&id, _)| (id, 0)));
                }
            }
        });
        if lost == Since::Lost {
            pending.void_all();
            evicted.forget();
        }
        if stale && !st.corrections.is_empty() {
            // One correction per request, to the lowest position removed (corrections add up
            // linearly, so this is what applying each in turn gives, with one walk of the requests).
            let mut fixes = std::mem::take(&mut st.corrections);
            fixes.sort_unstable();
            fixes.dedup_by_key(|f| f.0);
            for &(id, pos) in &fixes {
                Self::correct_overlap(st, self.cfg.block_size as u64, id, pos, now, self.cfg.cache_view.pending_grace_s);
            }
            fixes.clear();
            st.corrections = fixes;
        }
        let pending = &mut st.pending;
        if pend {
            pending.expire(now);
        }
    }

    /// "capacity": how likely a block an engine evicts is to be asked for again (the fraction of
    /// recent evictions asked for again, see `evicted`), after reading the removals logged since
    /// the last route; 0 for other policies and before any eviction.
    pub fn evicted_reuse(&self, now: Option<f64>) -> Result<f64, RouterError> {
        let now = self.now(now)?;
        let mut st = self.state.lock();
        self.drain_removals(&mut st, now);
        Ok(st.evicted.p())
    }

    /// The offered prefill load as a fraction of the prefill pool's capacity, decayed to `now`
    /// (see `RouterConfig::shed_load_threshold`).
    pub fn offered_load(&self, now: Option<f64>) -> Result<f64, RouterError> {
        let now = self.now(now)?;
        let st = self.state.lock();
        let capacity: f64 = st.workers.iter().filter(|w| w.spec.role.prefills()).map(|w| w.prefill_speed()).sum();
        let dt = st.offered_at.map_or(0.0, |t| (now - t).max(0.0));
        let rate = st.offered_rate * (-dt / self.cfg.admission.load_window()).exp();
        Ok(if capacity > 0.0 { rate / capacity } else { 0.0 })
    }
}
