//! Replays a Mooncake-format trace on an aggregated AISimulate cluster with one placement:
//! `cargo run --release -p kvroute-aisim --example replay_trace -- TRACE WORKERS SPEEDUP POLICY`
//! (POLICY: a kvroute policy name, or round_robin). Prints the run's summary as JSON.

use std::sync::Arc;

use kvroute_aisim::{load_trace, run, EngineModel, Placer, RunSpec, Slo, Topology};
use kvroute_core::{Router, RouterConfig};

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(a.len() == 5, "usage: replay_trace TRACE WORKERS SPEEDUP POLICY");
    let workers: usize = a[2].parse()?;
    let speedup: f64 = a[3].parse()?;
    let spec = RunSpec {
        engine: EngineModel::default(),
        topology: Topology::Aggregated { workers },
        slo: Slo { ttft_ms: Some(2_000.0), itl_ms: Some(50.0) },
        typical_prompt_tokens: 4096.0,
    };
    let trace = load_trace(std::path::Path::new(&a[1]), speedup)?;
    let placer = if a[4] == "round_robin" {
        Placer::RoundRobin
    } else {
        let cfg = RouterConfig { policy: a[4].clone(), block_size: spec.engine.block_size, ..Default::default() };
        Placer::Kvroute(Arc::new(Router::new(cfg, None)?))
    };
    let r = run(&spec, placer, trace)?;
    println!("{}", serde_json::to_string_pretty(&r.summary)?);
    eprintln!("wall {:.1} s", r.wall_s);
    Ok(())
}
