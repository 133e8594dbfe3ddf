//! Per-node worker membership: which workers hold a block, and on which tiers.
//! One worker is encoded inline in a `u32`; more spill into a per-shard arena of interned bitsets.

use std::sync::atomic::{AtomicPtr, Ordering::AcqRel, Ordering::Acquire, Ordering::Release};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Owned};
use hashbrown::HashTable;
use parking_lot::Mutex;

use super::shard::{mix, Shared};

/// Storage tier of a cached block (vLLM's and SGLang's `medium`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Tier {
    Device = 0,
    Host = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    #[inline]
    pub fn bit(self) -> u8 {
        1 << (self as u8)
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }

    pub fn from_name(s: &str) -> Option<Tier> {
        match s {
            "device" => Some(Tier::Device),
            "host" => Some(Tier::Host),
            "disk" => Some(Tier::Disk),
            _ => None,
        }
    }
}

/// A set of tiers as a bit mask (`Tier::bit`).
pub type TierMask = u8;
pub const ANY_TIER: TierMask = 0b111;

/// Encoded holders: tag in bits 30..32; a single holder keeps its slot in bits 0..27 and its
/// tiers in bits 27..30; a spilled set keeps its arena index in bits 0..30.
pub(crate) type Holders = u32;

const TAG_SHIFT: u32 = 30;
const TAG_SINGLE: u32 = 1;
const TAG_MANY: u32 = 2;
const SLOT_BITS: u32 = 27;
/// Worker slots the inline encoding can name (distinct live workers in one index).
pub const MAX_WORKERS: u32 = 1 << SLOT_BITS;
pub(crate) const EMPTY: Holders = 0;

/// A spilled set's words as matches read them: immutable once published.
pub(crate) struct Set {
    words: Box<[u64]>,
}

/// Set index -> published set, read by matches without a lock (`Shared::sets`). The writer
/// publishes a set when it interns it. When the last block lets go of a set (after the blocks'
/// new encodings are written), its index is retired: handed out again only through the epoch,
/// once no reader that may have read an encoding naming it is still pinned; the set stays
/// published until then (it is replaced, and freed through the epoch, when the index is reused).
/// So a pinned reader that holds an encoding always finds that encoding's set, never another's.
pub(crate) struct SetDir {
    ptrs: Box<[AtomicPtr<Set>]>,
}

impl SetDir {
    pub fn with_capacity(n: usize) -> Self {
        SetDir { ptrs: (0..n).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect() }
    }

    #[inline]
    pub fn words(&self, i: u32) -> Option<&[u64]> {
        let p = self.ptrs.get(i as usize)?.load(Acquire);
        // SAFETY: a published set is freed only through the epoch after being unpublished, and
        // `self` is only reachable by a pinned reader or the lock holder.
        (!p.is_null()).then(|| unsafe { &*(*p).words })
    }

    /// Frees every published set. Only `Shared`'s drop calls this, when no reader is left.
    pub(crate) unsafe fn free_sets(&self) {
        for a in self.ptrs.iter() {
            let p = a.load(Acquire);
            if !p.is_null() {
                drop(Box::from_raw(p));
            }
        }
    }
}

/// A set pointer handed to the epoch for freeing.
struct Retired(*mut Set);
// SAFETY: the set was unpublished and is owned by the deferred function alone.
unsafe impl Send for Retired {}

/// Word `w` of holders `h`'s bitset on the tiers in `mask`, with spilled set words from `set`
/// (0 if it has none).
#[inline]
pub(crate) fn word_with<'a>(h: Holders, mask: TierMask, w: usize, set: impl FnOnce(u32) -> Option<&'a [u64]>) -> u64 {
    match tag(h) {
        0 => 0,
        TAG_SINGLE => {
            let (s, t) = single_parts(h);
            if s as usize / 64 == w && t & mask != 0 {
                1u64 << (s % 64)
            } else {
                0
            }
        }
        _ => {
            let Some(set) = set(h & !(3 << TAG_SHIFT)) else { return 0 };
            let stride = set.len() / 3;
            if w >= stride {
                return 0;
            }
            let mut out = 0;
            for t in 0..3 {
                if mask & (1 << t) != 0 {
                    out |= set[t * stride + w];
                }
            }
            out
        }
    }
}

