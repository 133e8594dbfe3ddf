//! Decode-side choice, judged before any prefill is spent (Mooncake's order): a worker needs KV
//! room for the request (with headroom) and a predicted TPOT within the SLO.

use super::config::{RouterConfig, TieBreak};
use super::load::WorkerLoad;
use super::policy::pick_min_by;

/// Result of judging the decode side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DecodeChoice {
    /// Index (into the router's worker list) of the chosen decode worker and its predicted TPOT.
    Chosen(usize, Option<f64>),
    /// No decode worker has KV room; index of the one with the most free blocks.
    NoRoom(usize),
    /// Some have room but every one's TPOT would miss the SLO; index of the best.
    TpotMiss(usize, Option<f64>),
}

/// Whether worker `w` can take a request needing `need` KV blocks within the TPOT SLO.
pub fn admissible(w: &WorkerLoad, need: u64, cfg: &RouterConfig) -> bool {
    w.kv_fits(need, cfg.kv_headroom) && tpot_ok(w, cfg)
}

fn tpot_ok(w: &WorkerLoad, cfg: &RouterConfig) -> bool {
    match (cfg.tpot_slo, w.tpot_with_one_more(cfg.decode_step_s)) {
        (Some(slo), Some(t)) => t <= slo,
        _ => true,
    }
}

/// Picks a decode worker among `workers` for which `eligible` holds: lowest predicted TPOT, then
/// most free KV blocks, then the tie-break. Never empty-handed when some worker is eligible.
pub fn choose_decode(
    workers: &[WorkerLoad],
    eligible: impl Fn(&WorkerLoad) -> bool,
    need: u64,
    cfg: &RouterConfig,
    tie_break: TieBreak,
    rotation: &mut u64,
) -> Option<DecodeChoice> {
    let key = |w: &WorkerLoad| (w.tpot_with_one_more(cfg.decode_step_s).unwrap_or(0.0), -(w.kv_free() as f64));
    let load = |w: &WorkerLoad| (w.decoding as f64, 0.0);
    if let Some(i) = pick_min_by(tie_break, rotation, workers, |w| eligible(w) && admissible(w, need, cfg), key, load) {
        return Some(DecodeChoice::Chosen(i, workers[i].tpot_with_one_more(cfg.decode_step_s)));
    }
    let roomy = |w: &WorkerLoad| eligible(w) && w.kv_fits(need, cfg.kv_headroom);
    if let Some(i) = pick_min_by(tie_break, rotation, workers, roomy, key, load) {
        return Some(DecodeChoice::TpotMiss(i, workers[i].tpot_with_one_more(cfg.decode_step_s)));
    }
    let most_free = |w: &WorkerLoad| (-(w.kv_free() as f64), 0.0);
    pick_min_by(tie_break, rotation, workers, eligible, most_free, load).map(DecodeChoice::NoRoom)
}
