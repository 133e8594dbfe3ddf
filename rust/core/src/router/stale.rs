//! Stale overlaps: a queued request routed to blocks its worker has already evicted.
//!
//! A request is routed on the overlap the index (plus pending prefixes) shows for each worker. The
//! index learns an eviction from the engine's `removed` event, which comes after the eviction: a
//! request routed inside that lag can count blocks its worker no longer holds, and it then
//! prefills them again. Until its prefill is done the Router's queue for that worker is short by
//! that recompute, and every request admitted there meanwhile is predicted too early (on the
//! simulator's long-context trace at 50 ms lag, two stale overlaps of 37-39 blocks made 56 admitted
//! requests, they and the ones queued behind them, miss a 5 s SLO).
//!
//! So the Router remembers, for each tracked request whose prefill is pending, a few of the blocks
//! it counted as cached (checkpoints), and when a removal of one of them arrives for its worker, the
//! request's overlap shrinks to that block's position: its extra prefill joins its own predicted
//! work and moves the requests queued behind it (FIFO). Only while the prefill is pending (a running
//! prefill holds its blocks) and only for removals read within `pending_grace_s` of the routing (the
//! event lag allowed): a removal read later may be an eviction that came after the request was
//! placed, which vLLM would charge it for only if it was still waiting, and the simulator (whose
//! engine fixes a request's hit when it is enqueued) never does.
//!
//! Checkpoints sit at positions `o - 1, o - 2, o - 4, ...` and `0` of an overlap of `o` blocks
//! (at most `MAX_CHECKPOINTS`): dense at the deep end, which vLLM evicts first (a request's blocks
//! go back to its free queue tail first), and a removal of block `p` says only that the overlap is at
//! most `p`, so the estimate errs on the side of too much overlap (the one the checkpoints below
//! `p` would have caught). A block hash is held for at most `INLINE` requests (a hot shared prefix
//! queued on many requests at once is rarely evicted); further holders are not recorded.

use hashbrown::HashMap;

use crate::index::WorkerId;

/// Checkpoints per request: positions o-1, o-2, o-4, ..., o-2^14, and 0.
pub const MAX_CHECKPOINTS: usize = 16;
const INLINE: usize = 4;

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    request: u64,
    worker: WorkerId,
    pos: u32,
}

#[derive(Debug, Default)]
struct Holders {
    slots: [Slot; INLINE],
    len: u8,
}

/// The checkpoint hashes one request holds (kept in its `InFlight`, so they can be dropped).
#[derive(Clone, Copy, Debug, Default)]
pub struct Held {
    hashes: [u64; MAX_CHECKPOINTS],
    len: u8,
}

impl Held {
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Block hash -> the pending requests that counted it as cached on a worker, at which position.
#[derive(Debug, Default)]
pub struct Checkpoints {
    map: HashMap<u64, Holders>,
}

/// The positions checked for an overlap of `overlap` blocks, deepest first, into `out`; returns
/// how many.
pub fn positions(overlap: u32, out: &mut [u32; MAX_CHECKPOINTS]) -> usize {
    if overlap == 0 {
        return 0;
    }
    let (mut n, mut step) = (0, 1u32);
    while n < MAX_CHECKPOINTS - 1 {
        match overlap.checked_sub(step) {
            Some(p) if p > 0 => out[n] = p,
            _ => break,
        }
        n += 1;
        step = step.saturating_mul(2);
    }
    out[n] = 0;
    n + 1
}

impl Checkpoints {
    /// Records `request`'s checkpoints: `hashes[..overlap]` are the blocks it counted as cached on
    /// `worker`. Returns what it holds, for `remove`.
    pub fn add(&mut self, request: u64, worker: WorkerId, hashes: &[u64], overlap: u32) -> Held {
        let mut held = Held::default();
        let mut at = [0u32; MAX_CHECKPOINTS];
        let n = positions(overlap.min(hashes.len() as u32), &mut at);
        for &pos in &at[..n] {
            let h = hashes[pos as usize];
            let holders = self.map.entry(h).or_default();
            if (holders.len as usize) < INLINE {
                holders.slots[holders.len as usize] = Slot { request, worker, pos };
                holders.len += 1;
                held.hashes[held.len as usize] = h;
                held.len += 1;
            }
        }
        held
    }

    /// Drops `request`'s checkpoints.
    pub fn remove(&mut self, request: u64, held: &Held) {
        for h in &held.hashes[..held.len as usize] {
            if let Some(holders) = self.map.get_mut(h) {
                let n = holders.len as usize;
                if let Some(i) = holders.slots[..n].iter().position(|s| s.request == request) {
                    holders.slots[i] = holders.slots[n - 1];
                    holders.len -= 1;
                }
                if holders.len == 0 {
                    self.map.remove(h);
                }
            }
        }
    }

    /// `worker` dropped block `hash`: `(request, position)` for every request that counted it there.
    pub fn removed(&self, worker: WorkerId, hash: u64, mut f: impl FnMut(u64, u32)) {
        if let Some(holders) = self.map.get(&hash) {
            for s in &holders.slots[..holders.len as usize] {
                if s.worker == worker {
                    f(s.request, s.pos);
                }
            }
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_dense_at_the_deep_end_and_end_at_zero() {
        let of = |o: u32| {
            let mut out = [0u32; MAX_CHECKPOINTS];
            let n = positions(o, &mut out);
            out[..n].to_vec()
        };
        assert_eq!(of(0), Vec::<u32>::new());
        assert_eq!(of(1), vec![0]);
        assert_eq!(of(2), vec![1, 0]);
        assert_eq!(of(45), vec![44, 43, 41, 37, 29, 13, 0]);
        assert_eq!(of(64), vec![63, 62, 60, 56, 48, 32, 0]);
        let big = of(1 << 20);
        assert_eq!(big.len(), MAX_CHECKPOINTS);
        assert_eq!(big[MAX_CHECKPOINTS - 2], (1 << 20) - (1 << 14));
        assert_eq!(*big.last().unwrap(), 0);
        assert_eq!(of(u32::MAX).len(), MAX_CHECKPOINTS);
    }

    #[test]
    fn a_removal_reports_the_requests_that_counted_the_block_on_that_worker() {
        let hashes: Vec<u64> = (100..145).collect();
        let mut c = Checkpoints::default();
        let a = c.add(1, 7, &hashes, 45);
        let b = c.add(2, 8, &hashes, 45);
        let mut seen = vec![];
        c.removed(7, 100 + 29, |r, p| seen.push((r, p)));
        assert_eq!(seen, vec![(1, 29)]);
        seen.clear();
        c.removed(7, 100 + 30, |r, p| seen.push((r, p))); // not a checkpoint
        assert!(seen.is_empty());
        c.remove(1, &a);
        c.removed(7, 100 + 29, |r, p| seen.push((r, p)));
        assert!(seen.is_empty());
        c.remove(2, &b);
        assert!(c.is_empty());
    }

    #[test]
    fn a_hash_holds_at_most_inline_requests() {
        let hashes = [5u64];
        let mut c = Checkpoints::default();
        let held: Vec<Held> = (0..6).map(|r| c.add(r, 0, &hashes, 1)).collect();
        assert_eq!(held.iter().filter(|h| !h.is_empty()).count(), INLINE);
        let mut n = 0;
        c.removed(0, 5, |_, _| n += 1);
        assert_eq!(n, INLINE);
        for (r, h) in held.iter().enumerate() {
            c.remove(r as u64, h);
        }
        assert!(c.is_empty());
    }
}