#[inline]
fn tag(h: Holders) -> u32 {
    h >> TAG_SHIFT
}

#[inline]
pub(crate) fn single(slot: u32, tiers: TierMask) -> Holders {
    debug_assert!(slot < MAX_WORKERS);
    (TAG_SINGLE << TAG_SHIFT) | ((tiers as u32) << SLOT_BITS) | slot
}

#[inline]
fn single_parts(h: Holders) -> (u32, TierMask) {
    (h & (MAX_WORKERS - 1), ((h >> SLOT_BITS) & 0b111) as u8)
}

/// Outcome of adding a (worker, tier) to a block.
pub(crate) struct Added {
    /// The worker did not hold the block on any tier before.
    pub new_entry: bool,
    /// The worker already held the block on this tier.
    pub duplicate: bool,
}

/// Arena of spilled worker bitsets. A set is `[device words | host words | disk words]`,
/// each `stride` words long (the fewest that hold its highest slot), bit `slot % 64` of word
/// `slot / 64`.
///
/// Sets are interned: blocks with the same holders share one set (a session's blocks usually
/// do: every block a second worker prefilled holds the same two workers). That is one set per
/// holder pattern instead of one per block, and a match sees equal encodings on consecutive
/// blocks, so it skips their intersection and never reads the set again.
pub(crate) struct HolderArena {
    /// The writer's copy of each set's words (matches read the published copies).
    sets: Vec<Vec<u64>>,
    /// Blocks using each set; 0 for a free set.
    refs: Vec<u32>,
    free: Vec<u32>,
    /// Set indices by content.
    interned: HashTable<u32>,
    /// The set being built by `add`/`remove`, compared against interned ones before it is copied.
    scratch: Vec<u64>,
    /// The last `add` that led to a spilled set, and the last `remove` of a spilled set:
    /// consecutive blocks of a store mostly make the very same change (a session's {w1} blocks
    /// all become {w1, w2}), so repeating it needs no scratch set, content hash or probe.
    /// Interned sets never change while used, so a memo stays true until a set is freed (which
    /// clears both: a freed index may come back with other content).
    memo_add: Option<Memo>,
    memo_remove: Option<Memo>,
    shared: Arc<Shared>,
    /// Sets whose last user let go, to retire once the nodes' new encodings are written.
    pending: Vec<u32>,
    /// Set indices whose retirement the epoch has completed, to go back on `free`. A channel,
    /// not a lock: whichever thread runs the epoch's deferred work (a match, maybe) never waits.
    reclaimed_tx: Sender<u32>,
    reclaimed: Mutex<Receiver<u32>>,
}

impl Default for HolderArena {
    fn default() -> Self {
        Self::new(Arc::new(Shared::default()))
    }
}

/// A holder change `from` + (slot, tiers) -> `to`, and whether it added or removed an entry.
#[derive(Clone, Copy)]
struct Memo {
    from: Holders,
    slot: u32,
    tiers: TierMask,
    to: Holders,
    entry: bool,
}

impl Memo {
    #[inline]
    fn is(&self, from: Holders, slot: u32, tiers: TierMask) -> bool {
        self.from == from && self.slot == slot && self.tiers == tiers
    }
}

fn content_hash(words: &[u64]) -> u64 {
    words.iter().fold(words.len() as u64, |acc, &w| mix(acc ^ w))
}

impl HolderArena {
    pub fn new(shared: Arc<Shared>) -> Self {
        let (tx, rx) = channel();
        HolderArena {
            sets: Vec::new(),
            refs: Vec::new(),
            free: Vec::new(),
            interned: HashTable::new(),
            scratch: Vec::new(),
            memo_add: None,
            memo_remove: None,
            pending: Vec::new(),
            shared,
            reclaimed_tx: tx,
            reclaimed: Mutex::new(rx),
        }
    }

