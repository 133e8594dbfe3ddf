//! Node storage in fixed-size chunks: growth never moves or copies nodes, and wastes at most
//! one partly filled chunk (a doubling Vec would copy everything and waste up to half).

use std::ops::{Index, IndexMut};

const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;

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

    pub fn push(&mut self, v: T) {
        if self.len == self.chunks.len() * CHUNK {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks.last_mut().expect("a chunk with room").push(v);
        self.len += 1;
    }

    #[inline]
    pub fn get(&self, i: usize) -> Option<&T> {
        (i < self.len).then(|| &self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)])
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
