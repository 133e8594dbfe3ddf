//! One replay: a Mooncake-format trace on an AISimulate cluster, placed by kvroute's Router or by
//! round robin, reduced to per-request records and a `Summary`.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use aisimulate_core::engine::{EngineConfig, WorkerType};
use aisimulate_core::replay::loadgen::{MooncakeRow, Trace};
use aisimulate_core::replay::{
    ReplayComposition, ReplayEngineConfig, ReplayEngineFactory, ReplayReport, ReplayRoleConfig, ReplayRuntimeInput, ReplaySpec,
    ReplayTopology, Replayer, WorkerPoolSpec, WorkerTopology, CURRENT_REPLAY_SPEC_VERSION,
};
use aisimulate_core::replay::{ReplaySchedulerMetricsSnapshot, ReplayTelemetryObserver, ReplayTelemetrySnapshot};
use anyhow::{bail, ensure, Context, Result};
use kvroute_core::router::{Observed, WorkerSpec};
use kvroute_core::{Router, RouterError, WorkerId};
use serde::{Deserialize, Serialize};

use crate::engine::EngineModel;
use crate::placement::{KvEventObservation, KvroutePlacement, OutputShown, Routed, Shared, DECODE_BASE};
use crate::summary::{RequestRecord, Slo, Summary};

/// Tokens per `hash_ids` entry in Mooncake-format traces.
pub const TRACE_BLOCK_SIZE: usize = 512;

/// Which workers the cluster has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Topology {
    /// Unified workers (prefill and decode on each).
    Aggregated { workers: usize },
    /// xPyD: `prefill` prefill-only and `decode` decode-only workers.
    Disaggregated { prefill: usize, decode: usize },
}

impl Topology {
    fn validate(&self) -> Result<()> {
        match *self {
            Topology::Aggregated { workers } => ensure!(workers >= 1, "topology: workers must be >= 1, got {workers}"),
            Topology::Disaggregated { prefill, decode } => {
                ensure!(prefill >= 1 && decode >= 1, "topology: prefill and decode must be >= 1, got {prefill}P{decode}D")
            }
        }
        Ok(())
    }
}

/// Who places requests.
pub enum Placer {
    /// kvroute's Router (a fresh one: it must have no workers yet; the run registers them).
    Kvroute(Arc<Router>),
    /// AISimulate's round robin (no KV awareness).
    RoundRobin,
}

/// A run's inputs besides the placer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    pub engine: EngineModel,
    pub topology: Topology,
    #[serde(default)]
    pub slo: Slo,
    /// Typical prompt length, tokens: where the Router's prefill speed is read off the timing fit,
    /// and the context its decode speed assumes (`EngineModel::decode_tokens_per_s`). None: the
    /// trace's mean prompt length (what an operator calibrating the Router on this workload gets).
    #[serde(default)]
    pub typical_prompt_tokens: Option<f64>,
    /// How often the engines' load (waiting and running requests, KV usage) reaches the Router,
    /// ms of simulated time: what a gateway's /metrics poller does. None: never.
    #[serde(default = "metrics_interval")]
    pub metrics_interval_ms: Option<f64>,
    /// What the Router is told about the engines (see `Knowledge`).
    #[serde(default)]
    pub knowledge: Knowledge,
    /// The `max_tokens` every client sends: the output length the Router is shown (it reserves
    /// decode KV for it). The engines still generate each request's own `output_length`, which no
    /// deployment knows in advance; None: the request sends none (the Router reserves no output).
    /// Ignored under `Knowledge::Oracle`, which shows the true output length.
    #[serde(default)]
    pub max_tokens: Option<u64>,
}

/// What the Router is told about the simulated engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Knowledge {
    /// What a deployment knows: each engine's KV pool (vLLM's `cache_config_info`) and seats
    /// (`max_num_seqs`), and the PD link; not their speed. Workers register with `WorkerSpec`'s
    /// default prefill speed (the prior) and no decode speed; a Router with the learned TTFT model
    /// measures the rest from the prefills it sees finish. The Router's own `decode_step_s`.
    #[default]
    Deployed,
    /// An ablation no deployment can run: the simulator's own timing fit, read at the trace's mean
    /// prompt (`typical_prompt_tokens`), as each worker's prefill and decode speed, and each
    /// request's true output length.
    Oracle,
}

fn metrics_interval() -> Option<f64> {
    Some(1_000.0)
}

