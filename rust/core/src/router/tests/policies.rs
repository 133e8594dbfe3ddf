//! Each policy's arithmetic as its source states it, ties, and the SLO fallback.

use super::*;

#[test]
fn virtual_time_matches_seed_arithmetic() {
    // The seed: ttft = max(busy - t, 0) + (len - hit) / SPEED; busy = max(busy, t) + work.
    let r = router("ttft", TieBreak::Lowest, 2);
    let a = prompt(1, 2048 + 300);
    store(&r, 1, &a[..2048]);
    let d = route(&r, &a, 0.5);
    assert_eq!(d.worker, 1);
    assert_eq!(d.overlap_blocks, 32);
    assert_eq!(d.predicted_ttft, 300.0 / 20000.0);
    assert_eq!(d.busy_until, 0.5 + 300.0 / 20000.0);
    let d2 = route(&r, &a, 0.51);
    // Worker 1: queue 0.005 + 300 tokens; worker 0: 2348 tokens from scratch.
    let busy = 0.5 + 300.0 / 20000.0;
    assert_eq!(d2.worker, 1);
    assert_eq!(d2.predicted_ttft, (busy - 0.51f64).max(0.0) + 300.0 / 20000.0);
    assert_eq!(d2.busy_until, busy.max(0.51) + 300.0 / 20000.0);
}

#[test]
fn least_load_compares_raw_busy_until() {
    let r = router("least_load", TieBreak::Lowest, 3);
    let p = prompt(2, 640);
    assert_eq!(route(&r, &p, 0.0).worker, 0); // all 0.0: lowest id
    assert_eq!(route(&r, &p, 0.0).worker, 1);
    assert_eq!(route(&r, &p, 0.0).worker, 2);
    // At t=10 all are idle; the one idle longest (smallest busy_until) wins: worker 0.
    assert_eq!(route(&r, &p, 10.0).worker, 0);
}

#[test]
fn cache_only_prefers_overlap_then_shorter_queue() {
    let r = router("cache_only", TieBreak::Lowest, 3);
    let p = prompt(3, 1024);
    store(&r, 1, &p[..512]);
    store(&r, 2, &p[..512]);
    let d = route(&r, &p, 0.0);
    assert_eq!((d.worker, d.overlap_blocks, d.reason), (1, 8, Reason::Cache));
    // Worker 1 is now busier; worker 2 has the same overlap.
    assert_eq!(route(&r, &p, 0.0).worker, 2);
}

#[test]
fn cache_aware_balance_thresholds() {
    // Loads are in-flight requests; make worker 0 carry `k` tracked requests.
    let run = |k: u64, abs: f64, rel: f64| {
        let cfg = router_config!(policy: "cache_aware", balance_abs_threshold: abs, balance_rel_threshold: rel);
        let r = Router::new(cfg, None).unwrap();
        r.add_worker(0, WorkerSpec::default()).unwrap();
        r.add_worker(1, WorkerSpec::default()).unwrap();
        let p = prompt(4, 640);
        store(&r, 0, &p);
        for id in 0..k {
            r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(id), pin: Some(0), ..Default::default() }).unwrap();
        }
        let d = route(&r, &p, 0.0);
        (d.worker, d.reason)
    };
    // Gap 4 vs abs 4: not strictly greater -> cache.
    assert_eq!(run(4, 4.0, 1.5), (0, Reason::Cache));
    // Gap 5 > 4 and 5 > 1.5 * 0 -> balance.
    assert_eq!(run(5, 4.0, 1.5), (1, Reason::Balance));
}

#[test]
fn cache_aware_rel_threshold_and_cache_threshold() {
    let cfg = router_config!(policy: "cache_aware", balance_abs_threshold: 1.0, balance_rel_threshold: 3.0, pending_prefixes: false);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r.add_worker(1, WorkerSpec::default()).unwrap();
    let p = prompt(5, 640);
    store(&r, 0, &p[..192]); // 3 of 10 blocks: 0.3, not > 0.3
    let mut id = 0;
    let mut pin = |w: WorkerId| {
        id += 1;
        r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(id), pin: Some(w), ..Default::default() }).unwrap();
    };
    pin(0);
    pin(0);
    pin(0);
    pin(1); // loads 3 vs 1: gap 2 > 1 but 3 > 3 * 1 is false -> balanced
    let d = route(&r, &p, 0.0);
    assert_eq!((d.worker, d.reason), (1, Reason::LeastLoad), "matched fraction 0.3 is not above 0.3");
    store(&r, 0, &p[..256]);
    let d = route(&r, &p, 0.0);
    assert_eq!((d.worker, d.reason), (0, Reason::Cache));
}

