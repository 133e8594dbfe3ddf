//! Prefix lookup: for each worker, how many leading blocks of a request it holds, read without the
//! shard lock (see `view.rs`), one shard per walk.

use std::sync::atomic::Ordering::Relaxed;

use super::*;

impl KvIndex {
    /// For each worker holding `hashes[0]`, the number of leading blocks of `hashes` it holds
    /// (on any tier in `mask`), contiguous from block 0. `hashes` are a request's chained sequence
    /// hashes (each stands for the whole prefix up to it, as `hash::` and engines make them): a
    /// list whose later hashes do not follow from its earlier ones may match past where it leaves
    /// a stored chain.
    pub fn find_matches(&self, hashes: &[u64], mask: TierMask) -> Matches {
        thread_local! {
            // The walk's buffers, kept per thread: a match allocates only its answer.
            static SCRATCH: std::cell::RefCell<MatchScratch> = Default::default();
        }
        let mut out = Matches::default();
        SCRATCH.with(|sc| match sc.try_borrow_mut() {
            Ok(mut sc) => self.match_into(hashes, mask, &mut sc, &mut out),
            Err(_) => self.match_into(hashes, mask, &mut MatchScratch::default(), &mut out),
        });
        out
    }

    /// `find_matches` into caller-owned buffers.
    pub fn match_into(&self, hashes: &[u64], mask: TierMask, scratch: &mut MatchScratch, out: &mut Matches) {
        out.workers.clear();
        out.depths.clear();
        let Some(&h0) = hashes.first() else { return };
        // No lock: the walk reads the shard as published (see `shard::View`), pinned so that
        // nothing it reads is freed or reused under it. A writer in this shard, running or
        // descheduled, never holds it up.
        let guard = crossbeam_epoch::pin();
        let g = self.shards[root_shard(h0)].shared.view(&guard);
        // Recency is read only by eviction (`max_nodes`). Without it a match writes nothing; with
        // it, only to nodes whose recency is more than `touch_slack` store calls stale: a match
        // that wrote every node it walks whenever a store had moved the clock dirtied ~1 line per
        // 2-3 blocks under a concurrent writer (its 128-block p99 reached 2.5x idle).
        let touch = self.max_nodes.map(|_| (self.clock.load(Relaxed), self.touch_slack));
        let MatchScratch { alive, slots } = scratch;
        slots.clear();
        let mut prev = ROOT;
        let mut prev_hash = 0u64;
        let mut guess = u32::MAX;
        let mut depth = 0u32;
        let mut nw = 0usize;
        // Consecutive blocks usually have the very same holders (one encoding, or one spilled set):
        // then the set of workers still matching cannot change and the intersection is skipped.
        let mut last_holders = None;
        let mut d = 0usize;
        while d < hashes.len() {
            let h = hashes[d];
            let Some((i, hold)) = g.find_child(h, prev, prev_hash, guess) else { break };
            if last_holders != Some(hold) {
                if d == 0 {
                    // Words of the bitset: as many as the highest slot needs (a worker registered
                    // after this match began can only be in blocks it stored since, and is named
                    // by the `slot_ids` loaded below or not at all).
                    nw = self.slot_ids_in(&guard).len().div_ceil(64).max(1);
                    alive.clear();
                    alive.resize(nw, 0);
                }
                last_holders = Some(hold);
                let mut any = 0u64;
                for (w, a) in alive.iter_mut().enumerate() {
                    let held = g.word(hold, mask, w);
                    let next = if d == 0 { held } else { *a & held };
                    let mut dropped = *a & !next;
                    while dropped != 0 {
                        slots.push((w as u32 * 64 + dropped.trailing_zeros(), d as u32));
                        dropped &= dropped - 1;
                    }
                    *a = next;
                    any |= next;
                }
                if any == 0 {
                    break;
                }
            }
            if let Some(t) = touch {
                g.touch(i, t);
            }
            // Then along the run after it, as long as the holders stay the same.
            let run = g.follow_run(i, &hashes[d + 1..], hold, touch);
            prev = i + run as u32;
            prev_hash = hashes[d + run];
            guess = prev.wrapping_add(1);
            d += 1 + run;
            depth = d as u32;
        }
        if nw > 0 {
            for (w, &a) in alive.iter().enumerate() {
                let mut bits = a;
                while bits != 0 {
                    slots.push((w as u32 * 64 + bits.trailing_zeros(), depth));
                    bits &= bits - 1;
                }
            }
        }
        // Loaded after the walk, still pinned: a slot read above names its worker, or no one
        // if the worker was removed meanwhile (slots are reused only after the epoch's grace).
        let ids = self.slot_ids_in(&guard);
        // Sized once: grown a push at a time, a 64-worker answer reallocated each vector ~7 times
        // (a sixth of a reader's time beside a writer went to malloc/realloc).
        let found = slots.iter().filter(|&&(_, d)| d > 0).count();
        out.workers.reserve(found);
        out.depths.reserve(found);
        for &(slot, d) in slots.iter() {
            if d == 0 {
                continue;
            }
            if let Some(Some(id)) = ids.get(slot as usize) {
                out.workers.push(*id);
                out.depths.push(d);
            }
        }
    }
}
