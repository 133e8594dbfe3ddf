//! The bounded token share.

use super::*;

/// A `cache_only` router over `n` workers with `token_share_bound`, whose index alone (no pending
/// prefixes) holds `p`, on worker 0 only.
fn bounded(bound: Option<f64>, n: u64, p: &[u32]) -> Router {
    // The tests' runs are one window; the decay test waits 20 windows.
    let cfg = router_config!(policy: "cache_only", token_share_bound: bound, load_window_s: Some(1000.0), pending_prefixes: false);
    let r = Router::new(cfg, None).unwrap();
    for w in 0..n {
        r.add_worker(w, WorkerSpec::default()).unwrap();
    }
    store(&r, 0, p);
    r
}

#[test]
fn token_share_bound_keeps_every_worker_within_the_bound_and_otherwise_follows_the_policy() {
    let p = prompt(40, 1024);
    // Far apart in time for the queues (they drain), close for the window (the run is one window).
    let times: Vec<f64> = (0..200).map(|i| i as f64 * 0.01).collect();
    // Without the bound cache_only keeps every request on the worker holding the prompt.
    let free = bounded(None, 2, &p);
    assert!(times.iter().all(|&t| route(&free, &p, t).worker == 0));
    // With 1.25: worker 0 keeps as many as the bound allows (1.25x the mean is 62.5% of the tokens),
    // passing it by at most one request once it leads the mean by 8 requests; the first 17 requests
    // (a lead of 8) stay together.
    let r = bounded(Some(1.25), 2, &p);
    let mut tokens = [0u64; 2];
    let n = p.len() as f64;
    for (i, &t) in times.iter().enumerate() {
        let d = route(&r, &p, t);
        if i < 17 {
            assert_eq!(d.worker, 0, "route {}", i + 1);
        }
        tokens[d.worker as usize] += p.len() as u64;
        let mean = (tokens[0] + tokens[1]) as f64 / 2.0;
        let limit = (1.25 * mean).max(mean + crate::router::share::SLACK_REQUESTS * n) + n;
        assert!(tokens[0].max(tokens[1]) as f64 <= limit, "{tokens:?} after {} routes", i + 1);
    }
    let share0 = tokens[0] as f64 / (tokens[0] + tokens[1]) as f64;
    assert!((0.58..=0.63).contains(&share0), "worker 0 took {share0} of the tokens");
}

#[test]
fn token_share_bound_never_rejects_pins_or_counts_rejected_requests() {
    let p = prompt(41, 1024);
    // Every worker over the bound: the policy chooses among all (the bound never turns a request away).
    let r = bounded(Some(1.0), 2, &p);
    for i in 0..10 {
        assert!(route(&r, &p, i as f64 * 0.01).admitted);
    }
    // A pin goes where it is pinned, and counts.
    let r = bounded(Some(1.25), 2, &p);
    for i in 0..20 {
        let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(i as f64 * 0.01), pin: Some(0), ..Default::default() }).unwrap();
        assert_eq!(d.worker, 0);
    }
    // Worker 0 holds all 20 pinned requests' tokens: the next unpinned one goes to worker 1.
    assert_eq!(route(&r, &p, 0.21).worker, 1);
    // A rejected request is not counted: with an SLO no worker keeps, nothing is routed anywhere.
    let cfg = router_config!(policy: "cache_only", token_share_bound: Some(1.25), ttft_slo: Some(1e-6));
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r.add_worker(1, WorkerSpec::default()).unwrap();
    for i in 0..5 {
        assert!(!route(&r, &p, i as f64).admitted);
    }
    assert!(r.state.lock().workers.iter().all(|w| w.routed_tokens == 0.0));
}

#[test]
fn token_share_bound_decays_over_the_load_window() {
    let p = prompt(42, 1024);
    let r = bounded(Some(1.25), 2, &p);
    for i in 0..20 {
        r.route(&RouteRequest { tokens: Some(&p), now: Some(i as f64 * 0.01), pin: Some(0), ..Default::default() }).unwrap();
    }
    assert_eq!(route(&r, &p, 0.21).worker, 1); // worker 0 holds 20 of 20 recent requests
                                               // 20 windows later the history is gone: worker 0's cache wins again.
    assert_eq!(route(&r, &p, 20_000.0).worker, 0);
    let st = r.state.lock();
    assert!(st.workers[1].routed_tokens < 1e-3 && (st.workers[0].routed_tokens - p.len() as f64).abs() < 1e-3);
}

#[test]
fn token_share_bound_is_validated() {
    for bad in [0.5, f64::NAN, f64::INFINITY] {
        let cfg = router_config!(token_share_bound: Some(bad));
        let err = Router::new(cfg, None).err().expect("refused").to_string();
        assert!(err.contains("token_share_bound must be a finite number >= 1"), "{err}");
    }
}