#[test]
fn cost_is_dynamos_formula() {
    let cfg = router_config!(policy: "cost", prefill_load_scale: 2.0);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r.add_worker(1, WorkerSpec::default()).unwrap();
    let p = prompt(6, 640); // 10 blocks
    store(&r, 1, &p[..320]);
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), explain: true, ..Default::default() }).unwrap();
    let ex = d.explain.unwrap();
    assert_eq!(ex[0].score, 2.0 * 10.0 + 10.0);
    assert_eq!(ex[1].score, 2.0 * 5.0 + 10.0);
    assert_eq!(d.worker, 1);
}

#[test]
fn rotate_ties_never_collapse() {
    for policy in ["ttft", "least_load", "cache_only", "cache_aware", "cost", "slack"] {
        let r = router(policy, TieBreak::Rotate, 4);
        let p = prompt(7, 64);
        let mut counts = [0u32; 4];
        // Far apart in time: every worker is idle and empty-cached each time, so all scores tie.
        for k in 0..40 {
            counts[route(&r, &p, 1000.0 * k as f64).worker as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c >= 5), "{policy}: {counts:?}");
    }
}

#[test]
fn rejection_leaves_state_untouched() {
    let cfg = router_config!(policy: "ttft", ttft_slo: Some(0.1));
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    let big = prompt(8, 4096); // 0.2048 s of prefill > 0.1
    let before = r.load(0).unwrap();
    let d = r.route(&RouteRequest { tokens: Some(&big), now: Some(1.0), request_id: Some(9), ..Default::default() }).unwrap();
    assert!(!d.admitted);
    assert_eq!(d.reason, Reason::RejectedTtft);
    let after = r.load(0).unwrap();
    assert_eq!((before.busy_until, before.prefilling, before.decoding), (after.busy_until, after.prefilling, after.decoding));
    assert_eq!(r.num_in_flight(), 0);
    // The same id can be routed again later (it was never admitted).
    let small = prompt(8, 640);
    assert!(r.route(&RouteRequest { tokens: Some(&small), now: Some(1.0), request_id: Some(9), ..Default::default() }).unwrap().admitted);
}

#[test]
fn slo_fallback_takes_fastest_worker() {
    let cfg = router_config!(policy: "cache_only", ttft_slo: Some(0.05), tie_break: TieBreak::Lowest);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r.add_worker(1, WorkerSpec::default()).unwrap();
    let p = prompt(9, 640);
    store(&r, 0, &p);
    r.observe(0, Observed::default(), Some(1.0), Some(0.0)).unwrap(); // worker 0 has a 1 s queue
    let d = route(&r, &p, 0.0);
    assert_eq!((d.worker, d.reason), (1, Reason::SloFallback));
}

#[test]
fn random_policy_draws_like_cpython_randrange() {
    let r = router("random", TieBreak::Rotate, 8);
    let mut py = crate::random::PyRandom::new(0);
    let p = prompt(5, 64);
    for k in 0..200 {
        assert_eq!(route(&r, &p, k as f64).worker, py.randbelow(8));
    }
}

#[test]
fn new_slack_knobs_are_validated() {
    for cfg in [
        router_config!(shed_load_sigmas: -1.0),
        router_config!(shed_load_sigmas: f64::NAN),
        router_config!(policy: "slack", eviction_weight: -0.5),
        router_config!(policy: "slack", eviction_weight: f64::INFINITY),
    ] {
        assert!(matches!(Router::new(cfg, None), Err(RouterError::InvalidConfig(_))));
    }
}

#[test]
fn node_score_is_seed_003s_weighted_score() {
    // Worker 0 holds the whole prompt but has a queue; the score is cache-blind, so worker 1 (idle,
    // twice as fast) wins: 0.4 + 0.3 + 0.2 + 0.1 = 1.0 against less for worker 0.
    let cfg = router_config!(policy: "node_score", ttft_slo: Some(2.0), tie_break: TieBreak::Lowest);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec { prefill_tokens_per_s: 10_000.0, ..Default::default() }).unwrap();
    r.add_worker(1, WorkerSpec { prefill_tokens_per_s: 20_000.0, ..Default::default() }).unwrap();
    let a = prompt(9, 1024);
    store(&r, 0, &a);
    r.observe(0, Observed::default(), Some(1.0), Some(0.0)).unwrap();
    let d = r.route(&RouteRequest { tokens: Some(&a), now: Some(0.0), explain: true, ..Default::default() }).unwrap();
    assert_eq!((d.worker, d.reason), (1, Reason::NodeScore));
    let rows = d.explain.unwrap();
    // Worker 0: load 1 s / 2 s = 0.5, no queued requests, half the fastest speed.
    assert!((rows[0].score + (0.4 * 0.5 + 0.3 + 0.2 * 0.5 + 0.1)).abs() < 1e-12);
    assert!((rows[1].score + 1.0).abs() < 1e-12);
    // Each routed request deepens the queue by one tenth: worker 1 fills until worker 0 scores higher.
    let mut to_one = 0;
    // Worker 1 scores 1.0 - 0.03 per queued request (and a little load): below worker 0's 0.7 after 10.
    for k in 0..14 {
        let p = prompt(100 + k, 64);
        let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(k as u64), ..Default::default() }).unwrap();
        to_one += (d.worker == 1) as u32;
    }
    assert!((10..14).contains(&to_one), "{to_one}");
}

