//! A request's life on the Router (route, prefill_done, finished, cancel), errors, unified workers' room and seats.

use super::*;

#[test]
fn lifecycle_and_corrections() {
    let r = router("ttft", TieBreak::Lowest, 1);
    let p = prompt(10, 2000); // 0.1 s each
    for id in 0..3 {
        r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(id), output_tokens: Some(100), ..Default::default() })
            .unwrap();
    }
    let l = r.load(0).unwrap();
    assert!((l.busy_until - 0.3).abs() < 1e-12);
    assert_eq!((l.prefilling, l.decoding, l.decode_blocks), (3, 3, 3 * 33));
    // First prefill finished 0.05 s late: the queue moves by the same amount.
    r.prefill_done(0, Some(0.15)).unwrap();
    assert!((r.load(0).unwrap().busy_until - 0.35).abs() < 1e-12);
    // Second finished on the corrected schedule: no further shift.
    r.prefill_done(1, Some(0.25)).unwrap();
    assert!((r.load(0).unwrap().busy_until - 0.35).abs() < 1e-12);
    assert!(matches!(r.prefill_done(1, Some(0.3)), Err(RouterError::InvalidArgument(_))));
    r.cancel(2, Some(0.26)).unwrap();
    let l = r.load(0).unwrap();
    assert!((l.busy_until - 0.26).abs() < 1e-12, "{}", l.busy_until);
    assert_eq!((l.prefilling, l.decoding), (0, 2));
    r.finished(0, Some(1.0)).unwrap();
    r.finished(1, Some(1.0)).unwrap();
    assert_eq!(r.load(0).unwrap().decode_blocks, 0);
    assert_eq!(r.finished(1, None), Err(RouterError::UnknownRequest(1)));
}

#[test]
fn errors() {
    let r = router("ttft", TieBreak::Rotate, 0);
    let p = prompt(11, 64);
    assert!(matches!(r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), ..Default::default() }), Err(RouterError::NoWorkers(_))));
    r.add_worker(1, WorkerSpec::default()).unwrap();
    assert_eq!(r.add_worker(1, WorkerSpec::default()), Err(RouterError::DuplicateWorker(1)));
    assert!(matches!(
        r.add_worker(2, WorkerSpec { prefill_tokens_per_s: f64::NAN, ..Default::default() }),
        Err(RouterError::InvalidArgument(_))
    ));
    assert!(matches!(
        r.route(&RouteRequest { tokens: Some(&[]), now: Some(0.0), ..Default::default() }),
        Err(RouterError::InvalidArgument(_))
    ));
    assert!(matches!(
        r.route(&RouteRequest { tokens: Some(&p), now: Some(-1.0), ..Default::default() }),
        Err(RouterError::InvalidArgument(_))
    ));
    assert!(matches!(
        r.route(&RouteRequest { hashes: Some(&[1, 2]), num_tokens: Some(10), ..Default::default() }),
        Err(RouterError::InvalidArgument(_))
    ));
    assert_eq!(r.remove_worker(5), Err(RouterError::UnknownWorker(5)));
    assert_eq!(r.route(&RouteRequest { tokens: Some(&p), pin: Some(5), ..Default::default() }).unwrap_err(), RouterError::UnknownWorker(5));
    r.route(&RouteRequest { tokens: Some(&p), request_id: Some(1), ..Default::default() }).unwrap();
    assert_eq!(
        r.route(&RouteRequest { tokens: Some(&p), request_id: Some(1), ..Default::default() }).unwrap_err(),
        RouterError::DuplicateRequest(1)
    );
    let bad = params::build(Preset::Simulator, [("policy", "nope".into())]);
    assert!(matches!(bad, Err(RouterError::InvalidConfig(m)) if m.contains("unknown policy \"nope\"; expected one of random,")));
}

#[test]
fn hashes_with_partial_block_count_as_prefill_work() {
    let r = router("ttft", TieBreak::Lowest, 1);
    let p = prompt(12, 130);
    let hs = sequence_hashes(&p, 64, crate::DEFAULT_SEED, None);
    let d = r.route(&RouteRequest { hashes: Some(&hs), num_tokens: Some(130), now: Some(0.0), ..Default::default() }).unwrap();
    assert_eq!(d.uncached_tokens, 130);
    assert_eq!(d.predicted_ttft, 130.0 / 20000.0);
}

#[test]
fn unified_tpot_prediction_counts_the_new_sequence() {
    let r = Router::new(router_config!(policy: "ttft"), None).unwrap();
    r.add_worker(0, WorkerSpec { decode_tokens_per_s: Some(100.0), ..Default::default() }).unwrap();
    let p = prompt(21, 64);
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(1), ..Default::default() }).unwrap();
    assert_eq!(d.predicted_tpot, Some(0.01 + 1.0 / 100.0));
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), request_id: Some(2), ..Default::default() }).unwrap();
    assert_eq!(d.predicted_tpot, Some(0.01 + 2.0 / 100.0));
}

#[test]
fn optimistic_insert_is_off_by_default() {
    let r = router("ttft", TieBreak::Lowest, 2);
    let p = prompt(20, 640);
    route(&r, &p, 0.0);
    assert_eq!(r.index().len(), 0);
    let cfg = router_config!(policy: "ttft", optimistic_insert: true);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(3, WorkerSpec::default()).unwrap();
    route(&r, &p, 0.0);
    assert_eq!(r.index().num_blocks(3), 10);
}

