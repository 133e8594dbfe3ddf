//! Stale overlaps: a removal that shows a queued request's overlap was already evicted.

use super::*;

/// One worker; `stale` turns the correction on. Request 1 is routed on a 40-block prefix the index
/// shows on worker 0; the engine has evicted blocks 20.. of it, and the removal arrives after the
/// routing (the event lag).
fn stale_case(stale: bool) -> (Router, Vec<u64>) {
    let cfg = router_config!(policy: "cache_only", tie_break: TieBreak::Lowest, stale_overlaps: stale);
    let r = Router::new(cfg, None).unwrap();
    r.add_worker(0, WorkerSpec::default()).unwrap();
    let p = prompt(50, 40 * 64);
    store(&r, 0, &p);
    let d = tracked(&r, &p, 0.0, 1);
    assert_eq!((d.worker, d.overlap_blocks, d.uncached_tokens), (0, 40, 0));
    let hs = sequence_hashes(&p, 64, crate::DEFAULT_SEED, None);
    (r, hs)
}

#[test]
fn a_removal_of_blocks_a_queued_request_counted_moves_the_queue_behind_it() {
    let t = 64.0 / 20000.0; // one block's prefill at the default speed
    let (r, hs) = stale_case(true);
    let busy0 = r.load(0).unwrap().busy_until;
    // Request 2 is queued behind it, then the removal of blocks 20.. arrives.
    let q = prompt(51, 10 * 64);
    let d2 = tracked(&r, &q, 0.001, 2);
    r.index().remove(0, &hs[20..], ANY_TIER);
    // Positions checked for 40 blocks: 39, 38, 36, 32, 24, 8, 0; the removal takes 39..24 away,
    // so request 1's overlap is at most 24: 16 blocks more to prefill, and the queue grows by them.
    let d3 = tracked(&r, &prompt(52, 64), 0.002, 3);
    let w = r.load(0).unwrap();
    assert!((w.busy_until - (d2.busy_until + 16.0 * t + 64.0 / 20000.0)).abs() < 1e-9, "{} vs {}", w.busy_until, d2.busy_until);
    assert!((d3.queue_delay - (d2.busy_until + 16.0 * t - 0.002)).abs() < 1e-9);
    assert_eq!(w.prefill_tokens, 16 * 64 + 10 * 64 + 64);
    // Request 1 ends when its corrected prediction says: no correction left for those behind it.
    r.prefill_done(1, Some(busy0 + 16.0 * t)).unwrap();
    assert!((r.load(0).unwrap().busy_until - (d2.busy_until + 16.0 * t + 64.0 / 20000.0)).abs() < 1e-9);
    // A second removal for a request whose prefill is done changes nothing.
    r.index().remove(0, &hs[..20], ANY_TIER);
    let before = r.load(0).unwrap().busy_until;
    tracked(&r, &prompt(53, 64), 0.003, 4);
    assert!((r.load(0).unwrap().busy_until - (before + 64.0 / 20000.0)).abs() < 1e-9);
}

#[test]
fn without_stale_overlaps_or_after_the_window_the_queue_is_unchanged() {
    let t64 = 64.0 / 20000.0;
    let (r, hs) = stale_case(false);
    let busy = r.load(0).unwrap().busy_until;
    r.index().remove(0, &hs[20..], ANY_TIER);
    let d = tracked(&r, &prompt(54, 64), 0.001, 2);
    assert!((d.busy_until - (busy.max(0.001) + t64)).abs() < 1e-12);
    // On, but the removal is read more than `pending_grace_s` after the request was routed: the
    // engine may have evicted the blocks after the request was placed, so it is not corrected.
    let (r, hs) = stale_case(true);
    r.index().remove(0, &hs[20..], ANY_TIER);
    let d = tracked(&r, &prompt(55, 64), 1.5, 2);
    assert_eq!(d.queue_delay, 0.0);
}

#[test]
fn a_cleared_cache_takes_every_queued_requests_overlap() {
    let t = 64.0 / 20000.0;
    let (r, _) = stale_case(true);
    let busy = r.load(0).unwrap().busy_until;
    r.index().clear(0);
    let d = tracked(&r, &prompt(56, 64), 0.0, 2);
    assert!((d.queue_delay - (busy + 40.0 * t)).abs() < 1e-9, "{}", d.queue_delay);
    // Cancelling request 1 takes its corrected work out of the queue.
    r.cancel(1, Some(0.0)).unwrap();
    assert!((r.load(0).unwrap().busy_until - t).abs() < 1e-9);
    let st = r.state.lock();
    assert_eq!(st.checkpoints.len(), 0, "cancel and prefill_done drop the checkpoints");
}
