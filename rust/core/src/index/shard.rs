//! One shard of the index: a slab of nodes keyed by sequence hash, holding every chain whose
//! first block hashes to this shard, so a prefix match reads exactly one shard.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use hashbrown::HashTable;

use super::holders::{self, HolderArena, Holders, TierMask};
use super::slab::Slab;

/// `Node::parent` of a block 0 (a root of the tree).
pub(crate) const ROOT: u32 = u32::MAX;
/// `Node::parent` of a chain stored under a parent the index has never seen.
pub(crate) const ORPHAN: u32 = u32::MAX - 1;
/// `Node::parent` of a free slab slot.
pub(crate) const FREE: u32 = u32::MAX - 2;
/// `Node::children` of a free slot kept for the run that ends just before it (see
/// `Shard::slot_under`); slots on the free list have 0.
const RESERVED: u32 = 1;
/// Longest run tail a store moves to grow a run in place, and the most slots a run reserves.
const MAX_MOVE: usize = 128;
pub(crate) const MAX_RUN: usize = 256;
const MIN_RUN: usize = 8;
/// Free slots beyond the live node count at which runs stop moving to the end of the slab.
const HOLES_ALLOWED: usize = 1024;
/// Largest node index a shard hands out.
pub(crate) const MAX_NODES_PER_SHARD: usize = (u32::MAX - 3) as usize;

