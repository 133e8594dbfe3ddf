//! The KV prefix index: which workers hold which blocks, keyed by chained sequence hashes.
//! Concurrent: prefix matches take no lock at all and never wait for a writer, even one that is
//! descheduled mid-store; writers lock one shard at a time.
//!
//! Layout. The tree is a forest: every chain starts at a block-0 hash (a root), and the whole
//! chain lives in the shard its root hashes to. A match therefore walks one shard's flat hash
//! table (sequence hashes identify their whole prefix, so a flat table plus a parent check is a
//! radix tree without the pointer chasing). A chain stored over time still sits mostly in
//! consecutive slots (runs grow in place, or move to where they can), and per-group run words
//! (`slab.rs`) let a match cross a run of slots with the same holders by checking only its last
//! slot, since a sequence hash found at the end of a chain of parent links stands for the whole
//! prefix before it.
//!
//! Lock-free reads. Everything a match reads is atomics in memory that stays valid while it is
//! pinned (`crossbeam-epoch`): nodes in chunks that never move, the table (`table.rs`, replaced
//! whole when it grows), the slot -> worker-id table, and holder sets and worker slots whose
//! indices are reused only after the epoch's grace. Writers order their stores so that a
//! reader's checks (a node's holders and parent, one load, then its hash) can only accept what
//! some state of the block held; a walk that races a writer may stop short (a block being
//! removed or moved), never report more.
//!
//! Eviction. With `max_nodes`, a write that leaves more than `max_nodes` nodes evicts down to
//! 90% of it: least recently stored-or-matched leaves first (a node is a leaf when no stored
//! block extends it), for all workers at once. A match's recency is exact below 65,536 nodes
//! and to within `max_nodes / 65536` store calls above (a match writes a node's recency only once
//! it is that stale, so concurrent matches and stores do not fight over the nodes' cache lines);
//! an index without `max_nodes` never evicts, so its matches write nothing. Evicting only leaves
//! keeps every chain intact, and forgetting a block only ever shortens a match, never lengthens it.

pub(crate) mod aliases;
mod dump;
mod free;
mod holders;
mod lookup;
mod node;
mod removals;
mod shard;
mod slab;
mod store;
mod table;
mod view;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockUpgradableReadGuard, RwLockWriteGuard};

pub use holders::{Tier, TierMask, ANY_TIER, MAX_WORKERS};
pub use removals::{Removal, Since};
use shard::{mix, Shard, Shared, FREE, ROOT};

/// Number of shards; a power of two.
pub const NUM_SHARDS: usize = 16;

/// A worker id as engines and routers name it.
pub type WorkerId = u64;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    #[error("corrupt index dump: {0}")]
    Corrupt(String),
    #[error("index shard is full ({0} nodes); set max_nodes to bound the index")]
    Full(usize),
    #[error("too many workers: at most {0} distinct workers can be registered at once")]
    TooManyWorkers(u32),
}

/// Counters describing the index; see `KvIndex::stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub nodes: u64,
    pub entries: u64,
    pub workers: u64,
    pub estimated_bytes: u64,
    pub orphan_stores: u64,
    pub duplicate_stores: u64,
    pub parent_mismatches: u64,
    pub unknown_removals: u64,
    pub evictions: u64,
}

#[derive(Default)]
struct Counters {
    orphan_stores: AtomicU64,
    duplicate_stores: AtomicU64,
    parent_mismatches: AtomicU64,
    unknown_removals: AtomicU64,
    evictions: AtomicU64,
}

#[derive(Default)]
struct Registry {
    slot_of: HashMap<WorkerId, u32>,
    ids: Vec<Option<WorkerId>>,
    free: Vec<u32>,
}

/// A zero-sized field that starts the fields after it on a new pair of cache lines (128 bytes:
/// x86 prefetches lines in adjacent pairs) in a `repr(C)` struct, so what every match reads never
/// shares a line with what every store writes (false sharing costs a match a cache miss per store).
#[repr(align(128))]
#[derive(Clone, Copy, Default)]
struct CacheLine;

/// A shard: what matches read without a lock, then (on lines of its own: the lock word and the
/// writer's state change on every store) its writer state behind the lock.
#[repr(C, align(128))]
struct PaddedShard {
    shared: Arc<Shared>,
    _line: CacheLine,
    lock: RwLock<Shard>,
}

