//! Builds a benchmark index (1M entries, W=64) once and prints the build's time (stores, and
//! removals for `churn`; the workload is generated before the clock starts), memory estimate and
//! the time of 128- and 1024-block matches; a deterministic target for `valgrind --tool=callgrind`
//! and `perf`. For `churn` the queries are the most recently opened sessions (as in
//! `compare_index.py --workload churn`), and the line also gives how deep they match on average.
//! Usage: build_index [in-order|interleaved|churn] [entries] [match rounds]

#[path = "../benches/common/mod.rs"]
mod common;

use kvroute_core::{MatchScratch, Matches, ANY_TIER};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "interleaved".into());
    let entries: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let idx = kvroute_core::KvIndex::new(None);
    // The workload is generated first; the time is the build's alone.
    let (mut sessions, stores) = match mode.as_str() {
        "in-order" => (common::chat_workload(64, entries, 1), None),
        "interleaved" => {
            let (sessions, stores) = common::interleaved_stream(64, entries, 1);
            (sessions, Some(stores))
        }
        "churn" => {
            let (sessions, stores) = common::churn_stream(64, entries, 1);
            (sessions, Some(stores))
        }
        other => {
            eprintln!("unknown mode {other:?}: expected in-order, interleaved or churn");
            std::process::exit(2);
        }
    };
    let t = std::time::Instant::now();
    let n = match &stores {
        None => common::build(&idx, &sessions, 64),
        Some(stores) => common::build_stream(&idx, &sessions, stores),
    };
    let dt = t.elapsed().as_secs_f64();
    if mode == "churn" {
        sessions.reverse(); // the most recently opened first, for the queries below
    }
    let st = idx.stats();
    println!(
        "{mode}: {n} blocks in {dt:.3}s ({:.2}M blocks/s); {} nodes, {} entries; {:.1} estimated bytes per entry; {} orphan, {} duplicate stores, {} unknown removals",
        n as f64 / dt / 1e6,
        st.nodes,
        st.entries,
        st.estimated_bytes as f64 / st.entries as f64,
        st.orphan_stores,
        st.duplicate_stores,
        st.unknown_removals
    );
    let (mut sc, mut out) = (MatchScratch::default(), Matches::default());
    for blocks in [128usize, 1024] {
        let qs: Vec<&[u64]> = sessions.iter().filter(|s| s.seq.len() >= blocks).take(256).map(|s| &s.seq[..blocks]).collect();
        let depth: u64 = qs.iter().map(|q| idx.find_matches(q, ANY_TIER).depths.iter().copied().max().unwrap_or(0) as u64).sum();
        let t = std::time::Instant::now();
        for _ in 0..rounds {
            for q in &qs {
                idx.match_into(q, ANY_TIER, &mut sc, &mut out);
            }
        }
        let per = t.elapsed().as_secs_f64() / (rounds * qs.len()).max(1) as f64;
        println!(
            "match {blocks} blocks: {:.2} us mean over {} queries x {rounds}; {:.0} blocks matched on average",
            per * 1e6,
            qs.len(),
            depth as f64 / qs.len().max(1) as f64
        );
    }
}