/// Mixes a hash for table placement: folded 128-bit multiply, so that small sequential ids
/// (such as Mooncake's `hash_ids`) spread as well as xxh3 outputs do.
#[inline]
pub(crate) fn mix(h: u64) -> u64 {
    let r = (h as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    (r as u64) ^ ((r >> 64) as u64)
}

/// One block: 24 bytes.
pub(crate) struct Node {
    pub hash: u64,
    /// Encoded holders (see `holders`).
    pub holders: Holders,
    /// Recency for eviction: the index clock when last stored or matched.
    pub tick: AtomicU32,
    /// Index of the parent node in this shard, or `ROOT` / `ORPHAN` / `FREE`.
    pub parent: u32,
    pub children: u32,
}

fn is_reserved(nodes: &Slab<Node>, i: usize) -> bool {
    nodes.get(i).is_some_and(|n| n.parent == FREE && n.children == RESERVED)
}

/// The slot right after `p` if it is reserved for `p`'s run or is the slab's end (then pushed,
/// as a free placeholder the caller overwrites): where `p`'s first child goes without a move.
fn take_after(nodes: &mut Slab<Node>, p: u32) -> Option<u32> {
    let after = p as usize + 1;
    if is_reserved(nodes, after) {
        nodes[after].children = 0;
        return Some(after as u32);
    }
    if after == nodes.len() && after < MAX_NODES_PER_SHARD {
        nodes.push(Node { hash: 0, holders: holders::EMPTY, tick: AtomicU32::new(0), parent: FREE, children: 0 });
        return Some(after as u32);
    }
    None
}

/// Puts `node` in the slot right after `p` if that slot is reserved for `p`'s run or is the
/// slab's end: where `p`'s first child goes without a move. Gives the node back otherwise.
#[inline]
fn put_after(nodes: &mut Slab<Node>, p: u32, node: Node) -> Result<u32, Node> {
    let after = p as usize + 1;
    if after == nodes.len() && after < MAX_NODES_PER_SHARD {
        nodes.push(node);
        return Ok(after as u32);
    }
    if is_reserved(nodes, after) {
        nodes[after] = node;
        return Ok(after as u32);
    }
    Err(node)
}

#[derive(Default)]
pub(crate) struct Shard {
    pub nodes: Slab<Node>,
    free: Vec<u32>,
    /// Node indices by mixed hash. (Storing half the hash beside each index would spare rehashes
    /// from reading nodes: ~18% faster builds, but +4 bytes per entry; memory won.)
    table: HashTable<u32>,
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
    #[inline]
    pub fn find(&self, h: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.table.find(mix(h), |&i| nodes[i as usize].hash == h).copied()
    }

    /// Finds `h` as a child of `prev`, trying slab slot `guess` first: a chain stored in one
    /// call sits in consecutive slots, so walks mostly skip the table (path compression's
    /// cache-friendliness without splitting and merging edges).
    #[inline]
    pub fn find_child(&self, h: u64, prev: u32, guess: u32) -> Option<u32> {
        if self.is_guess(h, prev, guess) {
            return Some(guess);
        }
        let i = self.find(h)?;
        (self.nodes[i as usize].parent == prev).then_some(i)
    }

    /// Whether slab slot `guess` is `h`'s node under `prev`.
    #[inline]
    pub fn is_guess(&self, h: u64, prev: u32, guess: u32) -> bool {
        self.nodes.get(guess as usize).is_some_and(|n| n.hash == h && n.parent == prev)
    }

    /// How many of `hashes` continue the run after node `i`: slots `i+1, i+2, ...`, each the child of
    /// the slot before it, with the very holders encoding `holders` (so a match's set of workers is
    /// unchanged along them). Refreshes their recency to `clock`. The match's inner loop: one slice
    /// scan per chunk, no table probe, no holder intersection.
    #[inline]
    pub fn follow_run(&self, i: u32, hashes: &[u64], holders: Holders, clock: u32) -> usize {
        let mut n = 0;
        let mut cur = i as usize;
        while n < hashes.len() {
            let tail = self.nodes.chunk_tail(cur + 1);
            if tail.is_empty() {
                break;
            }
            let before = n;
            for (node, &h) in tail.iter().zip(&hashes[n..]) {
                if node.hash != h || node.parent as usize != cur || node.holders != holders {
                    break;
                }
                if node.tick.load(Relaxed) != clock {
                    node.tick.store(clock, Relaxed);
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

    #[inline]
    pub fn node(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    pub fn is_live(&self, i: u32) -> bool {
        (i as usize) < self.nodes.len() && self.nodes[i as usize].parent != FREE
    }

    /// How many more nodes the table takes before it must grow.
    pub fn table_room(&self) -> usize {
        self.table.capacity() - self.table.len()
    }

    /// A copy of the table with room for `extra` more nodes (at least twice the size). Built
    /// under a shared lock, so matches keep reading this shard while a big table is rehashed.
    pub fn grown_table(&self, extra: usize) -> HashTable<u32> {
        let want = (self.table.len() + extra).max(self.table.capacity() * 2).max(64);
        let mut t = HashTable::with_capacity(want);
        let nodes = &self.nodes;
        // Every live node has its entry: read them in slab order (sequential, no chunk lookup per
        // entry) rather than in table order (a random node read per entry).
        for (c, chunk) in nodes.chunks().enumerate() {
            let base = c * super::slab::CHUNK;
            for (k, n) in chunk.iter().enumerate() {
                if n.parent != FREE {
                    t.insert_unique(mix(n.hash), (base + k) as u32, |&j| mix(nodes[j as usize].hash));
                }
            }
        }
        t
    }

    /// Slab slots available without allocating (free-list slots included).
    pub fn slab_room(&self) -> usize {
        self.free.len() + self.nodes.spare()
    }

    /// Swaps in a grown table and returns the old one, to be freed after the lock is released
    /// (freeing a large table unmaps memory: no reader should wait behind that).
    pub fn set_table(&mut self, table: HashTable<u32>) -> HashTable<u32> {
        debug_assert_eq!(table.len(), self.table.len());
        std::mem::replace(&mut self.table, table)
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

    /// The node for `h`, creating it under `parent` if absent, with one table probe.
    /// With `grow`, a node created under a leaf goes in the slot right after it (`slot_under`).
    /// Returns (node, created); `None` when the shard is full. `grow` may move `parent` and the
    /// run it ends (never an orphan root), so callers must not hold other node indices across it.
    pub fn find_or_create(&mut self, h: u64, parent: u32, tick: u32, grow: bool) -> Option<(u32, bool)> {
        let grow = grow && parent < FREE && self.nodes[parent as usize].children == 0;
        let nodes = &self.nodes;
        let vacant = match self.table.entry(mix(h), |&i| nodes[i as usize].hash == h, |&i| mix(nodes[i as usize].hash)) {
            hashbrown::hash_table::Entry::Occupied(o) => return Some((*o.get(), false)),
            hashbrown::hash_table::Entry::Vacant(v) => v,
        };
        let node = Node { hash: h, holders: holders::EMPTY, tick: AtomicU32::new(tick), parent, children: 0 };
        // One table probe, unless the run under `parent` must move (rare: amortised).
        let placed = if grow { put_after(&mut self.nodes, parent, node) } else { Err(node) };
        let (i, parent) = match placed {
            Ok(i) => {
                vacant.insert(i);
                (i, parent)
            }
            Err(node) if grow => {
                // (`vacant` is not used on this path, so its borrow of the table ends here.)
                let placed = self.slot_under(parent);
                let (i, parent) = match placed {
                    Some((i, p)) => {
                        self.nodes[i as usize] = Node { parent: p, ..node };
                        (i, p)
                    }
                    None => (self.place(node)?, parent),
                };
                let nodes = &self.nodes;
                self.table.insert_unique(mix(h), i, |&j| mix(nodes[j as usize].hash));
                (i, parent)
            }
            Err(node) => {
                let i = match self.free.pop() {
                    Some(i) => {
                        self.nodes[i as usize] = node;
                        i
                    }
                    None => {
                        if self.nodes.len() >= MAX_NODES_PER_SHARD {
                            return None;
                        }
                        self.nodes.push(node);
                        (self.nodes.len() - 1) as u32
                    }
                };
                vacant.insert(i);
                (i, parent)
            }
        };
        if parent < FREE {
            self.nodes[parent as usize].children += 1;
        }
        self.live += 1;
        Some((i, true))
    }

    /// Puts `node` in a free slot or at the slab's end; `None` when the shard is full.
    fn place(&mut self, node: Node) -> Option<u32> {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
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
    fn slot_under(&mut self, p: u32) -> Option<(u32, u32)> {
        if let Some(i) = take_after(&mut self.nodes, p) {
            return Some((i, p));
        }
        // The run's tail: p and the nodes before it that chain into it and have no other child.
        let mut start = p as usize;
        if self.nodes[start].parent == ORPHAN {
            return None;
        }
        while p as usize - start + 1 < MAX_MOVE && start > 0 {
            let (prev, cur) = (&self.nodes[start - 1], &self.nodes[start]);
            if cur.parent != (start - 1) as u32 || prev.children != 1 || prev.parent == FREE || prev.parent == ORPHAN {
                break;
            }
            start -= 1;
        }
        let len = p as usize - start + 1;
        let cap = (2 * (len + 1)).clamp(MIN_RUN, MAX_RUN);
        // Where the run goes: a contiguous stretch on top of the free list (runs freed earlier),
        // else the end of the slab; but not while holes already outnumber live nodes, so that
        // churn (removals, eviction) cannot grow the slab without bound.
        let base = match self.take_free_stretch(cap) {
            Some(b) => b,
            None if self.free.len() > self.live + HOLES_ALLOWED || self.nodes.len() + cap >= MAX_NODES_PER_SHARD => return None,
            None => {
                let b = self.nodes.len();
                for _ in 0..cap {
                    self.nodes.push(Node { hash: 0, holders: holders::EMPTY, tick: AtomicU32::new(0), parent: FREE, children: 0 });
                }
                b
            }
        };
        for k in 0..len {
            let old = start + k;
            let n = &mut self.nodes[old];
            let moved = Node {
                hash: n.hash,
                holders: n.holders,
                tick: AtomicU32::new(n.tick.load(Relaxed)),
                parent: if k == 0 { n.parent } else { (base + k - 1) as u32 },
                children: n.children,
            };
            n.parent = FREE;
            n.holders = holders::EMPTY;
            n.children = 0;
            let h = moved.hash;
            self.nodes[base + k] = moved;
            if let Some(e) = self.table.find_mut(mix(h), |&j| j as usize == old) {
                *e = (base + k) as u32;
            }
        }
        // The old slots are free for anyone (and so are slots reserved after them, if any).
        self.release_reserved(start + len);
        for old in start..start + len {
            self.free.push(old as u32);
        }
        for k in len + 1..cap {
            self.nodes[base + k].children = RESERVED;
        }
        Some(((base + len) as u32, (base + len - 1) as u32))
    }

    /// `n` consecutive slots from the top of the free list, if its last `n` entries are that.
    fn take_free_stretch(&mut self, n: usize) -> Option<usize> {
        let top = self.free.len().checked_sub(n)?;
        let first = self.free[top];
        if !self.free[top..].iter().enumerate().all(|(k, &v)| v == first + k as u32) {
            return None;
        }
        self.free.truncate(top);
        Some(first as usize)
    }

    /// Returns the reserved slots from `i` on to the free list (their run lost its tail).
    fn release_reserved(&mut self, mut i: usize) {
        while self.is_reserved(i) {
            self.nodes[i].children = 0;
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
        if prev >= FREE || self.nodes[prev as usize].children != 0 {
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
            let nodes = &self.nodes;
            let vacant = match self.table.entry(mix(h), |&i| nodes[i as usize].hash == h, |&i| mix(nodes[i as usize].hash)) {
                hashbrown::hash_table::Entry::Occupied(_) => break,
                hashbrown::hash_table::Entry::Vacant(v) => v,
            };
            // Written as having one child (the next one); the last is corrected below.
            let node = Node { hash: h, holders: hold, tick: AtomicU32::new(tick), parent: p as u32, children: 1 };
            if at_end {
                self.nodes.push(node);
            } else {
                self.nodes[after] = node;
            }
            vacant.insert(after as u32);
            p = after;
        }
        let n = p - prev as usize;
        if n > 0 {
            self.nodes[prev as usize].children = 1;
            self.nodes[p].children = 0;
            self.live += n;
            self.bump(slot, n as i64);
        }
        n
    }

    /// Gives node `i`, created holder-less by this store, its first holder (slot, tier): an
    /// `add_holder` without the arena's cases.
    #[inline]
    pub fn first_holder(&mut self, i: u32, slot: u32, tier: TierMask) {
        let n = &mut self.nodes[i as usize];
        debug_assert!(holders::is_empty(n.holders));
        n.holders = holders::single(slot, tier);
        self.bump(slot, 1);
    }

    /// Adds (slot, tier) to node `i`; returns (new entry, duplicate).
    pub fn add_holder(&mut self, i: u32, slot: u32, tier: TierMask) -> (bool, bool) {
        let h = self.nodes[i as usize].holders;
        let (nh, added) = self.arena.add(h, slot, tier);
        self.nodes[i as usize].holders = nh;
        if added.new_entry {
            self.bump(slot, 1);
        }
        (added.new_entry, added.duplicate)
    }

    /// Removes (slot, tiers) from node `i`; returns whether an entry went away. A node left
    /// with no holders and no children is deleted, and so are its ancestors that become so.
    /// Returns the number of nodes deleted as the second value.
    pub fn remove_holder(&mut self, i: u32, slot: u32, tiers: TierMask) -> (bool, usize) {
        let h = self.nodes[i as usize].holders;
        let (nh, gone) = self.arena.remove(h, slot, tiers);
        self.nodes[i as usize].holders = nh;
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
            if !holders::is_empty(n.holders) || n.children != 0 {
                return deleted;
            }
            let parent = n.parent;
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
        self.arena.list(self.nodes[i as usize].holders, &mut list);
        for (slot, _) in list {
            self.bump(slot, -1);
        }
        let parent = self.nodes[i as usize].parent;
        self.delete(i);
        parent
    }

    fn delete(&mut self, i: u32) {
        let (h, parent, hold) = {
            let n = &self.nodes[i as usize];
            debug_assert_eq!(n.children, 0);
            (n.hash, n.parent, n.holders)
        };
        self.arena.drop_holders(hold);
        if let Ok(entry) = self.table.find_entry(mix(h), |&j| j == i) {
            entry.remove();
        }
        if parent < FREE {
            self.nodes[parent as usize].children -= 1;
        }
        if parent == ORPHAN {
            self.orphan_parent.remove(&i);
        }
        let n = &mut self.nodes[i as usize];
        n.parent = FREE;
        n.holders = holders::EMPTY;
        n.children = 0;
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
            if n.parent == FREE || self.arena.tiers(n.holders, slot) == 0 {
                continue;
            }
            let (nh, gone) = self.arena.remove(n.holders, slot, holders::ANY_TIER);
            self.nodes[i as usize].holders = nh;
            if gone {
                entries += 1;
                self.bump(slot, -1);
            }
            if holders::is_empty(nh) {
                emptied.push(i);
            }
        }
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
            if self.nodes[start].parent == FREE || depth[start] != u32::MAX {
                continue;
            }
            let mut i = start;
            loop {
                let p = self.nodes[i].parent;
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
        let mut order: Vec<u32> = (0..n as u32).filter(|&i| self.nodes[i as usize].parent != FREE).collect();
        order.sort_by_key(|&i| depth[i as usize]);
        order
    }

    pub fn bytes(&self) -> usize {
        self.nodes.bytes()
            + self.free.capacity() * 4
            + self.table.capacity() * (4 + 1)
            + self.arena.bytes()
            + self.counts.capacity() * 8
            + self.orphan_parent.capacity() * 13
    }

    /// Halves every tick (order kept) when the clock nears wrapping.
    pub fn halve_ticks(&mut self) {
        for n in self.nodes.iter_mut() {
            *n.tick.get_mut() >>= 1;
        }
    }

    pub fn touch(&self, i: u32, clock: u32) {
        let t = &self.nodes[i as usize].tick;
        if t.load(Relaxed) != clock {
            t.store(clock, Relaxed);
        }
    }
}
