//! One case of the race on AISimulate's engines: the same trace, engines and seed replayed with
//! every placement named, one JSON line each (the summary `kvroute_aisim::Summary` computes for all).
//!
//! Placements:
//! - `kvroute` (or `kvroute:POLICY`): kvroute's Router as `kvroute serve` builds it (its defaults,
//!   the engines' block size), told only what a deployment knows (`--knowledge deployed`, the
//!   default: KV pool, seats and PD link; speeds learned) or, as a labelled ablation, the
//!   simulator's own timing (`--knowledge oracle`). `--router` sets any Router parameter by its name.
//! - `dynamo`: Dynamo 1.6.1's `KvRouterPlacement` through dynamo-mocker's offline replay, with
//!   `KvRouterConfig` from `--dynamo` (its fields as Dynamo's serde names them; default: Dynamo's).
//! - `dynamo_shed`: the same KV router assembled from dynamo-kv-router's public parts as an
//!   AISimulate placement (`dynamo_shed`), plus Dynamo's busy-threshold load shedding with the
//!   thresholds of `--dynamo-shed` (none: nothing is shed). Shedding off, it places request for
//!   request as dynamo-mocker's `KvRouterPlacement` under canonical determinism (the test
//!   `same_placements_as_dynamo_mocker`); `dynamo` runs the mocker's file replay, whose
//!   tie-breaks are unseeded, so the two differ where ties fall. Aggregated topologies only.
//! - `round_robin` (AISimulate's) and `dynamo_round_robin` (dynamo-mocker's): the check that both
//!   harnesses build the same engines.
//!
//! ```text
//! aisim-race --trace T.jsonl --workers 16 --speedup 4 --seed 0 --ttft-slo-ms 2000 --itl-slo-ms 200 \
//!            --placements kvroute,dynamo,round_robin [--disagg 4,12] [--engine '{"num_gpu_blocks": 8192}'] \
//!            [--router '{"reject": false}'] [--dynamo '{"overlap_score_credit": 2.0}'] [--max-tokens 4096] \
//!            [--dynamo-shed '{"active_prefill_tokens_threshold": 20000, "active_decode_blocks_threshold": 0.9}'] \
//!            [--knowledge deployed|oracle] [--records]
//! ```

mod dynamo_shed;

use aisimulate_core::replay::{ReplayCaptureOptions, ReplayDeterminism};

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
use kvroute_aisim::{
    load_trace, run, EngineModel, Knowledge, Placer, RequestRecord, RunSpec, Slo, Summary, Timing, Topology, TRACE_BLOCK_SIZE,
};
use kvroute_core::router::params::{self, Value};
use kvroute_core::router::{Preset, RouterConfig};
use kvroute_core::Router;
use serde_json::json;

struct Args {
    trace: PathBuf,
    topology: Topology,
    speedup: f64,
    seed: u64,
    slo: Slo,
    placements: Vec<String>,
    engine: EngineModel,
    router: serde_json::Map<String, serde_json::Value>,
    dynamo: serde_json::Value,
    dynamo_shed: dynamo_shed::ShedConfig,
    knowledge: Knowledge,
    max_tokens: Option<u64>,
    records: bool,
}

fn args() -> Result<Args> {
    let mut a = Args {
        trace: PathBuf::new(),
        topology: Topology::Aggregated { workers: 16 },
        speedup: 1.0,
        seed: 0,
        slo: Slo::default(),
        placements: vec!["kvroute".into(), "dynamo".into(), "round_robin".into()],
        engine: EngineModel::default(),
        router: serde_json::Map::new(),
        dynamo: json!({}),
        dynamo_shed: dynamo_shed::ShedConfig::default(),
        knowledge: Knowledge::Deployed,
        max_tokens: None,
        records: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--records" {
            a.records = true;
            continue;
        }
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
            "--router" => {
                let v: serde_json::Value = serde_json::from_str(&val()?).context("--router: JSON")?;
                a.router = v.as_object().context("--router: a JSON object of Router parameters")?.clone();
            }
            "--dynamo" => a.dynamo = serde_json::from_str(&val()?).context("--dynamo: a JSON object of KvRouterConfig fields")?,
            "--dynamo-shed" => {
                a.dynamo_shed = serde_json::from_str(&val()?).context("--dynamo-shed: a JSON object of busy thresholds")?;
            }
            "--knowledge" => {
                a.knowledge = serde_json::from_value(json!(val()?)).context("--knowledge: deployed or oracle")?;
            }
            "--max-tokens" => a.max_tokens = Some(val()?.parse()?),
            _ => bail!("unknown flag {flag}"),
        }
    }
    if a.trace.as_os_str().is_empty() {
        bail!("--trace PATH is required");
    }
    Ok(a)
}

fn value(name: &str, v: &serde_json::Value) -> Result<Value> {
    Ok(match v {
        serde_json::Value::Null => Value::None,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i as i128),
            None => Value::Float(n.as_f64().context("a number")?),
        },
        serde_json::Value::String(s) => Value::Str(s.clone()),
        _ => bail!("--router: {name} must be a bool, number, string or null"),
    })
}

