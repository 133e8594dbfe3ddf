//! Admission: size-aware shedding under overload, and the eviction charge.

use super::*;

fn slack_router(cfg: RouterConfig) -> Router {
    let r = Router::new(router_config!(ttft_slo: Some(2.0), ..cfg), None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r
}

#[test]
fn admission_factor_ramps_with_offered_load() {
    let cfg = router_config!(policy: "slack");
    assert_eq!((cfg.admission.shed_load_threshold, cfg.admission.shed_load_ramp), (1.0, 1.0));
    assert_eq!(cfg.admission.factor_at(cfg.admission_work_factor(), 0.5), 0.0);
    assert_eq!(cfg.admission.factor_at(cfg.admission_work_factor(), 1.0), 0.0);
    assert_eq!(cfg.admission.factor_at(cfg.admission_work_factor(), 1.25), 0.5);
    assert_eq!(cfg.admission.factor_at(cfg.admission_work_factor(), 2.0), 2.0);
    assert_eq!(cfg.admission.factor_at(cfg.admission_work_factor(), 9.0), 2.0);
    let always = router_config!(shed_load_threshold: 0.0, shed_load_ramp: 0.0, ..cfg.clone());
    assert_eq!(always.admission.factor_at(always.admission_work_factor(), 0.0), 2.0);
    let ttft = router_config!(policy: "ttft");
    assert_eq!(ttft.admission.factor_at(ttft.admission_work_factor(), 5.0), 0.0);
    assert_eq!(router_config!(ttft_slo: Some(2.0)).admission.load_window(), 10.0);
    assert_eq!(RouterConfig::default().admission.load_window(), 10.0);
    assert_eq!(router_config!(load_window_s: Some(3.0)).admission.load_window(), 3.0);
}

#[test]
fn long_prompt_that_keeps_the_slo_is_admitted_below_capacity() {
    // One worker, queue 1.5 s, an uncached 8000-token prompt (0.4 s): predicted 1.9 s <= 2 s.
    let big = prompt(31, 8000);
    let r = slack_router(RouterConfig::default());
    r.observe(0, Observed::default(), Some(1.5), Some(0.0)).unwrap();
    let d = route(&r, &big, 0.0);
    assert!(d.admitted, "{d:?}");
    assert!((d.predicted_ttft - 1.9).abs() < 1e-9);
    // The offered load is that one prompt over a 10 s window: 800 tokens/s of 20000.
    assert!((r.offered_load(Some(0.0)).unwrap() - 0.04).abs() < 1e-12);
    // Always-on size-aware admission (the previous rule) turns it away: 1.9 + 2 * min(0.4, 1.5) > 2.
    let old = slack_router(router_config!(shed_load_threshold: 0.0, shed_load_ramp: 0.0));
    old.observe(0, Observed::default(), Some(1.5), Some(0.0)).unwrap();
    let d = route(&old, &big, 0.0);
    assert_eq!((d.admitted, d.reason), (false, Reason::RejectedTtft));
}

#[test]
fn overload_switches_size_aware_admission_on() {
    let r = slack_router(RouterConfig::default());
    // 50 uncached 8000-token prompts in one second: 400k tokens over a 10 s window, ~1.9x capacity.
    for k in 0..50 {
        route(&r, &prompt(100 + k, 8000), k as f64 / 50.0);
    }
    let rho = r.offered_load(Some(1.0)).unwrap();
    assert!(rho > 1.5 && rho < 2.0, "{rho}");
    r.observe(0, Observed::default(), Some(1.5), Some(1.0)).unwrap();
    let d = route(&r, &prompt(31, 8000), 1.0);
    assert_eq!((d.admitted, d.reason), (false, Reason::RejectedTtft));
    // A cheap request still fits: 1.5 + 0.01 + 2 * 0.01 <= 2.
    let d = route(&r, &prompt(32, 200), 1.0);
    assert!(d.admitted);
    // The estimate decays: a minute later the cluster counts as idle again.
    assert!(r.offered_load(Some(61.0)).unwrap() < 0.01);
}

#[test]
fn shedding_waits_for_evident_overload() {
    // Three uncached 80k-token prompts (4 s each: rejected on an idle worker with a 2 s SLO) put
    // the offered load at 1.2x capacity, but three arrivals are no evidence of overload: the
    // estimate's standard error is ~0.5 of capacity. An 8000-token prompt behind a 1.5 s queue
    // (1.9 s, keeps the SLO) is admitted; the previous rule (the bare estimate) turns it away.
    let run = |sigmas: f64| {
        let r = slack_router(router_config!(shed_load_sigmas: sigmas));
        for k in 0..3 {
            let d = route(&r, &prompt(200 + k, 80_000), 0.0);
            assert_eq!((d.admitted, d.reason), (false, Reason::RejectedTtft));
        }
        assert!((r.offered_load(Some(0.0)).unwrap() - 1.2).abs() < 1e-9);
        r.observe(0, Observed::default(), Some(1.5), Some(0.0)).unwrap();
        route(&r, &prompt(31, 8000), 0.0)
    };
    assert_eq!(RouterConfig::default().admission.shed_load_sigmas, 2.0);
    let d = run(2.0);
    assert!(d.admitted && (d.predicted_ttft - 1.9).abs() < 1e-9, "{d:?}");
    let d = run(0.0);
    assert_eq!((d.admitted, d.reason), (false, Reason::RejectedTtft));
}

#[test]
fn eviction_charge_prefers_a_worker_with_free_prefix_cache() {
    // Both workers hold 10-block prefix caches; worker 0's is full (10 blocks of another prompt),
    // worker 1's holds 2. A 4-block uncached prompt costs the same prefill on either, but on
    // worker 0 storing it evicts 4 cached blocks (4 * 64 / 20000 s of recompute).
    let make = |eviction_weight: f64| {
        let cfg = router_config!(policy: "slack", eviction_weight: eviction_weight, tie_break: TieBreak::Lowest, ttft_slo: Some(2.0));
        let r = Router::new(cfg, None).unwrap();
        for w in 0..2 {
            r.add_worker(w, WorkerSpec { prefix_cache_blocks: Some(10), ..Default::default() }).unwrap();
        }
        store(&r, 0, &prompt(40, 640));
        store(&r, 1, &prompt(41, 128));
        r
    };
    let p = prompt(42, 256);
    let charged = make(1.0);
    let d = charged.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), explain: true, ..Default::default() }).unwrap();
    assert_eq!(d.worker, 1);
    let ex = d.explain.unwrap();
    assert!((ex[0].score - ex[1].score - 256.0 / 20000.0).abs() < 1e-12, "{ex:?}");
    // Off (the default): equal scores, the lowest id.
    assert_eq!(PolicyConfig::named("slack"), Some(PolicyConfig::Slack(policy::Slack { eviction_weight: 0.0, ..Default::default() })));
    assert_eq!(route(&make(0.0), &p, 0.0).worker, 0);
    // Unknown capacity: nothing to charge.
    let cfg = router_config!(policy: "slack", eviction_weight: 1.0, tie_break: TieBreak::Lowest);
    let r = Router::new(cfg, None).unwrap();
    for w in 0..2 {
        r.add_worker(w, WorkerSpec::default()).unwrap();
    }
    store(&r, 0, &prompt(40, 640));
    assert_eq!(route(&r, &p, 0.0).worker, 0);
}
