//! `dynamo_shed` against dynamo-mocker's own KV router, and its shedding.

use std::io::Write;
use std::path::PathBuf;

use aisimulate_core::replay::PerRequestRecord;
use dynamo_mocker::replay::{simulate_loaded_trace_with_router_mode_and_capture_options, ReplayRouterMode, SlaThresholds};
use kvroute_aisim::{load_trace, TRACE_BLOCK_SIZE};
use serde_json::json;

use super::*;

/// A Mooncake-format trace of `n` requests written to a temp file: prompts of 1-4 shared prefix
/// blocks (one of 6 groups) then 1-3 blocks of their own, arrivals `gap_ms` apart on average.
fn trace_file(name: &str, n: usize, gap_ms: f64) -> PathBuf {
    // A fixed linear congruential stream: the same trace every run.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % m
    };
    let path = std::env::temp_dir().join(format!("dynamo_shed_{name}_{}.jsonl", std::process::id()));
    let mut f = std::fs::File::create(&path).unwrap();
    let (mut t, mut own) = (0.0, 1_000u64);
    for _ in 0..n {
        t += gap_ms * (0.5 + next(1_000) as f64 / 1_000.0);
        let group = next(6);
        let mut ids: Vec<u64> = (0..1 + next(4)).map(|k| group * 100 + k).collect();
        for _ in 0..1 + next(3) {
            ids.push(own);
            own += 1;
        }
        let input = ids.len() * TRACE_BLOCK_SIZE - next(200) as usize;
        let row = json!({"timestamp": t as u64, "input_length": input, "output_length": 20 + next(180), "hash_ids": ids});
        writeln!(f, "{row}").unwrap();
    }
    path
}

/// Small engines, so the cache evicts (removal events reach the index) and loads differ.
fn engine() -> EngineModel {
    EngineModel { num_gpu_blocks: 2_048, ..EngineModel::default() }
}

fn canonical() -> ReplayCaptureOptions {
    ReplayCaptureOptions { capture_per_request: true, determinism: ReplayDeterminism::CanonicalV1, ..Default::default() }
}

/// What must agree per request: where it ran and what the router saw there (the routing history:
/// worker, overlap tokens and blocks, best overlap available), and what happened (cache reuse,
/// first token, end).
fn outcome(r: &PerRequestRecord) -> serde_json::Value {
    json!({
        "worker": r.decode_worker_idx,
        "routing": r.routing_history,
        "reused_input_tokens": r.reused_input_tokens,
        "first_token_ms": r.first_token_ms,
        "terminal_ms": r.terminal_time_ms,
        "output_length": r.output_length,
    })
}

/// The worker a request was placed on (aggregated replays record no prefill worker index).
fn worker_of(r: &PerRequestRecord) -> Option<usize> {
    r.routing_history.last().and_then(|h| h.scheduler_id)
}

fn by_uuid(records: &[PerRequestRecord]) -> HashMap<String, &PerRequestRecord> {
    records.iter().map(|r| (r.uuid.clone(), r)).collect()
}

/// With no thresholds, `dynamo_shed` is dynamo-mocker's `KvRouterPlacement`: under canonical
/// determinism (ordinal request ids, the canonical selector seed on both sides) every request is
/// placed on the same worker with the same overlap, and the runs agree to the millisecond.
#[test]
fn same_placements_as_dynamo_mocker() {
    let path = trace_file("same", 300, 8.0);
    let trace = load_trace(&path, 1.0).unwrap();
    let mut per_config = Vec::new();
    for cfg in [json!({}), json!({"overlap_score_credit": 2.0, "prefill_load_scale": 0.5})] {
        let cfg: KvRouterConfig = serde_json::from_value(cfg).unwrap();
        let theirs = simulate_loaded_trace_with_router_mode_and_capture_options(
            crate::mocker_config(&engine()).unwrap(),
            Some(cfg.clone()),
            None,
            trace.clone(),
            4,
            1.0,
            ReplayRouterMode::KvRouter,
            canonical(),
            None,
            SlaThresholds::default(),
        )
        .unwrap();
        let ours = run(&engine(), 4, trace.clone(), cfg, ShedConfig::default(), canonical()).unwrap();
        assert!(ours.log.rejected.is_empty());
        let (theirs, ours) = (by_uuid(&theirs.per_request), by_uuid(&ours.report.per_request));
        assert_eq!(theirs.len(), 300);
        assert_eq!(ours.len(), 300);
        let mut outcomes: Vec<(String, serde_json::Value)> = theirs.iter().map(|(u, t)| (u.clone(), outcome(t))).collect();
        outcomes.sort_by(|a, b| a.0.cmp(&b.0));
        per_config.push(outcomes);
        let mut workers = HashSet::new();
        let (mut reused, mut overlapped) = (0, 0);
        for (uuid, t) in &theirs {
            let o = ours.get(uuid).unwrap_or_else(|| panic!("request {uuid} missing from dynamo_shed's run"));
            assert_eq!(outcome(o), outcome(t), "request {uuid}");
            workers.insert(worker_of(t).expect("placed"));
            reused += t.reused_input_tokens;
            overlapped += usize::from(t.routing_history.iter().any(|h| h.reported_overlap_tokens.is_some_and(|o| o > 0)));
        }
        // The comparison means something: the router spread the load and found cached prefixes.
        assert_eq!(workers.len(), 4, "placements on {workers:?}");
        assert!(reused > 0 && overlapped > 0);
    }
    // ... and the router's choices depend on its config, so agreeing on both is no accident.
    assert_ne!(per_config[0], per_config[1]);
    std::fs::remove_file(path).ok();
}

