//! The `dynamo_shed` placement: Dynamo 1.6.1's KV router, assembled here from dynamo-kv-router's
//! public parts and run as an AISimulate placement, plus the busy-threshold load shedding of
//! Dynamo's frontend.
//!
//! # What it reproduces
//!
//! dynamo-mocker's offline replay places requests with a KV router of its own (`KvRouterPlacement`,
//! private to the mocker). This module rebuilds the same behaviour from public pieces:
//! - a `RadixTree` fed with the engines' device-tier KV events, converted to Dynamo's
//!   `RouterEvent`s and applied as they are published (no event lag, the mocker's default);
//! - each prompt's overlap with every worker (`OverlapAnalysis` over the tree's match), from the
//!   block hashes the replay driver hands the placement, or from the prompt's tokens without them;
//! - load tracking in an `ActiveSequencesMultiWorker`: a request is added when placed (with its
//!   uncached prompt as prefill load and its output cap as expected output), its prefill marked
//!   done on `prefill_completed`, and it is freed on `request_terminal`;
//! - worker choice by `DefaultWorkerSelector` with the `KvRouterConfig` given (`--dynamo`), seeded
//!   with AISimulate's canonical seed under `ReplayDeterminism::CanonicalV1`, as the mocker is.
//!
//! With no thresholds set it places request for request as the mocker does (the test
//! `same_placements_as_dynamo_mocker` checks this under canonical determinism).
//!
//! # What it adds: busy-threshold shedding
//!
//! Dynamo's frontend (dynamo-llm's worker monitor, `LoadThresholdConfig`) marks a worker busy when
//! - its active prefill tokens exceed `active_prefill_tokens_threshold`, or exceed
//!   `active_prefill_tokens_threshold_frac` x the worker's `max_num_batched_tokens`; or
//! - its decode latch is set: set when its active decode blocks, or the KV blocks the engine reports
//!   in use, exceed `active_decode_blocks_threshold` x its total KV blocks, cleared only once both
//!   latest signals are at or below that. Both signals are re-read at every placement, so the latch
//!   is set exactly when either latest signal is above the limit.
//!
//! Busy workers are passed to the selector as the eligibility's *overloaded* set, so it never picks
//! one; when every worker is busy the selector answers `AllEligibleWorkersOverloaded`, which the
//! frontend turns into a 503. Here that request is rejected: AISimulate has no reject outcome, so
//! it is placed on a *sink* worker (one extra engine that no policy sees, whose KV events are
//! dropped) and its record is marked rejected, as kvroute's own placement does with its rejections.
//!
//! The load signals are the router's own (active prefill tokens and decode blocks of its
//! `ActiveSequencesMultiWorker`, which live Dynamo publishes after every change) and, for the
//! decode latch, the engines' used KV blocks sampled every `kv_used_interval_ms` of simulated time
//! (a worker's published `kv_used_blocks`). Live Dynamo reads them through an asynchronous monitor,
//! so its busy set lags a little; here it is current at every placement.
//!
//! # Not reproduced
//!
//! Router queueing (`router_queue_threshold` or a policy class that queues: rejected at
//! construction), lower storage tiers (`HostPinned` KV events fail the run), KV-event lag, a prefill
//! load estimator, data-parallel ranks and disaggregated serving.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aisimulate_core::engine::{KvEvent, KvEventData, KvEventTier};
use aisimulate_core::replay::loadgen::{ReplayRequestHashes, ReplayRequestPayload, Trace};
use aisimulate_core::replay::{
    EngineEventBatch, Placement, PlacementCacheSample, PlacementDecision, PlacementEffects, PlacementPolicy, ReplayAdmissionMetadata,
    ReplayCaptureOptions, ReplayComposition, ReplayDeterminism, ReplayEngineObservation, ReplayReport, ReplayResult, ReplayRuntimeInput,
    ReplayTelemetryObserver, ReplayTelemetrySnapshot, Replayer, WorkerStage, WorkerTopology,
};
use anyhow::{anyhow, bail, ensure, Context, Result};
use dynamo_custom_policy_builtin::DefaultWorkerSelector;
use dynamo_kv_router::config::KvRouterConfig;
use dynamo_kv_router::indexer::TieredMatchDetails;
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, PrefillLoadHint, RouterEvent, RoutingConstraints, StorageTier,
    WorkerConfigLike, WorkerId, WorkerWithDpRank,
};
use dynamo_kv_router::queue::DEFAULT_MAX_BATCHED_TOKENS;
use dynamo_kv_router::scheduling::{OverlapAnalysis, ScheduleMode};
use dynamo_kv_router::sequences::SchedulerLoadSnapshot;
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, RadixTree, RoutingPartitionRef, SchedulingRequest, SequencePublisher, SequenceRequest, SessionContext,
    TrackingHashAlgorithm, TrackingHashContext, TrackingHashScope, WorkerSelectionInput, WorkerSelector,
};
use kvroute_aisim::{replay_setup, EngineModel, RequestRecord, Topology};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use uuid::Uuid;

