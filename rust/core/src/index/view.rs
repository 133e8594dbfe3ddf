//! What a shard publishes for lock-free matches (`Shared`: chunk list, hash table, holder sets,
//! swapped by the writer and freed through the epoch) and a reader's look at it (`View`).

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Acquire, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Atomic, Guard};
use parking_lot::Mutex;

use super::holders::{self, Holders, SetDir, TierMask};
use super::node::*;
use super::slab::{ChunkDir, RUN};
use super::table::{self, Table};

/// Mixes a hash for table placement: folded 128-bit multiply, so that small sequential ids
/// (such as Mooncake's `hash_ids`) spread as well as xxh3 outputs do.
#[inline]
pub(crate) fn mix(h: u64) -> u64 {
    let r = (h as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    (r as u64) ^ ((r >> 64) as u64)
}

/// A match's recency refresh, `(clock, slack)`: the tick becomes `clock` if it is more than
/// `slack` ticks older (a tick ahead of `clock`, set by a store after the match loaded it, stays).
#[inline]
pub(crate) fn refresh(t: &AtomicU32, (clock, slack): (u32, u32)) {
    if t.load(Relaxed).saturating_add(slack) < clock {
        t.store(clock, Relaxed);
    }
}

/// What matches read without a lock, shared by a shard's writer and its readers: the published
/// chunk list, hash table and holder sets. Each is swapped only by the writer (under the shard
/// lock), and what it replaces is freed through the epoch once no pinned reader can hold it.
/// A replaced table is megabytes, and freeing it (unmapping) takes long enough to show in a match's
/// latency, so it is not freed by whichever thread runs the epoch's deferred work (a match, as
/// often as not): that work only passes it to `graveyard`, and the writer frees it in
/// `free_retired_tables`, after its store. `retired_tables` counts those not yet freed; stores push
/// the epoch along while there are any, so the memory comes back within a few stores.
pub(crate) struct Shared {
    pub chunks: Atomic<ChunkDir>,
    pub table: Atomic<Table>,
    pub sets: Atomic<SetDir>,
    pub retired_tables: Arc<AtomicUsize>,
    pub(crate) graveyard_tx: Sender<RetiredTable>,
    graveyard: Mutex<Receiver<RetiredTable>>,
}

impl Default for Shared {
    fn default() -> Self {
        let (graveyard_tx, graveyard) = channel();
        Shared {
            graveyard_tx,
            graveyard: Mutex::new(graveyard),
            chunks: Atomic::new(ChunkDir::empty()),
            table: Atomic::new(Table::with_buckets(table::buckets_for(FIRST_TABLE_ITEMS))),
            retired_tables: Default::default(),
            sets: Atomic::new(SetDir::with_capacity(0)),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the last owner is going away, so no reader or writer can reach these any more;
        // what was replaced earlier was handed to the epoch and is not reachable from here.
        unsafe {
            let g = epoch::unprotected();
            let chunks = self.chunks.load(Relaxed, g);
            chunks.deref().free_chunks();
            drop(chunks.into_owned());
            drop(self.table.load(Relaxed, g).into_owned());
            let sets = self.sets.load(Relaxed, g);
            sets.deref().free_sets();
            drop(sets.into_owned());
        }
    }
}

impl Shared {
    /// Writer side, after a store: pushes the epoch along and frees the tables this shard retired
    /// that no match can hold any more.
    pub fn free_retired_tables(&self) {
        if self.retired_tables.load(Relaxed) == 0 {
            return;
        }
        epoch::pin().flush();
        let mut freed = 0;
        if let Some(rx) = self.graveyard.try_lock() {
            for t in rx.try_iter() {
                // SAFETY: the table is owned by `t` until it is dropped right below.
                freed += unsafe { (*t.0).bytes() };
                drop(t);
                self.retired_tables.fetch_sub(1, Relaxed);
            }
        }
        if freed >= TRIM_AFTER_BYTES {
            return_freed_memory();
        }
    }

    /// The shard as a pinned reader sees it.
    #[inline]
    pub fn view<'g>(&self, guard: &'g Guard) -> View<'g> {
        // SAFETY: never null (set at construction, only ever swapped for another), and `guard`
        // keeps what was loaded alive.
        unsafe {
            View {
                chunks: self.chunks.load(Acquire, guard).deref(),
                table: self.table.load(Acquire, guard).deref(),
                sets: self.sets.load(Acquire, guard).deref(),
            }
        }
    }
}

