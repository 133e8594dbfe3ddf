//! A shard's hash table (mixed hash -> slab index) that matches read without any lock while the
//! shard's one writer changes it: hashbrown's layout (a control byte of 7 hash bits per bucket,
//! groups of 8 probed together, tombstones for deletions; 5 bytes per bucket) with every byte
//! and slot an atomic. Unlike hashbrown, the number of groups need not be a power of two: a
//! key's home group is its low 32 hash bits scaled to the group count (the tag is the top 7), and
//! probing moves one group at a time, wrapping, so a table grows by half (`grown_size`) rather
//! than doubling: after a doubling a table is 44% full, which at one unlucky size put ~10 of a
//! node's ~26 bytes in the table. The writer publishes a slot before the control byte that names it
//! (release / acquire), so a reader that sees a full control byte sees its slot. Growth builds a
//! new table and swaps it in (`Shared::table`); the old one is freed by epoch reclamation once no
//! reader can hold it. A reader's answer is a candidate: it checks the node's hash itself, so a
//! stale or concurrently changed slot at worst misses.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};

const EMPTY: u8 = 0xFF;
const DELETED: u8 = 0x80;
const GROUP: usize = 8;
const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

#[inline]
fn h2(hash: u64) -> u8 {
    (hash >> 57) as u8
}

/// Bytes of `group` that may equal `b` (bit 7 of each such byte; rare false positives, which the
/// caller's key check filters, as in hashbrown's generic group).
#[inline]
fn match_byte(group: u64, b: u8) -> u64 {
    let x = group ^ (LO * b as u64);
    x.wrapping_sub(LO) & !x & HI
}

#[inline]
fn match_empty(group: u64) -> u64 {
    group & (group << 1) & HI
}

#[inline]
fn match_free(group: u64) -> u64 {
    group & HI
}

pub(crate) struct Table {
    ctrl: Box<[AtomicU64]>,
    slots: Box<[AtomicU32]>,
    groups: usize,
}

/// `hash`'s home group among `groups`.
#[inline]
fn home(hash: u64, groups: usize) -> usize {
    ((hash as u32 as u64 * groups as u64) >> 32) as usize
}

/// Largest number of items a table of `buckets` buckets takes (7/8, as hashbrown).
pub(crate) fn capacity_of(buckets: usize) -> usize {
    buckets / 8 * 7
}

/// Buckets (a multiple of the group size) for at least `items` items.
pub(crate) fn buckets_for(items: usize) -> usize {
    (items.max(1) * 8).div_ceil(7).div_ceil(GROUP).max(2) * GROUP
}

/// The size a full table of `buckets` grows to: half as large again (a multiple of the group).
pub(crate) fn grown_size(buckets: usize) -> usize {
    (buckets + buckets / 2).div_ceil(GROUP) * GROUP
}

impl Table {
    pub fn with_buckets(buckets: usize) -> Table {
        debug_assert!(buckets % GROUP == 0 && buckets >= GROUP);
        let groups = buckets / GROUP;
        Table {
            ctrl: (0..groups).map(|_| AtomicU64::new(u64::MAX)).collect(),
            slots: (0..buckets).map(|_| AtomicU32::new(0)).collect(),
            groups,
        }
    }

    /// The group after `pos`, wrapping.
    #[inline]
    fn next(&self, pos: usize) -> usize {
        if pos + 1 == self.groups {
            0
        } else {
            pos + 1
        }
    }

    pub fn buckets(&self) -> usize {
        self.slots.len()
    }