/// Dynamo's busy thresholds (the frontend's `--active-decode-blocks-threshold`,
/// `--active-prefill-tokens-threshold` and `--active-prefill-tokens-threshold-frac`, or
/// `POST /busy_threshold`). All unset: nothing is shed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShedConfig {
    /// Busy when the active decode blocks (or the engine's used KV blocks) exceed this share of
    /// the worker's KV blocks, in 0..=1.
    #[serde(default)]
    pub active_decode_blocks_threshold: Option<f64>,
    /// Busy when the active prefill tokens exceed this many.
    #[serde(default)]
    pub active_prefill_tokens_threshold: Option<u64>,
    /// Busy when the active prefill tokens exceed this multiple of `max_num_batched_tokens`.
    #[serde(default)]
    pub active_prefill_tokens_threshold_frac: Option<f64>,
    /// How often the engines' used KV blocks reach the decode latch, ms of simulated time (only
    /// read with `active_decode_blocks_threshold`). None: the latch sees the router's active
    /// decode blocks only.
    #[serde(default = "kv_used_interval")]
    pub kv_used_interval_ms: Option<f64>,
}

fn kv_used_interval() -> Option<f64> {
    Some(100.0)
}

impl Default for ShedConfig {
    fn default() -> Self {
        ShedConfig {
            active_decode_blocks_threshold: None,
            active_prefill_tokens_threshold: None,
            active_prefill_tokens_threshold_frac: None,
            kv_used_interval_ms: kv_used_interval(),
        }
    }
}

impl ShedConfig {
    /// Whether any threshold is set (the run then has a sink worker).
    pub fn enabled(&self) -> bool {
        self.active_decode_blocks_threshold.is_some()
            || self.active_prefill_tokens_threshold.is_some()
            || self.active_prefill_tokens_threshold_frac.is_some()
    }

    fn validate(&self) -> Result<()> {
        if let Some(t) = self.active_decode_blocks_threshold {
            ensure!((0.0..=1.0).contains(&t), "active_decode_blocks_threshold must be in 0..=1, got {t}");
        }
        if let Some(f) = self.active_prefill_tokens_threshold_frac {
            ensure!(f.is_finite() && f >= 0.0, "active_prefill_tokens_threshold_frac must be finite and >= 0, got {f}");
        }
        if let Some(ms) = self.kv_used_interval_ms {
            ensure!(ms.is_finite() && ms > 0.0, "kv_used_interval_ms must be finite and > 0, got {ms}");
        }
        Ok(())
    }

    fn prefill_busy(&self, active_prefill_tokens: u64, max_num_batched_tokens: u64) -> bool {
        self.active_prefill_tokens_threshold.is_some_and(|t| active_prefill_tokens > t)
            || self.active_prefill_tokens_threshold_frac.is_some_and(|f| active_prefill_tokens > (f * max_num_batched_tokens as f64) as u64)
    }
}

/// What the router knows of one worker (Dynamo's `WorkerConfigLike`): one rank, its step budget
/// and KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WorkerLimits {
    max_num_batched_tokens: u64,
    total_kv_blocks: u64,
}

impl WorkerLimits {
    fn of(engine: &EngineModel) -> Self {
        WorkerLimits {
            max_num_batched_tokens: if engine.max_num_batched_tokens == usize::MAX {
                DEFAULT_MAX_BATCHED_TOKENS
            } else {
                engine.max_num_batched_tokens as u64
            },
            total_kv_blocks: engine.num_gpu_blocks as u64,
        }
    }
}

