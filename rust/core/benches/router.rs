//! Criterion benches for `Router::route`: 64 workers over a ~1M-entry index, an 8192-token prompt
//! given as tokens (hashing + match + scoring) or as precomputed sequence hashes (match + scoring).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute_core::router::{RouteRequest, Router, WorkerSpec};
use kvroute_core::router_config;
use kvroute_core::{hash::sequence_hashes, KvIndex, Tier, DEFAULT_SEED};

mod common;
use common::{build, chat_workload, Rng};

fn bench_route(c: &mut Criterion) {
    let sessions = chat_workload(64, 1_000_000, 3);
    let index = std::sync::Arc::new(KvIndex::new(None));
    build(&index, &sessions, 64);
    let mut rng = Rng::new(9);
    let prompt: Vec<u32> = (0..8192).map(|_| rng.next_u64() as u32).collect();
    let prompt_hashes = sequence_hashes(&prompt[..6016], 64, DEFAULT_SEED, None);
    for w in [5, 21, 50] {
        index.store(w, &prompt_hashes, None, Tier::Device).unwrap();
    }
    let queries: Vec<&[u64]> = sessions.iter().filter(|s| s.seq.len() >= 128).take(256).map(|s| &s.seq[..128]).collect();
    let mut g = c.benchmark_group("route");
    for policy in ["slack", "ttft", "cost"] {
        let cfg = router_config!(policy: policy, ttft_slo: Some(2.0));
        let router = Router::new(cfg, Some(index.clone())).unwrap();
        for w in 0..64 {
            router.add_worker(w, WorkerSpec::default()).unwrap();
        }
        let mut t = 0.0;
        g.bench_function(format!("{policy}_W64_1M_8192_tokens"), |b| {
            b.iter(|| {
                t += 100.0; // far apart: queues stay empty, every call sees the same state
                black_box(router.route(&RouteRequest { tokens: Some(black_box(&prompt)), now: Some(t), ..Default::default() }).unwrap())
            })
        });
        let mut i = 0;
        g.bench_function(format!("{policy}_W64_1M_128_hashes"), |b| {
            b.iter(|| {
                t += 100.0;
                i = (i + 1) % queries.len();
                let req = RouteRequest { hashes: Some(black_box(queries[i])), num_tokens: Some(8192), now: Some(t), ..Default::default() };
                black_box(router.route(&req).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_route);
criterion_main!(benches);
