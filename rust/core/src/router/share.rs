//! Bounded token share (`RouterConfig::token_share_bound`): no worker takes more than `bound` times
//! the mean of the prompt tokens routed over the load window (plus one request) once it leads the mean
//! by `SLACK_REQUESTS` requests, whatever its cache holds.
//!
//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018) applied to a
//! cache-affine policy: the policy chooses among the workers that stay within the bound, and only
//! when none does among all of them. A cache-affine policy keeps a prefix family where it is cached;
//! when one family's traffic grows, its worker's queue is the only thing that moves it, and where
//! prefill is cheap beside decode (short prompts, fast engines) the queue never grows enough, so the
//! worker ends up holding most of the pool's running KV and decode batch. Counted in prompt tokens
//! (the KV a request holds while it decodes), not uncached ones (the compute): the first is what
//! piles up. A bound per load window also bounds the whole run: each worker's total is a sum of
//! windows, each at most `bound` times their mean.
//!
//! Each router counts only what it routes, so several routers that each keep the bound keep it
//! together (a sum of bounded shares is bounded), without seeing one another.

use super::decision::Candidate;
use super::load::WorkerLoad;
use hashbrown::HashMap;

use crate::index::WorkerId;

/// Decays every worker's routed-token count to `now` (time constant `tau`) and returns the mean
/// over the prefill workers once `num_tokens` more are routed.
pub(super) fn decay_to(workers: &mut [WorkerLoad], at: &mut Option<f64>, now: f64, tau: f64, num_tokens: u64) -> f64 {
    let decay = super::decay_since(at, now, tau);
    let (mut total, mut n) = (num_tokens as f64, 0usize);
    for w in workers.iter_mut() {
        w.routed_tokens *= decay;
        if w.spec.role.prefills() {
            total += w.routed_tokens;
            n += 1;
        }
    }
    if n == 0 {
        0.0
    } else {
        total / n as f64
    }
}

/// How far ahead of the mean, in requests of this one's size, a worker must also be before the bound
/// counts it full: a share bound over a short history is noise (one conversation's turns would be
/// split as soon as it had three), so, as SGLang's router balances only past an absolute gap (64
/// requests) as well as a ratio, the bound binds only where the excess is real load.
pub(super) const SLACK_REQUESTS: f64 = 8.0;

/// Moves the candidates that are not full in worker order before the full ones (also in worker
/// order), without allocating; returns how many are not full. A worker is full once its routed
/// tokens reach `bound * mean` (the mean with this request counted) and lead the mean by
/// `SLACK_REQUESTS` requests of this size, as a bin with bounded load is full at its capacity: one
/// request takes a worker past the bound by at most its own tokens. When none or all are full,
/// nothing moves and the answer is every candidate: the bound only chooses between workers, it
/// never turns a request away.
pub(super) fn partition(
    cands: &mut [Candidate],
    workers: &[WorkerLoad],
    pos: &HashMap<WorkerId, usize>,
    bound: f64,
    mean: f64,
    num_tokens: u64,
) -> usize {
    let slack = SLACK_REQUESTS * num_tokens as f64;
    let within = |c: &Candidate| {
        let routed = workers[pos[&c.worker]].routed_tokens;
        routed < bound * mean || routed - mean < slack
    };
    let mut k = 0;
    for i in 0..cands.len() {
        if within(&cands[i]) {
            cands[k..=i].rotate_right(1);
            k += 1;
        }
    }
    if k == 0 {
        cands.len()
    } else {
        k
    }
}