impl WorkerConfigLike for WorkerLimits {
    fn data_parallel_start_rank(&self) -> u32 {
        0
    }
    fn data_parallel_size(&self) -> u32 {
        1
    }
    fn max_num_batched_tokens(&self) -> Option<u64> {
        Some(self.max_num_batched_tokens)
    }
    fn total_kv_blocks(&self) -> Option<u64> {
        Some(self.total_kv_blocks)
    }
}

/// One router in one process: nothing to publish to peers.
#[derive(Clone, Copy, Debug, Default)]
struct NoPeers;

impl SequencePublisher for NoPeers {
    fn enqueue_event(&self, _event: dynamo_kv_router::protocols::ActiveSequenceEvent) -> anyhow::Result<()> {
        Ok(())
    }
    fn publish_scheduler_load(&self, _snapshot: SchedulerLoadSnapshot) {}
    fn observe_load(&self, _: &WorkerWithDpRank, _: &str, _: usize, _: usize) {}
}

/// What the replay driver tells the placement of a request: its block hashes, and (for a PD
/// prefill) the output cap.
#[derive(Debug, Default)]
pub struct ShedMetadata {
    hashes: Option<ReplayRequestHashes>,
    max_output_override: Option<usize>,
}

impl ReplayAdmissionMetadata for ShedMetadata {
    fn from_hashes(hashes: Option<ReplayRequestHashes>) -> Self {
        ShedMetadata { hashes, max_output_override: None }
    }
    fn for_prefill(mut self) -> Self {
        self.max_output_override = Some(1);
        self
    }
    fn max_output_tokens_override(&self) -> Option<usize> {
        self.max_output_override
    }
    fn into_hashes(self) -> Option<ReplayRequestHashes> {
        self.hashes
    }
}

/// The engines' KV events as Dynamo's router receives them.
#[derive(Debug, Default)]
pub struct RouterEvents(pub Vec<RouterEvent>);

impl EngineEventBatch for RouterEvents {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn append(&mut self, mut other: Self) {
        self.0.append(&mut other.0);
    }
}

/// Turns on AISimulate's KV events and converts them to Dynamo's wire types.
#[derive(Debug, Default)]
pub struct RouterEventObservation;

impl ReplayEngineObservation for RouterEventObservation {
    type Batch = RouterEvents;
    const CAPTURE_ENGINE_KV_EVENTS: bool = true;

    fn capture_engine_kv_events(stage: WorkerStage) -> bool {
        !matches!(stage, WorkerStage::Decode)
    }

    fn observe_engine_events(stage: WorkerStage, worker_id: usize, _dp_rank: u32, events: Vec<KvEvent>) -> RouterEvents {
        if matches!(stage, WorkerStage::Decode) {
            return RouterEvents::default();
        }
        RouterEvents(events.into_iter().map(|e| router_event(worker_id as WorkerId, e)).collect())
    }
}

/// One engine KV event as a `RouterEvent` of `worker`.
fn router_event(worker: WorkerId, event: KvEvent) -> RouterEvent {
    let tier = match event.tier {
        KvEventTier::Device => StorageTier::Device,
        KvEventTier::HostPinned => StorageTier::HostPinned,
    };
    let data = match event.data {
        KvEventData::Stored(s) => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: s.parent_hash.map(ExternalSequenceBlockHash),
            start_position: s.start_position.map(|p| u32::try_from(p).expect("a block position beyond u32")),
            blocks: s
                .blocks
                .into_iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.block_hash),
                    tokens_hash: LocalBlockHash(b.tokens_hash),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        KvEventData::Removed { block_hashes } => {
            KvCacheEventData::Removed(KvCacheRemoveData { block_hashes: block_hashes.into_iter().map(ExternalSequenceBlockHash).collect() })
        }
    };
    RouterEvent::with_storage_tier(worker, KvCacheEvent { event_id: event.event_id, data, dp_rank: event.dp_rank }, tier)
}

/// One placement decision, for inspection (tests, `--records`).
#[derive(Clone, Debug, Serialize)]
pub struct Decision {
    pub request: Uuid,
    pub now_ms: f64,
    /// The worker chosen; None: rejected (every worker busy).
    pub worker: Option<usize>,
    /// The workers busy at that moment.
    pub overloaded: Vec<usize>,
    /// Every worker's load the decision was judged on.
    pub loads: Vec<WorkerLoad>,
}

