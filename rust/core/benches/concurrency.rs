//! Concurrent reads: match rate with 1 vs 2 threads, and match p99 idle vs with a writer
//! storing ~1M blocks/s. Python threads cannot show this for ~1 us calls (the GIL hand-off
//! dominates), so it is measured here on the core directly. Five runs, one line each, then one
//! JSON line with the worst of them: `two_thread_scaling` (lowest), `p99_ratio_128` and
//! `p99_ratio_1024` (highest p99 with the writer over idle p99).
//! `KVROUTE_BENCH_SEPARATE_WRITER=1` makes the writer store into a second index: the baseline
//! for how much of the tail is the host rather than the index's locks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::{KvIndex, MatchScratch, Matches, Tier, ANY_TIER};

mod common;
use common::{build, chat_workload};

fn match_rate(idx: &KvIndex, qs: &[&[u64]], threads: usize, window: Duration) -> f64 {
    let stop = AtomicBool::new(false);
    let total = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, total) = (&stop, &total);
            s.spawn(move || {
                let (mut sc, mut out) = (MatchScratch::default(), Matches::default());
                let mut n = 0u64;
                let mut i = t * 7;
                while !stop.load(Ordering::Relaxed) {
                    idx.match_into(qs[i % qs.len()], ANY_TIER, &mut sc, &mut out);
                    i += 1;
                    n += 1;
                }
                total.fetch_add(n, Ordering::Relaxed);
            });
        }
        std::thread::sleep(window); // the measurement window
        stop.store(true, Ordering::Relaxed);
    });
    total.load(Ordering::Relaxed) as f64 / window.as_secs_f64()
}

fn latencies(idx: &KvIndex, qs: &[&[u64]], rounds: usize) -> Vec<f64> {
    let (mut sc, mut out) = (MatchScratch::default(), Matches::default());
    let mut lat = Vec::with_capacity(rounds * qs.len());
    for _ in 0..rounds {
        for q in qs {
            let t = Instant::now();
            idx.match_into(q, ANY_TIER, &mut sc, &mut out);
            lat.push(t.elapsed().as_nanos() as f64 / 1000.0);
        }
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    lat
}

fn pct(xs: &[f64], q: f64) -> f64 {
    xs[((xs.len() as f64 * q) as usize).min(xs.len() - 1)]
}

/// Runs of the whole measurement; the JSON line reports the worst of them.
const RUNS: usize = 5;

fn main() {
    let sessions = chat_workload(64, 1_000_000, 1);
    let idx = KvIndex::new(None);
    build(&idx, &sessions, 64);
    let writer_sessions = chat_workload(8, 4_000_000, 99);
    let separate = KvIndex::new(None);
    let widx: &KvIndex = if std::env::var_os("KVROUTE_BENCH_SEPARATE_WRITER").is_some() { &separate } else { &idx };
    println!("index: {} nodes, {} entries", idx.len(), idx.stats().entries);
    // The writer goes on where the previous measurement stopped, so it always stores new blocks.
    let mut next_session = 0usize;
    let (mut worst_scaling, mut worst_128, mut worst_1024) = (f64::INFINITY, 0f64, 0f64);
    for run in 1..=RUNS {
        for blocks in [128usize, 1024] {
            let qs: Vec<&[u64]> = sessions.iter().filter(|s| s.seq.len() >= blocks).take(256).map(|s| &s.seq[..blocks]).collect();
            let window = Duration::from_millis(1500);
            let r1 = match_rate(&idx, &qs, 1, window);
            let r2 = match_rate(&idx, &qs, 2, window);
            let idle = latencies(&idx, &qs, 40);
            // A writer paced at ~1M blocks/s (64-block stores) while one thread measures.
            let stop = AtomicBool::new(false);
            let stored = AtomicU64::new(0);
            let first = next_session;
            let (busy, reached) = std::thread::scope(|s| {
                let writer = s.spawn(|| {
                    let t0 = Instant::now();
                    let mut k = first;
                    'outer: while k < writer_sessions.len() {
                        let sess = &writer_sessions[k];
                        for (c, chunk) in sess.seq.chunks(64).enumerate() {
                            if stop.load(Ordering::Relaxed) {
                                break 'outer;
                            }
                            let parent = (c > 0).then(|| sess.seq[c * 64 - 1]);
                            widx.store(1000 + (k as u64 % 8), chunk, parent, Tier::Device).unwrap();
                            let n = stored.fetch_add(chunk.len() as u64, Ordering::Relaxed) + chunk.len() as u64;
                            let due = Duration::from_secs_f64(n as f64 / 1e6);
                            let el = t0.elapsed();
                            if due > el {
                                std::thread::sleep(due - el);
                            }
                        }
                        k += 1;
                    }
                    k + 1
                });
                let t0 = Instant::now();
                let lat = latencies(&idx, &qs, 40);
                let secs = t0.elapsed().as_secs_f64();
                stop.store(true, Ordering::Relaxed);
                let reached = writer.join().unwrap();
                ((lat, stored.load(Ordering::Relaxed) as f64 / secs), reached)
            });
            next_session = reached;
            let (scaling, ratio) = (r2 / r1, pct(&busy.0, 0.99) / pct(&idle, 0.99));
            worst_scaling = worst_scaling.min(scaling);
            if blocks == 128 {
                worst_128 = worst_128.max(ratio);
            } else {
                worst_1024 = worst_1024.max(ratio);
            }
            println!(
                "run {run}, {blocks:>5} blocks: 1 thread {:.2}M match/s, 2 threads {:.2}M match/s ({scaling:.2}x); p50/p99 idle {:.2}/{:.2} us, with writer at {:.2}M blocks/s {:.2}/{:.2} us (p99 {ratio:.2}x idle)",
                r1 / 1e6,
                r2 / 1e6,
                pct(&idle, 0.5),
                pct(&idle, 0.99),
                busy.1 / 1e6,
                pct(&busy.0, 0.5),
                pct(&busy.0, 0.99),
            );
        }
    }
    println!("{{\"two_thread_scaling\": {worst_scaling:.3}, \"p99_ratio_128\": {worst_128:.3}, \"p99_ratio_1024\": {worst_1024:.3}}}");
}