    /// Asks the CPU to start loading `hash`'s home group (control word and slots), for a lookup
    /// the caller expects to make soon: the load overlaps whatever the caller reads meanwhile.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let pos = home(hash, self.groups);
            // SAFETY: a prefetch is only a hint: it never faults, and both addresses are in bounds.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(self.ctrl.as_ptr().add(pos) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(self.slots.as_ptr().add(pos * GROUP) as *const i8);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = hash;
    }

    /// The slot whose key `eq` accepts, probing from `hash`.
    #[inline]
    pub fn find(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.find_bucket(hash, eq).map(|b| self.slots[b].load(Relaxed))
    }

    #[inline]
    fn find_bucket(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        let tag = h2(hash);
        let mut pos = home(hash, self.groups);
        let mut visited = 0;
        loop {
            let group = self.ctrl[pos].load(Acquire);
            let mut m = match_byte(group, tag);
            while m != 0 {
                let b = pos * GROUP + (m.trailing_zeros() / 8) as usize;
                if eq(self.slots[b].load(Relaxed)) {
                    return Some(b);
                }
                m &= m - 1;
            }
            if match_empty(group) != 0 {
                return None;
            }
            visited += 1;
            if visited == self.groups {
                return None; // every group visited (a table of tombstones)
            }
            pos = self.next(pos);
        }
    }

    /// Writer only: the slot `eq` accepts, or else the bucket where the key goes (the first empty
    /// or deleted one on its probe sequence; the table must have room), in one probe sequence.
    #[inline(always)]
    pub fn find_or_vacant(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Result<u32, usize> {
        let tag = h2(hash);
        let mut pos = home(hash, self.groups);
        let mut visited = 0;
        let mut vacant = None;
        loop {
            let group = self.ctrl[pos].load(Relaxed);
            let mut m = match_byte(group, tag);
            while m != 0 {
                let b = pos * GROUP + (m.trailing_zeros() / 8) as usize;
                let i = self.slots[b].load(Relaxed);
                if eq(i) {
                    return Ok(i);
                }
                m &= m - 1;
            }
            let free = match_free(group);
            if vacant.is_none() && free != 0 {
                vacant = Some(pos * GROUP + (free.trailing_zeros() / 8) as usize);
            }
            visited += 1;
            if match_empty(group) != 0 || visited == self.groups {
                return Err(vacant.unwrap_or_else(|| self.free_bucket(hash)));
            }
            pos = self.next(pos);
        }
    }

    /// Writer only: puts `i` in bucket `b` (from `find_or_vacant`, nothing changed since).
    /// Returns whether the bucket was empty (rather than a tombstone).
    #[inline]
    pub fn insert_at(&self, b: usize, hash: u64, i: u32) -> bool {
        let was_empty = (self.ctrl[b / GROUP].load(Relaxed) >> ((b % GROUP) * 8)) as u8 == EMPTY;
        self.slots[b].store(i, Relaxed);
        self.set_ctrl(b, h2(hash)); // release: the slot is visible to whoever sees the byte
        was_empty
    }

    /// Writer only: the first empty or deleted bucket on `hash`'s probe sequence.
    fn free_bucket(&self, hash: u64) -> usize {
        let mut pos = home(hash, self.groups);
        loop {
            let m = match_free(self.ctrl[pos].load(Relaxed));
            if m != 0 {
                return pos * GROUP + (m.trailing_zeros() / 8) as usize;
            }
            pos = self.next(pos);
        }
    }

    /// Writer only: sets bucket `b`'s control byte.
    #[inline]
    fn set_ctrl(&self, b: usize, byte: u8) {
        let (g, k) = (b / GROUP, (b % GROUP) * 8);
        let old = self.ctrl[g].load(Relaxed);
        self.ctrl[g].store((old & !(0xFF << k)) | ((byte as u64) << k), Release);
    }

    /// Writer only: inserts `i` (absent) under `hash`. Returns whether it took an empty bucket
    /// (rather than a tombstone), i.e. used up growth room.
    pub fn insert(&self, hash: u64, i: u32) -> bool {
        self.insert_at(self.free_bucket(hash), hash, i)
    }

    /// Writer only: removes the entry for which `eq` holds; whether there was one.
    pub fn remove(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> bool {
        match self.find_bucket(hash, eq) {
            Some(b) => {
                self.set_ctrl(b, DELETED);
                true
            }
            None => false,
        }
    }

    /// Writer only: points the entry for which `eq` holds at `i` instead.
    pub fn repoint(&self, hash: u64, eq: impl FnMut(u32) -> bool, i: u32) {
        if let Some(b) = self.find_bucket(hash, eq) {
            self.slots[b].store(i, Release);
        }
    }

    pub fn bytes(&self) -> usize {
        self.slots.len() * 5
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_and_tombstones() {
        let t = Table::with_buckets(64);
        let key = |i: u32| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in 0..50u32 {
            assert!(t.insert(key(i), i));
        }
        for i in 0..50u32 {
            assert_eq!(t.find(key(i), |j| j == i), Some(i));
        }
        assert_eq!(t.find(key(77), |j| j == 77), None);
        for i in (0..50u32).step_by(2) {
            assert!(t.remove(key(i), |j| j == i));
        }
        for i in 0..50u32 {
            assert_eq!(t.find(key(i), |j| j == i).is_some(), i % 2 == 1, "{i}");
        }
        // A tombstone is reused and costs no growth room.
        assert!(!t.insert(key(0), 0));
        t.repoint(key(0), |j| j == 0, 1000);
        assert_eq!(t.find(key(0), |j| j == 1000), Some(1000));
        assert!(match_byte(u64::MAX, 0x7F) == 0);
    }

    /// Group counts that are not powers of two: filled to capacity (probes wrap past the last
    /// group), every key found, absent keys and a table of tombstones end their probe.
    #[test]
    fn any_group_count_fills_to_capacity_and_probes_wrap() {
        let key = |i: u32| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64) << 40;
        for groups in [2usize, 3, 5, 7, 12, 97] {
            let t = Table::with_buckets(groups * GROUP);
            let cap = capacity_of(t.buckets()) as u32;
            for i in 0..cap {
                assert!(t.insert(key(i), i));
            }
            for i in 0..cap {
                assert_eq!(t.find(key(i), |j| j == i), Some(i), "groups {groups}, key {i}");
            }
            assert_eq!(t.find(key(cap + 1), |j| j == cap + 1), None);
            for i in 0..cap {
                assert!(t.remove(key(i), |j| j == i));
            }
            assert_eq!(t.find(key(0), |j| j == 0), None);
        }
        assert_eq!(grown_size(64), 96);
        assert_eq!(grown_size(96), 144);
        assert!(capacity_of(buckets_for(1000)) >= 1000 && buckets_for(1000) % GROUP == 0);
    }
}
