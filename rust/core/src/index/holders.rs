//! Per-node worker membership: which workers hold a block, and on which tiers.
//! One worker is encoded inline in a `u32`; more spill into a per-shard bitset arena.

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

#[inline]
fn tag(h: Holders) -> u32 {
    h >> TAG_SHIFT
}

#[inline]
fn single(slot: u32, tiers: TierMask) -> Holders {
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
/// each `stride` words long, bit `slot % 64` of word `slot / 64`.
#[derive(Default)]
pub(crate) struct HolderArena {
    sets: Vec<Vec<u64>>,
    free: Vec<u32>,
}

impl HolderArena {
    fn alloc(&mut self, stride: usize) -> u32 {
        let words = vec![0u64; 3 * stride];
        match self.free.pop() {
            Some(i) => {
                self.sets[i as usize] = words;
                i
            }
            None => {
                self.sets.push(words);
                (self.sets.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, i: u32) {
        self.sets[i as usize] = Vec::new();
        self.free.push(i);
    }

    fn set_bit(&mut self, i: u32, slot: u32, tiers: TierMask) {
        let set = &mut self.sets[i as usize];
        let word = slot as usize / 64;
        let stride = set.len() / 3;
        if word >= stride {
            let new_stride = word + 1;
            let mut grown = vec![0u64; 3 * new_stride];
            for t in 0..3 {
                grown[t * new_stride..t * new_stride + stride].copy_from_slice(&set[t * stride..(t + 1) * stride]);
            }
            *set = grown;
        }
        let stride = set.len() / 3;
        for t in 0..3 {
            if tiers & (1 << t) != 0 {
                set[t * stride + word] |= 1u64 << (slot % 64);
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
        self.sets.capacity() * std::mem::size_of::<Vec<u64>>()
            + self.sets.iter().map(|s| s.capacity() * 8).sum::<usize>()
            + self.free.capacity() * 4
    }

    /// Adds `slot` on tier `tier` to holders `h`; returns the new encoding.
    pub fn add(&mut self, h: Holders, slot: u32, tier: TierMask) -> (Holders, Added) {
        match tag(h) {
            0 => (single(slot, tier), Added { new_entry: true, duplicate: false }),
            TAG_SINGLE => {
                let (s, t) = single_parts(h);
                if s == slot {
                    (single(s, t | tier), Added { new_entry: false, duplicate: t & tier == tier })
                } else {
                    let stride = (s.max(slot) as usize) / 64 + 1;
                    let i = self.alloc(stride);
                    self.set_bit(i, s, t);
                    self.set_bit(i, slot, tier);
                    ((TAG_MANY << TAG_SHIFT) | i, Added { new_entry: true, duplicate: false })
                }
            }
            _ => {
                let i = h & !(3 << TAG_SHIFT);
                let before = self.tiers_of(i, slot);
                self.set_bit(i, slot, tier);
                (h, Added { new_entry: before == 0, duplicate: before & tier == tier })
            }
        }
    }

    /// Removes `slot` from `tiers` of holders `h`. Returns the new encoding and whether the
    /// worker held the block before and no longer holds it on any tier.
    pub fn remove(&mut self, h: Holders, slot: u32, tiers: TierMask) -> (Holders, bool) {
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
                let set = &mut self.sets[i as usize];
                let stride = set.len() / 3;
                let word = slot as usize / 64;
                for t in 0..3 {
                    if tiers & (1 << t) != 0 {
                        set[t * stride + word] &= !(1u64 << (slot % 64));
                    }
                }
                let gone = before & !tiers == 0;
                (self.shrink(i), gone)
            }
        }
    }

    /// Re-encodes spilled set `i` as empty or single when it has at most one holder left.
    fn shrink(&mut self, i: u32) -> Holders {
        let set = &self.sets[i as usize];
        let stride = set.len() / 3;
        let mut count = 0u32;
        let mut only = (0u32, 0u8);
        for w in 0..stride {
            let any = set[w] | set[stride + w] | set[2 * stride + w];
            count += any.count_ones();
            if count > 1 {
                return (TAG_MANY << TAG_SHIFT) | i;
            }
            if any != 0 {
                let slot = w as u32 * 64 + any.trailing_zeros();
                only = (slot, self.tiers_of(i, slot));
            }
        }
        self.release(i);
        if count == 0 {
            EMPTY
        } else {
            single(only.0, only.1)
        }
    }

    /// Frees whatever `h` owns (before a node is deleted).
    pub fn drop_holders(&mut self, h: Holders) {
        if tag(h) == TAG_MANY {
            self.release(h & !(3 << TAG_SHIFT));
        }
    }

    /// Word `w` of the bitset of workers holding the block on any tier in `mask`.
    #[inline]
    pub fn word(&self, h: Holders, mask: TierMask, w: usize) -> u64 {
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
                let set = &self.sets[(h & !(3 << TAG_SHIFT)) as usize];
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
}
