//! kvroute's Router on AISimulate's engines, end to end on small generated traces: the index is fed
//! by the engines' KV events, placements follow prefixes, rejections never reach a serving engine,
//! and a disaggregated run decodes where the Router said.

use std::sync::Arc;

use aisimulate_core::replay::loadgen::MooncakeRow;
use kvroute_aisim::{run, trace_from_rows, EngineModel, Placer, RunSpec, Slo, Timing, Topology, TRACE_BLOCK_SIZE};
use kvroute_core::{router_config, Router};

/// `groups` prefix groups of `per_group` requests, each prompt = the group's 4-block prefix + one
/// block of its own; arrivals `gap_ms` apart, groups interleaved.
fn rows(groups: u64, per_group: u64, gap_ms: f64, output: usize) -> Vec<MooncakeRow> {
    let mut out = Vec::new();
    let mut fresh = 1_000;
    for i in 0..per_group {
        for g in 0..groups {
            let mut ids: Vec<u64> = (0..4).map(|b| g * 10 + b).collect();
            ids.push(fresh);
            fresh += 1;
            out.push(MooncakeRow {
                timestamp: Some(((i * groups + g) as f64) * gap_ms),
                input_length: Some(ids.len() * TRACE_BLOCK_SIZE),
                output_length: Some(output),
                hash_ids: Some(ids),
                ..Default::default()
            });
        }
    }
    out
}

fn spec(topology: Topology) -> RunSpec {
    let engine = EngineModel { num_gpu_blocks: 2048, timing: Timing::Fixed { prefill_ms: 20.0, decode_ms: 5.0 }, ..Default::default() };
    RunSpec { typical_prompt_tokens: Some(2560.0), ..RunSpec::new(engine, topology, Slo { ttft_ms: Some(1_000.0), itl_ms: None }) }
}

fn router(policy: &str, ttft_slo: Option<f64>) -> Arc<Router> {
    let cfg = router_config!(policy: policy, block_size: 64, ttft_slo: ttft_slo, link_bytes_per_s: 25e9, link_latency_s: 0.0);
    Arc::new(Router::new(cfg, None).unwrap())
}

#[test]
fn prefix_routing_beats_round_robin_on_hits_and_the_index_follows_the_engines() {
    let s = spec(Topology::Aggregated { workers: 4 });
    let rr = run(&s, Placer::RoundRobin, trace_from_rows(rows(3, 12, 200.0, 4), 1.0).unwrap()).unwrap();
    let r = router("cache_aware", None);
    let kv = run(&s, Placer::Kvroute(r.clone()), trace_from_rows(rows(3, 12, 200.0, 4), 1.0).unwrap()).unwrap();
    assert_eq!(rr.summary.completed, 36);
    assert_eq!(kv.summary.completed, 36);
    assert_eq!(kv.summary.rejected, 0);
    // Round robin spreads each group over every worker (3 groups, 4 workers), so each worker
    // computes each group's prefix; kvroute keeps a group on one worker.
    // Prompts are 40 engine blocks, 32 of them the group's prefix: kvroute misses each group's
    // prefix once (3 of 36 requests), round robin once per group and worker (12 of 36).
    assert!((kv.summary.prefix_hit_rate - 33.0 * 32.0 / 1440.0).abs() < 1e-9, "{}", kv.summary.prefix_hit_rate);
    assert!((rr.summary.prefix_hit_rate - 24.0 * 32.0 / 1440.0).abs() < 1e-9, "{}", rr.summary.prefix_hit_rate);
    // The index was fed by the engines' events: it holds blocks for the serving workers only.
    let idx = r.index();
    let held: Vec<u64> = (0..4).map(|w| idx.num_blocks(w)).collect();
    assert!(held.iter().sum::<u64>() > 0, "no KV events reached the index: {held:?}");
    assert_eq!(idx.num_blocks(4), 0, "the sink is not indexed");
    // At this load every request finds on its worker exactly the prefix the Router expected there
    // (the index, fed by the engines' events, agrees with the engines' caches).
    for x in &kv.records {
        assert_eq!(x.routed_overlap_tokens, Some(x.cached_tokens), "{x:?}");
    }
    assert!(kv.records.iter().filter(|x| x.cached_tokens > 0).count() >= 32);
}

#[test]
fn rejected_requests_go_to_the_sink_and_out_of_the_latency_figures() {
    // One worker, a burst of long prompts and a 50 ms TTFT SLO: most are predicted to miss it.
    let mut s = spec(Topology::Aggregated { workers: 1 });
    s.slo = Slo { ttft_ms: Some(50.0), itl_ms: None };
    let r = router("capacity", Some(0.05));
    let out = run(&s, Placer::Kvroute(r), trace_from_rows(rows(8, 4, 1.0, 4), 1.0).unwrap()).unwrap();
    assert!(out.summary.rejected > 0, "nothing rejected: {:?}", out.summary);
    assert_eq!(out.summary.rejected + out.summary.completed, 32);
    for rec in &out.records {
        if rec.rejected {
            assert_eq!(rec.ttft_ms, None);
            assert_eq!(rec.prefill_worker, Some(1), "a rejected request ran on a serving engine");
        } else {
            assert_eq!(rec.prefill_worker, Some(0));
        }
    }
    assert!(out.summary.rejected_share > 0.0 && out.summary.goodput_share <= 1.0 - out.summary.rejected_share);
}

#[test]
fn disaggregated_runs_decode_where_the_router_chose() {
    let s = spec(Topology::Disaggregated { prefill: 2, decode: 3 });
    let r = router("capacity", None);
    let out = run(&s, Placer::Kvroute(r), trace_from_rows(rows(3, 6, 50.0, 16), 1.0).unwrap()).unwrap();
    assert_eq!(out.summary.completed, 18);
    for rec in &out.records {
        assert!(matches!(rec.prefill_worker, Some(0 | 1)), "{rec:?}");
        assert!(matches!(rec.decode_worker, Some(0..=2)), "{rec:?}");
        assert!(rec.itl_ms.is_some());
    }
    let rr = run(&s, Placer::RoundRobin, trace_from_rows(rows(3, 6, 50.0, 16), 1.0).unwrap()).unwrap();
    assert_eq!(rr.summary.completed, 18);
    // A Router that believes in another link would mispredict every transfer: refused.
    let wrong = Arc::new(Router::new(router_config!(block_size: 64), None).unwrap());
    let e = run(&s, Placer::Kvroute(wrong), trace_from_rows(rows(1, 1, 1.0, 1), 1.0).unwrap()).unwrap_err();
    assert!(e.to_string().contains("KV transfer model"), "{e}");
}

#[test]
fn a_router_with_workers_or_another_block_size_is_refused() {
    let s = spec(Topology::Aggregated { workers: 2 });
    let r = Arc::new(Router::new(router_config!(block_size: 16), None).unwrap());
    let e = run(&s, Placer::Kvroute(r), trace_from_rows(rows(1, 1, 1.0, 1), 1.0).unwrap()).unwrap_err();
    assert!(e.to_string().contains("block_size"), "{e}");
    let r = router("capacity", None);
    r.add_worker(7, Default::default()).unwrap();
    let e = run(&s, Placer::Kvroute(r), trace_from_rows(rows(1, 1, 1.0, 1), 1.0).unwrap()).unwrap_err();
    assert!(e.to_string().contains("fresh Router"), "{e}");
    assert!(trace_from_rows(Vec::new(), 1.0).is_err());
    assert!(trace_from_rows(rows(1, 1, 1.0, 1), f64::NAN).is_err());
}
