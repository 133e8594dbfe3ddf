//! Pending prefixes: a routed request's blocks counted on its worker until its KV events arrive.

use super::*;

#[test]
fn back_to_back_requests_with_a_new_prefix_share_a_worker() {
    // A shared 1024-token system prompt nobody has cached, two different questions after it,
    // routed before any KV event: with pending prefixes the second sees the first's 16 blocks.
    let system = prompt(30, 1024);
    let ask = |q: u32| [system.clone(), prompt(q, 200)].concat();
    for (on, policy) in [(true, "slack"), (true, "cache_only"), (true, "cache_aware"), (false, "cache_only")] {
        let cfg = router_config!(policy: policy, pending_prefixes: on);
        let r = Router::new(cfg, None).unwrap();
        for w in 0..4 {
            r.add_worker(w, WorkerSpec::default()).unwrap();
        }
        let a = tracked(&r, &ask(31), 0.0, 1);
        let b = tracked(&r, &ask(32), 0.001, 2);
        if on {
            assert_eq!((b.worker, b.overlap_blocks), (a.worker, 16), "{policy}");
            assert_eq!(r.num_pending_blocks(Some(0.001)).unwrap(), 16 + 3 + 3);
        } else {
            assert_eq!(b.overlap_blocks, 0);
            assert_ne!(b.worker, a.worker, "cache_only without pending spreads by queue");
        }
    }
}

#[test]
fn pending_prefixes_go_away_after_prefill_done_plus_grace() {
    let cfg = router_config!(pending_grace_s: 0.5, pending_ttl_s: 30.0);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    let p = prompt(33, 640);
    tracked(&r, &p, 0.0, 1);
    tracked(&r, &prompt(34, 640), 0.0, 2);
    tracked(&r, &prompt(35, 640), 0.0, 3);
    assert_eq!(r.num_pending_blocks(Some(0.0)).unwrap(), 30);
    r.prefill_done(1, Some(0.2)).unwrap();
    r.finished(2, Some(0.3)).unwrap(); // prefill never reported: finished ends it
    r.cancel(3, Some(0.3)).unwrap(); // cancelled: nothing was computed, gone at once
    assert_eq!(r.num_pending_blocks(Some(0.3)).unwrap(), 20);
    assert_eq!(r.num_pending_blocks(Some(0.69)).unwrap(), 20);
    assert_eq!(r.num_pending_blocks(Some(0.7)).unwrap(), 10);
    assert_eq!(r.num_pending_blocks(Some(0.8)).unwrap(), 0);
    // The index is the only source again.
    assert_eq!(route(&r, &p, 1.0).overlap_blocks, 0);
}

#[test]
fn untracked_requests_pend_until_their_predicted_prefill_end() {
    let r = Router::new(router_config!(pending_grace_s: 0.25), None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    let p = prompt(36, 2000); // 0.1 s of prefill at 20k tokens/s
    route(&r, &p, 0.0);
    assert_eq!(route(&r, &p, 0.01).overlap_blocks, 31);
    assert_eq!(r.num_pending_blocks(Some(0.349)).unwrap(), 31);
    assert_eq!(r.num_pending_blocks(Some(0.36)).unwrap(), 0);
}

#[test]
fn callers_that_never_report_are_bounded_by_the_ttl() {
    // 10 tracked requests a second with distinct prompts, never finished: the pending set holds
    // only the last TTL's worth.
    let cfg = router_config!(pending_ttl_s: 2.0);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec { prefill_tokens_per_s: 1e9, ..Default::default() }).unwrap();
    for i in 0..1000u64 {
        tracked(&r, &prompt(1000 + i as u32, 640), i as f64 * 0.1, i);
        assert!(r.num_pending_blocks(Some(i as f64 * 0.1)).unwrap() <= 21 * 10);
    }
    assert_eq!(r.num_pending_blocks(Some(100.0 + 2.0)).unwrap(), 0);
    let st = r.state.lock();
    assert_eq!((st.pending.num_entries(), st.pending.num_blocks()), (0, 0));
}