/// One worker's load signals at a decision.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct WorkerLoad {
    pub worker: usize,
    /// The router's active prefill tokens.
    pub active_prefill_tokens: u64,
    /// The router's active decode blocks.
    pub active_decode_blocks: u64,
    /// The engine's used KV blocks, as last sampled (None: not sampled).
    pub kv_used_blocks: Option<u64>,
}

/// What a run's placement recorded.
#[derive(Debug, Default)]
pub struct ShedLog {
    /// Requests rejected (placed on the sink).
    pub rejected: HashSet<Uuid>,
    /// Every decision, in order (kept only when shedding is on).
    pub decisions: Vec<Decision>,
}

/// The engines' used KV blocks by worker, as last sampled.
type KvUsed = Arc<Mutex<HashMap<usize, u64>>>;

/// Dynamo's KV router with busy-threshold shedding, as one pool's placement.
pub struct ShedPlacement {
    config: KvRouterConfig,
    block_size: u32,
    tracking_hash: TrackingHashContext,
    limits: WorkerLimits,
    workers: HashMap<WorkerId, WorkerLimits>,
    slots: ActiveSequencesMultiWorker<NoPeers>,
    selector: DefaultWorkerSelector,
    tree: RadixTree,
    indexed_any: bool,
    epoch: Instant,
    shed: ShedConfig,
    sink: Option<usize>,
    kv_used: KvUsed,
    log: Rc<RefCell<ShedLog>>,
}

impl ShedPlacement {
    fn new(
        engine: &EngineModel,
        config: KvRouterConfig,
        shed: ShedConfig,
        selector_seed: Option<u64>,
        topology: &[WorkerTopology],
        kv_used: KvUsed,
        log: Rc<RefCell<ShedLog>>,
    ) -> Result<Self> {
        check_supported(&config)?;
        for w in topology {
            ensure!(
                w.scheduler_ids == [w.worker_id],
                "dynamo_shed supports one rank per worker (worker {} has {:?})",
                w.worker_id,
                w.scheduler_ids
            );
        }
        // The sink (highest id) exists only when something can be shed.
        let sink = if shed.enabled() { topology.iter().map(|w| w.worker_id).max() } else { None };
        let limits = WorkerLimits::of(engine);
        let workers: HashMap<WorkerId, WorkerLimits> =
            topology.iter().filter(|w| Some(w.worker_id) != sink).map(|w| (w.worker_id as WorkerId, limits)).collect();
        ensure!(!workers.is_empty(), "dynamo_shed needs at least one worker");
        let ranks = workers.keys().map(|&id| (id, (0, 1))).collect();
        let slots = ActiveSequencesMultiWorker::new_without_expiry(NoPeers, engine.block_size, ranks, false, 0, "replay");
        let selector = match selector_seed {
            Some(seed) => DefaultWorkerSelector::new_seeded(Some(config.clone()), "replay", seed),
            None => DefaultWorkerSelector::new(Some(config.clone()), "replay"),
        };
        Ok(ShedPlacement {
            tracking_hash: TrackingHashContext::from_config(&config)?,
            config,
            block_size: u32::try_from(engine.block_size).context("block size beyond u32")?,
            limits,
            workers,
            slots,
            selector,
            tree: RadixTree::new(),
            indexed_any: false,
            // Replay time `now_ms` is measured from this instant; wall time plays no part.
            epoch: Instant::now(),
            shed,
            sink,
            kv_used,
            log,
        })
    }

    fn at(&self, now_ms: f64) -> Instant {
        self.epoch + Duration::from_secs_f64(now_ms.max(0.0) / 1_000.0)
    }

