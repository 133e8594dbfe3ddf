//! The routing hot path allocates nothing once warm: a counting global allocator around
//! `Router::route` for an untracked request (hashing, index match, scoring, load update).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};

use kvroute_core::router::{RouteRequest, Router, RouterConfig, WorkerSpec};
use kvroute_core::{hash::sequence_hashes, Tier, DEFAULT_SEED};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            ALLOCS.fetch_add(1, Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn warm_route_does_not_allocate() {
    for policy in ["slack", "ttft", "cache_aware", "cost", "least_load"] {
        let cfg = RouterConfig { policy: policy.into(), ttft_slo: Some(2.0), ..Default::default() };
        let router = Router::new(cfg, None).unwrap();
        for w in 0..64 {
            router.add_worker(w, WorkerSpec::default()).unwrap();
        }
        let prompt: Vec<u32> = (0..8192u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let hashes = sequence_hashes(&prompt[..6000], 64, DEFAULT_SEED, None);
        for w in [3, 17, 40] {
            router.index().store(w, &hashes, None, Tier::Device).unwrap();
        }
        let req = |t: f64| RouteRequest { tokens: Some(&prompt), now: Some(t), ..Default::default() };
        router.route(&req(0.0)).unwrap(); // warms the thread-local scratch
        ALLOCS.store(0, Relaxed);
        COUNTING.store(true, Relaxed);
        for k in 1..100 {
            let d = router.route(&req(k as f64)).unwrap();
            assert!(d.admitted);
        }
        COUNTING.store(false, Relaxed);
        assert_eq!(ALLOCS.load(Relaxed), 0, "{policy}: route allocated");
        // The counter does count: `explain` builds a per-worker list.
        COUNTING.store(true, Relaxed);
        router.route(&RouteRequest { explain: true, ..req(200.0) }).unwrap();
        COUNTING.store(false, Relaxed);
        assert!(ALLOCS.load(Relaxed) > 0);
    }
}
