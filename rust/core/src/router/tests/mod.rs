//! The Router's unit tests, one file per part of it; shared helpers here.

use super::*;

mod admission;
mod lifecycle;
mod output_length;
mod pd;
mod pending;
mod policies;
mod pools;
mod share;
mod stale;
mod ttft_model;

use crate::hash::sequence_hashes;
use crate::router_config;

/// Overlap from the index alone (no pending prefixes): the policies' arithmetic as the seed states it.
fn router(policy: &str, tie: TieBreak, n: u64) -> Router {
    let cfg = router_config!(policy: policy, tie_break: tie, pending_prefixes: false);
    let r = Router::new(cfg, None).unwrap();
    for w in 0..n {
        r.add_worker(w, WorkerSpec::default()).unwrap();
    }
    r
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed)).collect()
}

fn route(r: &Router, toks: &[u32], now: f64) -> Decision {
    r.route(&RouteRequest { tokens: Some(toks), now: Some(now), ..Default::default() }).unwrap()
}

fn store(r: &Router, w: WorkerId, toks: &[u32]) {
    r.index().store(w, &sequence_hashes(toks, 64, crate::DEFAULT_SEED, None), None, Tier::Device).unwrap();
}

fn tracked(r: &Router, toks: &[u32], now: f64, id: u64) -> Decision {
    r.route(&RouteRequest { tokens: Some(toks), now: Some(now), request_id: Some(id), ..Default::default() }).unwrap()
}
