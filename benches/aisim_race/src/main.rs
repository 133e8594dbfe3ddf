//! One case of the race on AISimulate's engines: the same trace, engines and seed replayed with
//! every placement named, one JSON line each (the summary `kvroute_aisim::Summary` computes for all).
//!
//! Placements: kvroute policies by name (`kvroute:capacity`, ...), `dynamo` (Dynamo 1.6.1's
//! `KvRouterPlacement` with its default `KvRouterConfig`, through dynamo-mocker's offline replay),
//! `round_robin` (AISimulate's), and `dynamo_round_robin` (dynamo-mocker's round robin: the check
//! that both harnesses build the same engines).
//!
//! ```text
//! aisim-race --trace T.jsonl --workers 16 --speedup 4 --seed 0 --ttft-slo-ms 2000 --itl-slo-ms 50 \
//!            --placements kvroute:capacity,dynamo,round_robin [--disagg 4,12] [--engine '{"num_gpu_blocks": 8192}']
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use dynamo_kv_router::config::KvRouterConfig;
use dynamo_mocker::common::perf_model::PerfModel;
use dynamo_mocker::common::protocols::MockerConfig;
use dynamo_mocker::loadgen::TraceFileFormat;
use dynamo_mocker::replay::{
    simulate_trace_file_disagg_with_router_mode_and_format, simulate_trace_file_with_router_mode_and_format, OfflineDisaggReplayConfig,
    ReplayRouterMode, SlaThresholds,
};
use kvroute_aisim::{load_trace, run, EngineModel, Placer, RequestRecord, RunSpec, Slo, Summary, Timing, Topology, TRACE_BLOCK_SIZE};
use kvroute_core::{Router, RouterConfig};
use serde_json::json;

struct Args {
    trace: PathBuf,
    topology: Topology,
    speedup: f64,
    seed: u64,
    slo: Slo,
    placements: Vec<String>,
    engine: EngineModel,
    router: serde_json::Value,
}

fn args() -> Result<Args> {
    let mut a = Args {
        trace: PathBuf::new(),
        topology: Topology::Aggregated { workers: 16 },
        speedup: 1.0,
        seed: 0,
        slo: Slo::default(),
        placements: vec!["kvroute:capacity".into(), "dynamo".into(), "round_robin".into()],
        engine: EngineModel::default(),
        router: json!({}),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--trace" => a.trace = val()?.into(),
            "--workers" => a.topology = Topology::Aggregated { workers: val()?.parse()? },
            "--disagg" => {
                let v = val()?;
                let (p, d) = v.split_once(',').context("--disagg P,D")?;
                a.topology = Topology::Disaggregated { prefill: p.parse()?, decode: d.parse()? };
            }
            "--speedup" => a.speedup = val()?.parse()?,
            "--seed" => a.seed = val()?.parse()?,
            "--ttft-slo-ms" => a.slo.ttft_ms = Some(val()?.parse()?),
            "--itl-slo-ms" => a.slo.itl_ms = Some(val()?.parse()?),
            "--placements" => a.placements = val()?.split(',').map(str::to_string).collect(),
            "--engine" => a.engine = serde_json::from_str(&val()?).context("--engine: a JSON EngineModel")?,
            "--router" => a.router = serde_json::from_str(&val()?).context("--router: a JSON object of RouterConfig fields")?,
            _ => bail!("unknown flag {flag}"),
        }
    }
    if a.trace.as_os_str().is_empty() {
        bail!("--trace PATH is required");
    }
    Ok(a)
}

fn router_config(a: &Args, policy: &str) -> Result<RouterConfig> {
    let mut cfg = RouterConfig {
        policy: policy.to_string(),
        block_size: a.engine.block_size,
        seed: a.seed,
        // The cluster's KV transfer, as AISimulate models it (kvroute_aisim::run checks this in PD).
        kv_bytes_per_token: a.engine.kv_bytes_per_token as f64,
        link_bytes_per_s: a.engine.kv_transfer_gb_s * 1e9,
        link_latency_s: 0.0,
        decode_step_s: a.engine.decode_step_s(),
        ..Default::default()
    };
    if let Some(ms) = a.slo.ttft_ms {
        cfg.ttft_slo = Some(ms / 1_000.0);
    }
    for (k, v) in a.router.as_object().context("--router must be a JSON object")? {
        match (k.as_str(), v) {
            ("reject", serde_json::Value::Bool(b)) => cfg.reject = *b,
            ("ttft_slo", v) => cfg.ttft_slo = v.as_f64(),
            ("cache_threshold", v) => cfg.cache_threshold = v.as_f64().context("cache_threshold: a number")?,
            ("queue_weight", v) => cfg.queue_weight = v.as_f64().context("queue_weight: a number")?,
            ("prefill_weight", v) => cfg.prefill_weight = v.as_f64().context("prefill_weight: a number")?,
            ("balance_abs_threshold", v) => cfg.balance_abs_threshold = v.as_f64().context("a number")?,
            ("balance_rel_threshold", v) => cfg.balance_rel_threshold = v.as_f64().context("a number")?,
            ("token_share_bound", v) => cfg.token_share_bound = v.as_f64(),
            _ => bail!("--router: unsupported field {k}"),
        }
    }
    Ok(cfg)
}

