//! kvroute's Router as AISimulate's `PlacementPolicy`: every placement is one `Router::route`, and
//! the simulated engines' KV events reach the Router's `KvIndex` through `apply_decoded`, the same
//! code a live engine's event batch takes once decoded.
//!
//! Early rejection. AISimulate's placement contract has no "reject" outcome (a placement is
//! immediate or queued, and every request must finish somewhere). A request the Router rejects is
//! therefore sent to a *sink*: one extra engine per pool that no policy sees and whose KV events
//! are dropped. Its requests are reported as rejected and left out of every latency, goodput and
//! throughput figure, so a rejection costs the serving engines nothing, as a 429 would.
//!
//! Disaggregated serving. One Router picks the prefill and the decode worker in one `route` (the
//! PD pair); the decode pool's placement hands out the decode worker chosen then.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use aisimulate_core::engine::{KvEvent, KvEventData, KvEventTier};
use aisimulate_core::replay::loadgen::ReplayRequestPayload;
use aisimulate_core::replay::{
    EngineEventBatch, Placement, PlacementDecision, PlacementEffects, PlacementPolicy, ReplayEngineObservation, WorkerStage, WorkerTopology,
};
use anyhow::{anyhow, bail, Result};
use hashbrown::HashMap;
use kvroute_core::events::{DecodedBatch, DecodedEvent};
use kvroute_core::router::{Role, WorkerSpec};
use kvroute_core::{RouteRequest, Router, Tier, WorkerId};
use uuid::Uuid;

/// Router worker ids of the decode pool start here (prefill and unified workers use their
/// scheduler id), so the two pools never share an id in the one Router.
pub const DECODE_BASE: WorkerId = 1 << 32;

/// The KV events engine passes published: (logical worker, its events; each event names its rank).
#[derive(Debug, Default)]
pub struct KvEventBatch(pub Vec<(usize, Vec<KvEvent>)>);

impl EngineEventBatch for KvEventBatch {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn append(&mut self, mut other: Self) {
        self.0.append(&mut other.0);
    }
}

/// Turns on AISimulate's KV events for the pools whose caches the Router indexes.
#[derive(Debug, Default)]
pub struct KvEventObservation;

impl ReplayEngineObservation for KvEventObservation {
    type Batch = KvEventBatch;
    const CAPTURE_ENGINE_KV_EVENTS: bool = true;

    fn capture_engine_kv_events(stage: WorkerStage) -> bool {
        // A decode worker's cache never serves a prefill: the Router indexes prefill workers only.
        !matches!(stage, WorkerStage::Decode)
    }

    fn observe_engine_events(stage: WorkerStage, worker_id: usize, _dp_rank: u32, events: Vec<KvEvent>) -> KvEventBatch {
        if matches!(stage, WorkerStage::Decode) || events.is_empty() {
            return KvEventBatch::default();
        }
        KvEventBatch(vec![(worker_id, events)])
    }
}

/// What the Router decided for one request.
#[derive(Clone, Copy, Debug)]
pub struct Routed {
    /// Its predicted TTFT, seconds.
    pub predicted_ttft: f64,
    /// False: rejected (sent to a sink).
    pub admitted: bool,
}

/// The output length a request shows the Router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputShown {
    /// The client's `max_tokens` (None: it sends none).
    MaxTokens(Option<u64>),
    /// The request's true output length (an oracle; `Knowledge::Oracle`).
    True,
}

/// What one run's placements share: the Router, request ids, the PD pairs in flight, and what was
/// decided for every request.
pub struct Shared {
    router: Arc<Router>,
    block_size: usize,
    hash_seed: u64,
    /// Replay request -> Router request id, the decode worker chosen with it (PD), and the output
    /// tokens it will produce (reported to the Router when it finishes, as a response's usage
    /// tells a gateway), while in flight.
    requests: HashMap<Uuid, (u64, Option<WorkerId>, u64)>,
    next_id: u64,
    /// Every request the Router placed or rejected.
    pub routed: HashMap<Uuid, Routed>,
    /// Scheduler id of each pool's sink, once the pool's workers are known.
    sinks: [Option<usize>; 2],
    /// Every worker's spec (the role is set per pool).
    spec: WorkerSpec,
    pd: bool,
    batch: DecodedBatch,
    seqs: Vec<u64>,
    removals: Vec<u64>,
    /// Events that could not be applied, with why (a non-empty list fails the run at its end).
    pub event_errors: Vec<String>,
    output: OutputShown,
}

