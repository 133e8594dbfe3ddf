//! One shard of the index: a slab of nodes keyed by sequence hash, holding every chain whose
//! first block hashes to this shard, so a prefix match reads exactly one shard.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::Arc;

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::{channel, Receiver, Sender};

use parking_lot::Mutex;

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};

use super::free::FreeSlots;
use super::holders::{self, HolderArena, Holders, SetDir, TierMask};
use super::slab::{ChunkDir, Slab};
use super::table::{self, Table};
/// Bits of a node's parent index (the rest of its `hp` word's high half holds its child class).
pub(crate) const PARENT_BITS: u32 = 30;
const PARENT_MASK: u64 = (1 << PARENT_BITS) - 1;
/// `hp`'s child-class bits: 0, 1 or 2 children, or 3 for "3 or more, counted in the slab".
const KIDS_SHIFT: u32 = 32 + PARENT_BITS;
const KIDS_MASK: u64 = 3 << KIDS_SHIFT;
/// `Node::parent` of a block 0 (a root of the tree).
pub(crate) const ROOT: u32 = (1 << PARENT_BITS) - 1;
/// `Node::parent` of a chain stored under a parent the index has never seen.
pub(crate) const ORPHAN: u32 = ROOT - 1;
/// `Node::parent` of a free slab slot.
pub(crate) const FREE: u32 = ROOT - 2;
/// Child count of a free slot kept for the run that ends just before it (see
/// `Shard::slot_under`); slots on the free list have 0.
const RESERVED: u32 = 1;
/// Longest run tail a store moves to grow a run in place, and the most slots a run reserves.
const MAX_MOVE: usize = 128;
pub(crate) const MAX_RUN: usize = 256;
const MIN_RUN: usize = 8;
/// Free slots beyond the live node count at which runs stop moving to the end of the slab.
const HOLES_ALLOWED: usize = 1024;
/// Largest node index a shard hands out.
pub(crate) const MAX_NODES_PER_SHARD: usize = (FREE - 1) as usize;

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
fn refresh(t: &AtomicU32, (clock, slack): (u32, u32)) {
    if t.load(Relaxed).saturating_add(slack) < clock {
        t.store(clock, Relaxed);
    }
}

/// One block: 16 bytes, two atomics, so that matches read nodes without the shard lock while
/// its writer changes them. `hp` holds the encoded holders (low half), the parent index (30
/// bits) and the child class (top 2 bits: 0, 1, 2 children, or 3 for "3 or more", whose count
/// the slab keeps aside), so a reader gets holders and parent in one load. Recency lives beside
/// the nodes, in the slab, and only in an index with `max_nodes` (the only reader of it). The
/// writer fills a slot hash first, then `hp` (release); it frees a slot by storing (no holders,
/// `FREE`) in `hp`. A reader that loads `hp` (acquire) and then the hash, and finds hash and
/// parent as it expects, has the holders of that very block: a slot freed and refilled under it
/// shows the new hash to whoever saw the new `hp` (see `View::is_child`).
pub(crate) struct Node {
    hash: AtomicU64,
    hp: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<Node>() == 16);

#[inline]
pub(crate) fn pack(holders: Holders, parent: u32) -> u64 {
    debug_assert!(parent as u64 <= PARENT_MASK);
    holders as u64 | (parent as u64) << 32
}

/// (holders, parent) of an `hp` word.
#[inline]
pub(crate) fn unpack(hp: u64) -> (Holders, u32) {
    (hp as u32, ((hp >> 32) & PARENT_MASK) as u32)
}

/// A node's fields as plain values, for writing a slot in one go.
#[derive(Clone, Copy)]
pub(crate) struct NodeVal {
    pub hash: u64,
    pub holders: Holders,
    pub tick: u32,
    pub parent: u32,
    pub children: u32,
}

impl NodeVal {
    fn placeholder() -> Self {
        NodeVal { hash: 0, holders: holders::EMPTY, tick: 0, parent: FREE, children: 0 }
    }
}