    /// The prompt's overlap with every worker's cache, and its block sequence hashes for load
    /// tracking (None when the config tracks no active blocks).
    fn overlap_and_sequence(
        &self,
        request: &ReplayRequestPayload,
        hashes: Option<ReplayRequestHashes>,
    ) -> Result<(TieredMatchDetails, Option<Vec<u64>>)> {
        let scope = TrackingHashScope { partition: RoutingPartitionRef::new("replay", "default"), block_size: self.block_size };
        let tokens = || -> Result<Vec<u32>> {
            ensure!(
                request.metadata().prompt_tokens_are_placement_safe(),
                "KV-aware placement needs the prompt's token ids or block hashes, not a length-only prompt"
            );
            Ok(request.materialized_tokens().map_or_else(|| request.prompt_tokens(), <[u32]>::to_vec))
        };
        let by_tokens = |tokens: &[u32]| {
            self.config.compute_seq_hashes_for_tracking_with_context(
                &self.tracking_hash,
                scope,
                tokens,
                None,
                BlockHashOptions::default(),
                None,
            )
        };
        Ok(match hashes {
            Some(h) => {
                let matched = self.match_blocks(h.local_block_hashes.into_iter().map(LocalBlockHash).collect());
                let sequence = if !self.config.router_track_active_blocks {
                    None
                } else if !self.config.router_assume_kv_reuse {
                    self.config.random_seq_hashes_for_tracking(request.input_length() / self.block_size as usize)
                } else if self.tracking_hash.algorithm() == TrackingHashAlgorithm::PublicXxh3V1 {
                    Some(h.sequence_hashes)
                } else {
                    by_tokens(&tokens()?)
                };
                (matched, sequence)
            }
            None => {
                let tokens = tokens()?;
                let matched = if self.indexed_any {
                    self.match_blocks(compute_block_hash_for_seq(&tokens, self.block_size, BlockHashOptions::default()))
                } else {
                    TieredMatchDetails::default()
                };
                (matched, by_tokens(&tokens))
            }
        })
    }

    fn match_blocks(&self, blocks: Vec<LocalBlockHash>) -> TieredMatchDetails {
        TieredMatchDetails { device: self.tree.find_match_details(blocks, false), lower_tier: Default::default() }
    }

    /// The busy workers now (None when nothing is shed), and the loads they were judged on.
    fn overloaded(&self, at: Instant) -> (Option<HashSet<WorkerId>>, Vec<WorkerLoad>) {
        if !self.shed.enabled() {
            return (None, Vec::new());
        }
        let prefill = self.slots.active_tokens(at);
        let decode = self.slots.active_blocks();
        let kv_used = self.kv_used.lock().expect("kv_used lock");
        let mut busy = HashSet::new();
        let mut loads = Vec::with_capacity(self.workers.len());
        let mut ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let limits = self.workers[&id];
            let rank = WorkerWithDpRank::new(id, 0);
            let tokens = prefill.get(&rank).copied().unwrap_or(0) as u64;
            let blocks = decode.get(&rank).copied().unwrap_or(0) as u64;
            let used = kv_used.get(&(id as usize)).copied();
            // The decode latch: either latest signal above the limit sets it; it clears only once
            // both are at or below it.
            let latched = self.shed.active_decode_blocks_threshold.is_some_and(|t| {
                let limit = t * limits.total_kv_blocks as f64;
                limits.total_kv_blocks > 0 && (blocks as f64 > limit || used.is_some_and(|u| u as f64 > limit))
            });
            if latched || self.shed.prefill_busy(tokens, limits.max_num_batched_tokens) {
                busy.insert(id);
            }
            loads.push(WorkerLoad {
                worker: id as usize,
                active_prefill_tokens: tokens,
                active_decode_blocks: blocks,
                kv_used_blocks: used,
            });
        }
        (Some(busy), loads)
    }

    fn reject(&self, request: Uuid, now_ms: f64, overloaded: Vec<usize>, loads: Vec<WorkerLoad>) -> Result<PlacementEffects> {
        let sink = self.sink.ok_or_else(|| anyhow!("a rejection without a sink worker"))?;
        let mut log = self.log.borrow_mut();
        log.rejected.insert(request);
        log.decisions.push(Decision { request, now_ms, worker: None, overloaded, loads });
        let p = Placement {
            request_id: request,
            scheduler_id: sink,
            reported_overlap_tokens: 0,
            cache_sample: None,
            placement_replica_id: None,
        };
        Ok(PlacementEffects { decision: PlacementDecision::Immediate(p), released: Vec::new() })
    }
}