/// Nodes a shard's first table takes before it grows (~1.5 KiB per shard): from 14, a small index's
/// stores spent more time growing and swapping tables (each growth publishes a copy and retires the
/// old one through the epoch) than storing.
const FIRST_TABLE_ITEMS: usize = 256;

/// Freeing a table at least this large hands free heap memory back to the OS.
const TRIM_AFTER_BYTES: usize = 256 << 10;

/// Hands the allocator's free memory back to the OS. A retired table is megabytes; glibc's
/// malloc serves blocks that size from its heap once it has freed one (its mmap threshold adapts
/// upwards) and keeps freed heap pages mapped, so without this a shard's outgrown tables stayed in
/// the process's RSS (~2.4 B per entry at 1M entries: 25.7 -> 23.3 B on the in-order benchmark).
/// Rare: once per table growth, which is geometric.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases free memory; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A replaced table on its way to being freed (when this is dropped).
pub(crate) struct RetiredTable(pub(crate) *mut Table);
// SAFETY: unlinked from `Shared::table`; owned by whoever holds this.
unsafe impl Send for RetiredTable {}

impl Drop for RetiredTable {
    fn drop(&mut self) {
        // SAFETY: made from the `Box` behind an `Owned` that was unlinked, and owned only here;
        // it is dropped once the epoch's grace has passed (or with the index).
        drop(unsafe { Box::from_raw(self.0) });
    }
}

/// A consistent-enough look at one shard for a walk: the chunk list, table and holder sets as
/// published when it was taken. Nodes are read with the ordering described at `Node`.
pub(crate) struct View<'g> {
    chunks: &'g ChunkDir,
    table: &'g Table,
    pub sets: &'g SetDir,
}

