//! The Router: picks the worker (and in PD mode the decode worker) for each request from prefix
//! overlap in the `KvIndex` and its own per-worker load model, and keeps that model up to date.
//!
//! Concurrency. Hashing and the index match run outside any router lock on thread-local scratch
//! (the expensive part; many threads in parallel); scoring and the load update happen under one
//! short mutex over O(workers) state, so concurrent routes see each other's queue growth.

pub mod config;
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
use decode_worker::{choose_decode, DecodeChoice};
use evicted::EvictedReuse;
pub use load::{InFlight, Observed, PrefillFit, WorkerLoad, WorkerSpec};
use pending::PendingPrefixes;
use policy::{admission_ttft, pick_min, Ctx, Policy};
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
    /// Expected output tokens (KV reserved on the decode side).
    pub output_tokens: Option<u64>,
    pub explain: bool,
    /// Route to this worker (a session pin, or a caller's own choice); load and SLO checks still apply.
    pub pin: Option<WorkerId>,
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
}

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
        st.workers.insert(at, WorkerLoad::new(id, spec));
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
        st.requests.get_mut(&request_id).expect("present").prefill_pending = false;
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
        let w = &mut st.workers[at];
        if measured {
            let served = now - rec.routed_at.max(w.last_prefill_done);
            w.prefill_fit.add(rec.uncached_tokens as f64, served, 1.0 / w.spec.prefill_tokens_per_s);
        }
        w.last_prefill_done = w.last_prefill_done.max(now);
        w.prefilling = w.prefilling.saturating_sub(1);
        w.prefill_tokens = w.prefill_tokens.saturating_sub(rec.uncached_tokens);
        if rec.prefill_worker != rec.decode_worker {
            w.active = w.active.saturating_sub(1);
        }
        if w.prefilling == 0 {
            w.busy_until = now;
        } else {
            let expected = rec.done_at + (shift - rec.shift_at);
            let delta = now - expected;
            w.busy_until = (w.busy_until + delta).max(now);
            st.shifts[at] = shift + delta;
        }
    }

    fn release_decode(st: &mut State, rec: &InFlight) {
        let Some(&at) = st.pos.get(&rec.decode_worker) else { return };
        let w = &mut st.workers[at];
        w.active = w.active.saturating_sub(1);
        w.decoding = w.decoding.saturating_sub(1);
        w.decode_blocks = w.decode_blocks.saturating_sub(rec.kv_blocks);
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
                if n < full || n >= full + bs as u64 {
                    return Err(RouterError::InvalidArgument(format!(
                        "num_tokens = {n} does not fit {} hashes of {bs}-token blocks: expected {full}..={}",
                        h.len(),
                        full + bs as u64 - 1
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
                    crate::hash::extend_sequence_hashes(hashes, t, bs, self.cfg.hash_seed, None);
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

    /// `indexed`: the blocks the index holds for `w` (read only where the capacity charge is on).
    fn candidate(&self, w: &WorkerLoad, overlap: u32, now: f64, num_tokens: u64, transfer_time: f64, indexed: u64) -> Candidate {
        let cached = (overlap as u64 * self.cfg.block_size as u64).min(num_tokens);
        let uncached = num_tokens - cached;
        let queue_delay = w.queue_delay(now);
        let prefill_time = w.prefill_time(uncached);
        let stored = (num_tokens / self.cfg.block_size as u64).saturating_sub(overlap as u64);
        let needs = self.needs;
        let (evicted, fill) = match w.spec.prefix_cache_blocks {
            // A 0-block cache (prefix caching off) holds nothing to evict and no room a copy takes.
            Some(capacity) if capacity > 0 && needs.evictions => {
                // The index counts the cached blocks the engine's KV events reported. An engine's
                // own usage cannot replace it: vLLM's kv_cache_usage_perc counts the blocks running
                // requests hold, and a cached block no request holds counts as free (it sits in the
                // free queue until evicted), so a warm LRU that is full of cached prefixes reports
                // near 0. What the usage adds is blocks held but not (yet) cached, so the occupancy
                // is the larger of the two.
                let used = match w.observed.kv_usage {
                    Some(u) if needs.usage_occupancy => indexed.max((u * capacity as f64).round() as u64),
                    _ => indexed,
                };
                // The engine stores the full blocks it lacks; an LRU at capacity evicts as many.
                let evicted = (used + stored).saturating_sub(capacity).min(stored);
                (evicted, (used as f64 / capacity as f64).min(1.0))
            }
            _ => (0, 0.0),
        };
        let evict_time = if needs.evict_time { w.token_time(evicted * self.cfg.block_size as u64) } else { 0.0 };
        let step_time = w.step_time(self.cfg.decode.step_s);
        Candidate {
            worker: w.id,
            overlap_blocks: overlap,
            uncached_tokens: uncached,
            busy_until: w.busy_until,
            queue_delay,
            prefill_time,
            transfer_time,
            step_time,
            // The seed's ttft(i): max(busy - t, 0) + (len - hit) / SPEED, in that order (its
            // prefill instances decode nothing: step_time is 0 there).
            predicted_ttft: queue_delay + prefill_time + transfer_time + step_time,
            in_flight: w.in_flight(),
            queued: w.prefilling.max(w.observed.waiting.unwrap_or(0)),
            prefill_speed: w.prefill_speed(),
            prefill_tokens: w.prefill_tokens,
            decode_blocks: w.decode_blocks,
            evict_time,
            stored_blocks: if needs.eviction_reuse { stored } else { 0 },
            evicted_blocks: evicted,
            cache_fill: fill,
            score: 0.0,
        }
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

    fn decide(
        &self,
        now: f64,
        num_tokens: u64,
        req: &RouteRequest<'_>,
        hashes: &[u64],
        matches: &Matches,
    ) -> Result<Decision, RouterError> {
        let cfg = &self.cfg;
        let bs = cfg.block_size as u64;
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if st.workers.is_empty() {
            return Err(RouterError::NoWorkers("none registered (call add_worker)".into()));
        }
        if let Some(id) = req.request_id {
            if st.requests.contains_key(&id) {
                return Err(RouterError::DuplicateRequest(id));
            }
        }
        let pinned = match req.pin {
            Some(p) => Some(*st.pos.get(&p).ok_or(RouterError::UnknownWorker(p))?),
            None => None,
        };
        st.overlaps.clear();
        st.overlaps.resize(st.workers.len(), 0);
        for (w, &d) in matches.workers.iter().zip(&matches.depths) {
            if let Some(&at) = st.pos.get(w) {
                st.overlaps[at] = d;
            }
        }
        self.drain_removals(st, now);
        if cfg.cache_view.pending_prefixes {
            // A worker's overlap: its index prefix, continued by the blocks pending there (an entry
            // holds only what the index lacked when it was routed). Workers without an index
            // prefix share one walk from block 0; each worker with one continues from its end.
            let State { pending, pending_alive, overlaps, pos, .. } = st;
            pending.overlaps(hashes, pending_alive, |w, d| {
                if let Some(&at) = pos.get(&w) {
                    overlaps[at] = overlaps[at].max(d);
                }
            });
            for (w, &d) in matches.workers.iter().zip(&matches.depths) {
                if let Some(&at) = pos.get(w) {
                    overlaps[at] = overlaps[at].max(d + pending.run_from(hashes, d as usize, *w));
                }
            }
        }
        // The index's occupancy per worker, for the capacity charge only (it reads every shard), and
        // only where some worker has a prefix-cache size to charge against.
        let occupancy = self.needs.evictions && st.workers.iter().any(|w| w.spec.prefix_cache_blocks.is_some());
        if occupancy {
            let State { workers, indexed_blocks, occupancy_slots, .. } = st;
            self.index.num_blocks_into(workers.iter().map(|w| w.id), occupancy_slots, indexed_blocks);
        }
        let kv_need = (num_tokens + req.output_tokens.unwrap_or(0)).div_ceil(bs);
        let pd = st.workers.iter().any(|w| w.spec.role == Role::Decode);
        let indexed_at = |st: &State, at: usize| if occupancy { st.indexed_blocks[at] } else { 0 };
        let uncached_on = |st: &State, at: usize| num_tokens - (st.overlaps[at] as u64 * bs).min(num_tokens);

        // Decode side first: nothing is spent on a request that cannot be decoded.
        let mut decode_at: Option<usize> = None;
        let mut predicted_tpot = None;
        let mut decode_reject: Option<(Reason, usize)> = None;
        if pd {
            let choice = choose_decode(&st.workers, |w| w.spec.role.decodes(), kv_need, &cfg.decode, cfg.tie_break, &mut st.rotation)
                .ok_or_else(|| RouterError::NoWorkers("no decode workers".into()))?;
            match choice {
                DecodeChoice::Chosen(i, t) => {
                    decode_at = Some(i);
                    predicted_tpot = t;
                }
                DecodeChoice::TpotMiss(i, t) => {
                    decode_at = Some(i);
                    predicted_tpot = t;
                    decode_reject = Some((Reason::RejectedTpot, i));
                }
                DecodeChoice::NoRoom(i) => {
                    decode_at = Some(i);
                    predicted_tpot = st.workers[i].tpot_with_one_more(cfg.decode.step_s);
                    decode_reject = Some((Reason::RejectedDecode, i));
                }
            }
        }

        // Prefill candidates. Unified mode: the decode-side test applies to each candidate.
        st.cands.clear();
        let mut decode_filtered = 0usize;
        let mut decode_miss_reason = Reason::RejectedDecode;
        // Unified mode without rejection: workers without KV room (or over the TPOT SLO) are
        // chosen only when no worker has room; they wait here.
        let mut spill: Vec<Candidate> = Vec::new();
        for at in 0..st.workers.len() {
            if pinned.is_some_and(|p| p != at) {
                continue;
            }
            let w = &st.workers[at];
            if !w.spec.role.prefills() {
                if pinned.is_some() {
                    return Err(RouterError::InvalidArgument(format!("worker {} is decode-only and cannot prefill", w.id)));
                }
                continue;
            }
            let need_here = unified_kv_need(kv_need, st.overlaps[at]);
            let unfit = !pd && !decode_worker::admissible(w, need_here, &cfg.decode);
            if unfit && cfg.admission.reject {
                decode_filtered += 1;
                if w.kv_fits(need_here, cfg.decode.kv_headroom) {
                    decode_miss_reason = Reason::RejectedTpot;
                }
                continue;
            }
            let transfer = match decode_at {
                Some(d) if d != at => {
                    let d_cached = (st.overlaps[d] as u64 * bs).min(num_tokens);
                    cfg.pd.transfer_time(num_tokens - d_cached)
                }
                _ => 0.0,
            };
            let c = self.candidate(w, st.overlaps[at], now, num_tokens, transfer, indexed_at(st, at));
            if unfit {
                spill.push(c);
            } else {
                st.cands.push(c);
            }
        }
        if st.cands.is_empty() {
            st.cands.append(&mut spill);
        }
        let (_, rho_evident) = Self::record_offered(st, cfg, now, num_tokens);
        let reuse = if self.needs.eviction_reuse { Self::record_reuse(st, cfg, now, hashes) } else { 0.0 };
        if st.cands.is_empty() && decode_filtered == 0 {
            return Err(RouterError::NoWorkers("no worker can prefill (all are decode-only)".into()));
        }
        if !pd && st.cands.is_empty() {
            // Unified mode, every worker lacks KV room or would miss the TPOT SLO.
            let at = pinned.unwrap_or_else(|| (0..st.workers.len()).max_by_key(|&i| st.workers[i].kv_free()).expect("non-empty"));
            let c = self.candidate(&st.workers[at], st.overlaps[at], now, num_tokens, 0.0, indexed_at(st, at));
            predicted_tpot = st.workers[at].tpot_with_one_more(cfg.decode.step_s);
            return Ok(self.rejection(c, None, decode_miss_reason, predicted_tpot, num_tokens, req, &st.cands));
        }
        if let (true, Some((reason, d))) = (cfg.admission.reject, decode_reject) {
            let c = st.cands[0];
            return Ok(self.rejection(c, Some(st.workers[d].id), reason, predicted_tpot, num_tokens, req, &st.cands));
        }

        // Conditional disaggregation, short prompts: prefill where the decode happens.
        let mut path = if pd { Path::Disaggregated } else { Path::Unified };
        let mut chosen: Option<(Candidate, Reason)> = None;
        if let (Some(d), true) = (decode_at, pd && cfg.pd.local_prefill_max_tokens > 0 && pinned.is_none()) {
            if uncached_on(st, d) <= cfg.pd.local_prefill_max_tokens {
                let c = self.candidate(&st.workers[d], st.overlaps[d], now, num_tokens, 0.0, indexed_at(st, d));
                if !cfg.admission.reject || keeps_slo(cfg.admission.ttft_slo, c.predicted_ttft) {
                    chosen = Some((c, Reason::ShortPrompt));
                    path = Path::Local;
                }
            }
        }

        // Bounded token share: the policy chooses among the workers that stay within the bound.
        // A pin skips the bound but is counted (at admission), so the counts are decayed here for it too.
        let within = match cfg.token_share_bound {
            Some(bound) => {
                let mean = share::decay_to(&mut st.workers, &mut st.routed_at, now, cfg.admission.load_window(), num_tokens);
                match pinned {
                    None => share::partition(&mut st.cands, &st.workers, &st.pos, bound, mean, num_tokens),
                    Some(_) => st.cands.len(),
                }
            }
            None => st.cands.len(),
        };

        let mut fetch_from = None;
        let (c, reason) = match chosen {
            Some(x) => x,
            None => {
                let State { cands, rotation, rr, rng, .. } = st;
                let mut ctx = Ctx {
                    tie_break: cfg.tie_break,
                    rotation,
                    rr,
                    rng: rng.as_mut(),
                    num_tokens,
                    block_size: cfg.block_size,
                    ttft_slo: cfg.admission.ttft_slo,
                    admission_work_factor: cfg.admission.factor_at(self.admission_work_factor, rho_evident),
                    reuse,
                };
                let (mut i, mut reason) = match pinned {
                    Some(_) => (0, Reason::Pinned),
                    None => self.policy.choose(&mut ctx, &mut cands[..within]),
                };
                // Early rejection: the policy's choice misses the SLO -> the fastest worker, if any keeps it.
                if let (true, Some(slo)) = (cfg.admission.reject, cfg.admission.ttft_slo) {
                    let f = ctx.admission_work_factor;
                    let adm = |c: &Candidate| admission_ttft(c, f);
                    if adm(&cands[i]) > slo {
                        let best = pick_min(&mut ctx, cands, |_| true, |c| (adm(c), c.predicted_ttft)).expect("non-empty");
                        if adm(&cands[best]) > slo {
                            let c = cands[best];
                            let dw = decode_at.map(|d| st.workers[d].id);
                            return Ok(self.rejection(c, dw, Reason::RejectedTtft, predicted_tpot, num_tokens, req, &st.cands));
                        }
                        i = best;
                        reason = Reason::SloFallback;
                    }
                }
                let c = cands[i];
                fetch_from = self.hot_prefix_holder(cands, &c, num_tokens, &st.workers, &st.pos);
                // Conditional disaggregation, busy prefill pool: the decode worker is sooner.
                let busy = cfg.pd.prefill_busy_queue_s.is_some_and(|q| c.queue_delay > q);
                if let (Some(d), true) = (decode_at, pd && busy && pinned.is_none()) {
                    let local = self.candidate(&st.workers[d], st.overlaps[d], now, num_tokens, 0.0, indexed_at(st, d));
                    if local.predicted_ttft < c.predicted_ttft {
                        path = Path::Local;
                        fetch_from = None;
                        (local, Reason::PrefillPoolBusy)
                    } else {
                        (c, reason)
                    }
                } else {
                    (c, reason)
                }
            }
        };

        // Admit: advance the virtual-time queue and (if tracked) the in-flight counts.
        if !pd {
            predicted_tpot = st.workers[st.pos[&c.worker]].tpot_with_one_more(cfg.decode.step_s);
        }
        let p_at = st.pos[&c.worker];
        let d_at = decode_at.unwrap_or(p_at);
        let shift_at = st.shifts[p_at];
        if cfg.token_share_bound.is_some() {
            st.workers[p_at].routed_tokens += num_tokens as f64;
        }
        let pw = &mut st.workers[p_at];
        let done_at = pw.enqueue_prefill(now, c.prefill_time);
        let busy_until = pw.busy_until;
        // Tracked: pending until prefill_done / finished says when (TTL if never); untracked: until
        // the predicted prefill end, the only end the router will know.
        let pending = if cfg.cache_view.pending_prefixes {
            let full = ((num_tokens / bs) as usize).min(hashes.len());
            let indexed = matches.workers.iter().position(|&w| w == c.worker).map_or(0, |i| matches.depths[i] as usize).min(full);
            let until = match req.request_id {
                Some(_) => now + cfg.cache_view.pending_ttl_s,
                None => done_at.max(now) + cfg.cache_view.pending_grace_s,
            };
            st.pending.add(c.worker, &hashes[indexed..full], until)
        } else {
            None
        };
        if let Some(id) = req.request_id {
            // A fetched prefix (hot-prefix relief) is not the worker's own: nothing to check.
            let checkpoints = if cfg.cache_view.stale_overlaps && fetch_from.is_none() {
                st.checkpoints.add(id, c.worker, hashes, c.overlap_blocks)
            } else {
                stale::Held::default()
            };
            let pw = &mut st.workers[p_at];
            pw.prefilling += 1;
            pw.prefill_tokens += c.uncached_tokens;
            pw.active += 1;
            let dw = &mut st.workers[d_at];
            if d_at != p_at {
                dw.active += 1;
            }
            dw.decoding += 1;
            // PD: the whole KV moves to the decode worker.
            let kv_blocks = if d_at == p_at { unified_kv_need(kv_need, c.overlap_blocks) } else { kv_need };
            dw.decode_blocks += kv_blocks;
            st.requests.insert(
                id,
                InFlight {
                    prefill_worker: c.worker,
                    decode_worker: st.workers[d_at].id,
                    uncached_tokens: c.uncached_tokens,
                    work: c.prefill_time,
                    done_at,
                    shift_at,
                    kv_blocks,
                    prefill_pending: true,
                    routed_at: now,
                    pending,
                    overlap_blocks: c.overlap_blocks,
                    checkpoints,
                },
            );
        }
        Ok(Decision {
            worker: c.worker,
            decode_worker: decode_at.map(|d| st.workers[d].id),
            overlap_blocks: c.overlap_blocks,
            num_tokens,
            uncached_tokens: c.uncached_tokens,
            queue_delay: c.queue_delay,
            predicted_ttft: c.predicted_ttft,
            predicted_tpot,
            busy_until,
            admitted: true,
            reason,
            path,
            fetch_from,
            request_id: req.request_id,
            explain: req.explain.then(|| st.cands.iter().map(WorkerBreakdown::from).collect()),
        })
    }

    /// Folds this arrival into the offered-load estimate and returns the load as a fraction of the
    /// prefill pool's capacity. The request is counted at its cheapest candidate (the least it can
    /// cost the cluster), admitted or not: rejected requests are offered load too.
    fn record_offered(st: &mut State, cfg: &RouterConfig, now: f64, num_tokens: u64) -> (f64, f64) {
        let tokens = st.cands.iter().map(|c| c.uncached_tokens).min().unwrap_or(num_tokens);
        let tau = cfg.admission.load_window();
        let decay = decay_since(&mut st.offered_at, now, tau);
        st.offered_rate = st.offered_rate * decay + tokens as f64 / tau;
        st.offered_sq = st.offered_sq * decay + (tokens as f64).powi(2) / tau;
        let capacity: f64 = st.workers.iter().filter(|w| w.spec.role.prefills()).map(|w| w.prefill_speed()).sum();
        if capacity > 0.0 {
            // Arrivals are (close to) a compound Poisson stream: the exponentially weighted rate
            // has variance lambda * E[tokens^2] / (2 tau), and offered_sq estimates lambda * E[tokens^2].
            let std_err = (st.offered_sq / (2.0 * tau)).sqrt();
            (st.offered_rate / capacity, (st.offered_rate - cfg.admission.shed_load_sigmas * std_err).max(0.0) / capacity)
        } else {
            (0.0, 0.0)
        }
    }

    /// "capacity": this arrival asks again for the evicted blocks past every worker's cached
    /// prefix (see `evicted`); returns how likely an evicted block is to be asked for again.
    fn record_reuse(st: &mut State, cfg: &RouterConfig, now: f64, hashes: &[u64]) -> f64 {
        let best = st.cands.iter().map(|c| c.overlap_blocks as usize).max().unwrap_or(0);
        st.evicted.asked(hashes, best, now, cfg.admission.load_window());
        st.evicted.p()
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

    #[allow(clippy::too_many_arguments)]
    fn rejection(
        &self,
        c: Candidate,
        decode_worker: Option<WorkerId>,
        reason: Reason,
        predicted_tpot: Option<f64>,
        num_tokens: u64,
        req: &RouteRequest<'_>,
        cands: &[Candidate],
    ) -> Decision {
        Decision {
            worker: c.worker,
            decode_worker,
            overlap_blocks: c.overlap_blocks,
            num_tokens,
            uncached_tokens: c.uncached_tokens,
            queue_delay: c.queue_delay,
            predicted_ttft: c.predicted_ttft,
            predicted_tpot,
            busy_until: c.busy_until,
            admitted: false,
            reason,
            path: if decode_worker.is_some() { Path::Disaggregated } else { Path::Unified },
            fetch_from: None,
            request_id: req.request_id,
            explain: req.explain.then(|| cands.iter().map(WorkerBreakdown::from).collect()),
        }
    }

    /// Hot-prefix relief (Mooncake's cache load balancing): the worker holding the longest prefix,
    /// when `chosen` holds less and pulling the difference is cheaper than recomputing it.
    fn hot_prefix_holder(
        &self,
        cands: &[Candidate],
        chosen: &Candidate,
        num_tokens: u64,
        workers: &[WorkerLoad],
        pos: &HashMap<WorkerId, usize>,
    ) -> Option<WorkerId> {
        if self.cfg.pd.kv_bytes_per_token <= 0.0 {
            return None;
        }
        let holder = cands
            .iter()
            .filter(|c| c.overlap_blocks > chosen.overlap_blocks)
            .max_by_key(|c| (c.overlap_blocks, std::cmp::Reverse(c.worker)))?;
        let bs = self.cfg.block_size as u64;
        let extra = (holder.overlap_blocks as u64 * bs).min(num_tokens) - (chosen.overlap_blocks as u64 * bs).min(num_tokens);
        let recompute = workers[pos[&chosen.worker]].token_time(extra);
        (self.cfg.pd.transfer_time(extra) < recompute).then_some(holder.worker)
    }
}

/// The KV blocks a request needing `kv_need` takes on a unified worker that caches its first
/// `overlap` blocks: the cached prefix is shared with the request (prefix caching), so only the rest
/// of the prompt and the output take new blocks there.
fn unified_kv_need(kv_need: u64, overlap: u32) -> u64 {
    kv_need - (overlap as u64).min(kv_need)
}

/// No SLO, or `v` keeps it.
fn keeps_slo(slo: Option<f64>, v: f64) -> bool {
    slo.map_or(true, |s| v <= s)
}
