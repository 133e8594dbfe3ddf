//! Node storage in fixed-size chunks that never move and are freed only with the index: growth
//! never copies nodes, wastes at most one partly filled chunk, and lets matches read nodes
//! without a lock (every node field is an atomic; slots not yet used hold free nodes).
//!
//! The writer (holding its shard's lock) indexes its own list of chunk pointers; readers go
//! through a `ChunkDir`, an immutable copy of that list published in `Shared::chunks` whenever a
//! chunk is added, the old copy retired through the epoch.
//!
//! Beside each chunk of nodes, an index with `max_nodes` keeps a chunk of recency ticks (a
//! `u32` per slot): eviction is their only reader, so an index without it keeps none and a node
//! costs 16 bytes, not 20. A node's child count is in its `hp` word as a class (0, 1, 2, or 3 for
//! "3 or more"); the counts of the few nodes with 3 or more (branch points) are kept here.
//!
//! Run words. Beside each chunk, one word per aligned group of `RUN` slots names the stretch of the
//! group that forms a uniform run: consecutive slots, each after the first the child of the slot
//! before it, all with the same holders encoding (`RunWord`: start, end, holders, and whether the
//! group's first slot continues the group before, so runs are followed across groups). A match that has
//! reached a slot inside such a run checks only the run's last slot it needs (its hash, parent and
//! holders): sequence hashes identify their whole prefix, so a hash found at the end of a chain of
//! parent links from the match's block means every block between is the request's too, and the
//! word says they all have the match's holders. The writer keeps the words conservative: before it
//! changes a slot it cuts the word back to the slots before it (`run_cut`), and after, it extends the
//! word over the slots that continue it (`run_grow`). A match that read a word before a cut saw the
//! group as it was then, as a slot-by-slot walk that read those slots then would have.

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Owned};

use super::holders::{self, Holders};
use super::shard::{unpack, Node, NodeVal, Shared, FREE};

const CHUNK_BITS: u32 = 12;
pub(crate) const CHUNK: usize = 1 << CHUNK_BITS;
/// Slots per run word (see the module docs).
const RUN_BITS: u32 = 6;
pub(crate) const RUN: usize = 1 << RUN_BITS;
const RUNS_PER_CHUNK: usize = CHUNK / RUN;

/// A chunk's run words, all empty.
fn alloc_runs() -> NonNull<AtomicU64> {
    alloc_zeroed(RUNS_PER_CHUNK)
}

/// Frees run words made by `alloc_runs`.
///
/// # Safety
/// As `free_chunk`.
unsafe fn free_runs(c: NonNull<AtomicU64>) {
    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(c.as_ptr(), RUNS_PER_CHUNK)));
}

/// The run word of slot `i`'s group (`None` past the last chunk).
#[inline]
fn run_word(runs: &[NonNull<AtomicU64>], i: usize) -> Option<&AtomicU64> {
    let c = runs.get(i >> CHUNK_BITS)?;
    // SAFETY: a chunk's run words outlive the list that names them; the index stays inside them.
    Some(unsafe { &*c.as_ptr().add((i & (CHUNK - 1)) >> RUN_BITS) })
}

/// A group's run word: the uniform run `[start, end)` (offsets in the group; empty when equal),
/// its holders, and `linked`: the group's first slot is in the run and its parent is the slot
/// before it (so a run that reaches the end of the group before continues into this one).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct RunWord {
    holders: Holders,
    start: usize,
    end: usize,
    linked: bool,
}

impl RunWord {
    const EMPTY: RunWord = RunWord { holders: 0, start: 0, end: 0, linked: false };

    #[inline]
    fn pack(self) -> u64 {
        self.holders as u64 | (self.start as u64) << 32 | (self.end as u64) << 40 | (self.linked as u64) << 48
    }
    #[inline]
    fn unpack(w: u64) -> Self {
        RunWord { holders: w as u32, start: (w >> 32) as u8 as usize, end: (w >> 40) as u8 as usize, linked: w >> 48 & 1 == 1 }
    }
}