/// Refuses what this placement does not reproduce (see the module docs).
fn check_supported(config: &KvRouterConfig) -> Result<()> {
    config.validate().map_err(|e| anyhow!("KvRouterConfig: {e}"))?;
    if config.request_classifier_config()?.is_some() {
        bail!("dynamo_shed does not support request_classifier plugins");
    }
    if let Some(instance) = config.selected_worker_selection_policy_instance()? {
        bail!("dynamo_shed supports Dynamo's default worker selector only, not {instance:?}");
    }
    let profile = config.configured_policy_profile()?;
    if profile.classes().iter().any(|c| c.queueing_enabled() && !c.never_queues()) {
        bail!("dynamo_shed does not reproduce the router queue (router_queue_threshold or a queueing policy class)");
    }
    Ok(())
}

impl PlacementPolicy<ReplayRequestPayload> for ShedPlacement {
    type Metadata = ShedMetadata;
    type Observation = RouterEvents;

    fn place(
        &mut self,
        request: &ReplayRequestPayload,
        metadata: ShedMetadata,
        session_id: Option<String>,
        now_ms: f64,
    ) -> Result<PlacementEffects> {
        let meta = request.metadata();
        let uuid = meta.uuid.ok_or_else(|| anyhow!("a replay request without a UUID"))?;
        let max_output =
            metadata.max_output_override.map_or(meta.effective_max_output_tokens(), |o| o.min(meta.effective_max_output_tokens()));
        let expected_output = u32::try_from(max_output).context("max output tokens beyond u32")?;
        let at = self.at(now_ms);
        let (matched, sequence) = self.overlap_and_sequence(request, metadata.hashes)?;
        let overlap = OverlapAnalysis::new(&self.config, self.block_size, &matched).signals();
        let (priority_jump, strict_priority) = meta.router_priorities();
        let isl = request.input_length();
        let track_prefill_tokens = self.config.router_track_prefill_tokens;
        let mut sched = SchedulingRequest {
            mode: ScheduleMode::Tracked { request_id: uuid.to_string() },
            worker_loads: self.slots.project_worker_loads(sequence.as_deref(), at),
            token_seq: sequence,
            isl_tokens: isl,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            track_prefill_tokens,
            router_config_override: None,
            lora_name: None,
            priority_jump,
            strict_priority,
            policy_class: meta.policy_class().map(str::to_string),
            session_context: session_id.map(|s| SessionContext::new(s, None, None, None)),
            expected_output_tokens: Some(expected_output),
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: RoutingConstraints::default(),
            shared_cache_hits: None,
            resp_tx: None,
        };
        let (overloaded, loads) = self.overloaded(at);
        let (selected, best_available) = {
            let eligibility = sched.eligibility_with_overloaded(overloaded.as_ref());
            // The best overlap any eligible worker offers (rounded weighted blocks, as Dynamo's
            // overlap metric counts them).
            let best = sched
                .overlap
                .effective_overlap_blocks
                .iter()
                .filter(|(w, _)| {
                    w.dp_rank == 0 && self.workers.get(&w.worker_id).is_some_and(|c| eligibility.allows_worker(w.worker_id, c))
                })
                .map(|(_, o)| o.round() as u32)
                .max()
                .unwrap_or(0);
            let input = WorkerSelectionInput::configured(&self.workers, &sched, eligibility, self.block_size);
            (self.selector.select_worker(input), best)
        };
        let mut busy: Vec<usize> = overloaded.iter().flatten().map(|&w| w as usize).collect();
        busy.sort_unstable();
        let selection = match selected {
            Ok(s) => s,
            Err(e) if e.is_overload() && self.sink.is_some() => return self.reject(uuid, now_ms, busy, loads),
            Err(e) => return Err(anyhow::Error::new(e).context(format!("selecting a worker for request {uuid}"))),
        };
        let worker = usize::try_from(selection.worker.worker_id).context("worker id beyond usize")?;
        ensure!(selection.worker.dp_rank == 0, "the selector chose rank {} of a one-rank worker", selection.worker.dp_rank);
        let uncached = isl.saturating_sub(selection.cached_tokens.min(isl));
        let prefill_load_hint = (track_prefill_tokens && uncached > 0)
            .then_some(PrefillLoadHint { initial_effective_prefill_tokens: uncached, expected_prefill_duration: None });
        self.slots.add_request(
            SequenceRequest {
                request_id: uuid.to_string(),
                token_sequence: sched.token_seq.take(),
                track_prefill_tokens,
                expected_output_tokens: Some(expected_output),
                prefill_load_hint,
                worker: selection.worker,
                lora_name: None,
            },
            at,
        )?;
        let overlap_blocks = selection.effective_overlap_blocks.round() as u32;
        if self.shed.enabled() {
            self.log.borrow_mut().decisions.push(Decision { request: uuid, now_ms, worker: Some(worker), overloaded: busy, loads });
        }
        let placement = Placement {
            request_id: uuid,
            scheduler_id: worker,
            reported_overlap_tokens: overlap_blocks as usize * self.block_size as usize,
            cache_sample: Some(PlacementCacheSample {
                overlap_blocks,
                best_available_overlap_blocks: best_available,
                isl_blocks: u32::try_from(isl.div_ceil(self.block_size as usize)).unwrap_or(u32::MAX),
            }),
            placement_replica_id: None,
        };
        Ok(PlacementEffects { decision: PlacementDecision::Immediate(placement), released: Vec::new() })
    }