    /// Publishes set `i` (just written to `sets[i]`) for readers.
    fn publish(&mut self, i: u32) {
        // SAFETY: only the lock holder (this arena's owner) swaps the directory.
        let g = unsafe { epoch::unprotected() };
        let dir = unsafe { self.shared.sets.load(Acquire, g).deref() };
        let set = Box::into_raw(Box::new(Set { words: self.sets[i as usize].clone().into_boxed_slice() }));
        if (i as usize) < dir.ptrs.len() {
            let old = Retired(dir.ptrs[i as usize].swap(set, AcqRel));
            if !old.0.is_null() {
                // The set this index named before it was retired: no encoding names it any more
                // (the epoch's grace passed before the index came back), but free it through the
                // epoch all the same.
                epoch::pin().defer(move || {
                    let old = old;
                    // SAFETY: replaced above; owned by this deferred function alone.
                    drop(unsafe { Box::from_raw(old.0) });
                });
            }
            return;
        }
        let grown = SetDir::with_capacity((dir.ptrs.len() * 2).max(i as usize + 1).max(16));
        for (k, p) in dir.ptrs.iter().enumerate() {
            grown.ptrs[k].store(p.load(Acquire), Release);
        }
        grown.ptrs[i as usize].store(set, Release);
        let guard = epoch::pin();
        let old = self.shared.sets.swap(Owned::new(grown), AcqRel, &guard);
        // SAFETY: unlinked just now (its sets live on in the new directory); freed after readers.
        unsafe { guard.defer_destroy(old) };
    }

