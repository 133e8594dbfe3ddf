//! A node of the index and its packed words: the sequence hash, and one atomic word holding the
//! encoded holders, the parent's slot and a child class; the reserved parent values (ROOT, ORPHAN, FREE).

use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};

use super::holders::{self, Holders};

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
const _: () = assert!(PARENT_BIAS == 3 && ROOT < 1 << PARENT_BITS);
// A free node is all zero bits (see `PARENT_BIAS`).
const _: () = assert!(holders::EMPTY == 0 && (FREE.wrapping_add(PARENT_BIAS) as u64 & PARENT_MASK) == 0);

/// A parent is stored plus `PARENT_BIAS` (wrapping in its 30 bits), so that `FREE` is stored as 0
/// and a free node is all zero bits: chunks are allocated zeroed, and their pages are touched only
/// when slots are used. Parents that are node indices stay in order, one apart per slot (a run's
/// expected `hp` words are the first plus `k << 32`, see `view::run_in`).
const PARENT_BIAS: u32 = (1 << PARENT_BITS) - FREE;

#[inline]
pub(crate) fn pack(holders: Holders, parent: u32) -> u64 {
    debug_assert!(parent as u64 <= PARENT_MASK);
    holders as u64 | ((parent.wrapping_add(PARENT_BIAS) as u64) & PARENT_MASK) << 32
}

/// (holders, parent) of an `hp` word.
#[inline]
pub(crate) fn unpack(hp: u64) -> (Holders, u32) {
    (hp as u32, (((hp >> 32) as u32).wrapping_sub(PARENT_BIAS)) & PARENT_MASK as u32)
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
    pub(crate) fn placeholder() -> Self {
        NodeVal { hash: 0, holders: holders::EMPTY, tick: 0, parent: FREE, children: 0 }
    }
}

impl Node {
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
        self.hp.store((old & !(PARENT_MASK << 32)) | (pack(0, p) & PARENT_MASK << 32), Release);
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