#[test]
fn pending_prefixes_are_validated_and_dropped_with_their_worker() {
    for bad in [
        router_config!(pending_grace_s: -1.0),
        router_config!(pending_grace_s: f64::NAN),
        router_config!(pending_ttl_s: 0.0),
        router_config!(pending_ttl_s: f64::INFINITY),
    ] {
        assert!(matches!(Router::new(bad, None), Err(RouterError::InvalidConfig(_))));
    }
    let r = Router::new(RouterConfig::default(), None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    r.add_worker(1, WorkerSpec::default()).unwrap();
    let p = prompt(37, 640);
    let d = tracked(&r, &p, 0.0, 1);
    r.remove_worker(d.worker).unwrap();
    assert_eq!(r.num_pending_blocks(Some(0.0)).unwrap(), 0);
    r.add_worker(d.worker, WorkerSpec::default()).unwrap();
    assert_eq!(route(&r, &p, 0.0).overlap_blocks, 0);
}

/// Workers 0 and 1 under "cache_only", ties to the lowest id: placement by overlap alone.
fn cache_only_pair() -> Router {
    let r = Router::new(router_config!(policy: "cache_only", tie_break: TieBreak::Lowest), None).unwrap();
    for w in 0..2 {
        r.add_worker(w, WorkerSpec::default()).unwrap();
    }
    r
}

#[test]
fn pending_continues_the_index_prefix_and_holds_only_what_it_lacked() {
    let r = cache_only_pair();
    let p = prompt(38, 640);
    store(&r, 1, &p[..512]); // the index: 8 of the 10 blocks on worker 1
    let d = tracked(&r, &p, 0.0, 1);
    assert_eq!((d.worker, d.overlap_blocks), (1, 8));
    assert_eq!(r.num_pending_blocks(Some(0.0)).unwrap(), 2);
    let d = tracked(&r, &p, 0.0, 2);
    assert_eq!((d.worker, d.overlap_blocks), (1, 10));
    // The index loses the prefix (evicted): the pending tail alone is no prefix.
    r.index().remove(1, &sequence_hashes(&p[..512], 64, crate::DEFAULT_SEED, None), ANY_TIER);
    assert_eq!(tracked(&r, &p, 0.0, 3).overlap_blocks, 0);
}

#[test]
fn a_pending_block_its_engine_removed_no_longer_counts() {
    // What the real-engine test (tests/e2e/test_e2e_index.py) saw, as an event sequence: A is
    // routed to worker 0 (its 10 blocks pending there), finishes, its stores arrive; the engine
    // then evicts A's last 5 blocks for the next request, all within the grace after A's end.
    // A request with A's prompt must see the 5 blocks the engine still holds, not 10.
    let r = cache_only_pair();
    let p = prompt(39, 640);
    let hs = sequence_hashes(&p, 64, crate::DEFAULT_SEED, None);
    let a = tracked(&r, &p, 0.0, 1);
    assert_eq!((a.worker, a.overlap_blocks), (0, 0));
    r.finished(1, Some(0.1)).unwrap();
    store(&r, 0, &p);
    r.index().remove(0, &hs[5..], ANY_TIER);
    assert_eq!(r.num_pending_blocks(Some(0.2)).unwrap(), 5, "the blocks still held stay pending until the grace ends");
    let c = tracked(&r, &p, 0.2, 2);
    assert_eq!((c.worker, c.overlap_blocks), (0, 5));
    // C re-pends hs[5..] on worker 0; the engine then drops its whole cache (AllBlocksCleared).
    r.index().clear(0);
    assert_eq!(tracked(&r, &p, 0.3, 3).overlap_blocks, 0);
    // A removal applied before a request is routed does not void that request's pending blocks.
    let q = prompt(40, 640);
    for w in 0..2 {
        r.index().remove(w, &sequence_hashes(&q, 64, crate::DEFAULT_SEED, None), ANY_TIER);
    }
    tracked(&r, &q, 0.4, 4);
    assert_eq!(tracked(&r, &q, 0.5, 5).overlap_blocks, 10);
    // Without pending prefixes the Router does not subscribe to the index's removals.
    let off = Router::new(router_config!(pending_prefixes: false), Some(r.index().clone())).unwrap();
    drop(off);
}

#[test]
fn unified_step_time_charges_the_decodes_a_prefill_runs_beside() {
    // Two unified workers decoding at 200 tokens/s (each request in flight adds 5 ms to a step).
    // Worker 0 holds 512 of the prompt's 576 tokens (25.6 ms of recompute at 20,000 tokens/s
    // elsewhere) but runs 8 requests: its step is 0.01 + 8 / 200 = 50 ms against worker 1's 10 ms.
    let make = |decode_tokens_per_s: Option<f64>| {
        let cfg = router_config!(tie_break: TieBreak::Lowest, pending_prefixes: false);
        let r = Router::new(cfg, None).unwrap();
        for w in 0..2 {
            r.add_worker(w, WorkerSpec { decode_tokens_per_s, ..Default::default() }).unwrap();
        }
        r.observe(0, Observed { running: Some(8), ..Default::default() }, None, Some(0.0)).unwrap();
        let p = prompt(50, 576);
        store(&r, 0, &p[..512]);
        (r, p)
    };
    let (r, p) = make(Some(200.0));
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), explain: true, ..Default::default() }).unwrap();
    assert_eq!(d.worker, 1);
    let ex = d.explain.clone().unwrap();
    assert!((ex[0].step_time - 0.05).abs() < 1e-12 && (ex[1].step_time - 0.01).abs() < 1e-12, "{ex:?}");
    assert!((d.predicted_ttft - (576.0 / 20000.0 + 0.01)).abs() < 1e-12, "{d:?}");
    // The step is latency, not queued work: the prefill queue advances by the prefill alone.
    assert!((d.busy_until - 576.0 / 20000.0).abs() < 1e-12, "{d:?}");
    // Fewer decodes there, and the cached prefix wins again: 0.01 + 2 / 200 = 20 ms.
    r.observe(0, Observed { running: Some(2), ..Default::default() }, None, Some(1.0)).unwrap();
    assert_eq!(route(&r, &p, 1.0).worker, 0);
    // Without a decode speed (the seed's prefill instances, the simulator) there is no step term.
    let (r, p) = make(None);
    let d = r.route(&RouteRequest { tokens: Some(&p), now: Some(0.0), explain: true, ..Default::default() }).unwrap();
    assert_eq!(d.worker, 0);
    assert!(d.explain.unwrap().iter().all(|c| c.step_time == 0.0));
}