#[test]
fn capacity_charges_the_evictions_a_full_cache_makes() {
    // Worker 0 holds 24 of the prompt's 32 blocks but is 0.4 s behind; worker 1 is idle with a full
    // 32-block prefix cache of other blocks. slack recomputes on worker 1; capacity sees that
    // storing 32 blocks there evicts 32 cached ones (reused with p = 3/4: 3 blocks of recompute
    // each) and keeps the request where its prefix is. p is measured: worker 1's engine evicted 4
    // blocks, and a prompt asked for 3 of them again before (at t = 0; the rest runs at t = T,
    // when that prompt's queue is long gone).
    const T: f64 = 100.0;
    let a = prompt(21, 2048);
    let other = prompt(22, 2048);
    let make = |policy: &str| {
        let cfg = router_config!(policy: policy, tie_break: TieBreak::Lowest, ttft_slo: Some(2.0), pending_prefixes: false);
        let r = Router::new(cfg, None).unwrap();
        for w in 0..2 {
            r.add_worker(w, WorkerSpec { prefix_cache_blocks: Some(32), ..Default::default() }).unwrap();
        }
        let x = prompt(23, 8 * 64);
        let y = prompt(24, 64);
        let (xs, ys) = (sequence_hashes(&x, 64, crate::DEFAULT_SEED, None), sequence_hashes(&y, 64, crate::DEFAULT_SEED, None));
        store(&r, 1, &x[..3 * 64]);
        store(&r, 1, &y);
        r.index().remove(1, &xs[..3], ANY_TIER);
        r.index().remove(1, &ys, ANY_TIER);
        route(&r, &x, 0.0);
        store(&r, 0, &a[..24 * 64]);
        store(&r, 1, &other);
        r.observe(0, Observed::default(), Some(0.4), Some(T)).unwrap();
        r
    };
    let slack = make("slack");
    assert_eq!(route(&slack, &a, T).worker, 1);
    let cap = make("capacity");
    let d = cap.route(&RouteRequest { tokens: Some(&a), now: Some(T), explain: true, ..Default::default() }).unwrap();
    assert_eq!((d.worker, d.reason), (0, Reason::Capacity));
    let rows = d.explain.unwrap();
    let t_block = 64.0 / 20_000.0;
    let slack_cost = |q: f64, work: f64| 0.2 * q + work + 8.0 * work * (q + work) / 2.0;
    assert!((rows[0].score - slack_cost(0.4, 512.0 / 20_000.0)).abs() < 1e-12);
    assert!((rows[1].score - (slack_cost(0.0, 2048.0 / 20_000.0) + 3.0 * t_block * 32.0)).abs() < 1e-12);
    // An engine-reported usage below the index's count does not empty the cache: vLLM reports the
    // blocks running requests hold, and its cached blocks count as free there (evictable, still
    // cached). Worker 1 reporting 0 still evicts its 32 indexed blocks.
    cap.observe(1, Observed { kv_usage: Some(0.0), ..Default::default() }, None, Some(T)).unwrap();
    let d = cap.route(&RouteRequest { tokens: Some(&a), now: Some(T), explain: true, ..Default::default() }).unwrap();
    assert_eq!(d.worker, 0);
    let rows = d.explain.unwrap();
    assert!((rows[1].score - (slack_cost(0.0, 2048.0 / 20_000.0) + 3.0 * t_block * 32.0)).abs() < 1e-12);
    // Once the index holds nothing for worker 1 (its engine's events removed every block), it
    // evicts nothing and its copy of the 24 blocks worker 0 holds costs nothing while its cache is
    // empty: the request goes to the idle worker.
    cap.index().clear(1);
    let d = cap.route(&RouteRequest { tokens: Some(&a), now: Some(T), ..Default::default() }).unwrap();
    assert_eq!(d.worker, 1);
    // A usage above the index's count (blocks held by running requests, not cached yet) is what
    // the cache holds: reported full, worker 1 evicts again.
    cap.observe(1, Observed { kv_usage: Some(1.0), ..Default::default() }, None, Some(T)).unwrap();
    let d = cap.route(&RouteRequest { tokens: Some(&a), now: Some(T), ..Default::default() }).unwrap();
    assert_eq!(d.worker, 0);
}