/// With low thresholds under heavy load some requests are rejected (sent to the sink, marked
/// rejected), and no request is ever placed on a worker that was busy when it was placed.
#[test]
fn sheds_when_every_worker_is_busy() {
    let path = trace_file("shed", 400, 2.0);
    let shed =
        ShedConfig { active_prefill_tokens_threshold: Some(3_000), active_decode_blocks_threshold: Some(0.3), ..ShedConfig::default() };
    let r = run(&engine(), 4, load_trace(&path, 1.0).unwrap(), KvRouterConfig::default(), shed.clone(), canonical()).unwrap();
    let log = &r.log;
    assert_eq!(log.decisions.len(), 400);
    let rejected = log.decisions.iter().filter(|d| d.worker.is_none()).count();
    assert!(rejected > 0 && rejected < 400, "{rejected} of 400 rejected");
    assert_eq!(rejected, log.rejected.len());
    let total = engine().num_gpu_blocks as f64;
    let mut placed_despite_busy_peers = 0;
    for d in &log.decisions {
        // Busy is judged from the loads recorded with the decision, independently of the placement.
        let busy: Vec<usize> = d
            .loads
            .iter()
            .filter(|l| {
                l.active_prefill_tokens > 3_000
                    || l.active_decode_blocks as f64 > 0.3 * total
                    || l.kv_used_blocks.is_some_and(|u| u as f64 > 0.3 * total)
            })
            .map(|l| l.worker)
            .collect();
        assert_eq!(busy, d.overloaded, "request {}", d.request);
        match d.worker {
            Some(w) => {
                assert!(!d.overloaded.contains(&w), "request {} placed on busy worker {w}", d.request);
                placed_despite_busy_peers += usize::from(!d.overloaded.is_empty());
            }
            None => assert_eq!(d.overloaded, [0, 1, 2, 3], "request {} rejected with a worker free", d.request),
        }
    }
    // Shedding narrowed the choice before it rejected anything.
    assert!(placed_despite_busy_peers > 0);
    // Rejected requests ran on the sink (worker 4) and are marked so; the others on the four workers.
    let records = r.records();
    assert_eq!(records.iter().filter(|x| x.rejected).count(), rejected);
    for p in &r.report.per_request {
        let uuid: Uuid = p.uuid.parse().unwrap();
        assert_eq!(worker_of(p) == Some(4), log.rejected.contains(&uuid), "request {uuid}");
    }
    std::fs::remove_file(path).ok();
}

#[test]
fn thresholds_parse_as_the_frontend_names_them() {
    let s: ShedConfig =
        serde_json::from_str(r#"{"active_prefill_tokens_threshold": 20000, "active_decode_blocks_threshold": 0.9}"#).unwrap();
    assert!(s.enabled());
    assert_eq!(s.active_prefill_tokens_threshold, Some(20_000));
    assert_eq!(s.kv_used_interval_ms, Some(100.0));
    assert!(!ShedConfig::default().enabled());
    assert!(serde_json::from_str::<ShedConfig>(r#"{"busy": 1}"#).is_err());
    // The fractional threshold is judged against max_num_batched_tokens, truncated as Dynamo does.
    let frac = ShedConfig { active_prefill_tokens_threshold_frac: Some(0.5), ..ShedConfig::default() };
    assert!(!frac.prefill_busy(4_096, 8_192));
    assert!(frac.prefill_busy(4_097, 8_192));
}