// Chunked storage, shared by node chunks and tick chunks: each pointer names CHUNK initialised
// values that are freed only with the index (or, unpublished, with their `FreshChunk`).

/// A fresh chunk of `n` values, all zero bits, which must be a valid `T` (atomics; a free `Node`,
/// see `node::PARENT_BIAS`). Allocated zeroed, so that the allocator can hand out fresh pages
/// untouched: a shard's first chunk costs only the pages its slots use (a small index's 16 shards
/// no longer fault in 1 MiB of free nodes on their first stores).
fn alloc_zeroed<T>(n: usize) -> NonNull<T> {
    let layout = std::alloc::Layout::array::<T>(n).expect("chunk layout");
    // SAFETY: a non-zero size; all-zero bits are a valid `T` for every `T` this is used with.
    let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
}

/// A fresh chunk of CHUNK values, all zero bits (see `alloc_zeroed`).
fn alloc_chunk<T>() -> NonNull<T> {
    alloc_zeroed(CHUNK)
}

/// Frees a chunk made by `alloc_chunk`.
///
/// # Safety
/// `c` came from `alloc_chunk`, is freed once, and nothing reads it any more.
unsafe fn free_chunk<T>(c: NonNull<T>) {
    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(c.as_ptr(), CHUNK)));
}

/// Slot `i` of chunked storage (`None` past the last chunk).
#[inline]
fn slot<T>(chunks: &[NonNull<T>], i: usize) -> Option<&T> {
    let c = chunks.get(i >> CHUNK_BITS)?;
    // SAFETY: a chunk holds CHUNK initialised values and outlives the list that names it.
    Some(unsafe { &*c.as_ptr().add(i & (CHUNK - 1)) })
}

/// Slots `i..` up to the end of `i`'s chunk (empty past the last chunk).
#[inline]
fn slots_from<T>(chunks: &[NonNull<T>], i: usize) -> &[T] {
    match chunks.get(i >> CHUNK_BITS) {
        // SAFETY: as in `slot`; the slice stays inside the chunk.
        Some(c) => unsafe {
            let off = i & (CHUNK - 1);
            std::slice::from_raw_parts(c.as_ptr().add(off), CHUNK - off)
        },
        None => &[],
    }
}

/// Chunk pointers as readers see them: immutable once published.
pub(crate) struct ChunkDir {
    chunks: Box<[NonNull<Node>]>,
    /// The tick chunks (empty in an index that keeps no recency).
    ticks: Box<[NonNull<AtomicU32>]>,
    /// The run words of each chunk.
    runs: Box<[NonNull<AtomicU64>]>,
}

// SAFETY: the pointers name chunks of atomics that live as long as the index (`Shared`'s drop
// frees them); sharing or sending the list of them across threads is sound.
unsafe impl Send for ChunkDir {}
unsafe impl Sync for ChunkDir {}

impl ChunkDir {
    pub fn empty() -> Self {
        ChunkDir { chunks: Box::new([]), ticks: Box::new([]), runs: Box::new([]) }
    }

    /// The last slot of the uniform run with holders `holders` that slot `s` continues, if a run
    /// word says `s` is inside one and is not its first slot (so `s`'s parent is the slot before
    /// it); the run followed into the groups after while their words continue it.
    #[inline]
    pub fn run_end(&self, s: usize, holders: Holders) -> Option<usize> {
        let w = RunWord::unpack(run_word(&self.runs, s)?.load(Acquire));
        let off = s & (RUN - 1);
        if w.holders != holders || off <= w.start || off >= w.end {
            return None;
        }
        let mut group = s - off;
        let mut end = w.end;
        while end == RUN {
            let Some(next) = run_word(&self.runs, group + RUN) else { break };
            let n = RunWord::unpack(next.load(Acquire));
            if !(n.linked && n.holders == holders && n.start == 0 && n.end > 0) {
                break;
            }
            group += RUN;
            end = n.end;
        }
        Some(group + end - 1)
    }

    #[inline]
    pub fn get(&self, i: usize) -> Option<&Node> {
        slot(&self.chunks, i)
    }