fn mocker_config(engine: &EngineModel) -> Result<MockerConfig> {
    // The same engine AISimulate gets from kvroute-aisim (the round-robin pair checks it).
    let mut m = MockerConfig::default();
    m.engine.engine = engine.to_aisim(true);
    m.engine.num_gpu_blocks_is_explicit = true;
    m.perf_model = Arc::new(match &engine.timing {
        Timing::Builtin => PerfModel::default(),
        Timing::Fixed { prefill_ms, decode_ms } => PerfModel::Fixed { prefill_ms: *prefill_ms, decode_ms: *decode_ms },
        Timing::Polynomial(_) => {
            bail!("the race runs Dynamo on AISimulate's built-in or fixed timing only (the mocker takes no other fit)")
        }
    });
    m.normalized()
}

fn dynamo(a: &Args, mode: ReplayRouterMode) -> Result<Vec<RequestRecord>> {
    let sla = SlaThresholds::default();
    let report = match a.topology {
        Topology::Aggregated { workers } => simulate_trace_file_with_router_mode_and_format(
            mocker_config(&a.engine)?,
            (mode == ReplayRouterMode::KvRouter).then(KvRouterConfig::default),
            None,
            &a.trace,
            TRACE_BLOCK_SIZE,
            workers,
            a.speedup,
            mode,
            TraceFileFormat::Mooncake,
            0.0,
            0,
            true,
            None,
            sla,
        )?,
        Topology::Disaggregated { prefill, decode } => {
            let mut p = mocker_config(&a.engine)?;
            p.engine.engine.worker_type = aisimulate_core::engine::WorkerType::Prefill;
            let mut d = mocker_config(&a.engine)?;
            d.engine.engine.worker_type = aisimulate_core::engine::WorkerType::Decode;
            simulate_trace_file_disagg_with_router_mode_and_format(
                OfflineDisaggReplayConfig { prefill_args: p, decode_args: d, num_prefill_workers: prefill, num_decode_workers: decode },
                (mode == ReplayRouterMode::KvRouter).then(KvRouterConfig::default),
                None,
                &a.trace,
                TRACE_BLOCK_SIZE,
                a.speedup,
                mode,
                TraceFileFormat::Mooncake,
                0.0,
                0,
                true,
                None,
                sla,
            )?
        }
    };
    let mut recs: Vec<RequestRecord> = report.per_request.iter().map(|r| RequestRecord::from_aisim(r, false)).collect();
    recs.sort_by(|x, y| x.arrival_ms.total_cmp(&y.arrival_ms));
    Ok(recs)
}

fn main() -> Result<()> {
    let a = args()?;
    let spec = RunSpec::new(a.engine.clone(), a.topology, a.slo);
    for name in &a.placements {
        let start = Instant::now();
        let records = match name.as_str() {
            "dynamo" => dynamo(&a, ReplayRouterMode::KvRouter)?,
            "dynamo_round_robin" => dynamo(&a, ReplayRouterMode::RoundRobin)?,
            "round_robin" => run(&spec, Placer::RoundRobin, load_trace(&a.trace, a.speedup)?)?.records,
            other => {
                let policy = other.strip_prefix("kvroute:").with_context(|| format!("unknown placement {other}"))?;
                let router = Arc::new(Router::new(router_config(&a, policy)?, None)?);
                run(&spec, Placer::Kvroute(router), load_trace(&a.trace, a.speedup)?)?.records
            }
        };
        let wall_s = start.elapsed().as_secs_f64();
        let summary = Summary::of(&records, a.slo);
        println!(
            "{}",
            json!({"placement": name, "topology": a.topology, "speedup": a.speedup, "seed": a.seed, "wall_s": wall_s, "summary": summary})
        );
    }
    Ok(())
}