    /// Retires the sets whose last user let go: their indices come back to `free` once no reader
    /// can still hold an encoding that names them. The caller has written every node's new
    /// encoding first (a reader pinned after that cannot read the old one).
    pub fn retire_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let guard = epoch::pin();
        for i in self.pending.drain(..) {
            let reclaimed = self.reclaimed_tx.clone();
            guard.defer(move || {
                let _ = reclaimed.send(i);
            });
        }
    }

    /// A free set index, taking back those the epoch has released.
    fn free_index(&mut self) -> Option<u32> {
        if self.free.is_empty() {
            self.free.extend(self.reclaimed.get_mut().try_iter());
        }
        self.free.pop()
    }

    /// The encoding of the holders in `scratch` (trimmed to its canonical stride), sharing an
    /// interned set when one has the same content.
    fn intern_scratch(&mut self) -> Holders {
        let stride = self.scratch.len() / 3;
        let used = (0..stride).rev().find(|&w| (0..3).any(|t| self.scratch[t * stride + w] != 0)).map_or(0, |w| w + 1);
        if used < stride {
            for t in 1..3 {
                self.scratch.copy_within(t * stride..t * stride + used, t * used);
            }
            self.scratch.truncate(3 * used);
        }
        let stride = used;
        let count: u32 =
            (0..stride).map(|w| (self.scratch[w] | self.scratch[stride + w] | self.scratch[2 * stride + w]).count_ones()).sum();
        if count == 0 {
            return EMPTY;
        }
        if count == 1 {
            let w = (0..stride).find(|&w| (self.scratch[w] | self.scratch[stride + w] | self.scratch[2 * stride + w]) != 0).unwrap_or(0);
            let any = self.scratch[w] | self.scratch[stride + w] | self.scratch[2 * stride + w];
            let bit = any.trailing_zeros();
            let tiers = (0..3).filter(|&t| self.scratch[t * stride + w] >> bit & 1 != 0).fold(0u8, |m, t| m | 1 << t);
            return single(w as u32 * 64 + bit, tiers);
        }
        let hash = content_hash(&self.scratch);
        let sets = &self.sets;
        let scratch = &self.scratch;
        if let Some(&i) = self.interned.find(hash, |&i| sets[i as usize] == *scratch) {
            self.refs[i as usize] += 1;
            return (TAG_MANY << TAG_SHIFT) | i;
        }
        let words = scratch.clone();
        let i = match self.free_index() {
            Some(i) => {
                self.sets[i as usize] = words;
                self.refs[i as usize] = 1;
                i
            }
            None => {
                self.sets.push(words);
                self.refs.push(1);
                (self.sets.len() - 1) as u32
            }
        };
        self.publish(i);
        let sets = &self.sets;
        self.interned.insert_unique(hash, i, |&j| content_hash(&sets[j as usize]));
        (TAG_MANY << TAG_SHIFT) | i
    }

    /// Repeats the memoised change `m` for one more block: one more use of its result, one less
    /// of its origin.
    #[inline]
    fn repeat(&mut self, m: Memo) -> Holders {
        if tag(m.to) == TAG_MANY {
            self.refs[(m.to & !(3 << TAG_SHIFT)) as usize] += 1;
        }
        if tag(m.from) == TAG_MANY {
            self.release(m.from & !(3 << TAG_SHIFT));
        }
        m.to
    }

    /// Drops one block's use of set `i`, freeing it with the last.
    fn release(&mut self, i: u32) {
        self.refs[i as usize] -= 1;
        if self.refs[i as usize] > 0 {
            return;
        }
        self.memo_add = None;
        self.memo_remove = None;
        let hash = content_hash(&self.sets[i as usize]);
        if let Ok(e) = self.interned.find_entry(hash, |&j| j == i) {
            e.remove();
        }
        self.sets[i as usize] = Vec::new();
        self.pending.push(i);
    }

    /// Loads set `i` (or an empty set) into `scratch` with room for `slot`.
    fn scratch_from(&mut self, i: Option<u32>, slot: u32) {
        let old: &[u64] = i.map_or(&[], |i| &self.sets[i as usize]);
        let stride = old.len() / 3;
        let new_stride = stride.max(slot as usize / 64 + 1);
        self.scratch.clear();
        self.scratch.resize(3 * new_stride, 0);
        for t in 0..3 {
            self.scratch[t * new_stride..t * new_stride + stride].copy_from_slice(&old[t * stride..(t + 1) * stride]);
        }
    }

    /// Sets (`on`) or clears `slot`'s bits for `tiers` in `scratch`.
    fn scratch_bits(&mut self, slot: u32, tiers: TierMask, on: bool) {
        let stride = self.scratch.len() / 3;
        let word = slot as usize / 64;
        for t in 0..3 {
            if tiers & (1 << t) != 0 {
                let w = &mut self.scratch[t * stride + word];
                if on {
                    *w |= 1u64 << (slot % 64);
                } else {
                    *w &= !(1u64 << (slot % 64));
                }
            }
        }
    }

    /// Tiers on which `slot` holds the block, per set `i`.
    fn tiers_of(&self, i: u32, slot: u32) -> TierMask {
        let set = &self.sets[i as usize];
        let stride = set.len() / 3;
        let word = slot as usize / 64;
        if word >= stride {
            return 0;
        }
        let mut m = 0;
        for t in 0..3 {
            if set[t * stride + word] >> (slot % 64) & 1 != 0 {
                m |= 1 << t;
            }
        }
        m
    }

    pub fn bytes(&self) -> usize {
        // Each set twice (the writer's words and the published copy) plus the directory.
        self.sets.capacity() * (std::mem::size_of::<Vec<u64>>() + 8)
            + self.sets.iter().filter(|s| !s.is_empty()).map(|s| s.len() * 16 + 16).sum::<usize>()
            + self.refs.capacity() * 4
            + self.free.capacity() * 4
            + self.interned.capacity() * 5
            + self.scratch.capacity() * 8
    }

    /// Adds `slot` on tier `tier` to holders `h`; returns the new encoding. The old encoding is
    /// given up (its set released) unless it is returned unchanged.
    pub fn add(&mut self, h: Holders, slot: u32, tier: TierMask) -> (Holders, Added) {
        if let Some(m) = self.memo_add.filter(|m| m.is(h, slot, tier)) {
            return (self.repeat(m), Added { new_entry: m.entry, duplicate: false });
        }
        match tag(h) {
            0 => (single(slot, tier), Added { new_entry: true, duplicate: false }),
            TAG_SINGLE => {
                let (s, t) = single_parts(h);
                if s == slot {
                    (single(s, t | tier), Added { new_entry: false, duplicate: t & tier == tier })
                } else {
                    self.scratch_from(None, s.max(slot));
                    self.scratch_bits(s, t, true);
                    self.scratch_bits(slot, tier, true);
                    let nh = self.intern_scratch();
                    self.memo_add = Some(Memo { from: h, slot, tiers: tier, to: nh, entry: true });
                    (nh, Added { new_entry: true, duplicate: false })
                }
            }
            _ => {
                let i = h & !(3 << TAG_SHIFT);
                let before = self.tiers_of(i, slot);
                if before & tier == tier {
                    return (h, Added { new_entry: false, duplicate: true });
                }
                self.scratch_from(Some(i), slot);
                self.scratch_bits(slot, tier, true);
                let nh = self.intern_scratch();
                self.release(i);
                if tag(nh) == TAG_MANY && self.refs[(h & !(3 << TAG_SHIFT)) as usize] > 0 {
                    self.memo_add = Some(Memo { from: h, slot, tiers: tier, to: nh, entry: before == 0 });
                }
                (nh, Added { new_entry: before == 0, duplicate: false })
            }
        }
    }

    /// Removes `slot` from `tiers` of holders `h`. Returns the new encoding and whether the
    /// worker held the block before and no longer holds it on any tier. A set left with one
    /// holder becomes the inline encoding again.
    pub fn remove(&mut self, h: Holders, slot: u32, tiers: TierMask) -> (Holders, bool) {
        if let Some(m) = self.memo_remove.filter(|m| m.is(h, slot, tiers)) {
            return (self.repeat(m), m.entry);
        }
        match tag(h) {
            0 => (h, false),
            TAG_SINGLE => {
                let (s, t) = single_parts(h);
                if s != slot || t & tiers == 0 {
                    return (h, false);
                }
                let left = t & !tiers;
                if left == 0 {
                    (EMPTY, true)
                } else {
                    (single(s, left), false)
                }
            }
            _ => {
                let i = h & !(3 << TAG_SHIFT);
                let before = self.tiers_of(i, slot);
                if before & tiers == 0 {
                    return (h, false);
                }
                self.scratch_from(Some(i), slot);
                self.scratch_bits(slot, tiers, false);
                let nh = self.intern_scratch();
                self.release(i);
                let gone = before & !tiers == 0;
                if self.refs[i as usize] > 0 {
                    self.memo_remove = Some(Memo { from: h, slot, tiers, to: nh, entry: gone });
                }
                (nh, gone)
            }
        }
    }

    /// Spilled sets in use (tests: sharing and freeing).
    #[cfg(test)]
    pub fn live_sets(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    /// Frees whatever `h` owns (before a node is deleted).
    pub fn drop_holders(&mut self, h: Holders) {
        if tag(h) == TAG_MANY {
            self.release(h & !(3 << TAG_SHIFT));
        }
    }

    /// Word `w` of the bitset of workers holding the block on any tier in `mask`.
    #[cfg(test)]
    pub fn word(&self, h: Holders, mask: TierMask, w: usize) -> u64 {
        word_with(h, mask, w, |i| self.sets.get(i as usize).map(Vec::as_slice))
    }

    /// Tiers on which `slot` holds the block.
    pub fn tiers(&self, h: Holders, slot: u32) -> TierMask {
        match tag(h) {
            0 => 0,
            TAG_SINGLE => {
                let (s, t) = single_parts(h);
                if s == slot {
                    t
                } else {
                    0
                }
            }
            _ => self.tiers_of(h & !(3 << TAG_SHIFT), slot),
        }
    }

    /// Every (slot, tiers) holding the block.
    pub fn list(&self, h: Holders, out: &mut Vec<(u32, TierMask)>) {
        out.clear();
        match tag(h) {
            0 => {}
            TAG_SINGLE => out.push(single_parts(h)),
            _ => {
                let i = h & !(3 << TAG_SHIFT);
                let set = &self.sets[i as usize];
                let stride = set.len() / 3;
                for w in 0..stride {
                    let mut any = set[w] | set[stride + w] | set[2 * stride + w];
                    while any != 0 {
                        let slot = w as u32 * 64 + any.trailing_zeros();
                        out.push((slot, self.tiers_of(i, slot)));
                        any &= any - 1;
                    }
                }
            }
        }
    }
}