    /// Slots `i..` up to the end of `i`'s chunk (empty past the last chunk).
    #[inline]
    pub fn chunk_tail(&self, i: usize) -> &[Node] {
        slots_from(&self.chunks, i)
    }

    /// Slot `i`'s recency tick (`None` in an index that keeps no recency).
    #[inline]
    pub fn tick(&self, i: usize) -> Option<&AtomicU32> {
        slot(&self.ticks, i)
    }

    /// Ticks of slots `i..` up to the end of `i`'s chunk (empty without recency).
    #[inline]
    pub fn tick_tail(&self, i: usize) -> &[AtomicU32] {
        slots_from(&self.ticks, i)
    }

    /// Frees every chunk. Only `Shared`'s drop calls this, when no reader is left.
    pub(crate) unsafe fn free_chunks(&self) {
        self.chunks.iter().for_each(|&c| free_chunk(c));
        self.ticks.iter().for_each(|&c| free_chunk(c));
        self.runs.iter().for_each(|&c| free_runs(c));
    }
}

/// A chunk of free nodes (and, with recency, its ticks), allocated before any lock is taken when
/// possible.
pub(crate) struct FreshChunk(NonNull<Node>, Option<NonNull<AtomicU32>>, NonNull<AtomicU64>);

// SAFETY: an unpublished chunk of atomics, owned by whoever holds this.
unsafe impl Send for FreshChunk {}

impl FreshChunk {
    fn new(ticks: bool) -> Self {
        FreshChunk(alloc_chunk(), ticks.then(alloc_chunk), alloc_runs())
    }
}

impl Drop for FreshChunk {
    fn drop(&mut self) {
        // SAFETY: never published (publishing forgets it), so this is its only owner.
        unsafe {
            free_chunk(self.0);
            self.1.into_iter().for_each(|t| free_chunk(t));
            free_runs(self.2);
        }
    }
}

pub(crate) struct Slab {
    chunks: Vec<NonNull<Node>>,
    /// One per chunk in an index that keeps recency, else empty.
    ticks: Vec<NonNull<AtomicU32>>,
    /// One per chunk: the run words (see the module docs).
    runs: Vec<NonNull<AtomicU64>>,
    recency: bool,
    len: usize,
    /// Child counts of the nodes whose class is 3 ("3 or more").
    many_kids: hashbrown::HashMap<u32, u32>,
    shared: Arc<Shared>,
}

// SAFETY: see `ChunkDir`; the writer's copy of the pointers is only used under the shard lock.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

impl Slab {
    /// `recency`: keep a tick per slot (an index with `max_nodes`).
    pub fn new(shared: Arc<Shared>, recency: bool) -> Self {
        Slab { chunks: Vec::new(), ticks: Vec::new(), runs: Vec::new(), recency, len: 0, many_kids: Default::default(), shared }
    }

