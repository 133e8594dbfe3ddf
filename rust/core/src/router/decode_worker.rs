//! Decode-side choice, judged before any prefill is spent (Mooncake's order): a worker needs KV
//! room for the request (with headroom) and a predicted TPOT within the SLO.

use super::config::{DecodeConfig, DecodeRule, TieBreak};
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

/// Whether worker `w` can take a request needing `need` KV blocks within the TPOT SLO, with a
/// seat among its running requests.
pub fn admissible(w: &WorkerLoad, need: u64, cfg: &DecodeConfig) -> bool {
    w.kv_fits(need, cfg.kv_headroom) && tpot_ok(w, cfg) && w.has_seat()
}

fn tpot_ok(w: &WorkerLoad, cfg: &DecodeConfig) -> bool {
    match (cfg.tpot_slo, w.tpot_with_one_more(cfg.step_s)) {
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
    cfg: &DecodeConfig,
    tie_break: TieBreak,
    rotation: &mut u64,
) -> Option<DecodeChoice> {
    let load = |w: &WorkerLoad| (w.decoding as f64, 0.0);
    if cfg.rule == DecodeRule::Score {
        return choose_by_score(workers, eligible, need, cfg, tie_break, rotation);
    }
    let key = |w: &WorkerLoad| (w.tpot_with_one_more(cfg.step_s).unwrap_or(0.0), -(w.kv_free() as f64));
    if let Some(i) = pick_min_by(tie_break, rotation, workers, |w| eligible(w) && admissible(w, need, cfg), key, load) {
        return Some(DecodeChoice::Chosen(i, workers[i].tpot_with_one_more(cfg.step_s)));
    }
    let roomy = |w: &WorkerLoad| eligible(w) && w.kv_fits(need, cfg.kv_headroom);
    if let Some(i) = pick_min_by(tie_break, rotation, workers, roomy, key, load) {
        return Some(DecodeChoice::TpotMiss(i, workers[i].tpot_with_one_more(cfg.step_s)));
    }
    let most_free = |w: &WorkerLoad| (-(w.kv_free() as f64), 0.0);
    pick_min_by(tie_break, rotation, workers, eligible, most_free, load).map(DecodeChoice::NoRoom)
}

/// The seed documents' target ITL (50 ms), used when no TPOT SLO is set.
pub const SEED_TARGET_ITL_S: f64 = 0.05;
/// The seed's batch-size normaliser (its decode scheduler's maximum batch).
pub const SEED_MAX_BATCH: f64 = 256.0;

/// The seed documents' decode score of `w` (higher is better): 0.5 (1 - ITL / target) + 0.3
/// bandwidth + 0.2 (1 - batch / 256), with ITL = the worker's current TPOT (`decode_step_s` +
/// batch / decode speed; 0 when its speed is unknown), target = the TPOT SLO or 50 ms, bandwidth
/// = its decode speed / the fastest decode worker's (the memory-bound decode rate stands in for
/// memory bandwidth).
pub fn seed_decode_score(w: &WorkerLoad, cfg: &DecodeConfig, fastest: f64) -> f64 {
    let batch = w.batch() as f64;
    let itl = w.spec.decode_tokens_per_s.map_or(0.0, |r| cfg.step_s + batch / r);
    let target = cfg.tpot_slo.unwrap_or(SEED_TARGET_ITL_S);
    let bandwidth = match w.spec.decode_tokens_per_s {
        Some(r) if fastest > 0.0 => r / fastest,
        _ => 1.0,
    };
    0.5 * (1.0 - itl / target) + 0.3 * bandwidth + 0.2 * (1.0 - batch / SEED_MAX_BATCH)
}

fn choose_by_score(
    workers: &[WorkerLoad],
    eligible: impl Fn(&WorkerLoad) -> bool,
    need: u64,
    cfg: &DecodeConfig,
    tie_break: TieBreak,
    rotation: &mut u64,
) -> Option<DecodeChoice> {
    let load = |w: &WorkerLoad| (w.decoding as f64, 0.0);
    let fastest = workers.iter().filter(|w| eligible(w)).filter_map(|w| w.spec.decode_tokens_per_s).fold(0.0, f64::max);
    // Only workers with KV room (the seed's 20% margin is `kv_headroom`'s default).
    let roomy = |w: &WorkerLoad| eligible(w) && w.kv_fits(need, cfg.kv_headroom);
    let key = |w: &WorkerLoad| (-seed_decode_score(w, cfg, fastest), -(w.kv_free() as f64));
    if let Some(i) = pick_min_by(tie_break, rotation, workers, roomy, key, load) {
        let t = workers[i].tpot_with_one_more(cfg.step_s);
        return Some(if tpot_ok(&workers[i], cfg) { DecodeChoice::Chosen(i, t) } else { DecodeChoice::TpotMiss(i, t) });
    }
    let most_free = |w: &WorkerLoad| (-(w.kv_free() as f64), 0.0);
    pick_min_by(tie_break, rotation, workers, eligible, most_free, load).map(DecodeChoice::NoRoom)
}