#[test]
fn slack_and_capacity_break_ties_toward_the_worker_idle_longest() {
    // Three idle workers, none holding the prompt: every cost is equal. After work on 2, 1, 0 at
    // t = 0, 1, 2 (each finished), a new prompt at t = 10 goes to worker 2, idle the longest (its
    // cache the coldest), then 1, then 0; rotation would have taken 0, 1, 2.
    for policy in ["slack", "capacity"] {
        let r = router(policy, TieBreak::Rotate, 3);
        for (w, t) in [(2u64, 0.0), (1, 1.0), (0, 2.0)] {
            let id = w + 100;
            r.route(&RouteRequest {
                tokens: Some(&prompt(90 + w as u32, 640)),
                now: Some(t),
                request_id: Some(id),
                pin: Some(w),
                ..Default::default()
            })
            .unwrap();
            r.finished(id, Some(t + 0.5)).unwrap();
        }
        let mut got = vec![];
        for k in 0..3u64 {
            let id = k + 200;
            let d = r
                .route(&RouteRequest {
                    tokens: Some(&prompt(300 + k as u32, 640)),
                    now: Some(10.0 + k as f64),
                    request_id: Some(id),
                    ..Default::default()
                })
                .unwrap();
            r.finished(id, Some(10.5 + k as f64)).unwrap();
            got.push(d.worker);
        }
        assert_eq!(got, vec![2, 1, 0], "{policy}");
        // A queue still comes first: worker 2 busy (not finished) loses the tie to idle 1 and 0.
        let d = r
            .route(&RouteRequest {
                tokens: Some(&prompt(400, 6400)),
                now: Some(20.0),
                request_id: Some(1),
                pin: Some(2),
                ..Default::default()
            })
            .unwrap();
        assert!(d.busy_until > 20.1);
        let d = route(&r, &prompt(401, 640), 20.0);
        assert_eq!(d.worker, 1, "{policy}");
    }
}
