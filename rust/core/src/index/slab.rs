//! Node storage in fixed-size chunks: growth never moves or copies nodes, and wastes at most
//! one partly filled chunk (a doubling Vec would copy everything and waste up to half).

use std::ops::{Index, IndexMut};

const CHUNK_BITS: u32 = 12;
pub(crate) const CHUNK: usize = 1 << CHUNK_BITS;

pub(crate) struct Slab<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { chunks: Vec::new(), len: 0 }
    }
}

impl<T> Slab<T> {
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Slots available without allocating a chunk.
    pub fn spare(&self) -> usize {
        self.chunks.len() * CHUNK - self.len
    }

    /// Empty chunks for at least `n` more slots, with their pages already touched, so that
    /// the page faults of a fresh chunk are taken before, not while, a writer holds the shard.
    pub fn prefaulted_chunks(n: usize) -> Vec<Vec<T>> {
        (0..n.div_ceil(CHUNK))
            .map(|_| {
                let mut v: Vec<T> = Vec::with_capacity(CHUNK);
                // SAFETY: writes zero bytes into the vector's own spare capacity; its length stays
                // 0, so the bytes are never read as `T`.
                unsafe { std::ptr::write_bytes(v.as_mut_ptr().cast::<u8>(), 0, CHUNK * std::mem::size_of::<T>()) };
                v
            })
            .collect()
    }

    /// Appends chunks made by `prefaulted_chunks` after the last (full) chunk.
    pub fn add_chunks(&mut self, chunks: Vec<Vec<T>>) {
        debug_assert_eq!(self.spare(), 0);
        self.chunks.extend(chunks);
    }

    #[inline(always)]
    pub fn push(&mut self, v: T) {
        let c = self.len >> CHUNK_BITS;
        if c == self.chunks.len() {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks[c].push(v);
        self.len += 1;
    }

    #[inline]
    pub fn get(&self, i: usize) -> Option<&T> {
        (i < self.len).then(|| &self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)])
    }

    /// Slots `i..` up to the end of `i`'s chunk (or of the slab): consecutive nodes in one slice,
    /// so that a walk along a run reads them without a chunk lookup per slot.
    #[inline]
    pub fn chunk_tail(&self, i: usize) -> &[T] {
        if i >= self.len {
            return &[];
        }
        &self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)..]
    }

    /// The chunks as slices, in slot order: chunk `c` holds slots `c * CHUNK ..`.
    pub fn chunks(&self) -> impl Iterator<Item = &[T]> {
        self.chunks.iter().map(Vec::as_slice)
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.chunks.iter_mut().flatten()
    }

    pub fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<T>() + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

impl<T> Index<usize> for Slab<T> {
    type Output = T;
    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]
    }
}

impl<T> IndexMut<usize> for Slab<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]
    }
}