/// The Router `kvroute serve` builds with KV events (`Preset::Gateway`), set to the engines' block
/// size, the cluster's PD link and the TTFT SLO; under `Knowledge::Oracle`, also the fit's decode
/// step; then `policy` (when named) and `--router`'s parameters.
fn router_config(a: &Args, policy: Option<&str>) -> Result<RouterConfig> {
    let mut given: Vec<(String, Value)> = vec![
        ("block_size".into(), Value::Int(a.engine.block_size as i128)),
        ("seed".into(), Value::Int(a.seed as i128)),
        // The cluster's KV transfer, as AISimulate models it (kvroute_aisim::run checks this in PD).
        ("kv_bytes_per_token".into(), Value::Float(a.engine.kv_bytes_per_token as f64)),
        ("link_bytes_per_s".into(), Value::Float(a.engine.kv_transfer_gb_s * 1e9)),
        ("link_latency_s".into(), Value::Float(0.0)),
    ];
    if let Some(ms) = a.slo.ttft_ms {
        given.push(("ttft_slo".into(), Value::Float(ms / 1_000.0)));
    }
    if a.knowledge == Knowledge::Oracle {
        given.push(("decode_step_s".into(), Value::Float(a.engine.decode_step_s())));
        given.push(("ttft_model".into(), Value::Str("configured".into())));
    }
    if let Some(p) = policy {
        given.push(("policy".into(), Value::Str(p.into())));
    }
    for (k, v) in &a.router {
        given.retain(|(name, _)| name != k);
        given.push((k.clone(), value(k, v)?));
    }
    Ok(params::build(Preset::Gateway, given.iter().map(|(k, v)| (k.as_str(), v.clone())))?)
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
    let kv_cfg = || -> Result<Option<KvRouterConfig>> {
        if mode != ReplayRouterMode::KvRouter {
            return Ok(None);
        }
        Ok(Some(serde_json::from_value(a.dynamo.clone()).context("--dynamo: KvRouterConfig fields")?))
    };
    let report = match a.topology {
        Topology::Aggregated { workers } => simulate_trace_file_with_router_mode_and_format(
            mocker_config(&a.engine)?,
            kv_cfg()?,
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
                kv_cfg()?,
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

/// Dynamo's KV router with busy-threshold shedding, on the same engines as `kvroute` and
/// `round_robin` (aggregated topologies only).
fn dynamo_shed(a: &Args) -> Result<(Vec<RequestRecord>, serde_json::Value)> {
    let Topology::Aggregated { workers } = a.topology else {
        bail!("dynamo_shed runs aggregated topologies only");
    };
    let cfg: KvRouterConfig = serde_json::from_value(a.dynamo.clone()).context("--dynamo: KvRouterConfig fields")?;
    // Canonical determinism, as dynamo-mocker's canonical replay: ordinal request ids and a seeded
    // selector, so a run reproduces (CI's check reruns one).
    let capture = ReplayCaptureOptions { determinism: ReplayDeterminism::CanonicalV1, ..Default::default() };
    let r = dynamo_shed::run(&a.engine, workers, load_trace(&a.trace, a.speedup)?, cfg, a.dynamo_shed.clone(), capture)?;
    Ok((r.records(), json!({"shed": a.dynamo_shed, "rejected": r.log.rejected.len()})))
}

fn main() -> Result<()> {
    let a = args()?;
    let mut spec = RunSpec::new(a.engine.clone(), a.topology, a.slo);
    spec.knowledge = a.knowledge;
    spec.max_tokens = a.max_tokens;
    for name in &a.placements {
        let start = Instant::now();
        let kvroute = |policy: Option<&str>| -> Result<_> {
            let router = Arc::new(Router::new(router_config(&a, policy)?, None)?);
            let r = run(&spec, Placer::Kvroute(router), load_trace(&a.trace, a.speedup)?)?;
            Ok((r.records, json!({"speeds": r.speeds, "fit_prefill_tokens_per_s": r.fit_prefill_tokens_per_s})))
        };
        let (records, learned) = match name.as_str() {
            "dynamo" => (dynamo(&a, ReplayRouterMode::KvRouter)?, json!(null)),
            "dynamo_shed" => dynamo_shed(&a)?,
            "dynamo_round_robin" => (dynamo(&a, ReplayRouterMode::RoundRobin)?, json!(null)),
            "round_robin" => (run(&spec, Placer::RoundRobin, load_trace(&a.trace, a.speedup)?)?.records, json!(null)),
            "kvroute" => kvroute(None)?,
            other => kvroute(Some(other.strip_prefix("kvroute:").with_context(|| format!("unknown placement {other}"))?))?,
        };
        let wall_s = start.elapsed().as_secs_f64();
        let summary = Summary::of(&records, a.slo);
        let mut line =
            json!({"placement": name, "topology": a.topology, "speedup": a.speedup, "seed": a.seed, "wall_s": wall_s, "summary": summary});
        if !learned.is_null() {
            line["router"] = learned;
        }
        if a.records {
            line["records"] = json!(records);
        }
        println!("{line}");
    }
    Ok(())
}
