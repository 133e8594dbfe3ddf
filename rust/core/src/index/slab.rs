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

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Owned};

use super::shard::{Node, NodeVal, Shared};

const CHUNK_BITS: u32 = 12;
pub(crate) const CHUNK: usize = 1 << CHUNK_BITS;

// Chunked storage, shared by node chunks and tick chunks: each pointer names CHUNK initialised
// values that are freed only with the index (or, unpublished, with their `FreshChunk`).

/// A fresh chunk of CHUNK values made by `init`.
fn alloc_chunk<T>(init: impl FnMut(usize) -> T) -> NonNull<T> {
    let b: Box<[T]> = (0..CHUNK).map(init).collect();
    // SAFETY: `Box::into_raw` never returns null.
    unsafe { NonNull::new_unchecked(Box::into_raw(b) as *mut T) }
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
}

// SAFETY: the pointers name chunks of atomics that live as long as the index (`Shared`'s drop
// frees them); sharing or sending the list of them across threads is sound.
unsafe impl Send for ChunkDir {}
unsafe impl Sync for ChunkDir {}

impl ChunkDir {
    pub fn empty() -> Self {
        ChunkDir { chunks: Box::new([]), ticks: Box::new([]) }
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
    }
}

/// A chunk of free nodes (and, with recency, its ticks), allocated and written before any lock
/// is taken when possible.
pub(crate) struct FreshChunk(NonNull<Node>, Option<NonNull<AtomicU32>>);

// SAFETY: an unpublished chunk of atomics, owned by whoever holds this.
unsafe impl Send for FreshChunk {}

impl FreshChunk {
    fn new(ticks: bool) -> Self {
        FreshChunk(alloc_chunk(|_| Node::free()), ticks.then(|| alloc_chunk(|_| AtomicU32::new(0))))
    }
}

impl Drop for FreshChunk {
    fn drop(&mut self) {
        // SAFETY: never published (publishing forgets it), so this is its only owner.
        unsafe {
            free_chunk(self.0);
            self.1.into_iter().for_each(|t| free_chunk(t));
        }
    }
}

pub(crate) struct Slab {
    chunks: Vec<NonNull<Node>>,
    /// One per chunk in an index that keeps recency, else empty.
    ticks: Vec<NonNull<AtomicU32>>,
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
        Slab { chunks: Vec::new(), ticks: Vec::new(), recency, len: 0, many_kids: Default::default(), shared }
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

    /// Fresh chunks for at least `n` more slots, with their nodes written (and so their pages
    /// faulted in) before, not while, a writer holds the shard.
    pub fn fresh_chunks(n: usize, recency: bool) -> Vec<FreshChunk> {
        (0..n.div_ceil(CHUNK)).map(|_| FreshChunk::new(recency)).collect()
    }

    /// Appends chunks after the last one and publishes the new list to readers.
    pub fn add_chunks(&mut self, chunks: Vec<FreshChunk>) {
        for c in chunks {
            assert_eq!(c.1.is_some(), self.recency, "a chunk made for another kind of index");
            self.chunks.push(c.0);
            self.ticks.extend(c.1);
            std::mem::forget(c);
        }
        let dir = Owned::new(ChunkDir { chunks: self.chunks.clone().into_boxed_slice(), ticks: self.ticks.clone().into_boxed_slice() });
        let guard = epoch::pin();
        let old = self.shared.chunks.swap(dir, std::sync::atomic::Ordering::AcqRel, &guard);
        // SAFETY: unlinked just now; readers that loaded it are pinned, so it is freed after them.
        unsafe { guard.defer_destroy(old) };
    }

    #[inline(always)]
    pub fn push(&mut self, v: NodeVal) {
        if self.len == self.chunks.len() * CHUNK {
            self.add_chunks(vec![FreshChunk::new(self.recency)]);
        }
        self.len += 1;
        self.fill(self.len - 1, v);
    }

    /// Writes slot `i` (node, tick, child count) in one go.
    #[inline(always)]
    pub fn fill(&mut self, i: usize, v: NodeVal) {
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
        self[i].fill(v.hash, v.holders, v.parent, class);
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