    pub fn keeps_recency(&self) -> bool {
        self.recency
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Slots available without allocating a chunk.
    pub fn spare(&self) -> usize {
        self.chunks.len() * CHUNK - self.len
    }

    /// Fresh chunks for at least `n` more slots, allocated before, not while, a writer holds the
    /// shard (their pages are faulted in as slots are used).
    pub fn fresh_chunks(n: usize, recency: bool) -> Vec<FreshChunk> {
        (0..n.div_ceil(CHUNK)).map(|_| FreshChunk::new(recency)).collect()
    }

    /// Appends chunks after the last one and publishes the new list to readers.
    pub fn add_chunks(&mut self, chunks: Vec<FreshChunk>) {
        for c in chunks {
            assert_eq!(c.1.is_some(), self.recency, "a chunk made for another kind of index");
            self.chunks.push(c.0);
            self.ticks.extend(c.1);
            self.runs.push(c.2);
            std::mem::forget(c);
        }
        let dir = Owned::new(ChunkDir {
            chunks: self.chunks.clone().into_boxed_slice(),
            ticks: self.ticks.clone().into_boxed_slice(),
            runs: self.runs.clone().into_boxed_slice(),
        });
        let guard = epoch::pin();
        let old = self.shared.chunks.swap(dir, std::sync::atomic::Ordering::AcqRel, &guard);
        // SAFETY: unlinked just now; readers that loaded it are pinned, so it is freed after them.
        unsafe { guard.defer_destroy(old) };
    }

    #[inline(always)]
    pub fn push(&mut self, v: NodeVal) {
        self.push_unruled(v);
        self.run_grow(self.len - 1);
    }

    /// `push` without extending the run words (see `fill_unruled`).
    #[inline(always)]
    pub fn push_unruled(&mut self, v: NodeVal) {
        if self.len == self.chunks.len() * CHUNK {
            self.add_chunks(vec![FreshChunk::new(self.recency)]);
        }
        self.len += 1;
        self.fill_unruled(self.len - 1, v);
    }

    /// Writes slot `i` (node, tick, child count) in one go.
    #[inline(always)]
    pub fn fill(&mut self, i: usize, v: NodeVal) {
        self.fill_unruled(i, v);
        self.run_grow(i);
    }

    /// `fill` that leaves the run words cut before `i` but not extended over it: for a writer that
    /// fills consecutive slots and then extends the words once (`grow_runs`). Words that stop
    /// short only make matches check more slots.
    #[inline(always)]
    pub fn fill_unruled(&mut self, i: usize, v: NodeVal) {
        self.set_tick(i, v.tick);
        let class = if v.children >= 3 {
            self.many_kids.insert(i as u32, v.children);
            3
        } else {
            if self[i].kids_class() == 3 {
                self.many_kids.remove(&(i as u32));
            }
            v.children
        };
        self.run_cut(i);
        self[i].fill(v.hash, v.holders, v.parent, class);
    }

    /// Extends the run words over slots `from..to`, just filled by `fill_unruled`.
    pub fn grow_runs(&self, from: usize, to: usize) {
        let mut i = from;
        while i < to {
            self.run_grow(i);
            i = (i | (RUN - 1)) + 1;
        }
    }

    /// Writer only: sets slot `i`'s holders.
    #[inline]
    pub fn set_holders(&self, i: usize, h: Holders) {
        self.run_cut(i);
        self[i].set_holders(h);
        self.run_grow(i);
    }

    /// Writer only: sets slot `i`'s parent.
    #[inline]
    pub fn set_parent(&self, i: usize, p: u32) {
        self.run_cut(i);
        self[i].set_parent(p);
        self.run_grow(i);
    }

    /// Before slot `i` changes: its group's run word stops short of it. (Then a fence, so that a
    /// match that sees the slot's new value, or anything the writer does after, sees the cut.)
    #[inline]
    fn run_cut(&self, i: usize) {
        let Some(w) = run_word(&self.runs, i) else { return };
        let mut r = RunWord::unpack(w.load(Relaxed));
        let off = i & (RUN - 1);
        if r.start <= off && off < r.end {
            r.end = off;
            if r.end == r.start {
                r = RunWord::EMPTY;
            }
            w.store(r.pack(), Relaxed);
            fence(Release);
        }
    }

    /// After slot `i` changed: if its group's run word ends just before it, or is empty, the word
    /// extends over it (or starts at it) and over the slots after it that continue the run.
    #[inline]
    fn run_grow(&self, i: usize) {
        let Some(w) = run_word(&self.runs, i) else { return };
        let old = RunWord::unpack(w.load(Relaxed));
        let off = i & (RUN - 1);
        let mut r = old;
        if r.start == r.end {
            let (h, p) = unpack(self[i].hp());
            // (A block created holder-less gets its holder right after: the word starts then.)
            if p == FREE || holders::is_empty(h) {
                return;
            }
            let linked = off == 0 && i > 0 && p as usize == i - 1;
            r = RunWord { holders: h, start: off, end: off + 1, linked };
        } else if off != r.end {
            return;
        }
        let group = i - off;
        let limit = RUN.min(self.len - group);
        while r.end < limit {
            let t = group + r.end;
            let (h, p) = unpack(self[t].hp());
            if p == FREE || h != r.holders || p as usize != t - 1 {
                break;
            }
            r.end += 1;
        }
        if r != old {
            w.store(r.pack(), Release);
        }
    }

    /// Slot `i` as plain values.
    pub fn val(&self, i: usize) -> NodeVal {
        let n = &self[i];
        NodeVal { hash: n.hash(), holders: n.holders(), tick: self.tick(i), parent: n.parent(), children: self.children(i) }
    }

    /// Marks slot `i` free (no holders, `FREE`, no children).
    #[inline]
    pub fn clear(&mut self, i: usize) {
        if self[i].kids_class() == 3 {
            self.many_kids.remove(&(i as u32));
        }
        self.run_cut(i);
        self[i].clear();
    }

    /// Children of slot `i`.
    #[inline]
    pub fn children(&self, i: usize) -> u32 {
        match self[i].kids_class() {
            3 => self.many_kids.get(&(i as u32)).copied().unwrap_or(3),
            c => c,
        }
    }

    /// Writer only: sets slot `i`'s child count.
    #[inline]
    pub fn set_children(&mut self, i: usize, c: u32) {
        let old = self[i].kids_class();
        if c >= 3 {
            self.many_kids.insert(i as u32, c);
            if old != 3 {
                self[i].set_kids_class(3);
            }
        } else {
            if old == 3 {
                self.many_kids.remove(&(i as u32));
            }
            if old != c {
                self[i].set_kids_class(c);
            }
        }
    }

    /// Slot `i`'s recency tick (0 in an index that keeps none).
    #[inline]
    pub fn tick(&self, i: usize) -> u32 {
        slot(&self.ticks, i).map_or(0, |t| t.load(Relaxed))
    }

    /// Sets slot `i`'s recency tick (nothing in an index that keeps none).
    #[inline]
    pub fn set_tick(&self, i: usize, t: u32) {
        if let Some(tick) = slot(&self.ticks, i) {
            tick.store(t, Relaxed);
        }
    }

    /// Halves every tick (order kept) when the clock nears wrapping.
    pub fn halve_ticks(&self) {
        for i in 0..self.len {
            self.set_tick(i, self.tick(i) >> 1);
        }
    }

    #[inline]
    pub fn get(&self, i: usize) -> Option<&Node> {
        (i < self.len).then(|| &self[i])
    }

    /// Slots `i..` up to the end of `i`'s chunk (or of the slab).
    #[inline]
    pub fn chunk_tail(&self, i: usize) -> &[Node] {
        if i >= self.len {
            return &[];
        }
        let off = i & (CHUNK - 1);
        let end = (self.len - (i - off)).min(CHUNK);
        // SAFETY: chunk `i >> CHUNK_BITS` exists (i < len) and holds CHUNK nodes.
        unsafe { std::slice::from_raw_parts(self.chunks[i >> CHUNK_BITS].as_ptr().add(off), end - off) }
    }

    /// The used part of each chunk, in slot order: chunk `c` holds slots `c * CHUNK ..`.
    pub fn chunks(&self) -> impl Iterator<Item = &[Node]> {
        (0..self.chunks.len()).map(move |c| self.chunk_tail(c * CHUNK)).filter(|s| !s.is_empty())
    }

    pub fn iter(&self) -> impl Iterator<Item = &Node> {
        self.chunks().flatten()
    }

    pub fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<Node>()
            + self.ticks.len() * CHUNK * 4
            + self.runs.len() * RUNS_PER_CHUNK * 8
            + (self.chunks.capacity() + self.ticks.capacity()) * 16
            + self.many_kids.capacity() * 9
    }
}

impl std::ops::Index<usize> for Slab {
    type Output = Node;
    #[inline]
    fn index(&self, i: usize) -> &Node {
        // SAFETY: bounds-checked against the allocated chunks (slots past `len` are free nodes).
        let c = self.chunks[i >> CHUNK_BITS];
        unsafe { &*c.as_ptr().add(i & (CHUNK - 1)) }
    }
}