impl<'g> View<'g> {
    #[inline]
    pub fn node(&self, i: u32) -> Option<&'g Node> {
        self.chunks.get(i as usize)
    }

    #[inline]
    pub fn find(&self, h: u64) -> Option<u32> {
        let chunks = self.chunks;
        self.table.find(mix(h), |i| chunks.get(i as usize).is_some_and(|n| n.hash() == h))
    }

    /// Node `i`'s holders, if it is `h`'s node (holders and parent in one load, then the hash).
    #[inline]
    pub fn holders_of(&self, i: u32, h: u64) -> Option<Holders> {
        let n = self.node(i)?;
        let (hold, parent) = unpack(n.hp());
        (parent != FREE && n.hash() == h).then_some(hold)
    }

    /// Node `i` as `h`'s node under `prev`, with its holders: holders and parent in one load,
    /// then the hash (see `Node`).
    #[inline]
    pub fn is_child(&self, i: u32, h: u64, prev: u32) -> Option<Holders> {
        let n = self.node(i)?;
        let (hold, parent) = unpack(n.hp());
        (n.hash() == h && parent == prev).then_some(hold)
    }

    /// Finds `h` as a child of `prev` (whose hash is `prev_hash`), trying slab slot `guess`
    /// first: a chain stored in one call sits in consecutive slots, so walks mostly skip the
    /// table. Returns the node and its holders. A node found through the table whose parent
    /// index differs is still `h`'s child if its parent's hash is `prev_hash`: a run moved
    /// (copied, re-pointed, then freed) while the walk was on its old copy.
    #[inline]
    pub fn find_child(&self, h: u64, prev: u32, prev_hash: u64, guess: u32) -> Option<(u32, Holders)> {
        if let Some(hold) = self.is_child(guess, h, prev) {
            return Some((guess, hold));
        }
        let i = self.find(h)?;
        let n = self.node(i)?;
        let (hold, p) = unpack(n.hp());
        if n.hash() != h {
            return None;
        }
        let ok = p == prev || (prev < FREE && p < FREE && self.node(p).is_some_and(|pn| pn.hash() == prev_hash));
        ok.then_some((i, hold))
    }

    /// How many of `hashes` continue the run after node `i`: slots `i+1, i+2, ...`, each the child of
    /// the slot before it, with the very holders encoding `holders` (so a match's set of workers is
    /// unchanged along them). Refreshes their recency as `touch` says (see `refresh`). The match's
    /// inner loop: where a run word covers the next slots (see `slab.rs`), one check of the last
    /// slot needed; else a scan, slot by slot, to the end of the group; no table probe, no holder
    /// intersection.
    #[inline]
    pub fn follow_run(&self, i: u32, hashes: &[u64], holders: Holders, touch: Option<(u32, u32)>) -> usize {
        let mut n = 0;
        let mut cur = i as usize;
        while n < hashes.len() {
            // Across a run word's run (all of it, `whole`), else slot by slot: a group's first slot
            // alone (the run word then covers the slots after it), else the rest of the group.
            let (k, whole) = match self.run_skip(cur, &hashes[n..], holders) {
                Some(k) => (k, true),
                None => {
                    let tail = self.chunks.chunk_tail(cur + 1);
                    let off = (cur + 1) & (RUN - 1);
                    let m = tail.len().min(hashes.len() - n).min(if off == 0 { 1 } else { RUN - off });
                    if m == 0 {
                        break;
                    }
                    let k = run_in(&tail[..m], &hashes[n..n + m], holders, cur as u32);
                    (k, k == m)
                }
            };
            if let Some(t) = touch {
                self.chunks.tick_tail(cur + 1).iter().take(k).for_each(|tick| refresh(tick, t));
            }
            cur += k;
            n += k;
            if !whole {
                break;
            }
        }
        n
    }

    /// How many of `hashes` a run word lets the walk take after slot `cur` at once: the run the next
    /// slot is inside (see `ChunkDir::run_end`), up to its end or the last hash, if that last slot is
    /// the request's block (hash, parent, holders). `None`: no such run, or the request leaves it.
    #[inline]
    fn run_skip(&self, cur: usize, hashes: &[u64], holders: Holders) -> Option<usize> {
        let e = self.chunks.run_end(cur + 1, holders)?.min(cur + hashes.len());
        let k = e - cur;
        if k < hashes.len() {
            // Where the run ends the walk goes on through the table, most often: start loading
            // that lookup while the run's last slot is read.
            self.table.prefetch(mix(hashes[k]));
        }
        let last = self.chunks.get(e)?;
        (last.hp() == pack(holders, (e - 1) as u32) && last.hash() == hashes[k - 1]).then_some(k)
    }

    /// Refreshes node `i`'s recency as `touch` says (see `refresh`: a store only when it is stale,
    /// so that matches and stores on two cores do not keep moving its cache line between them).
    #[inline]
    pub fn touch(&self, i: u32, touch: (u32, u32)) {
        if let Some(t) = self.chunks.tick(i as usize) {
            refresh(t, touch);
        }
    }

    /// Word `w` of the bitset of workers holding the block on any tier in `mask`.
    #[inline]
    pub fn word(&self, h: Holders, mask: TierMask, w: usize) -> u64 {
        holders::word_with(h, mask, w, |i| self.sets.words(i))
    }
}

/// How many leading `nodes` continue a run whose last node is slot `prev`: node `k` has hash
/// `hashes[k]`, parent `prev + 1 + k - 1` and holders `holders` (one `hp` load, then the hash, per
/// node; see `Node`). Four nodes are compared per branch: a run of consecutive slots is the match's
/// inner loop, and a branch per node held it to ~0.6 ns per block.
#[inline]
fn run_in(nodes: &[Node], hashes: &[u64], holders: Holders, prev: u32) -> usize {
    debug_assert_eq!(nodes.len(), hashes.len());
    let first = pack(holders, prev);
    let expect = |k: usize| first + ((k as u64) << 32);
    let ok = |k: usize| nodes[k].hp() == expect(k) && nodes[k].hash() == hashes[k];
    let mut k = 0;
    while k + 4 <= nodes.len() {
        let mut diff = 0;
        for j in k..k + 4 {
            diff |= (nodes[j].hp() ^ expect(j)) | (nodes[j].hash() ^ hashes[j]);
        }
        if diff != 0 {
            break;
        }
        k += 4;
    }
    while k < nodes.len() && ok(k) {
        k += 1;
    }
    k
}
