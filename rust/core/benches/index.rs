//! Criterion benches for the index hot paths: match (128 / 1024 blocks), store, hashing.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvroute_core::{KvIndex, MatchScratch, Matches, ANY_TIER, DEFAULT_SEED};

mod common;
use common::{build, build_stream, chat_workload, churn_stream, interleaved_stream, Session};

fn bench_match(c: &mut Criterion) {
    let sessions = chat_workload(64, 1_000_000, 1);
    let idx = KvIndex::new(None);
    build(&idx, &sessions, 64);
    match_group(c, "match", &idx, &sessions);
    drop(idx);
    let (sessions, stores) = interleaved_stream(64, 1_000_000, 1);
    let idx = KvIndex::new(None);
    build_stream(&idx, &sessions, &stores);
    match_group(c, "match_interleaved", &idx, &sessions);
    drop(idx);
    // Caches that overflow: the most recently opened sessions, as a router is asked about them.
    let (mut sessions, stores) = churn_stream(64, 1_000_000, 1);
    let idx = KvIndex::new(None);
    build_stream(&idx, &sessions, &stores);
    sessions.reverse();
    match_group(c, "match_churn", &idx, &sessions);
}

fn match_group(c: &mut Criterion, name: &str, idx: &KvIndex, sessions: &[Session]) {
    let mut g = c.benchmark_group(name);
    for blocks in [128usize, 1024] {
        let qs: Vec<&[u64]> = sessions.iter().filter(|s| s.seq.len() >= blocks).take(256).map(|s| &s.seq[..blocks]).collect();
        let (mut scratch, mut out) = (MatchScratch::default(), Matches::default());
        let mut i = 0;
        g.bench_function(format!("W64_1M_{blocks}_blocks"), |b| {
            b.iter(|| {
                i = (i + 1) % qs.len();
                idx.match_into(black_box(qs[i]), ANY_TIER, &mut scratch, &mut out);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn bench_store(c: &mut Criterion) {
    let sessions = chat_workload(64, 200_000, 2);
    let blocks: usize = sessions.iter().map(|s| s.seq.len()).sum();
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(blocks as u64));
    g.sample_size(10);
    for batch in [16usize, 64] {
        g.bench_function(format!("W64_200k_blocks_batch{batch}"), |b| {
            b.iter_batched(|| KvIndex::new(None), |idx| build(&idx, &sessions, batch), BatchSize::PerIteration)
        });
    }
    g.finish();
}

fn bench_hash(c: &mut Criterion) {
    let toks: Vec<u32> = (0..8192u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_000).collect();
    c.bench_function("sequence_hashes_8192_tokens_block64", |b| {
        b.iter(|| kvroute_core::hash::sequence_hashes(black_box(&toks), 64, DEFAULT_SEED, None))
    });
}

criterion_group!(benches, bench_match, bench_store, bench_hash);
criterion_main!(benches);