impl Shared {
    pub fn new(router: Arc<Router>, pd: bool, spec: WorkerSpec, output: OutputShown) -> Rc<RefCell<Shared>> {
        let cfg = router.config();
        let (block_size, hash_seed) = (cfg.block_size, cfg.hash_seed);
        Rc::new(RefCell::new(Shared {
            router,
            block_size,
            hash_seed,
            requests: HashMap::new(),
            next_id: 0,
            routed: HashMap::new(),
            sinks: [None, None],
            spec,
            pd,
            batch: DecodedBatch::default(),
            seqs: Vec::new(),
            removals: Vec::new(),
            event_errors: Vec::new(),
            output,
        }))
    }

    fn apply(&mut self, worker: WorkerId, events: Vec<KvEvent>) -> Result<()> {
        let b = &mut self.batch;
        b.clear();
        for ev in events {
            let tier = match ev.tier {
                KvEventTier::Device => Tier::Device,
                KvEventTier::HostPinned => Tier::Host,
            };
            b.dp_rank = ev.dp_rank;
            match ev.data {
                KvEventData::Stored(s) => {
                    let (h0, t0) = (b.hashes.len(), b.tokens.len());
                    for blk in s.blocks {
                        let toks =
                            blk.token_ids.ok_or_else(|| anyhow!("a BlockStored event without token ids (emit_kv_token_ids is off)"))?;
                        b.hashes.push(blk.block_hash);
                        b.tokens.extend_from_slice(&toks);
                    }
                    b.events.push(DecodedEvent::Stored {
                        hashes: h0..b.hashes.len(),
                        parent: s.parent_hash,
                        tokens: t0..b.tokens.len(),
                        tier,
                        root: None,
                        mixes: 0..0,
                    });
                }
                KvEventData::Removed { block_hashes } => {
                    let h0 = b.hashes.len();
                    b.hashes.extend_from_slice(&block_hashes);
                    b.events.push(DecodedEvent::Removed { hashes: h0..b.hashes.len(), tier });
                }
            }
        }
        let Shared { router, batch, seqs, removals, block_size, hash_seed, .. } = self;
        router.index().apply_decoded(worker, batch, *block_size, *hash_seed, seqs, removals)?;
        Ok(())
    }
}

fn secs(now_ms: f64) -> f64 {
    now_ms / 1_000.0
}

/// One pool's placement policy over the shared Router.
pub struct KvroutePlacement {
    shared: Rc<RefCell<Shared>>,
    /// Unified/prefill pool (0) or decode pool (1).
    pool: usize,
    /// The pool's workers registered with the Router, by scheduler id (the sink is not one).
    workers: Vec<usize>,
}

impl KvroutePlacement {
    /// `topology` is the pool's workers; the one with the highest id is the pool's sink (see the
    /// module docs), the others are registered with the Router.
    pub fn new(shared: Rc<RefCell<Shared>>, pool: usize, topology: &[WorkerTopology]) -> Result<Self> {
        for w in topology {
            if w.scheduler_ids != [w.worker_id] {
                bail!(
                    "the aisim engine supports one data-parallel rank per worker (worker {} has schedulers {:?})",
                    w.worker_id,
                    w.scheduler_ids
                );
            }
        }
        let sink = topology.iter().map(|w| w.worker_id).max().ok_or_else(|| anyhow!("a pool without workers"))?;
        shared.borrow_mut().sinks[pool] = Some(sink);
        let mut p = KvroutePlacement { shared, pool, workers: Vec::new() };
        for w in topology {
            p.worker_ready(w.clone(), 0.0)?;
        }
        Ok(p)
    }

    fn router_id(&self, scheduler: usize) -> WorkerId {
        if self.pool == 1 {
            DECODE_BASE + scheduler as WorkerId
        } else {
            scheduler as WorkerId
        }
    }

    fn placement(request_id: Uuid, scheduler_id: usize, overlap_tokens: usize) -> Placement {
        Placement { request_id, scheduler_id, reported_overlap_tokens: overlap_tokens, cache_sample: None, placement_replica_id: None }
    }
}

impl PlacementPolicy<ReplayRequestPayload> for KvroutePlacement {
    type Metadata = ();
    type Observation = KvEventBatch;

