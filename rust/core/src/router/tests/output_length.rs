//! Decode KV reserved for what requests produce (`Router::output_done`), capped by max_tokens.

use super::*;

#[test]
fn the_learned_output_length_replaces_the_cap_once_reported() {
    let mut o = OutputLength::default();
    assert_eq!((o.expected(Some(4096)), o.expected(None)), (4096, 0), "nothing reported: the cap, or nothing");
    for i in 0..15 {
        o.add(100 + (i % 2) * 100);
    }
    assert_eq!(o.expected(Some(4096)), 4096, "15 reports are not yet enough");
    o.add(100);
    // Mean ~150, SD ~50: mean + 2 SD ~250.
    let e = o.expected(Some(4096));
    assert!((240..=260).contains(&e), "{e}");
    assert_eq!(o.expected(Some(120)), 120, "never above the request's own cap");
    assert_eq!(o.expected(None), e);
}

#[test]
fn a_router_told_what_requests_produce_stops_reserving_the_whole_cap() {
    // 100 blocks of 64 tokens; a 640-token prompt capped at 8,192 output tokens needs 138 blocks
    // with the cap reserved: no room, rejected. Once finished requests reported ~100-token outputs,
    // it needs about 14 and is admitted.
    let r = Router::new(router_config!(block_size: 64), None).unwrap();
    r.add_worker(0, WorkerSpec { kv_capacity_blocks: Some(100), ..Default::default() }).unwrap();
    let toks = prompt(3, 640);
    let ask =
        |now: f64| r.route(&RouteRequest { tokens: Some(&toks), now: Some(now), output_tokens: Some(8192), ..Default::default() }).unwrap();
    let d = ask(0.0);
    assert!(!d.admitted && d.reason == Reason::RejectedDecode, "{:?}", d.reason);
    for id in 0..16 {
        let small = prompt(100 + id as u32, 64);
        r.route(&RouteRequest { tokens: Some(&small), now: Some(0.5), request_id: Some(id), ..Default::default() }).unwrap();
        r.output_done(id, 100, Some(0.6)).unwrap();
        r.finished(id, Some(0.6)).unwrap();
    }
    assert!(ask(1.0).admitted);
    assert_eq!(r.output_done(99, 1, None), Err(RouterError::UnknownRequest(99)), "only a request in flight");
}