    fn observe(&mut self, batch: RouterEvents, _now_ms: f64) -> Result<Vec<Placement>> {
        for event in batch.0 {
            if self.sink.is_some_and(|s| event.worker_id == s as WorkerId) {
                continue;
            }
            ensure!(event.storage_tier.is_gpu(), "dynamo_shed indexes the device tier only (got a {:?} event)", event.storage_tier);
            self.indexed_any = true;
            let worker = event.worker_id;
            self.tree.apply_event(event).map_err(|e| anyhow!("KV event of worker {worker}: {e}"))?;
        }
        Ok(Vec::new())
    }

    fn cancel_pending(&mut self, _request_id: Uuid) -> bool {
        // Every placement is immediate: nothing is ever pending.
        false
    }

    fn request_terminal(&mut self, request_id: Uuid, now_ms: f64) -> Result<Vec<Placement>> {
        self.slots.free(&request_id.to_string(), self.at(now_ms))?;
        Ok(Vec::new())
    }

    fn prefill_completed(&mut self, request_id: Uuid, now_ms: f64) -> Result<Vec<Placement>> {
        self.slots.mark_prefill_completed(&request_id.to_string(), self.at(now_ms))?;
        Ok(Vec::new())
    }

    fn pending_count(&self) -> usize {
        0
    }

    fn worker_ready(&mut self, worker: WorkerTopology, _now_ms: f64) -> Result<Vec<Placement>> {
        let id = worker.worker_id as WorkerId;
        if Some(worker.worker_id) != self.sink && !self.workers.contains_key(&id) {
            self.slots.upsert_worker(dynamo_kv_router::sequences::topology::WorkerDpRange::new(id, 0, 1))?;
            self.workers.insert(id, self.limits);
        }
        Ok(Vec::new())
    }

    fn worker_draining(&mut self, worker: WorkerTopology, _now_ms: f64) -> Result<Vec<Placement>> {
        // Its requests in flight still finish and its events still arrive: only eligibility ends.
        self.workers.remove(&(worker.worker_id as WorkerId));
        Ok(Vec::new())
    }

    fn worker_removed(&mut self, worker: WorkerTopology, _now_ms: f64) -> Result<Vec<Placement>> {
        if Some(worker.worker_id) != self.sink {
            self.slots.unregister_worker(worker.worker_id as WorkerId)?;
            self.tree.remove_worker(worker.worker_id as WorkerId);
        }
        Ok(Vec::new())
    }

    fn topology_settled(&mut self, _now_ms: f64) -> Result<Vec<Placement>> {
        Ok(Vec::new())
    }
}

/// Builds the aggregated pool's `ShedPlacement` for AISimulate's `Replayer`.
struct ShedComposition {
    engine: EngineModel,
    config: KvRouterConfig,
    shed: ShedConfig,
    selector_seed: Option<u64>,
    kv_used: KvUsed,
    log: Rc<RefCell<ShedLog>>,
}

impl ReplayComposition for ShedComposition {
    type Metadata = ShedMetadata;
    type Observation = RouterEventObservation;
    type AggregatedPlacement = ShedPlacement;
    type DisaggregatedPlacement = ShedPlacement;

