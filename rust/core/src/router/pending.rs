//! Pending prefixes: the blocks of requests this router sent to a worker that the engine's KV
//! events cannot have reported yet, so a request arriving meanwhile sees them as that worker's.
//!
//! The index learns a prefix from the engine's `stored` events, which come after the prefill that
//! computed it. Without this, requests sharing a new prefix (a system prompt) that arrive while its
//! first prefill runs see no overlap anywhere and get spread, and every engine they reach computes
//! and caches the prefix again. An entry lives until the events can have confirmed it: the
//! request's prefill is done (`prefill_done` / `finished`) plus a grace for the event lag; a
//! request that is never reported expires after a TTL, so memory stays bounded for any caller.
//!
//! An engine's removal ends a pending block at once: once the engine reports that a worker
//! dropped a block (evicted after it was stored, or a cleared cache), that worker cannot serve
//! it from cache whatever a pending entry routed before says, so the block stops counting there
//! for every entry routed before the removal (`void_block`, `void_worker`; the Router feeds them
//! the index's removal log). Without this, a block stored and then evicted within the grace was
//! still counted: the real-engine test saw the Router predict 6-11 cached blocks where vLLM had
//! evicted them all.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use hashbrown::HashMap;

use crate::index::WorkerId;

/// The workers a block hash is pending on, each with how many routed requests hold it there.
/// Up to `INLINE` workers are stored inline (no allocation on the route path); more spill to a Vec.
#[derive(Debug, Default)]
struct Holders {
    inline: [(WorkerId, u32); INLINE],
    len: u8,
    more: Vec<(WorkerId, u32)>,
}

const INLINE: usize = 4;

impl Holders {
    fn one(w: WorkerId) -> Self {
        let mut h = Holders::default();
        h.inline[0] = (w, 1);
        h.len = 1;
        h
    }

    fn slots(&self) -> impl Iterator<Item = &(WorkerId, u32)> {
        self.inline[..self.len as usize].iter().chain(self.more.iter())
    }

    fn contains(&self, w: WorkerId) -> bool {
        self.slots().any(|(x, _)| *x == w)
    }

    fn add(&mut self, w: WorkerId) {
        let n = self.len as usize;
        if let Some(s) = self.inline[..n].iter_mut().chain(self.more.iter_mut()).find(|(x, _)| *x == w) {
            s.1 += 1;
        } else if n < INLINE {
            self.inline[n] = (w, 1);
            self.len += 1;
        } else {
            self.more.push((w, 1));
        }
    }

    /// Drops every hold of `w`; returns how many there were.
    fn take(&mut self, w: WorkerId) -> u32 {
        let n = self.slots().find(|(x, _)| *x == w).map_or(0, |s| s.1);
        for _ in 0..n {
            self.release(w);
        }
        n
    }

    /// Drops one hold of `w`; true when no worker holds the block any more.
    fn release(&mut self, w: WorkerId) -> bool {
        let n = self.len as usize;
        if let Some(i) = self.inline[..n].iter().position(|(x, _)| *x == w) {
            self.inline[i].1 -= 1;
            if self.inline[i].1 == 0 {
                self.inline.swap(i, n - 1);
                self.len -= 1;
                if let Some(m) = self.more.pop() {
                    self.inline[n - 1] = m;
                    self.len += 1;
                }
            }
        } else if let Some(i) = self.more.iter().position(|(x, _)| *x == w) {
            self.more[i].1 -= 1;
            if self.more[i].1 == 0 {
                self.more.swap_remove(i);
            }
        }
        self.len == 0
    }

    fn for_each(&self, mut f: impl FnMut(WorkerId)) {
        self.slots().for_each(|(x, _)| f(*x));
    }

    fn num_workers(&self) -> usize {
        self.len as usize + self.more.len()
    }
}

#[derive(Debug)]
struct Entry {
    worker: WorkerId,
    hashes: Vec<u64>,
    expires_at: f64,
    /// `PendingPrefixes::voids` when it was added: a void counted later applies to it.
    since: u64,
}

/// Expiry times ordered for a min-heap (times are finite: the router checks its clock values).
#[derive(Clone, Copy, Debug)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// One pending prefix per routed request, found by block hash. Kept under the Router's state
/// lock, so concurrent routes see each other's choices.
#[derive(Debug, Default)]
pub struct PendingPrefixes {
    blocks: HashMap<u64, Holders>,
    entries: HashMap<u64, Entry>,
    /// (expiry, entry) pairs, lazily updated: an entry whose expiry moved has a newer pair, and
    /// the old one is skipped when it comes up. At most two pairs per entry (routed, prefilled).
    expiry: BinaryHeap<Reverse<(Time, u64)>>,
    next: u64,
    /// Hash lists of dropped entries, reused so a warm router's route() does not allocate.
    spare: Vec<Vec<u64>>,
    /// Voids so far (`void_block` calls that took holds).
    voids: u64,
    /// (block, worker) -> (holds taken by voids whose entries are still live, the last such
    /// void's number): an entry added before that void gives its hold back here, not to `blocks`.
    voided: HashMap<(u64, WorkerId), (u32, u64)>,
}