impl PaddedShard {
    fn new(recency: bool) -> Self {
        let shard = Shard::new(recency);
        PaddedShard { shared: shard.shared.clone(), _line: CacheLine, lock: RwLock::new(shard) }
    }
}

/// Per-worker depth of a prefix match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Matches {
    pub workers: Vec<WorkerId>,
    pub depths: Vec<u32>,
}

impl Matches {
    pub fn get(&self, worker: WorkerId) -> Option<u32> {
        self.workers.iter().position(|&w| w == worker).map(|i| self.depths[i])
    }
    pub fn len(&self) -> usize {
        self.workers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

/// Reusable buffers for `KvIndex::match_into`, so the routing hot path allocates nothing.
#[derive(Default)]
pub struct MatchScratch {
    alive: Vec<u64>,
    slots: Vec<(u32, u32)>,
}

#[repr(C)]
pub struct KvIndex {
    // Read by every match: kept off the lines stores write (`clock`, `nodes`, counters, locks).
    shards: Box<[PaddedShard]>,
    /// Slot -> worker id, read without locks by matches.
    slot_ids: crossbeam_epoch::Atomic<Vec<Option<WorkerId>>>,
    max_nodes: Option<usize>,
    /// How stale (in clock ticks) a node's recency may be before a match refreshes it: 0 (always)
    /// below 65,536 nodes, `max_nodes / 65536` above; matches never write recency without
    /// `max_nodes`, which is the only thing that reads it (see `match_into`).
    touch_slack: u32,
    _line: CacheLine,
    registry: RwLock<Registry>,
    /// Worker slots freed by `remove_worker` whose epoch grace has passed, for reuse: a match
    /// pinned while a slot was cleared must not name the slot's next worker. (A channel: the
    /// thread that runs the epoch's deferred work, maybe a match, never waits on a lock.)
    released_tx: std::sync::mpsc::Sender<u32>,
    released_rx: Mutex<std::sync::mpsc::Receiver<u32>>,
    /// Recency clock: +1 per store call; ticks are halved before it can wrap.
    clock: AtomicU32,
    nodes: AtomicUsize,
    evicting: Mutex<()>,
    /// Parent hash -> orphan roots waiting for it, as (shard, node).
    awaiting: Mutex<HashMap<u64, Vec<(u32, u32)>>>,
    awaiting_len: AtomicUsize,
    /// `awaiting_len` right after the last sweep of stale entries.
    awaiting_swept: AtomicUsize,
    /// Direct-mapped hint: chain tail hash -> shard, so continuation stores skip probing.
    hint: Box<[AtomicU64]>,
    counters: Counters,
    /// Other parties' ids for the blocks (the engines' block hashes), per worker (`aliases.rs`).
    pub(crate) aliases: aliases::BlockAliases,
    /// Removals in order, for readers that subscribed (the Router's pending prefixes).
    removals: removals::RemovalLog,
}

const HINT_SLOTS: usize = 1 << 14;
/// A store releases its shard every this many blocks, so other writers and the lock-taking reads
/// (a store's parent lookup, stats) are not held up long behind it. (Matches take no lock.)
const YIELD_EVERY: usize = 16;
/// How long a writer spins for the lock's other holders to leave before it parks (~10-20 us).
const WRITER_SPINS: u32 = 4096;

/// Upgrades to write access, spinning while the lock's readers (parent lookups, stats; never
/// matches) finish: they are short, and a parked writer makes parking_lot hold new ones back
/// until it has been woken and is done.
fn upgrade_spinning(mut ug: RwLockUpgradableReadGuard<'_, Shard>) -> RwLockWriteGuard<'_, Shard> {
    for _ in 0..WRITER_SPINS {
        match RwLockUpgradableReadGuard::try_upgrade(ug) {
            Ok(g) => return g,
            Err(back) => {
                ug = back;
                std::hint::spin_loop();
            }
        }
    }
    RwLockUpgradableReadGuard::upgrade(ug)
}

/// Tries `attempt` up to `spins` times, then falls back to the blocking `block`.
fn spin_then<G>(spins: u32, mut attempt: impl FnMut() -> Option<G>, block: impl FnOnce() -> G) -> G {
    for _ in 0..spins {
        if let Some(g) = attempt() {
            return g;
        }
        std::hint::spin_loop();
    }
    block()
}

/// Write access to a shard, spinning first (see `upgrade_spinning`).
fn write_spinning(lock: &RwLock<Shard>) -> RwLockWriteGuard<'_, Shard> {
    spin_then(WRITER_SPINS, || lock.try_write(), || lock.write())
}
const CLOCK_LIMIT: u32 = 1 << 31;

#[inline]
fn root_shard(h: u64) -> usize {
    (mix(h ^ 0x5851_F42D_4C95_7F2D) >> 60) as usize & (NUM_SHARDS - 1)
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(None)
    }
}

impl KvIndex {
    /// An empty index; `max_nodes` caps the number of distinct blocks (see the module docs).
    pub fn new(max_nodes: Option<usize>) -> Self {
        let released = std::sync::mpsc::channel();
        KvIndex {
            shards: (0..NUM_SHARDS).map(|_| PaddedShard::new(max_nodes.is_some())).collect(),
            slot_ids: crossbeam_epoch::Atomic::new(Vec::new()),
            max_nodes,
            touch_slack: max_nodes.map_or(0, |n| (n >> 16).min(u32::MAX as usize) as u32),
            _line: CacheLine,
            registry: RwLock::new(Registry::default()),
            released_tx: released.0,
            released_rx: Mutex::new(released.1),
            clock: AtomicU32::new(1),
            nodes: AtomicUsize::new(0),
            evicting: Mutex::new(()),
            awaiting: Mutex::new(HashMap::new()),
            awaiting_len: AtomicUsize::new(0),
            awaiting_swept: AtomicUsize::new(0),
            hint: (0..HINT_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            counters: Counters::default(),
            aliases: Default::default(),
            removals: Default::default(),
        }
    }

    pub fn max_nodes(&self) -> Option<usize> {
        self.max_nodes
    }

    fn shard(&self, s: usize) -> &RwLock<Shard> {
        &self.shards[s].lock
    }

    // ---- worker registry -------------------------------------------------------------

    /// Resolves (registering if new) a worker's slot; the returned guard keeps the slot valid.
    fn slot_for(&self, worker: WorkerId) -> Result<(RwLockReadGuard<'_, Registry>, u32), IndexError> {
        {
            let r = self.registry.read();
            if let Some(&s) = r.slot_of.get(&worker) {
                return Ok((r, s));
            }
        }
        let mut w = self.registry.write();
        let slot = match w.slot_of.get(&worker) {
            Some(&s) => s,
            None => {
                if w.free.is_empty() {
                    // (Under the registry's write lock: nobody else receives.)
                    w.free.extend(self.released_rx.lock().try_iter());
                }
                let s = match w.free.pop() {
                    Some(s) => s,
                    None if w.ids.len() >= MAX_WORKERS as usize => return Err(IndexError::TooManyWorkers(MAX_WORKERS)),
                    None => {
                        w.ids.push(None);
                        (w.ids.len() - 1) as u32
                    }
                };
                w.ids[s as usize] = Some(worker);
                w.slot_of.insert(worker, s);
                self.publish_slot_ids(w.ids.clone());
                s
            }
        };
        Ok((parking_lot::RwLockWriteGuard::downgrade(w), slot))
    }

    fn existing_slot(&self, worker: WorkerId) -> Option<(RwLockReadGuard<'_, Registry>, u32)> {
        let r = self.registry.read();
        let s = *r.slot_of.get(&worker)?;
        Some((r, s))
    }

    /// Publishes a new slot -> worker-id table (under the registry's write lock); the old one is
    /// freed once no pinned match can hold it.
    fn publish_slot_ids(&self, ids: Vec<Option<WorkerId>>) {
        let guard = crossbeam_epoch::pin();
        let old = self.slot_ids.swap(crossbeam_epoch::Owned::new(ids), std::sync::atomic::Ordering::AcqRel, &guard);
        // SAFETY: unlinked just now; pinned readers that loaded it keep it alive until they unpin.
        unsafe { guard.defer_destroy(old) };
    }

    /// The slot -> worker-id table as published, valid while `guard` is pinned.
    fn slot_ids_in<'g>(&self, guard: &'g crossbeam_epoch::Guard) -> &'g [Option<WorkerId>] {
        // SAFETY: never null; replaced tables are freed through the epoch after `guard` unpins.
        unsafe { self.slot_ids.load(std::sync::atomic::Ordering::Acquire, guard).deref() }
    }

