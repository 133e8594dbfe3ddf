//! Replays a Mooncake-format trace on an aggregated AISimulate cluster with one placement:
//! `cargo run --release -p kvroute-aisim --example replay_trace -- TRACE WORKERS SPEEDUP POLICY`
//! (POLICY: a kvroute policy name, or round_robin; the Router `kvroute serve` builds, told what a
//! deployment knows, see `Knowledge`). Prints the run's summary as JSON; TTFT SLO 2 s
//! (the Router's too), ITL SLO 200 ms. KVROUTE_REJECT=0: no early rejection; KVROUTE_DECODE=D: WORKERS
//! prefill and D decode workers; KVROUTE_POLL_MS=off: no load polling; KVROUTE_RECORDS=FILE:
//! the per-request records as JSON.

use std::sync::Arc;

use kvroute_aisim::{load_trace, run, EngineModel, Knowledge, Placer, RunSpec, Slo, Topology};
use kvroute_core::router::{params, Preset};
use kvroute_core::Router;

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(a.len() == 5, "usage: replay_trace TRACE WORKERS SPEEDUP POLICY");
    let workers: usize = a[2].parse()?;
    let speedup: f64 = a[3].parse()?;
    let spec = RunSpec {
        engine: EngineModel::default(),
        topology: match std::env::var("KVROUTE_DECODE") {
            Ok(d) => Topology::Disaggregated { prefill: workers, decode: d.parse()? },
            Err(_) => Topology::Aggregated { workers },
        },
        slo: Slo { ttft_ms: Some(2_000.0), itl_ms: Some(200.0) },
        typical_prompt_tokens: std::env::var("KVROUTE_TYPICAL").ok().and_then(|v| v.parse().ok()),
        metrics_interval_ms: std::env::var("KVROUTE_POLL_MS").map_or(Some(1_000.0), |v| v.parse().ok()),
        // What a deployment knows; its clients send max_tokens=4096.
        knowledge: Knowledge::Deployed,
        max_tokens: Some(4_096),
    };
    let trace = load_trace(std::path::Path::new(&a[1]), speedup)?;
    let placer = if a[4] == "round_robin" {
        Placer::RoundRobin
    } else {
        let reject = std::env::var("KVROUTE_REJECT").map_or(true, |v| v != "0");
        let cfg = params::build(
            Preset::Gateway,
            [
                ("policy", a[4].as_str().into()),
                ("block_size", spec.engine.block_size.into()),
                ("ttft_slo", Some(2.0).into()),
                ("reject", reject.into()),
                ("link_latency_s", 0.0.into()),
            ],
        )?;
        Placer::Kvroute(Arc::new(Router::new(cfg, None)?))
    };
    let r = run(&spec, placer, trace)?;
    println!("{}", serde_json::to_string_pretty(&r.summary)?);
    if let Ok(path) = std::env::var("KVROUTE_RECORDS") {
        std::fs::write(path, serde_json::to_string(&r.records)?)?;
    }
    eprintln!("wall {:.1} s", r.wall_s);
    Ok(())
}