impl PendingPrefixes {
    /// Records `hashes` (a prompt's full blocks, in order) as pending on `worker` until
    /// `expires_at`; returns the entry's handle (None for a prompt without full blocks).
    pub fn add(&mut self, worker: WorkerId, hashes: &[u64], expires_at: f64) -> Option<u64> {
        if hashes.is_empty() {
            return None;
        }
        let tag = self.next;
        self.next += 1;
        for &h in hashes {
            self.blocks.entry(h).and_modify(|x| x.add(worker)).or_insert_with(|| Holders::one(worker));
        }
        let mut list = self.spare.pop().unwrap_or_default();
        list.extend_from_slice(hashes);
        self.entries.insert(tag, Entry { worker, hashes: list, expires_at, since: self.voids });
        self.expiry.push(Reverse((Time(expires_at), tag)));
        Some(tag)
    }

    /// Moves an entry's expiry (e.g. to prefill done + grace); a gone entry is left gone.
    pub fn expire_at(&mut self, tag: u64, at: f64) {
        if let Some(e) = self.entries.get_mut(&tag) {
            e.expires_at = at;
            self.expiry.push(Reverse((Time(at), tag)));
        }
    }

    /// Drops an entry now (a cancelled request computed nothing to confirm).
    pub fn remove(&mut self, tag: u64) {
        if let Some(e) = self.entries.remove(&tag) {
            self.release(e);
        }
    }