    /// Registered workers, in registration-slot order.
    pub fn workers(&self) -> Vec<WorkerId> {
        let guard = crossbeam_epoch::pin();
        self.slot_ids_in(&guard).iter().flatten().copied().collect()
    }

    // ---- writes ----------------------------------------------------------------------

    fn hint_slot(h: u64) -> usize {
        (mix(h) as usize) & (HINT_SLOTS - 1)
    }

    fn remember_shard(&self, h: u64, s: usize) {
        self.hint[Self::hint_slot(h)].store((h & !0xF) | s as u64, Relaxed);
    }

    fn hinted_shard(&self, h: u64) -> Option<usize> {
        let e = self.hint[Self::hint_slot(h)].load(Relaxed);
        (e & !0xF == h & !0xF && e != 0).then_some((e & 0xF) as usize)
    }

    /// Write access to shard `s` with table room for `n` more nodes. When the table must grow,
    /// the bigger copy is built under an upgradable (shared) lock, so other lock holders (stores'
    /// parent lookups, stats) are not stalled behind a rehash of the whole shard; matches never
    /// wait for it in any case (they read the published table). New slab chunks are written there
    /// too, so their page faults are not taken with the shard held.
    fn write_with_room(&self, s: usize, n: usize) -> RwLockWriteGuard<'_, Shard> {
        let ug = self.shard(s).upgradable_read();
        if ug.table_room() >= n && ug.slab_room() >= n {
            return upgrade_spinning(ug);
        }
        let grown = (ug.table_room() < n).then(|| ug.grown_table(n));
        let chunks = (ug.slab_room() < n && ug.nodes.spare() == 0).then(|| slab::Slab::fresh_chunks(n, ug.nodes.keeps_recency()));
        let mut g = upgrade_spinning(ug);
        if let Some(t) = grown {
            g.set_table(t);
        }
        if let Some(c) = chunks {
            g.nodes.add_chunks(c);
        }
        g
    }

    /// Finds the shard holding node `h`, preferring one where `slot` holds it. Reads the shards as
    /// matches do, without their locks (a block that is not a chain's root lives in its root's
    /// shard, which only a hint names, so a removal may look in all 16; taking each shard's lock
    /// for that made a small replay's removals cost more than its stores). The caller locks the
    /// shard it gets and finds `h` there again.
    fn locate(&self, h: u64, slot: Option<u32>, first: Option<usize>) -> Option<usize> {
        let guard = crossbeam_epoch::pin();
        let mut fallback = None;
        let order = first.into_iter().chain(self.hinted_shard(h)).chain(std::iter::once(root_shard(h))).chain(0..NUM_SHARDS);
        let mut seen = 0u32;
        for s in order {
            if seen & (1 << s) != 0 {
                continue;
            }
            seen |= 1 << s;
            let v = self.shards[s].shared.view(&guard);
            let Some(hold) = v.find(h).and_then(|i| v.holders_of(i, h)) else { continue };
            match slot {
                Some(sl) if v.word(hold, holders::ANY_TIER, (sl / 64) as usize) & (1 << (sl % 64)) == 0 => {
                    fallback.get_or_insert(s);
                }
                _ => return Some(s),
            }
        }
        fallback
    }

    /// Records that `worker` no longer holds `hashes` on `tiers` (`ANY_TIER`: anywhere).
    /// Returns the number of (block, worker) entries removed; unknown blocks are counted.
    pub fn remove(&self, worker: WorkerId, hashes: &[u64], tiers: TierMask) -> usize {
        // Logged before it is applied: a reader that matched before the removal and reads the
        // log after it sees the record, whichever order their locks come in.
        if self.removals.on() {
            self.removals.record(hashes.iter().map(|&h| Removal::Block(worker, h)));
        }
        let Some((_reg, slot)) = self.existing_slot(worker) else {
            self.counters.unknown_removals.fetch_add(hashes.len() as u64, Relaxed);
            return 0;
        };
        let mut removed = 0;
        let mut deleted = 0;
        let mut last: Option<usize> = None;
        for &h in hashes {
            // Fast path: the previous block's shard.
            let mut done = false;
            if let Some(s) = last {
                let mut g = write_spinning(self.shard(s));
                if let Some(i) = g.find(h) {
                    if g.arena.tiers(g.node(i).holders(), slot) != 0 {
                        let (gone, d) = g.remove_holder(i, slot, tiers);
                        removed += gone as usize;
                        deleted += d;
                        done = true;
                    }
                }
            }
            if done {
                continue;
            }
            let found = self.locate(h, Some(slot), None).and_then(|s| {
                let mut g = write_spinning(self.shard(s));
                let i = g.find(h)?;
                if g.arena.tiers(g.node(i).holders(), slot) == 0 {
                    return None;
                }
                let (gone, d) = g.remove_holder(i, slot, tiers);
                removed += gone as usize;
                deleted += d;
                Some(s)
            });
            match found {
                Some(s) => last = Some(s),
                None => {
                    self.counters.unknown_removals.fetch_add(1, Relaxed);
                }
            }
        }
        self.nodes.fetch_sub(deleted, Relaxed);
        removed
    }

    /// The worker dropped its whole cache. Returns the entries removed (0 for an unknown worker).
    pub fn clear(&self, worker: WorkerId) -> usize {
        let aliases = self.aliases.existing(worker);
        let mut held = aliases.as_ref().map(|a| a.lock());
        if let Some(a) = held.as_mut() {
            a.clear();
        }
        self.clear_blocks(worker)
    }

    /// `clear` without dropping the worker's engine map (the event path resets that itself).
    pub(crate) fn clear_blocks(&self, worker: WorkerId) -> usize {
        if self.removals.on() {
            self.removals.record(std::iter::once(Removal::Worker(worker)));
        }
        let Some((_reg, slot)) = self.existing_slot(worker) else { return 0 };
        self.clear_slot(slot)
    }

    fn clear_slot(&self, slot: u32) -> usize {
        let mut entries = 0;
        for s in 0..NUM_SHARDS {
            let (e, d) = self.shard(s).write().clear_slot(slot);
            entries += e as usize;
            self.nodes.fetch_sub(d, Relaxed);
        }
        entries
    }

    /// Forgets a worker entirely. Returns the entries removed (0 for an unknown worker).
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        // The aliases go with the blocks, under their lock (see `clear`); the emptied map stays for
        // the worker's next batch, so one that waited on it keeps its blocks removable.
        let aliases = self.aliases.existing(worker);
        let mut held = aliases.as_ref().map(|a| a.lock());
        if let Some(a) = held.as_mut() {
            a.clear();
        }
        if self.removals.on() {
            self.removals.record(std::iter::once(Removal::Worker(worker)));
        }
        let mut reg = self.registry.write();
        let Some(slot) = reg.slot_of.remove(&worker) else { return 0 };
        let entries = self.clear_slot(slot);
        reg.ids[slot as usize] = None;
        self.publish_slot_ids(reg.ids.clone());
        // The slot is reused only once no match that may have read it before the clear is
        // still pinned: such a match names it by the `slot_ids` it loads, which then says this
        // worker or no one, never the slot's next worker.
        let released = self.released_tx.clone();
        crossbeam_epoch::pin().defer(move || {
            let _ = released.send(slot);
        });
        entries
    }

    // ---- the removal log ---------------------------------------------------------------

    /// Starts recording removals (`remove`, `clear`, `remove_worker`; not the index's own
    /// capacity evictions, which say nothing of what an engine holds) for one more reader, and
    /// returns its cursor: `removals_since` delivers what is removed after this call.
    pub fn subscribe_removals(&self) -> u64 {
        self.removals.subscribe()
    }

    /// Ends one reader's subscription; with none left nothing is recorded.
    pub fn unsubscribe_removals(&self) {
        self.removals.unsubscribe()
    }

    /// Calls `f` for every removal since `cursor`, in order, and moves `cursor` past them.
    /// `Since::Lost` when the bounded log dropped records this reader had not seen.
    pub fn removals_since(&self, cursor: &mut u64, f: impl FnMut(Removal)) -> Since {
        self.removals.since(cursor, f)
    }

    // ---- reads -----------------------------------------------------------------------

    /// Number of blocks `worker` holds (0 for an unknown worker).
    pub fn num_blocks(&self, worker: WorkerId) -> u64 {
        let Some((_reg, slot)) = self.existing_slot(worker) else { return 0 };
        (0..NUM_SHARDS).map(|s| self.shard(s).read().counts.get(slot as usize).copied().unwrap_or(0)).sum()
    }

    /// `num_blocks` of many workers at once, into `out` (0 for a worker the index does not know):
    /// one read lock per shard for all of them, where `num_blocks` takes one per shard per worker.
    /// `slots` is scratch space; both vectors keep their capacity, so a warm call allocates nothing.
    pub fn num_blocks_into(&self, workers: impl ExactSizeIterator<Item = WorkerId>, slots: &mut Vec<u32>, out: &mut Vec<u64>) {
        slots.clear();
        {
            let reg = self.registry.read();
            slots.extend(workers.map(|w| reg.slot_of.get(&w).copied().unwrap_or(u32::MAX)));
        }
        out.clear();
        out.resize(slots.len(), 0);
        for s in 0..NUM_SHARDS {
            let g = self.shard(s).read();
            for (o, &slot) in out.iter_mut().zip(slots.iter()) {
                *o += g.counts.get(slot as usize).copied().unwrap_or(0);
            }
        }
    }

    /// Distinct blocks (nodes) in the index.
    pub fn len(&self) -> usize {
        self.nodes.load(Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> IndexStats {
        let mut st = IndexStats::default();
        let mut bytes = std::mem::size_of::<Self>() + HINT_SLOTS * 8;
        for s in 0..NUM_SHARDS {
            let g = self.shard(s).read();
            st.nodes += g.live as u64;
            st.entries += g.entries;
            bytes += g.bytes();
        }
        let reg = self.registry.read();
        st.workers = reg.slot_of.len() as u64;
        bytes += reg.slot_of.capacity() * 13 + reg.ids.capacity() * 16;
        st.estimated_bytes = bytes as u64;
        let c = &self.counters;
        st.orphan_stores = c.orphan_stores.load(Relaxed);
        st.duplicate_stores = c.duplicate_stores.load(Relaxed);
        st.parent_mismatches = c.parent_mismatches.load(Relaxed);
        st.unknown_removals = c.unknown_removals.load(Relaxed);
        st.evictions = c.evictions.load(Relaxed);
        st
    }

    /// Halves the clock and every tick (recency order kept) so the u32 clock never wraps.
    #[cold]
    fn halve_clock(&self) {
        let _one = self.evicting.lock();
        if self.clock.load(Relaxed) < CLOCK_LIMIT {
            return; // another thread did it
        }
        let mut guards: Vec<_> = (0..NUM_SHARDS).map(|s| self.shard(s).write()).collect();
        for g in guards.iter_mut() {
            g.halve_ticks();
        }
        self.clock.store(self.clock.load(Relaxed) >> 1, Relaxed);
    }

    // ---- eviction --------------------------------------------------------------------

    fn maybe_evict(&self) {
        let Some(cap) = self.max_nodes else { return };
        if self.nodes.load(Relaxed) <= cap {
            return;
        }
        let Some(_one) = self.evicting.try_lock() else { return };
        let target = cap - cap / 10;
        // Oldest leaves first; a parent joins the heap when its last child goes.
        let mut heap: BinaryHeap<Reverse<(u32, u32, u32)>> = BinaryHeap::new();
        for s in 0..NUM_SHARDS {
            let g = self.shard(s).read();
            for (i, n) in g.nodes.iter().enumerate() {
                if n.parent() != FREE && n.kids_class() == 0 {
                    heap.push(Reverse((g.nodes.tick(i), s as u32, i as u32)));
                }
            }
        }
        let mut evicted = 0u64;
        while self.nodes.load(Relaxed) > target {
            let Some(Reverse((tick, s, i))) = heap.pop() else { break };
            let mut g = write_spinning(self.shard(s as usize));
            if !g.is_live(i) || g.node(i).kids_class() != 0 {
                continue;
            }
            let now = g.nodes.tick(i as usize);
            if now != tick {
                heap.push(Reverse((now, s, i)));
                continue;
            }
            let parent = g.evict_leaf(i);
            self.nodes.fetch_sub(1, Relaxed);
            evicted += 1;
            if parent < FREE {
                let p = g.node(parent);
                if p.kids_class() == 0 {
                    if holders::is_empty(p.holders()) {
                        let d = g.prune(parent);
                        self.nodes.fetch_sub(d, Relaxed);
                    } else {
                        heap.push(Reverse((g.nodes.tick(parent as usize), s, parent)));
                    }
                }
            }
        }
        self.counters.evictions.fetch_add(evicted, Relaxed);
    }
}

#[cfg(test)]
mod tests;
