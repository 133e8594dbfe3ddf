//! Node storage in fixed-size chunks that never move and are freed only with the index: growth
//! never copies nodes, wastes at most one partly filled chunk, and lets matches read nodes
//! without a lock (every node field is an atomic; slots not yet used hold free nodes).
//!
//! The writer (holding its shard's lock) indexes its own list of chunk pointers; readers go
//! through a `ChunkDir`, an immutable copy of that list published in `Shared::chunks` whenever a
//! chunk is added, the old copy retired through the epoch.

use std::ptr::NonNull;
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Owned};

use super::shard::{Node, NodeVal, Shared};

const CHUNK_BITS: u32 = 12;
pub(crate) const CHUNK: usize = 1 << CHUNK_BITS;

/// Chunk pointers as readers see them: immutable once published.
pub(crate) struct ChunkDir {
    chunks: Box<[NonNull<Node>]>,
}

// SAFETY: the pointers name chunks of atomics that live as long as the index (`Shared`'s drop
// frees them); sharing or sending the list of them across threads is sound.
unsafe impl Send for ChunkDir {}
unsafe impl Sync for ChunkDir {}

impl ChunkDir {
    pub fn empty() -> Self {
        ChunkDir { chunks: Box::new([]) }
    }

    #[inline]
    pub fn get(&self, i: usize) -> Option<&Node> {
        let c = self.chunks.get(i >> CHUNK_BITS)?;
        // SAFETY: a chunk holds CHUNK initialised nodes and outlives `self` (see above).
        Some(unsafe { &*c.as_ptr().add(i & (CHUNK - 1)) })
    }

    /// Slots `i..` up to the end of `i`'s chunk (empty past the last chunk).
    #[inline]
    pub fn chunk_tail(&self, i: usize) -> &[Node] {
        match self.chunks.get(i >> CHUNK_BITS) {
            // SAFETY: as in `get`; the slice stays inside the chunk.
            Some(c) => unsafe {
                let off = i & (CHUNK - 1);
                std::slice::from_raw_parts(c.as_ptr().add(off), CHUNK - off)
            },
            None => &[],
        }
    }

    /// Frees every chunk. Only `Shared`'s drop calls this, when no reader is left.
    pub(crate) unsafe fn free_chunks(&self) {
        for c in self.chunks.iter() {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(c.as_ptr(), CHUNK)));
        }
    }
}

/// A chunk of free nodes, allocated and written before any lock is taken when possible.
pub(crate) struct FreshChunk(NonNull<Node>);

// SAFETY: an unpublished chunk of atomics, owned by whoever holds this.
unsafe impl Send for FreshChunk {}

impl FreshChunk {
    fn new() -> Self {
        let b: Box<[Node]> = (0..CHUNK).map(|_| Node::free()).collect();
        // SAFETY: `Box::into_raw` never returns null.
        FreshChunk(unsafe { NonNull::new_unchecked(Box::into_raw(b) as *mut Node) })
    }
}

impl Drop for FreshChunk {
    fn drop(&mut self) {
        // SAFETY: never published (publishing forgets it), so this is its only owner.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.0.as_ptr(), CHUNK))) }
    }
}

pub(crate) struct Slab {
    chunks: Vec<NonNull<Node>>,
    len: usize,
    shared: Arc<Shared>,
}

// SAFETY: see `ChunkDir`; the writer's copy of the pointers is only used under the shard lock.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

impl Slab {
    pub fn new(shared: Arc<Shared>) -> Self {
        Slab { chunks: Vec::new(), len: 0, shared }
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
    pub fn fresh_chunks(n: usize) -> Vec<FreshChunk> {
        (0..n.div_ceil(CHUNK)).map(|_| FreshChunk::new()).collect()
    }

    /// Appends chunks after the last one and publishes the new list to readers.
    pub fn add_chunks(&mut self, chunks: Vec<FreshChunk>) {
        for c in chunks {
            self.chunks.push(c.0);
            std::mem::forget(c);
        }
        let dir = Owned::new(ChunkDir { chunks: self.chunks.clone().into_boxed_slice() });
        let guard = epoch::pin();
        let old = self.shared.chunks.swap(dir, std::sync::atomic::Ordering::AcqRel, &guard);
        // SAFETY: unlinked just now; readers that loaded it are pinned, so it is freed after them.
        unsafe { guard.defer_destroy(old) };
    }

    #[inline(always)]
    pub fn push(&mut self, v: NodeVal) {
        if self.len == self.chunks.len() * CHUNK {
            self.add_chunks(vec![FreshChunk::new()]);
        }
        self[self.len].fill(v);
        self.len += 1;
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
        self.chunks.len() * CHUNK * std::mem::size_of::<Node>() + self.chunks.capacity() * 16
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