/// The engines' load, as a /metrics poller would read it, into `Router::observe`.
struct LoadPoller {
    router: Arc<Router>,
    pd: bool,
}

impl ReplayTelemetryObserver for LoadPoller {
    fn on_sample(&mut self, snap: ReplayTelemetrySnapshot) -> Result<()> {
        let now = Some(snap.sampled_at_ms / 1_000.0);
        // Aggregated replays report their one pool in the decode rows.
        let pools: [(&[ReplaySchedulerMetricsSnapshot], WorkerId); 2] = if self.pd {
            [(&snap.prefill_scheduler_metrics, 0), (&snap.decode_scheduler_metrics, DECODE_BASE)]
        } else {
            [(&snap.decode_scheduler_metrics, 0), (&[], 0)]
        };
        for (rows, base) in pools {
            for m in rows {
                let seen = Observed {
                    waiting: Some(m.waiting_requests.min(u32::MAX as u64) as u32),
                    running: Some(m.running_requests.min(u32::MAX as u64) as u32),
                    kv_usage: Some(m.active_cache_usage.clamp(0.0, 1.0)),
                };
                match self.router.observe(base + m.worker_id as WorkerId, seen, None, now) {
                    Ok(()) | Err(RouterError::UnknownWorker(_)) => {} // the sink is no worker of the Router's
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }
}

impl RunSpec {
    /// A spec with the defaults for everything but the engines, topology and SLOs.
    pub fn new(engine: EngineModel, topology: Topology, slo: Slo) -> Self {
        RunSpec {
            engine,
            topology,
            slo,
            typical_prompt_tokens: None,
            metrics_interval_ms: metrics_interval(),
            knowledge: Knowledge::default(),
            max_tokens: None,
        }
    }
}

/// The trace's mean prompt length, tokens (4,096 for an empty trace).
fn mean_prompt(trace: &Trace) -> f64 {
    let (n, sum) = trace.sessions.iter().flat_map(|s| &s.turns).fold((0usize, 0usize), |(n, s), t| (n + 1, s + t.input_length));
    if n == 0 {
        4096.0
    } else {
        sum as f64 / n as f64
    }
}

/// What one run produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub summary: Summary,
    pub records: Vec<RequestRecord>,
    /// Wall-clock seconds the replay took.
    pub wall_s: f64,
    /// kvroute placements: each prefill worker's speed as the Router ends the run with it.
    #[serde(default)]
    pub speeds: Vec<WorkerSpeed>,
    /// The engines' prefill speed as the timing fit gives it at the trace's typical prompt (what
    /// `Knowledge::Oracle` tells the Router), tokens per second: the reference a learned speed
    /// is judged against.
    #[serde(default)]
    pub fit_prefill_tokens_per_s: Option<f64>,
}

/// One prefill worker's speed in the Router at the end of a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerSpeed {
    pub worker: WorkerId,
    /// Prefill tokens per second the Router predicts with: learned, or as registered.
    pub prefill_tokens_per_s: f64,
    /// The learned fixed part of a prefill, seconds (None: not fitted).
    pub overhead_s: Option<f64>,
    /// Finished prefills the fit has seen.
    pub samples: u64,
}

/// Reads a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
/// `hash_ids` of 512-token blocks, optional `session_id`), arrivals sped up by `speedup`.
pub fn load_trace(path: &Path, speedup: f64) -> Result<Trace> {
    ensure!(speedup.is_finite() && speedup > 0.0, "speedup must be a finite number > 0, got {speedup}");
    let t = Trace::from_mooncake(path, TRACE_BLOCK_SIZE).with_context(|| format!("reading trace {}", path.display()))?;
    t.speed_up_timing(speedup)
}

/// The same from rows already in memory.
pub fn trace_from_rows(rows: Vec<MooncakeRow>, speedup: f64) -> Result<Trace> {
    trace_from_rows_in_blocks(rows, TRACE_BLOCK_SIZE, speedup)
}

/// Rows whose `hash_ids` name blocks of `block_size` tokens (Mooncake's are 512; a generator may
/// use the engines' block size to place shared prefixes more finely).
pub fn trace_from_rows_in_blocks(rows: Vec<MooncakeRow>, block_size: usize, speedup: f64) -> Result<Trace> {
    ensure!(!rows.is_empty(), "the trace has no requests");
    ensure!(block_size >= 1, "the trace's block size must be >= 1, got {block_size}");
    ensure!(speedup.is_finite() && speedup > 0.0, "speedup must be a finite number > 0, got {speedup}");
    Trace::from_mooncake_rows(rows, block_size)?.speed_up_timing(speedup)
}

struct KvrouteComposition {
    shared: Rc<RefCell<Shared>>,
}

impl ReplayComposition for KvrouteComposition {
    type Metadata = ();
    type Observation = KvEventObservation;
    type AggregatedPlacement = KvroutePlacement;
    type DisaggregatedPlacement = KvroutePlacement;