    fn create_aggregated_placement(&mut self, dp_size: u32, topology: Vec<WorkerTopology>) -> Result<ShedPlacement> {
        ensure!(dp_size == 1, "dynamo_shed supports one rank per worker (dp_size {dp_size})");
        ShedPlacement::new(
            &self.engine,
            self.config.clone(),
            self.shed.clone(),
            self.selector_seed,
            &topology,
            self.kv_used.clone(),
            self.log.clone(),
        )
    }

    fn create_disaggregated_placements(
        &mut self,
        _prefill_dp_size: u32,
        _prefill: Vec<WorkerTopology>,
        _decode_dp_size: u32,
        _decode: Vec<WorkerTopology>,
    ) -> Result<(ShedPlacement, ShedPlacement)> {
        bail!("dynamo_shed runs aggregated topologies only")
    }

    fn set_determinism(&mut self, determinism: ReplayDeterminism) -> ReplayResult<()> {
        self.selector_seed = determinism.selector_seed();
        Ok(())
    }
}

/// The engines' used KV blocks, sampled for the decode latch (a worker's published
/// `kv_used_blocks`).
struct KvUsedPoller(KvUsed);

impl ReplayTelemetryObserver for KvUsedPoller {
    fn on_sample(&mut self, snap: ReplayTelemetrySnapshot) -> Result<()> {
        let mut used = self.0.lock().expect("kv_used lock");
        // Aggregated replays report their one pool in the decode rows.
        for m in snap.decode_scheduler_metrics.iter().chain(&snap.prefill_scheduler_metrics) {
            used.insert(m.worker_id, m.active_blocks);
        }
        Ok(())
    }
}

/// One `dynamo_shed` replay's output.
pub struct ShedRun {
    pub report: ReplayReport,
    pub log: ShedLog,
}

impl ShedRun {
    /// Per-request records, rejections marked, in arrival order.
    pub fn records(&self) -> Vec<RequestRecord> {
        let mut recs: Vec<RequestRecord> = self
            .report
            .per_request
            .iter()
            .map(|r| {
                let rejected = r.uuid.parse::<Uuid>().is_ok_and(|u| self.log.rejected.contains(&u));
                RequestRecord::from_aisim(r, rejected)
            })
            .collect();
        recs.sort_by(|x, y| x.arrival_ms.total_cmp(&y.arrival_ms));
        recs
    }
}

/// Replays `trace` (arrivals already sped up) on `workers` aggregated engines of `engine`, placed by
/// Dynamo's KV router with `config` and the busy thresholds of `shed`.
pub fn run(
    engine: &EngineModel,
    workers: usize,
    trace: Trace,
    config: KvRouterConfig,
    shed: ShedConfig,
    capture: ReplayCaptureOptions,
) -> Result<ShedRun> {
    shed.validate()?;
    let (spec, factory) = replay_setup(engine, Topology::Aggregated { workers }, shed.enabled(), true)?;
    // As dynamo-mocker's replay of a loaded trace: sessions start at their first arrival, and a
    // single-turn trace carries no session metadata.
    let trace = trace.normalize_session_starts()?;
    let single_turn = trace.is_single_turn();
    let mut driver = trace.into_trace_driver_with_block_size(engine.block_size)?;
    if single_turn {
        driver = driver.without_session_metadata();
    }
    let kv_used = KvUsed::default();
    let log = Rc::new(RefCell::new(ShedLog::default()));
    let comp = ShedComposition {
        engine: engine.clone(),
        config,
        shed: shed.clone(),
        selector_seed: None,
        kv_used: kv_used.clone(),
        log: log.clone(),
    };
    let mut replayer = Replayer::with_composition(spec, factory, comp)?
        .with_capture_options(ReplayCaptureOptions { capture_per_request: true, ..capture })
        .with_runtime_input(ReplayRuntimeInput::Workload(driver));
    if let (Some(_), Some(ms)) = (shed.active_decode_blocks_threshold, shed.kv_used_interval_ms) {
        replayer = replayer.with_telemetry_observer(ms, Box::new(KvUsedPoller(kv_used)))?;
    }
    let report = replayer.run()?;
    let log = std::mem::take(&mut *log.borrow_mut());
    Ok(ShedRun { report, log })
}

#[cfg(test)]
mod tests;