#[inline]
pub(crate) fn is_empty(h: Holders) -> bool {
    h == EMPTY
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_many_round_trip() {
        let mut a = HolderArena::default();
        let (h, r) = a.add(EMPTY, 3, Tier::Device.bit());
        assert!(r.new_entry);
        let (h, r) = a.add(h, 3, Tier::Device.bit());
        assert!(r.duplicate && !r.new_entry);
        let (h, r) = a.add(h, 130, Tier::Host.bit());
        assert!(r.new_entry);
        assert_eq!(a.word(h, ANY_TIER, 0), 1 << 3);
        assert_eq!(a.word(h, ANY_TIER, 2), 1 << 2);
        assert_eq!(a.word(h, Tier::Device.bit(), 2), 0);
        let mut l = Vec::new();
        a.list(h, &mut l);
        assert_eq!(l, vec![(3, 1), (130, 2)]);
        let (h, gone) = a.remove(h, 3, ANY_TIER);
        assert!(gone);
        assert_eq!(h >> TAG_SHIFT, 1, "shrinks back to a single holder");
        assert_eq!(a.tiers(h, 130), Tier::Host.bit());
        let (h, gone) = a.remove(h, 130, Tier::Device.bit());
        assert!(!gone);
        let (h, gone) = a.remove(h, 130, ANY_TIER);
        assert!(gone && is_empty(h));
    }

    #[test]
    fn equal_sets_are_shared_and_freed_with_their_last_user() {
        let mut a = HolderArena::default();
        let pair = |a: &mut HolderArena| {
            let (h, _) = a.add(EMPTY, 3, Tier::Device.bit());
            a.add(h, 70, Tier::Host.bit()).0
        };
        let (x, y) = (pair(&mut a), pair(&mut a));
        assert_eq!(x, y, "same holders, same set");
        assert_eq!(a.sets.iter().filter(|s| !s.is_empty()).count(), 1);
        // Adding to one block's set moves that block to a new set and leaves the other alone.
        let (z, r) = a.add(x, 5, Tier::Device.bit());
        assert!(r.new_entry && z != y);
        assert_eq!(a.word(y, ANY_TIER, 0), 1 << 3);
        assert_eq!(a.word(z, ANY_TIER, 0), 1 << 3 | 1 << 5);
        // Removing the worker again lands on the shared set.
        let (back, gone) = a.remove(z, 5, ANY_TIER);
        assert!(gone);
        assert_eq!(back, y);
        assert_eq!(a.sets.iter().filter(|s| !s.is_empty()).count(), 1, "the three-holder set was freed");
        // Removing slot 70 trims the stride and shrinks to the inline encoding.
        let (one, _) = a.remove(back, 70, ANY_TIER);
        assert_eq!(one >> TAG_SHIFT, TAG_SINGLE);
        a.drop_holders(y);
        assert!(a.sets.iter().all(|s| s.is_empty()), "no block uses a set any more");
        assert_eq!(a.interned.len(), 0);
        // A duplicate add keeps the encoding (and its reference) as it was.
        let p = pair(&mut a);
        let (q, r) = a.add(p, 70, Tier::Host.bit());
        assert!(r.duplicate && q == p);
        assert_eq!(a.refs[(p & !(3 << TAG_SHIFT)) as usize], 1);
    }
}
