//! Builds the chat-like benchmark index (1M entries, W=64, 64-block stores) once and prints the
//! time and memory estimate; a deterministic target for `valgrind --tool=cachegrind`.

#[path = "../benches/common/mod.rs"]
mod common;

fn main() {
    let entries: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let sessions = common::chat_workload(64, entries, 1);
    let idx = kvroute_core::KvIndex::new(None);
    let t = std::time::Instant::now();
    let n = common::build(&idx, &sessions, 64);
    let dt = t.elapsed().as_secs_f64();
    let st = idx.stats();
    println!(
        "{n} blocks in {dt:.3}s ({:.2}M blocks/s); {} nodes; {:.1} estimated bytes per entry",
        n as f64 / dt / 1e6,
        st.nodes,
        st.estimated_bytes as f64 / st.entries as f64
    );
}