#[test]
fn concurrent_routes_account_every_request() {
    let r = Arc::new(router("slack", TieBreak::Rotate, 8));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let r = r.clone();
            std::thread::spawn(move || {
                for k in 0..250u64 {
                    let p = prompt(t * 1000 + (k % 7) as u32, 640);
                    r.route(&RouteRequest {
                        tokens: Some(&p),
                        now: Some(0.0),
                        request_id: Some(t as u64 * 1000 + k),
                        ..Default::default()
                    })
                    .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let total: u32 = r.workers().iter().map(|&w| r.load(w).unwrap().prefilling).sum();
    assert_eq!(total, 1000);
    let work: f64 = r.workers().iter().map(|&w| r.load(w).unwrap().busy_until).sum();
    assert!((work - 1000.0 * 640.0 / 20000.0).abs() < 1e-9);
}

/// Two unified "cache_only" workers with `spec`, ties to the lowest id, rejection as given.
fn two_unified(reject: bool, spec: WorkerSpec) -> Router {
    let cfg = router_config!(policy: "cache_only", tie_break: TieBreak::Lowest, pending_prefixes: false, reject: reject);
    let r = Router::new(cfg, None).unwrap();
    for w in 0..2 {
        r.add_worker(w, spec.clone()).unwrap();
    }
    r
}

#[test]
fn unified_workers_without_kv_room_are_avoided_and_a_cached_prefix_needs_no_new_room() {
    for reject in [true, false] {
        let r = two_unified(reject, WorkerSpec { kv_capacity_blocks: Some(1000), ..Default::default() });
        // A 640-block prompt, 600 blocks of it cached on worker 1: there it needs 40 + output, not 640.
        let p = prompt(9, 640 * 64);
        store(&r, 1, &p[..600 * 64]);
        let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), output_tokens: Some(64), ..Default::default() }).unwrap();
        assert!(d.admitted && d.worker == 1, "reject={reject}: {d:?}");
        // Worker 1's engine reports its KV 99% held by running requests: no room for the 33 blocks
        // (32 uncached + 1 of output, with headroom) a half-cached prompt needs there; it goes to
        // worker 0 instead of waiting, with or without rejection.
        r.observe(1, Observed { kv_usage: Some(0.99), ..Default::default() }, None, Some(0.0)).unwrap();
        let q = prompt(10, 64 * 64);
        store(&r, 1, &q[..32 * 64]);
        let d = r.route(&RouteRequest { tokens: Some(&q), now: Some(0.1), output_tokens: Some(64), ..Default::default() }).unwrap();
        assert!(d.admitted && d.worker == 0, "reject={reject}: {d:?}");
        // Both full: rejected with rejection on; placed anyway (on the best prefix) with it off.
        r.observe(0, Observed { kv_usage: Some(0.99), ..Default::default() }, None, Some(0.1)).unwrap();
        let d = r.route(&RouteRequest { tokens: Some(&q), now: Some(0.2), output_tokens: Some(64), ..Default::default() }).unwrap();
        assert_eq!(d.admitted, !reject, "{d:?}");
        if !reject {
            assert_eq!(d.worker, 1);
        }
    }
}

#[test]
fn a_unified_worker_without_a_seat_is_chosen_only_when_none_has_one() {
    for reject in [false, true] {
        let r = two_unified(reject, WorkerSpec { max_running: Some(2), ..Default::default() });
        let p = prompt(11, 64 * 8);
        store(&r, 1, &p);
        let go = |id: u64, now: f64| {
            r.route(&RouteRequest { tokens: Some(&p), now: Some(now), request_id: Some(id), ..Default::default() }).unwrap()
        };
        // Worker 1 holds the prefix: it takes requests while it has seats (2), then worker 0 does.
        assert_eq!(go(1, 0.0).worker, 1);
        assert_eq!(go(2, 0.0).worker, 1);
        assert_eq!(go(3, 0.0).worker, 0);
        assert_eq!(go(4, 0.0).worker, 0);
        // No seat anywhere: rejected with rejection on, else placed anyway (on the prefix).
        let d = go(5, 0.0);
        assert_eq!(d.admitted, !reject, "{d:?}");
        if !reject {
            assert_eq!(d.worker, 1);
        }
        // The engine's own count counts too: worker 0 reports 2 running after ours finished.
        for id in [3, 4] {
            r.finished(id, Some(1.0)).unwrap();
        }
        r.observe(0, Observed { running: Some(2), waiting: Some(0), ..Default::default() }, None, Some(1.0)).unwrap();
        r.finished(1, Some(1.0)).unwrap();
        assert_eq!(go(6, 1.0).worker, 1);
    }
}

#[test]
fn a_learned_prefix_cache_size_keeps_the_workers_load() {
    let r = router("capacity", TieBreak::Lowest, 2);
    let p = prompt(1, 640);
    r.route(&RouteRequest { tokens: Some(&p), request_id: Some(7), now: Some(0.0), ..Default::default() }).unwrap();
    let busy = r.load(0).unwrap();
    r.set_prefix_cache_blocks(0, Some(31)).unwrap();
    let after = r.load(0).unwrap();
    assert_eq!(after.spec.prefix_cache_blocks, Some(31));
    assert_eq!((after.busy_until, after.active), (busy.busy_until, busy.active));
    assert_eq!(r.num_in_flight(), 1);
    r.finished(7, Some(1.0)).unwrap();
    assert_eq!(r.set_prefix_cache_blocks(9, None), Err(RouterError::UnknownWorker(9)));
}
