//! Model pools and identities: a request routes only among the workers given, and its identity
//! keys its prompt.

use super::*;
use crate::hash::identity_root;

fn req<'a>(toks: &'a [u32], workers: Option<&'a [WorkerId]>, identity: Option<u64>) -> RouteRequest<'a> {
    RouteRequest { tokens: Some(toks), now: Some(0.0), workers, identity, ..Default::default() }
}

#[test]
fn routes_only_among_the_workers_given() {
    let r = router("ttft", TieBreak::Lowest, 4);
    let p = prompt(1, 640);
    // Worker 0 holds the prefix but serves another model: the pool's best is chosen instead.
    store(&r, 0, &p);
    assert_eq!(route(&r, &p, 0.0).worker, 0);
    for pool in [&[2u64, 3][..], &[3], &[1, 3, 99]] {
        let d = r.route(&req(&p, Some(pool), None)).unwrap();
        assert!(pool.contains(&d.worker), "{pool:?} -> {}", d.worker);
        assert_eq!(d.overlap_blocks, 0);
    }
    // Ids no longer registered are ignored; none left is NoWorkers, not a panic.
    let e = r.route(&req(&p, Some(&[7, 8]), None)).unwrap_err();
    assert!(matches!(e, RouterError::NoWorkers(_)), "{e}");
    let e = r.route(&RouteRequest { pin: Some(0), ..req(&p, Some(&[1]), None) }).unwrap_err();
    assert!(matches!(e, RouterError::InvalidArgument(_)), "{e}");
    // Load stays per worker: two pools sharing worker 1 see each other's requests on it.
    let r = router("ttft", TieBreak::Lowest, 3);
    for id in 0..4 {
        let d = r.route(&RouteRequest { request_id: Some(id), ..req(&prompt(10 + id as u32, 640), Some(&[0, 1]), None) }).unwrap();
        assert!(d.worker <= 1);
    }
    let d = r.route(&req(&prompt(99, 640), Some(&[1, 2]), None)).unwrap();
    assert_eq!(d.worker, 2, "worker 1 carries the other pool's queue");
}

#[test]
fn pd_pools_pick_both_sides_inside_the_pool() {
    let r = Router::new(router_config!(policy: "ttft", tie_break: TieBreak::Lowest), None).unwrap();
    for w in 0..2 {
        r.add_worker(w, WorkerSpec { role: Role::Prefill, ..Default::default() }).unwrap();
    }
    for w in 10..12 {
        r.add_worker(w, WorkerSpec { role: Role::Decode, kv_capacity_blocks: Some(100), ..Default::default() }).unwrap();
    }
    let p = prompt(3, 640);
    let d = r.route(&req(&p, Some(&[1, 11]), None)).unwrap();
    assert_eq!((d.worker, d.decode_worker), (1, Some(11)));
}

#[test]
fn identity_keys_the_prompt() {
    let r = router("ttft", TieBreak::Lowest, 2);
    let p = prompt(5, 640);
    let a = identity_root(Some(b"tenant-a"), None);
    r.index().store(1, &sequence_hashes(&p, 64, crate::DEFAULT_SEED, a), None, Tier::Device).unwrap();
    assert_eq!(r.route(&req(&p, None, a)).unwrap().overlap_blocks, 10);
    assert_eq!(r.route(&req(&p, None, None)).unwrap().overlap_blocks, 0);
    assert_eq!(r.route(&req(&p, None, identity_root(Some(b"tenant-b"), None))).unwrap().overlap_blocks, 0);
    let h = sequence_hashes(&p, 64, crate::DEFAULT_SEED, a);
    let e = r.route(&RouteRequest { hashes: Some(&h), identity: a, ..Default::default() }).unwrap_err();
    assert!(matches!(e, RouterError::InvalidArgument(_)), "{e}");
}