    fn create_aggregated_placement(&mut self, _dp_size: u32, topology: Vec<WorkerTopology>) -> Result<KvroutePlacement> {
        KvroutePlacement::new(self.shared.clone(), 0, &topology)
    }

    fn create_disaggregated_placements(
        &mut self,
        _prefill_dp_size: u32,
        prefill: Vec<WorkerTopology>,
        _decode_dp_size: u32,
        decode: Vec<WorkerTopology>,
    ) -> Result<(KvroutePlacement, KvroutePlacement)> {
        Ok((KvroutePlacement::new(self.shared.clone(), 0, &prefill)?, KvroutePlacement::new(self.shared.clone(), 1, &decode)?))
    }
}

fn spec(engine: &EngineModel, topology: ReplayTopology, kv_events: bool) -> Result<ReplaySpec> {
    let mut cfg = ReplayEngineConfig { rank: engine.to_aisim(kv_events), ..Default::default() };
    if matches!(topology, ReplayTopology::Disaggregated { .. }) {
        // The Router indexes the prefill pool only: decode engines publish no KV events.
        let role = |worker_type, events| ReplayRoleConfig {
            dp_size: 1,
            tensor_parallel_size: 1,
            prefill_context_parallel_size: 1,
            num_gpu_blocks_is_explicit: Some(true),
            rank: EngineConfig { worker_type, ..engine.to_aisim(events) },
        };
        cfg.prefill = Some(role(WorkerType::Prefill, kv_events));
        cfg.decode = Some(role(WorkerType::Decode, false));
        cfg.rank = cfg.prefill.as_ref().expect("set").rank.clone();
    }
    Ok(ReplaySpec {
        version: CURRENT_REPLAY_SPEC_VERSION,
        topology,
        engine: serde_json::to_value(cfg)?,
        adapters: Default::default(),
        max_sim_time_ms: None,
        max_in_flight: None,
        record_per_request: true,
        sla: Default::default(),
        requests: Vec::new(),
    })
}

fn pools(t: Topology, sink: usize) -> ReplayTopology {
    let pool = |n: usize| WorkerPoolSpec { initial_workers: n + sink, ..Default::default() };
    match t {
        Topology::Aggregated { workers } => ReplayTopology::Aggregated { workers: pool(workers) },
        Topology::Disaggregated { prefill, decode } => {
            ReplayTopology::Disaggregated { prefill: pool(prefill), decode: pool(decode), handoff_latency_ms: 0.0 }
        }
    }
}

/// The `ReplaySpec` and engine factory every run of this crate builds: the engines of `engine`
/// (publishing KV events when `kv_events`) in `topology`, with one extra *sink* worker per pool when
/// `sink` (see `placement`). For a placement composed outside this crate that must run on exactly
/// the engines the race's other placements get.
pub fn replay_setup(engine: &EngineModel, topology: Topology, sink: bool, kv_events: bool) -> Result<(ReplaySpec, ReplayEngineFactory)> {
    engine.validate()?;
    topology.validate()?;
    Ok((spec(engine, pools(topology, usize::from(sink)), kv_events)?, factory(engine)))
}

fn factory(engine: &EngineModel) -> ReplayEngineFactory {
    match engine.timing_provider() {
        Some(t) => ReplayEngineFactory::with_timing_model(t),
        None => ReplayEngineFactory::new(),
    }
}

/// Replays `trace` on the cluster `spec` describes, placed by `placer`.
pub fn run(spec_: &RunSpec, placer: Placer, trace: Trace) -> Result<RunResult> {
    spec_.engine.validate()?;
    spec_.topology.validate()?;
    let block_size = spec_.engine.block_size;
    let start = Instant::now();
    let typical = spec_.typical_prompt_tokens.unwrap_or_else(|| mean_prompt(&trace));
    ensure!(typical.is_finite() && typical >= 1.0, "typical_prompt_tokens must be a finite number >= 1, got {typical}");
    let driver = trace.into_trace_driver_with_block_size(block_size)?;
    let input = ReplayRuntimeInput::Workload(driver);
    let mut speeds = Vec::new();
    let (report, routed, errors): (ReplayReport, hashbrown::HashMap<uuid::Uuid, Routed>, _) = match placer {
        Placer::RoundRobin => {
            let r = Replayer::new(spec(&spec_.engine, pools(spec_.topology, 0), false)?, factory(&spec_.engine))?
                .with_runtime_input(input)
                .run()?;
            (r, Default::default(), Vec::new())
        }
        Placer::Kvroute(router) => {
            let cfg = router.config();
            if cfg.block_size != block_size {
                bail!("the Router's block_size ({}) must be the engines' ({block_size})", cfg.block_size);
            }
            if !router.workers().is_empty() {
                bail!("give the run a fresh Router: this one has workers already (the run registers the cluster's)");
            }
            let pd = matches!(spec_.topology, Topology::Disaggregated { .. });
            let link = spec_.engine.kv_transfer_gb_s * 1e9;
            if pd
                && (cfg.pd.kv_bytes_per_token != spec_.engine.kv_bytes_per_token as f64
                    || cfg.pd.link_bytes_per_s != link
                    || cfg.pd.link_latency_s != 0.0)
            {
                bail!(
                    "the Router's KV transfer model (kv_bytes_per_token {}, link_bytes_per_s {}, link_latency_s {}) is not the cluster's \
                     ({} bytes per token over {link} bytes/s, no latency): build it with those, or its TTFT predictions miss every transfer",
                    cfg.pd.kv_bytes_per_token,
                    cfg.pd.link_bytes_per_s,
                    cfg.pd.link_latency_s,
                    spec_.engine.kv_bytes_per_token
                );
            }
            let mut worker = WorkerSpec {
                kv_capacity_blocks: Some(spec_.engine.num_gpu_blocks as u64),
                prefix_cache_blocks: Some(spec_.engine.num_gpu_blocks as u64),
                max_running: Some(spec_.engine.max_num_seqs.min(u32::MAX as usize) as u32),
                ..Default::default()
            };
            let output = match spec_.knowledge {
                Knowledge::Deployed => OutputShown::MaxTokens(spec_.max_tokens),
                Knowledge::Oracle => {
                    worker.prefill_tokens_per_s = spec_.engine.prefill_tokens_per_s(typical);
                    worker.decode_tokens_per_s = spec_.engine.decode_tokens_per_s(typical);
                    OutputShown::True
                }
            };
            let shared = Shared::new(router.clone(), pd, worker, output);
            let comp = KvrouteComposition { shared: shared.clone() };
            let mut replayer =
                Replayer::with_composition(spec(&spec_.engine, pools(spec_.topology, 1), true)?, factory(&spec_.engine), comp)?
                    .with_runtime_input(input);
            if let Some(ms) = spec_.metrics_interval_ms {
                replayer = replayer.with_telemetry_observer(ms, Box::new(LoadPoller { router: router.clone(), pd }))?;
            }
            let r = replayer.run()?;
            for id in router.workers() {
                let w = router.load(id)?;
                if w.spec.role.prefills() {
                    let f = &w.prefill_fit;
                    let (prefill_tokens_per_s, overhead_s) = (w.prefill_speed(), w.prefill_model().map(|(a, _)| a));
                    speeds.push(WorkerSpeed { worker: id, prefill_tokens_per_s, overhead_s, samples: f.samples() });
                }
            }
            let mut sh = shared.borrow_mut();
            (r, std::mem::take(&mut sh.routed), std::mem::take(&mut sh.event_errors))
        }
    };
    if let Some(first) = errors.first() {
        bail!("{} KV event batches could not be applied to the Router's index; the first: {first}", errors.len());
    }
    let mut records: Vec<RequestRecord> = report
        .per_request
        .iter()
        .map(|r| {
            let decided = r.uuid.parse::<uuid::Uuid>().ok().and_then(|u| routed.get(&u));
            RequestRecord {
                predicted_ttft_ms: decided.map(|d| d.predicted_ttft * 1_000.0),
                ..RequestRecord::from_aisim(r, decided.is_some_and(|d| !d.admitted))
            }
        })
        .collect();
    records.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
    let summary = Summary::of(&records, spec_.slo);
    let fit_prefill_tokens_per_s = spec_.engine.fit().is_some().then(|| spec_.engine.prefill_tokens_per_s(typical));
    Ok(RunResult { summary, records, wall_s: start.elapsed().as_secs_f64(), speeds, fit_prefill_tokens_per_s })
}
