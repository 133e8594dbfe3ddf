//! One shard of the index: a slab of nodes keyed by sequence hash, holding every chain whose
//! first block hashes to this shard, so a prefix match reads exactly one shard.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Owned};

use super::free::FreeSlots;
use super::holders::{self, HolderArena, TierMask};
pub(crate) use super::node::*;
use super::slab::Slab;
use super::table::{self, Table};
pub(crate) use super::view::{mix, RetiredTable, Shared};

/// Child count of a free slot kept for the run that ends just before it (see
/// `Shard::slot_under`); slots on the free list have 0.
const RESERVED: u32 = 1;
/// Longest run tail a store moves to grow a run in place, and the most slots a run reserves.
/// (From 128 / 256: a 1024-block match then left its runs ~4 times, not ~10, through the table,
/// 1.17 -> 0.83 us on the index race's interleaved W = 8 stream, at the same store rate and
/// 16.4 -> 14.0 bytes per entry; `benches/index_race`.)
const MAX_MOVE: usize = 512;
pub(crate) const MAX_RUN: usize = 1024;
const MIN_RUN: usize = 8;
/// Free slots beyond the live node count at which runs stop moving to the end of the slab.
const HOLES_ALLOWED: usize = 1024;
/// Largest node index a shard hands out.
pub(crate) const MAX_NODES_PER_SHARD: usize = (FREE - 1) as usize;

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
                self.nodes.push_unruled(node);
            } else {
                self.nodes.fill_unruled(after, node);
            }
            self.table_insert_at(vacant, h, after as u32);
            p = after;
        }
        let n = p - prev as usize;
        if n > 0 {
            self.nodes.grow_runs(prev as usize + 1, p + 1);
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
        debug_assert!(holders::is_empty(self.nodes[i as usize].holders()));
        self.nodes.set_holders(i as usize, holders::single(slot, tier));
        self.bump(slot, 1);
    }

    /// Adds (slot, tier) to node `i`; returns (new entry, duplicate).
    pub fn add_holder(&mut self, i: u32, slot: u32, tier: TierMask) -> (bool, bool) {
        let h = self.nodes[i as usize].holders();
        let (nh, added) = self.arena.add(h, slot, tier);
        self.nodes.set_holders(i as usize, nh);
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
        self.nodes.set_holders(i as usize, nh);
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
            self.nodes.set_holders(i as usize, nh);
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