impl Node {
    pub fn free() -> Node {
        Node { hash: AtomicU64::new(0), hp: AtomicU64::new(pack(holders::EMPTY, FREE)) }
    }
    #[inline]
    pub fn hash(&self) -> u64 {
        self.hash.load(Acquire)
    }
    /// The `hp` word without its child class: (holders, parent) as `pack` makes them.
    #[inline]
    pub fn hp(&self) -> u64 {
        self.hp.load(Acquire) & !KIDS_MASK
    }
    #[inline]
    pub fn holders(&self) -> Holders {
        self.hp.load(Acquire) as u32
    }
    #[inline]
    pub fn parent(&self) -> u32 {
        unpack(self.hp.load(Acquire)).1
    }
    /// 0, 1, 2, or 3 for "3 or more" (`Slab::children` has the count).
    #[inline]
    pub(crate) fn kids_class(&self) -> u32 {
        (self.hp.load(Relaxed) >> KIDS_SHIFT) as u32
    }
    /// Writer only (the one writer changes `hp`, so load-then-store loses nothing).
    #[inline]
    pub fn set_holders(&self, h: Holders) {
        let old = self.hp.load(Relaxed);
        self.hp.store((old & !(u32::MAX as u64)) | h as u64, Release);
    }
    /// Writer only.
    #[inline]
    pub fn set_parent(&self, p: u32) {
        debug_assert!(p as u64 <= PARENT_MASK);
        let old = self.hp.load(Relaxed);
        self.hp.store((old & !(PARENT_MASK << 32)) | (p as u64) << 32, Release);
    }
    /// Writer only: the child class (0..=3).
    #[inline]
    pub(crate) fn set_kids_class(&self, c: u32) {
        debug_assert!(c <= 3);
        let old = self.hp.load(Relaxed);
        self.hp.store((old & !KIDS_MASK) | (c as u64) << KIDS_SHIFT, Release);
    }
    /// Writes a slot's hash and `hp` (see the type's docs for the order); `kids` is the class.
    #[inline]
    pub(crate) fn fill(&self, hash: u64, holders: Holders, parent: u32, kids: u32) {
        self.hash.store(hash, Relaxed);
        self.hp.store(pack(holders, parent) | (kids as u64) << KIDS_SHIFT, Release);
    }
    /// Marks a slot free (its hash stays until it is filled again).
    #[inline]
    pub fn clear(&self) {
        self.hp.store(pack(holders::EMPTY, FREE), Release);
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
    graveyard_tx: Sender<RetiredTable>,
    graveyard: Mutex<Receiver<RetiredTable>>,
}

impl Default for Shared {
    fn default() -> Self {
        let (graveyard_tx, graveyard) = channel();
        Shared {
            graveyard_tx,
            graveyard: Mutex::new(graveyard),
            chunks: Atomic::new(ChunkDir::empty()),
            table: Atomic::new(Table::with_buckets(table::buckets_for(0))),
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
struct RetiredTable(*mut Table);
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
    /// inner loop: one slice scan per chunk, no table probe, no holder intersection.
    #[inline]
    pub fn follow_run(&self, i: u32, hashes: &[u64], holders: Holders, touch: Option<(u32, u32)>) -> usize {
        let mut n = 0;
        let mut cur = i as usize;
        while n < hashes.len() {
            let tail = self.chunks.chunk_tail(cur + 1);
            if tail.is_empty() {
                break;
            }
            let before = n;
            let ticks = if touch.is_some() { self.chunks.tick_tail(cur + 1) } else { &[] };
            for (k, (node, &h)) in tail.iter().zip(&hashes[n..]).enumerate() {
                // Holders and parent in one load, then the hash (see `Node`).
                if node.hp() != pack(holders, cur as u32) || node.hash() != h {
                    break;
                }
                if let (Some(t), Some(tick)) = (touch, ticks.get(k)) {
                    refresh(tick, t);
                }
                cur += 1;
                n += 1;
            }
            if n - before < tail.len() {
                break; // stopped inside the chunk (or ran out of hashes)
            }
        }
        n
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

fn is_reserved(nodes: &Slab, i: usize) -> bool {
    nodes.get(i).is_some_and(|n| n.parent() == FREE) && nodes.children(i) == RESERVED
}

/// The slot right after `p` if it is reserved for `p`'s run or is the slab's end (then pushed,
/// as a free placeholder the caller overwrites): where `p`'s first child goes without a move.
fn take_after(nodes: &mut Slab, p: u32) -> Option<u32> {
    let after = p as usize + 1;
    if is_reserved(nodes, after) {
        nodes.set_children(after, 0);
        return Some(after as u32);
    }
    if after == nodes.len() && after < MAX_NODES_PER_SHARD {
        nodes.push(NodeVal::placeholder());
        return Some(after as u32);
    }
    None
}

/// Puts `node` in the slot right after `p` if that slot is reserved for `p`'s run or is the
/// slab's end: where `p`'s first child goes without a move. Gives the node back otherwise.
#[inline]
fn put_after(nodes: &mut Slab, p: u32, node: NodeVal) -> Result<u32, NodeVal> {
    let after = p as usize + 1;
    if after == nodes.len() && after < MAX_NODES_PER_SHARD {
        nodes.push(node);
        return Ok(after as u32);
    }
    if is_reserved(nodes, after) {
        nodes.fill(after, node);
        return Ok(after as u32);
    }
    Err(node)
}

/// A shard's writer state, behind its lock. What matches read lives in `Shared` (reached from
/// here through `nodes`, `table_ref` and `arena`), never inline, so that holding this `&mut`
/// asserts nothing about memory readers are reading.
pub(crate) struct Shard {
    pub shared: Arc<Shared>,
    pub nodes: Slab,
    free: FreeSlots,
    /// Entries in the table, and how many more it takes before it must grow (tombstones use
    /// room up, as in hashbrown).
    table_items: usize,
    table_growth_left: usize,
    pub arena: HolderArena,
    /// Blocks held per worker slot in this shard.
    pub counts: Vec<u64>,
    /// (block, worker) entries in this shard.
    pub entries: u64,
    pub live: usize,
    /// Parent hash of each orphan root, by node index.
    pub orphan_parent: hashbrown::HashMap<u32, u64>,
}

impl Shard {
    /// An empty shard; `recency`: keep a tick per node (an index with `max_nodes`).
    pub fn new(recency: bool) -> Self {
        let shared = Arc::new(Shared::default());
        // SAFETY: not shared with anyone yet.
        let buckets = unsafe { shared.table.load(Relaxed, epoch::unprotected()).deref().buckets() };
        Shard {
            nodes: Slab::new(shared.clone(), recency),
            arena: HolderArena::new(shared.clone()),
            shared,
            free: FreeSlots::default(),
            table_items: 0,
            table_growth_left: table::capacity_of(buckets),
            counts: Vec::new(),
            entries: 0,
            live: 0,
            orphan_parent: Default::default(),
        }
    }
}

impl Shard {
    #[inline]
    fn table_ref(&self) -> &Table {
        // SAFETY: only the lock holder (borrowed through `self`) swaps the table and retires the
        // old one, so the current one outlives this borrow.
        unsafe { self.shared.table.load(Relaxed, epoch::unprotected()).deref() }
    }

    #[inline]
    pub fn find(&self, h: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.table_ref().find(mix(h), |i| nodes.get(i as usize).is_some_and(|n| n.hash() == h))
    }

    /// Whether slab slot `guess` is `h`'s node under `prev`.
    #[inline]
    pub fn is_guess(&self, h: u64, prev: u32, guess: u32) -> bool {
        self.nodes.get(guess as usize).is_some_and(|n| n.hash() == h && n.parent() == prev)
    }

    #[inline]
    pub fn node(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    pub fn is_live(&self, i: u32) -> bool {
        (i as usize) < self.nodes.len() && self.nodes[i as usize].parent() != FREE
    }

    /// How many more nodes the table takes before it must grow.
    pub fn table_room(&self) -> usize {
        self.table_growth_left
    }

    /// A copy of the table with room for `extra` more nodes (half as large again, unless
    /// tombstones are what filled it). Built under a shared lock, and readers never wait for it.
    pub fn grown_table(&self, extra: usize) -> Table {
        let buckets = self.table_ref().buckets();
        let need = self.table_items + extra;
        let want = if table::capacity_of(buckets) >= 2 * need { buckets } else { table::buckets_for(need).max(table::grown_size(buckets)) };
        let t = Table::with_buckets(want);
        // Every live node has its entry: read them in slab order.
        for (c, chunk) in self.nodes.chunks().enumerate() {
            let base = c * super::slab::CHUNK;
            for (k, n) in chunk.iter().enumerate() {
                if n.parent() != FREE {
                    t.insert(mix(n.hash()), (base + k) as u32);
                }
            }
        }
        t
    }

    /// Free slab slots (not counting those reserved for runs).
    #[cfg(test)]
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Slab slots available without allocating (free-list slots included).
    pub fn slab_room(&self) -> usize {
        self.free.len() + self.nodes.spare()
    }

    /// Publishes a table made by `grown_table`; the old one is freed once no match holds it.
    pub fn set_table(&mut self, table: Table) {
        let cap = table::capacity_of(table.buckets());
        let guard = epoch::pin();
        let old = self.shared.table.swap(Owned::new(table), std::sync::atomic::Ordering::AcqRel, &guard);
        let old = RetiredTable(old.as_raw() as *mut Table);
        self.shared.retired_tables.fetch_add(1, Relaxed);
        let graveyard = self.shared.graveyard_tx.clone();
        // After the grace, to the writer (a send never waits); if the index is gone by then, the
        // table comes back in the error and is freed right there.
        guard.defer(move || drop(graveyard.send(old)));
        guard.flush();
        self.table_growth_left = cap - self.table_items;
    }

    /// Makes sure the table takes one more entry (so a vacant bucket found now stays usable).
    #[inline]
    fn table_reserve_one(&mut self) {
        if self.table_growth_left == 0 {
            let t = self.grown_table(1);
            self.set_table(t);
        }
    }

    /// `h`'s node, or else the bucket its entry goes in (after `table_reserve_one`).
    #[inline(always)]
    fn find_or_vacant(&self, h: u64) -> Result<u32, usize> {
        let nodes = &self.nodes;
        self.table_ref().find_or_vacant(mix(h), |i| nodes.get(i as usize).is_some_and(|n| n.hash() == h))
    }

    #[inline]
    fn table_insert_at(&mut self, b: usize, h: u64, i: u32) {
        if self.table_ref().insert_at(b, mix(h), i) {
            self.table_growth_left -= 1;
        }
        self.table_items += 1;
    }

    fn table_remove(&mut self, h: u64, i: u32) {
        if self.table_ref().remove(mix(h), |j| j == i) {
            self.table_items -= 1;
        }
    }

    /// Creates a holder-less node under `parent` (`ROOT`, `ORPHAN` or a node index).
    /// `None` when the shard is full.
    pub fn create(&mut self, h: u64, parent: u32, tick: u32) -> Option<u32> {
        match self.find_or_create(h, parent, tick, false) {
            Some((i, true)) => Some(i),
            Some((_, false)) => unreachable!("create() of a hash already present"),
            None => None,
        }
    }

    /// The node for `h`, creating it under `parent` if absent.
    /// With `grow`, a node created under a leaf goes in the slot right after it (`slot_under`).
    /// Returns (node, created); `None` when the shard is full. `grow` may move `parent` and the
    /// run it ends (never an orphan root), so callers must not hold other node indices across it.
    pub fn find_or_create(&mut self, h: u64, parent: u32, tick: u32, grow: bool) -> Option<(u32, bool)> {
        self.table_reserve_one();
        let vacant = match self.find_or_vacant(h) {
            Ok(i) => return Some((i, false)),
            Err(b) => b,
        };
        let grow = grow && parent < FREE && self.nodes.children(parent as usize) == 0;
        let node = NodeVal { hash: h, holders: holders::EMPTY, tick, parent, children: 0 };
        let placed = if grow { put_after(&mut self.nodes, parent, node) } else { Err(node) };
        let (i, parent) = match placed {
            Ok(i) => (i, parent),
            Err(node) if grow => match self.slot_under(parent) {
                Some((i, p)) => {
                    self.nodes.fill(i as usize, NodeVal { parent: p, ..node });
                    (i, p)
                }
                None => (self.place(node)?, parent),
            },
            Err(node) => (self.place(node)?, parent),
        };
        // (Moving a run re-points entries but adds or removes none: `vacant` is still vacant.)
        self.table_insert_at(vacant, h, i);
        if parent < FREE {
            let c = self.nodes.children(parent as usize);
            self.nodes.set_children(parent as usize, c + 1);
        }
        self.live += 1;
        Some((i, true))
    }

    /// Puts `node` in a free slot or at the slab's end; `None` when the shard is full.
    fn place(&mut self, node: NodeVal) -> Option<u32> {
        match self.free.pop() {
            Some(i) => {
                self.nodes.fill(i as usize, node);
                Some(i)
            }
            None if self.nodes.len() >= MAX_NODES_PER_SHARD => None,
            None => {
                self.nodes.push(node);
                Some((self.nodes.len() - 1) as u32)
            }
        }
    }

    fn is_reserved(&self, i: usize) -> bool {
        is_reserved(&self.nodes, i)
    }

    /// A slot right after leaf `p` for its first child, and `p`'s index then: runs grow in place.
    /// A session's turns arrive one under another, far apart in time; so that they still sit in
    /// consecutive slots (where walks find them without the table), a run that cannot grow where
    /// it is moves its tail (at most `MAX_MOVE` nodes, each with one child, no orphan root) to the
    /// end of the slab with room reserved after it, twice its length: amortised growth like a
    /// vector's. `None` when `p` cannot be moved (an orphan root) or the shard is full.
    /// Readers on the old copy finish on it or, once it is freed, find the new copy through the
    /// table: the copy is written first, then the table re-pointed, then the old slots freed.
    fn slot_under(&mut self, p: u32) -> Option<(u32, u32)> {
        if let Some(i) = take_after(&mut self.nodes, p) {
            return Some((i, p));
        }
        // The run's tail: p and the nodes before it that chain into it and have no other child.
        let mut start = p as usize;
        if self.nodes[start].parent() == ORPHAN {
            return None;
        }
        while p as usize - start + 1 < MAX_MOVE && start > 0 {
            let (prev, cur) = (&self.nodes[start - 1], &self.nodes[start]);
            if cur.parent() != (start - 1) as u32 || self.nodes.children(start - 1) != 1 || prev.parent() == FREE || prev.parent() == ORPHAN
            {
                break;
            }
            start -= 1;
        }
        let len = p as usize - start + 1;
        let cap = (2 * (len + 1)).clamp(MIN_RUN, MAX_RUN);
        // Where the run goes, with room reserved after it: a stretch of free slots (runs freed
        // earlier, evicted chains), else the end of the slab; but not while holes already
        // outnumber live nodes, so that churn (removals, eviction) cannot grow the slab without
        // bound. (A stretch just long enough, without the reserve, was tried: runs then moved
        // again at their next turn, halving store speed on streams without eviction.)
        let base = match self.free.take_stretch(cap) {
            Some(b) => b,
            None if self.free.len() > self.live + HOLES_ALLOWED || self.nodes.len() + cap >= MAX_NODES_PER_SHARD => return None,
            None => {
                let b = self.nodes.len();
                for _ in 0..cap {
                    self.nodes.push(NodeVal::placeholder());
                }
                b
            }
        };
        for k in 0..len {
            let v = self.nodes.val(start + k);
            let parent = if k == 0 { v.parent } else { (base + k - 1) as u32 };
            self.nodes.fill(base + k, NodeVal { parent, ..v });
        }
        for k in 0..len {
            let (old, h) = (start + k, self.nodes[start + k].hash());
            self.table_ref().repoint(mix(h), |j| j as usize == old, (base + k) as u32);
        }
        for old in start..start + len {
            self.nodes.clear(old);
        }
        // The old slots are free for anyone (and so are slots reserved after them, if any).
        self.release_reserved(start + len);
        for old in start..start + len {
            self.free.push(old as u32);
        }
        for k in len + 1..cap {
            self.nodes.set_children(base + k, RESERVED);
        }
        Some(((base + len) as u32, (base + len - 1) as u32))
    }

    /// Returns the reserved slots from `i` on to the free list (their run lost its tail).
    fn release_reserved(&mut self, mut i: usize) {
        while self.is_reserved(i) {
            self.nodes.set_children(i, 0);
            self.free.push(i as u32);
            i += 1;
        }
    }

    /// Extends the run that ends at leaf `prev` with new nodes for the leading `hashes` this shard
    /// lacks, each in the slot right after the one before (reserved for the run, or the slab's
    /// end), held by (`slot`, `tier`): a store's common case without `find_or_create`'s others.
    /// Returns how many it appended, stopping at the first hash present, where the run cannot
    /// grow in place, or at a full shard; nodes `prev + 1 ..= prev + n` are the new ones.
    pub fn extend_run(&mut self, prev: u32, hashes: &[u64], tick: u32, slot: u32, tier: TierMask) -> usize {
        if prev >= FREE || self.nodes.children(prev as usize) != 0 {
            return 0;
        }
        let hold = holders::single(slot, tier);
        let mut p = prev as usize;
        for &h in hashes {
            let after = p + 1;
            let at_end = after == self.nodes.len();
            if !(at_end && after < MAX_NODES_PER_SHARD || is_reserved(&self.nodes, after)) {
                break;
            }
            self.table_reserve_one();
            let vacant = match self.find_or_vacant(h) {
                Ok(_) => break,
                Err(b) => b,
            };
            // Written as having one child (the next one); the last is corrected below.
            let node = NodeVal { hash: h, holders: hold, tick, parent: p as u32, children: 1 };
            if at_end {
                self.nodes.push(node);
            } else {
                self.nodes.fill(after, node);
            }
            self.table_insert_at(vacant, h, after as u32);
            p = after;
        }
        let n = p - prev as usize;
        if n > 0 {
            self.nodes.set_children(prev as usize, 1);
            self.nodes.set_children(p, 0);
            self.live += n;
            self.bump(slot, n as i64);
        }
        n
    }

    /// Gives node `i`, created holder-less by this store, its first holder (slot, tier): an
    /// `add_holder` without the arena's cases.
    #[inline]
    pub fn first_holder(&mut self, i: u32, slot: u32, tier: TierMask) {
        let n = &self.nodes[i as usize];
        debug_assert!(holders::is_empty(n.holders()));
        n.set_holders(holders::single(slot, tier));
        self.bump(slot, 1);
    }

    /// Adds (slot, tier) to node `i`; returns (new entry, duplicate).
    pub fn add_holder(&mut self, i: u32, slot: u32, tier: TierMask) -> (bool, bool) {
        let h = self.nodes[i as usize].holders();
        let (nh, added) = self.arena.add(h, slot, tier);
        self.nodes[i as usize].set_holders(nh);
        // (A set this released is retired by the caller before it lets the shard go: once per
        // store, not per block. Retiring later than needed is always safe.)
        if added.new_entry {
            self.bump(slot, 1);
        }
        (added.new_entry, added.duplicate)
    }

    /// Removes (slot, tiers) from node `i`; returns whether an entry went away. A node left
    /// with no holders and no children is deleted, and so are its ancestors that become so.
    /// Returns the number of nodes deleted as the second value.
    pub fn remove_holder(&mut self, i: u32, slot: u32, tiers: TierMask) -> (bool, usize) {
        let h = self.nodes[i as usize].holders();
        let (nh, gone) = self.arena.remove(h, slot, tiers);
        self.nodes[i as usize].set_holders(nh);
        self.arena.retire_pending();
        if gone {
            self.bump(slot, -1);
        }
        (gone, self.prune(i))
    }

    #[inline]
    fn bump(&mut self, slot: u32, d: i64) {
        let s = slot as usize;
        if s >= self.counts.len() {
            self.counts.resize(s + 1, 0);
        }
        self.counts[s] = (self.counts[s] as i64 + d) as u64;
        self.entries = (self.entries as i64 + d) as u64;
    }

    /// Deletes node `i` if it has neither holders nor children, then its ancestors likewise.
    pub fn prune(&mut self, mut i: u32) -> usize {
        let mut deleted = 0;
        loop {
            let n = &self.nodes[i as usize];
            if !holders::is_empty(n.holders()) || n.kids_class() != 0 {
                return deleted;
            }
            let parent = n.parent();
            self.delete(i);
            deleted += 1;
            if parent >= FREE {
                return deleted;
            }
            i = parent;
        }
    }

    /// Deletes leaf `i` whatever it holds (eviction), and returns its parent index.
    pub fn evict_leaf(&mut self, i: u32) -> u32 {
        let mut list = Vec::new();
        self.arena.list(self.nodes[i as usize].holders(), &mut list);
        for (slot, _) in list {
            self.bump(slot, -1);
        }
        let parent = self.nodes[i as usize].parent();
        self.delete(i);
        parent
    }

    fn delete(&mut self, i: u32) {
        let (h, parent, hold) = {
            let n = &self.nodes[i as usize];
            debug_assert_eq!(n.kids_class(), 0);
            (n.hash(), n.parent(), n.holders())
        };
        self.table_remove(h, i);
        if parent < FREE {
            let c = self.nodes.children(parent as usize);
            self.nodes.set_children(parent as usize, c - 1);
        }
        if parent == ORPHAN {
            self.orphan_parent.remove(&i);
        }
        self.nodes.clear(i as usize);
        // (After the node stops naming it: the set may be retired here.)
        self.arena.drop_holders(hold);
        self.arena.retire_pending();
        self.free.push(i);
        self.live -= 1;
        self.release_reserved(i as usize + 1);
    }

    /// Removes `slot` from every node; deletes nodes left empty. Returns (entries, nodes) removed.
    pub fn clear_slot(&mut self, slot: u32) -> (u64, usize) {
        let mut entries = 0;
        let mut emptied = Vec::new();
        for i in 0..self.nodes.len() as u32 {
            let n = &self.nodes[i as usize];
            let hold = n.holders();
            if n.parent() == FREE || self.arena.tiers(hold, slot) == 0 {
                continue;
            }
            let (nh, gone) = self.arena.remove(hold, slot, holders::ANY_TIER);
            self.nodes[i as usize].set_holders(nh);
            if gone {
                entries += 1;
                self.bump(slot, -1);
            }
            if holders::is_empty(nh) {
                emptied.push(i);
            }
        }
        self.arena.retire_pending();
        let mut deleted = 0;
        for i in emptied {
            if self.is_live(i) {
                deleted += self.prune(i);
            }
        }
        if (slot as usize) < self.counts.len() {
            self.counts[slot as usize] = 0;
        }
        (entries, deleted)
    }

    /// Indices of live nodes, parents before children.
    pub fn topo_order(&self) -> Vec<u32> {
        let n = self.nodes.len();
        let mut depth = vec![u32::MAX; n];
        let mut stack = Vec::new();
        for start in 0..n {
            if self.nodes[start].parent() == FREE || depth[start] != u32::MAX {
                continue;
            }
            let mut i = start;
            loop {
                let p = self.nodes[i].parent();
                if p >= FREE {
                    depth[i] = 0;
                    break;
                }
                if depth[p as usize] != u32::MAX {
                    depth[i] = depth[p as usize] + 1;
                    break;
                }
                stack.push(i);
                i = p as usize;
            }
            let mut d = depth[i];
            while let Some(j) = stack.pop() {
                d += 1;
                depth[j] = d;
            }
        }
        let mut order: Vec<u32> = (0..n as u32).filter(|&i| self.nodes[i as usize].parent() != FREE).collect();
        order.sort_by_key(|&i| depth[i as usize]);
        order
    }

    pub fn bytes(&self) -> usize {
        self.nodes.bytes()
            + self.free.bytes()
            + self.table_ref().bytes()
            + self.arena.bytes()
            + self.counts.capacity() * 8
            + self.orphan_parent.capacity() * 13
    }

    /// Halves every tick (order kept) when the clock nears wrapping.
    pub fn halve_ticks(&mut self) {
        self.nodes.halve_ticks();
    }
}
