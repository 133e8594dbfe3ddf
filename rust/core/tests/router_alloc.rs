//! The routing hot path allocates nothing once warm: a counting global allocator around
//! `Router::route` for an untracked request (hashing, index match, scoring, load update).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use kvroute_core::router::{RouteRequest, Router, WorkerSpec};
use kvroute_core::router_config;
use kvroute_core::{hash::sequence_hashes, Tier, DEFAULT_SEED};

struct Counting;

// Per thread, so the test harness's own threads do not count.
thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    let _ = COUNTING.try_with(|c| {
        if c.get() {
            let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        }
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn warm_route_does_not_allocate() {
    for policy in ["slack", "ttft", "cache_aware", "cost", "least_load", "capacity"] {
        let cfg = router_config!(policy: policy, ttft_slo: Some(2.0));
        let router = Router::new(cfg, None).unwrap();
        for w in 0..64 {
            // A prefix-cache size: "capacity" then reads every worker's occupancy on each route.
            router.add_worker(w, WorkerSpec { prefix_cache_blocks: Some(1000), ..Default::default() }).unwrap();
        }
        let prompt: Vec<u32> = (0..8192u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let hashes = sequence_hashes(&prompt[..6000], 64, DEFAULT_SEED, None);
        for w in [3, 17, 40] {
            router.index().store(w, &hashes, None, Tier::Device).unwrap();
        }
        let req = |t: f64| RouteRequest { tokens: Some(&prompt), now: Some(t), ..Default::default() };
        // Warms the thread-local scratch, and the pending-prefix tables up to the few entries
        // that are live at once here (each request's prefix pends until ~1.4 s after it).
        for k in 0..4 {
            router.route(&req(k as f64)).unwrap();
        }
        ALLOCS.set(0);
        COUNTING.set(true);
        for k in 4..1000 {
            let d = router.route(&req(k as f64)).unwrap();
            assert!(d.admitted);
        }
        COUNTING.set(false);
        assert_eq!(ALLOCS.get(), 0, "{policy}: route allocated");
        // The counter does count: `explain` builds a per-worker list.
        COUNTING.set(true);
        router.route(&RouteRequest { explain: true, ..req(200.0) }).unwrap();
        COUNTING.set(false);
        assert!(ALLOCS.get() > 0);
    }
}
