//! PD mode: decode choice, transfer time, conditional disaggregation, hot-prefix relief.

use super::*;

fn pd_router(cfg: RouterConfig) -> Router {
    let r = Router::new(cfg, None).unwrap();
    for w in 0..2 {
        r.add_worker(w, WorkerSpec { role: Role::Prefill, ..Default::default() }).unwrap();
    }
    for w in 10..12 {
        r.add_worker(
            w,
            WorkerSpec { role: Role::Decode, kv_capacity_blocks: Some(100), decode_tokens_per_s: Some(1000.0), ..Default::default() },
        )
        .unwrap();
    }
    r
}

#[test]
fn pd_pairs_and_transfer_time() {
    let cfg = router_config!(policy: "ttft", tie_break: TieBreak::Lowest);
    let r = pd_router(cfg.clone());
    let p = prompt(13, 640);
    let d = r
        .route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(1), output_tokens: Some(640), ..Default::default() })
        .unwrap();
    assert_eq!(d.path, Path::Disaggregated);
    assert_eq!(d.decode_worker, Some(10));
    assert_eq!(d.predicted_ttft, 640.0 / 20000.0 + cfg.pd.transfer_time(640));
    assert_eq!(d.predicted_tpot, Some(0.01 + 1.0 / 1000.0));
    assert_eq!(r.load(10).unwrap().decode_blocks, 20);
    // Next decode goes to the other (lower TPOT now).
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(2), ..Default::default() }).unwrap();
    assert_eq!(d.decode_worker, Some(11));
}

#[test]
fn pd_decode_rejections() {
    let cfg = router_config!(policy: "ttft", tpot_slo: Some(0.0125));
    let r = pd_router(cfg);
    let p = prompt(14, 64 * 70);
    // 70 blocks * 1.2 = 84 <= 100 fits; a second would not.
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(1), ..Default::default() }).unwrap();
    assert!(d.admitted);
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(2), ..Default::default() }).unwrap();
    assert!(d.admitted);
    let before = (r.load(10).unwrap().decode_blocks, r.load(0).unwrap().busy_until);
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(3), ..Default::default() }).unwrap();
    assert_eq!((d.admitted, d.reason), (false, Reason::RejectedDecode));
    assert_eq!(before, (r.load(10).unwrap().decode_blocks, r.load(0).unwrap().busy_until));
    // TPOT: 0.01 + 2/1000 = 0.012 ok, 3/1000 -> 0.013 > 0.0125.
    let small = prompt(15, 64);
    for id in 4..6 {
        assert!(
            r.route(&RouteRequest { tokens: Some(&small), now: Some(0.0), request_id: Some(id), ..Default::default() }).unwrap().admitted
        );
    }
    let d = r.route(&RouteRequest { tokens: Some(&small), now: Some(0.0), request_id: Some(7), ..Default::default() }).unwrap();
    assert_eq!(d.reason, Reason::RejectedTpot);
}

#[test]
fn conditional_disaggregation() {
    let cfg = router_config!(policy: "ttft", local_prefill_max_tokens: 100, prefill_busy_queue_s: Some(1.0));
    let r = pd_router(cfg);
    let d = route(&r, &prompt(16, 80), 0.0);
    assert_eq!((d.path, d.reason, Some(d.worker)), (Path::Local, Reason::ShortPrompt, d.decode_worker));
    // Long prompt, prefill pool busy for 5 s: prefilling on the decode worker is sooner.
    r.observe(0, Observed::default(), Some(5.0), Some(0.0)).unwrap();
    r.observe(1, Observed::default(), Some(5.0), Some(0.0)).unwrap();
    let d = route(&r, &prompt(17, 4096), 0.0);
    assert_eq!((d.path, d.reason), (Path::Local, Reason::PrefillPoolBusy));
    let d = route(&r, &prompt(18, 4096), 100.0);
    assert_eq!(d.path, Path::Disaggregated);
}

#[test]
fn hot_prefix_fetch_from() {
    let cfg = router_config!(policy: "ttft");
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r.add_worker(1, WorkerSpec::default()).unwrap();
    let p = prompt(19, 8192);
    store(&r, 0, &p);
    r.observe(0, Observed::default(), Some(10.0), Some(0.0)).unwrap();
    let d = route(&r, &p, 0.0);
    assert_eq!((d.worker, d.fetch_from), (1, Some(0)));
}

#[test]
fn seed_decode_score_prefers_bandwidth_over_a_small_batch() {
    // Decode worker 10 is twice as fast and runs 10 sequences; 11 is idle. Lowest TPOT with the
    // request: 11 (0.0105 s vs 0.01275 s). The seed 003 score: 10 (0.375 + 0.3 + 0.192 = 0.867)
    // over 11 (0.4 + 0.15 + 0.2 = 0.75).
    let build = |rule: DecodeRule| {
        let cfg = router_config!(policy: "ttft", tie_break: TieBreak::Lowest, decode_choice: rule);
        let r = Router::new(cfg, None).unwrap();
        r.add_worker(0, WorkerSpec { role: Role::Prefill, ..Default::default() }).unwrap();
        let dec = |speed: f64| WorkerSpec {
            role: Role::Decode,
            kv_capacity_blocks: Some(1000),
            decode_tokens_per_s: Some(speed),
            ..Default::default()
        };
        r.add_worker(10, dec(4000.0)).unwrap();
        r.add_worker(11, dec(2000.0)).unwrap();
        r.observe(10, Observed { running: Some(10), ..Default::default() }, None, Some(0.0)).unwrap();
        r
    };
    let p = prompt(40, 256);
    let req = RouteRequest { tokens: Some(&p), now: Some(0.0), ..Default::default() };
    assert_eq!(build(DecodeRule::Tpot).route(&req).unwrap().decode_worker, Some(11));
    assert_eq!(build(DecodeRule::Score).route(&req).unwrap().decode_worker, Some(10));
    // Only workers with 20% KV headroom: a request that leaves worker 10 too little room goes to 11.
    let r = build(DecodeRule::Score);
    r.observe(10, Observed { kv_usage: Some(0.9), ..Default::default() }, None, Some(0.0)).unwrap();
    let big = prompt(41, 64 * 90);
    let d = r.route(&RouteRequest { tokens: Some(&big), now: Some(0.0), ..Default::default() }).unwrap();
    assert_eq!(d.decode_worker, Some(11));
}

#[test]
fn compressed_transfer_halves_the_bytes() {
    let plain = RouterConfig::default();
    let fp8 = router_config!(kv_compression: 0.5);
    let bytes = |c: &RouterConfig, n: u64| (c.pd.transfer_time(n) - c.pd.link_latency_s) * c.pd.link_bytes_per_s;
    assert!((bytes(&fp8, 1000) - 0.5 * bytes(&plain, 1000)).abs() < 1e-3);
    assert_eq!(fp8.pd.transfer_time(0), 0.0);
    for bad in [0.0, 1.5, f64::NAN] {
        assert!(Router::new(router_config!(kv_compression: bad), None).is_err());
    }
}