    /// Drops every entry on `worker` (it was removed from the router).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let gone: Vec<u64> = self.entries.iter().filter(|(_, e)| e.worker == worker).map(|(t, _)| *t).collect();
        for t in gone {
            self.remove(t);
        }
    }

    /// `worker` no longer holds block `h` (its engine said so): no entry added so far counts it there.
    pub fn void_block(&mut self, worker: WorkerId, h: u64) {
        let Some(x) = self.blocks.get_mut(&h) else { return };
        let n = x.take(worker);
        if n == 0 {
            return;
        }
        if x.num_workers() == 0 {
            self.blocks.remove(&h);
        }
        self.voids += 1;
        let v = self.voided.entry((h, worker)).or_insert((0, 0));
        *v = (v.0 + n, self.voids);
    }

    /// `worker` dropped its whole cache: its entries so far are dropped.
    pub fn void_worker(&mut self, worker: WorkerId) {
        self.remove_worker(worker);
    }

    /// Anything may have been removed anywhere (the removal log was lost): every entry goes.
    pub fn void_all(&mut self) {
        let tags: Vec<u64> = self.entries.keys().copied().collect();
        for t in tags {
            self.remove(t);
        }
        self.expiry.clear();
        debug_assert!(self.blocks.is_empty() && self.voided.is_empty());
    }

    fn release(&mut self, mut e: Entry) {
        for h in &e.hashes {
            if let Some(v) = self.voided.get_mut(&(*h, e.worker)) {
                if e.since < v.1 {
                    // This entry's hold was taken by a later void.
                    v.0 -= 1;
                    if v.0 == 0 {
                        self.voided.remove(&(*h, e.worker));
                    }
                    continue;
                }
            }
            if let Some(x) = self.blocks.get_mut(h) {
                if x.release(e.worker) {
                    self.blocks.remove(h);
                }
            }
        }
        // Bounded: at most as many spares as entries were ever live at once.
        e.hashes.clear();
        self.spare.push(e.hashes);
    }

    /// Drops the entries whose expiry is at or before `now`.
    pub fn expire(&mut self, now: f64) {
        while let Some(&Reverse((Time(t), tag))) = self.expiry.peek() {
            if t > now {
                break;
            }
            self.expiry.pop();
            // A pair older than the entry's current expiry is stale (a newer pair exists).
            if self.entries.get(&tag).is_some_and(|e| e.expires_at <= now) {
                let e = self.entries.remove(&tag).expect("present");
                self.release(e);
            }
        }
        if self.entries.is_empty() {
            self.expiry.clear();
        }
    }

    /// Calls `f(worker, depth)` for every worker with a pending prefix of `hashes`: depth is the
    /// number of leading blocks pending there. Cost: one lookup per block while any worker's
    /// prefix continues (one lookup when nothing is pending).
    pub fn overlaps(&self, hashes: &[u64], alive: &mut Vec<WorkerId>, mut f: impl FnMut(WorkerId, u32)) {
        alive.clear();
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(h)) else { return };
        first.for_each(|w| alive.push(w));
        let mut depth = 1u32;
        for h in &hashes[1..] {
            let Some(x) = self.blocks.get(h) else { break };
            alive.retain(|&w| {
                let keep = x.contains(w);
                if !keep {
                    f(w, depth);
                }
                keep
            });
            if alive.is_empty() {
                return;
            }
            depth += 1;
        }
        alive.iter().for_each(|&w| f(w, depth));
    }

    /// How many blocks of `hashes` from `start` on are pending on `worker`, consecutively.
    pub fn run_from(&self, hashes: &[u64], start: usize, worker: WorkerId) -> u32 {
        hashes
            .get(start..)
            .map_or(0, |tail| tail.iter().take_while(|h| self.blocks.get(*h).is_some_and(|x| x.contains(worker))).count() as u32)
    }

    /// Distinct (block, worker) pairs pending.
    pub fn num_blocks(&self) -> usize {
        self.blocks.values().map(Holders::num_workers).sum()
    }

    /// Routed requests with a pending prefix.
    pub fn num_entries(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depths(p: &PendingPrefixes, hs: &[u64]) -> Vec<(WorkerId, u32)> {
        let mut out = Vec::new();
        p.overlaps(hs, &mut Vec::new(), |w, d| out.push((w, d)));
        out.sort();
        out
    }

    #[test]
    fn depth_is_the_leading_run_per_worker() {
        let mut p = PendingPrefixes::default();
        p.add(1, &[10, 11, 12], 5.0);
        p.add(2, &[10, 11], 5.0);
        assert_eq!(depths(&p, &[10, 11, 12, 13]), vec![(1, 3), (2, 2)]);
        assert_eq!(depths(&p, &[10, 99, 12]), vec![(1, 1), (2, 1)]);
        assert_eq!(depths(&p, &[11, 12]), vec![(1, 2), (2, 1)]);
        assert!(depths(&p, &[99, 10]).is_empty());
        assert_eq!(p.num_blocks(), 5);
    }

    #[test]
    fn holds_are_counted_and_expiry_moves() {
        let mut p = PendingPrefixes::default();
        let a = p.add(1, &[10, 11], 100.0).unwrap();
        let b = p.add(1, &[10, 11, 12], 1.0).unwrap();
        p.expire(2.0); // b gone; a still holds 10, 11
        assert_eq!(depths(&p, &[10, 11, 12]), vec![(1, 2)]);
        p.expire_at(a, 3.0); // earlier than its TTL
        p.expire(2.9);
        assert_eq!(p.num_entries(), 1);
        p.expire(3.0);
        assert_eq!((p.num_entries(), p.num_blocks()), (0, 0));
        assert!(p.expiry.is_empty());
        p.expire_at(b, 50.0); // gone entries stay gone
        assert_eq!(p.num_entries(), 0);
    }

    #[test]
    fn a_later_expiry_outlives_its_first_pair() {
        let mut p = PendingPrefixes::default();
        let a = p.add(3, &[7], 1.0).unwrap();
        p.expire_at(a, 10.0);
        p.expire(5.0);
        assert_eq!(depths(&p, &[7]), vec![(3, 1)]);
        p.remove(a);
        assert_eq!((p.num_entries(), p.num_blocks()), (0, 0));
        assert!(p.add(3, &[], 1.0).is_none());
    }

    #[test]
    fn more_holders_than_fit_inline_spill_and_come_back() {
        let mut p = PendingPrefixes::default();
        let tags: Vec<u64> = (0..7).map(|w| p.add(w, &[5, 6], 9.0).unwrap()).collect();
        assert_eq!(depths(&p, &[5, 6]), (0..7).map(|w| (w, 2)).collect::<Vec<_>>());
        for &t in &tags[..3] {
            p.remove(t);
        }
        assert_eq!(depths(&p, &[5, 6]), (3..7).map(|w| (w, 2)).collect::<Vec<_>>());
        for &t in &tags[3..] {
            p.remove(t);
        }
        assert_eq!(p.num_blocks(), 0);
    }

    #[test]
    fn remove_worker_drops_only_its_entries() {
        let mut p = PendingPrefixes::default();
        p.add(1, &[10, 11], 9.0);
        p.add(2, &[10, 11], 9.0);
        p.remove_worker(1);
        assert_eq!(depths(&p, &[10, 11]), vec![(2, 2)]);
        assert_eq!(p.num_blocks(), 2);
    }

    #[test]
    fn voided_holds_are_given_back_to_the_void_not_to_later_entries() {
        // Entry a (worker 1, block 7) voided by a removal; entry b routed after it holds 7 again.
        // a's expiry must not release b's hold.
        let mut p = PendingPrefixes::default();
        let a = p.add(1, &[7, 8], 10.0).unwrap();
        p.void_block(1, 7);
        let _b = p.add(1, &[7], 20.0).unwrap();
        p.expire_at(a, 1.0);
        p.expire(1.0);
        assert_eq!(p.num_blocks(), 1, "b's hold of block 7 on worker 1");
        p.expire(20.0);
        assert_eq!(p.num_blocks(), 0);
    }
}