    fn place(
        &mut self,
        request: &ReplayRequestPayload,
        _metadata: (),
        _session_id: Option<String>,
        now_ms: f64,
    ) -> Result<PlacementEffects> {
        let uuid = request.metadata().uuid.ok_or_else(|| anyhow!("a replay request without a UUID"))?;
        let mut sh = self.shared.borrow_mut();
        let sink = sh.sinks[self.pool].expect("set at construction");
        if self.pool == 1 {
            // Decode pool: the worker chosen with the prefill, or the sink for a rejected request.
            let scheduler = match sh.requests.get(&uuid) {
                Some((_, Some(d), _)) => (d - DECODE_BASE) as usize,
                _ if sh.routed.get(&uuid).is_some_and(|r| !r.admitted) => sink,
                _ => bail!("decode placement for request {uuid}, which was never routed to a prefill worker"),
            };
            return Ok(PlacementEffects {
                decision: PlacementDecision::Immediate(Self::placement(uuid, scheduler, 0)),
                released: Vec::new(),
            });
        }
        let tokens = request.prompt_tokens();
        let rid = sh.next_id;
        sh.next_id += 1;
        let produced = request.metadata().effective_max_output_tokens() as u64;
        let out = match sh.output {
            OutputShown::MaxTokens(m) => m,
            OutputShown::True => Some(produced),
        };
        let d = sh.router.route(&RouteRequest {
            tokens: Some(&tokens),
            now: Some(secs(now_ms)),
            request_id: Some(rid),
            output_tokens: out,
            ..Default::default()
        })?;
        sh.routed.insert(uuid, Routed { predicted_ttft: d.predicted_ttft, admitted: d.admitted });
        let scheduler = if d.admitted {
            sh.requests.insert(uuid, (rid, d.decode_worker, produced));
            if sh.pd && d.decode_worker.is_none() {
                bail!("the Router chose no decode worker for request {uuid} in a disaggregated run");
            }
            d.worker as usize
        } else {
            sink
        };
        let overlap = d.overlap_blocks as usize * sh.block_size;
        Ok(PlacementEffects { decision: PlacementDecision::Immediate(Self::placement(uuid, scheduler, overlap)), released: Vec::new() })
    }

    fn observe(&mut self, batch: KvEventBatch, _now_ms: f64) -> Result<Vec<Placement>> {
        let mut sh = self.shared.borrow_mut();
        let sink = sh.sinks[self.pool];
        for (worker, events) in batch.0 {
            if Some(worker) == sink {
                continue;
            }
            let id = self.router_id(worker);
            if let Err(e) = sh.apply(id, events) {
                let msg = format!("KV events of worker {worker}: {e:#}");
                sh.event_errors.push(msg);
            }
        }
        Ok(Vec::new())
    }

    fn cancel_pending(&mut self, _request_id: Uuid) -> bool {
        // Every placement is immediate: nothing is ever pending here.
        false
    }

    fn request_terminal(&mut self, request_id: Uuid, now_ms: f64) -> Result<Vec<Placement>> {
        let mut sh = self.shared.borrow_mut();
        // In PD the request ends on the decode side; the prefill side's terminal (if any) is not the end.
        if sh.pd && self.pool == 0 {
            return Ok(Vec::new());
        }
        if let Some((rid, _, produced)) = sh.requests.remove(&request_id) {
            if matches!(sh.output, OutputShown::MaxTokens(_)) {
                sh.router.output_done(rid, produced, Some(secs(now_ms)))?;
            }
            sh.router.finished(rid, Some(secs(now_ms)))?;
        }
        Ok(Vec::new())
    }

    fn prefill_completed(&mut self, request_id: Uuid, now_ms: f64) -> Result<Vec<Placement>> {
        let sh = self.shared.borrow();
        if self.pool == 0 {
            if let Some((rid, _, _)) = sh.requests.get(&request_id) {
                sh.router.prefill_done(*rid, Some(secs(now_ms)))?;
            }
        }
        Ok(Vec::new())
    }

    fn pending_count(&self) -> usize {
        0
    }

    fn worker_ready(&mut self, worker: WorkerTopology, _now_ms: f64) -> Result<Vec<Placement>> {
        let sh = self.shared.borrow();
        if Some(worker.worker_id) == sh.sinks[self.pool] || self.workers.contains(&worker.worker_id) {
            return Ok(Vec::new());
        }
        let mut spec = sh.spec.clone();
        spec.role = match (sh.pd, self.pool) {
            (false, _) => Role::Both,
            (true, 0) => Role::Prefill,
            (true, _) => Role::Decode,
        };
        sh.router.add_worker(self.router_id(worker.worker_id), spec)?;
        self.workers.push(worker.worker_id);
        Ok(Vec::new())
    }

    fn worker_draining(&mut self, worker: WorkerTopology, _now_ms: f64) -> Result<Vec<Placement>> {
        let sh = self.shared.borrow();
        if self.workers.contains(&worker.worker_id) {
            sh.router.remove_worker(self.router_id(worker.worker_id))?;
            self.workers.retain(|&w| w != worker.worker_id);
        }
        Ok(Vec::new())
    }

    fn worker_removed(&mut self, _worker: WorkerTopology, _now_ms: f64) -> Result<Vec<Placement>> {
        Ok(Vec::new())
    }

    fn topology_settled(&mut self, _now_ms: f64) -> Result<Vec<Placement>> {
        Ok(Vec::new())
    }
}
