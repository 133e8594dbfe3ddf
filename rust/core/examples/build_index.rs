//! Builds a benchmark index (1M entries, W=64) once and prints the time, memory estimate and the
//! time of 128- and 1024-block matches; a deterministic target for `valgrind --tool=callgrind`.
//! Usage: build_index [in-order|interleaved] [entries] [match rounds]

#[path = "../benches/common/mod.rs"]
mod common;

use kvroute_core::{MatchScratch, Matches, ANY_TIER};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "interleaved".into());
    let entries: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let idx = kvroute_core::KvIndex::new(None);
    let t = std::time::Instant::now();
    let (sessions, n) = match mode.as_str() {
        "in-order" => {
            let sessions = common::chat_workload(64, entries, 1);
            let n = common::build(&idx, &sessions, 64);
            (sessions, n)
        }
        "interleaved" => {
            let (sessions, stores) = common::interleaved_stream(64, entries, 1);
            let n = common::build_stream(&idx, &sessions, &stores);
            (sessions, n)
        }
        other => {
            eprintln!("unknown mode {other:?}: expected in-order or interleaved");
            std::process::exit(2);
        }
    };
    let dt = t.elapsed().as_secs_f64();
    let st = idx.stats();
    println!(
        "{mode}: {n} blocks in {dt:.3}s ({:.2}M blocks/s); {} nodes, {} entries; {:.1} estimated bytes per entry",
        n as f64 / dt / 1e6,
        st.nodes,
        st.entries,
        st.estimated_bytes as f64 / st.entries as f64
    );
    let (mut sc, mut out) = (MatchScratch::default(), Matches::default());
    for blocks in [128usize, 1024] {
        let qs: Vec<&[u64]> = sessions.iter().filter(|s| s.seq.len() >= blocks).take(256).map(|s| &s.seq[..blocks]).collect();
        let t = std::time::Instant::now();
        for _ in 0..rounds {
            for q in &qs {
                idx.match_into(q, ANY_TIER, &mut sc, &mut out);
            }
        }
        let per = t.elapsed().as_secs_f64() / (rounds * qs.len()).max(1) as f64;
        println!("match {blocks} blocks: {:.2} us mean over {} queries x {rounds}", per * 1e6, qs.len());
    }
}
