//! A shard's free slab slots: a bitmap (one bit per slot, set when free), so that slots freed next
//! to each other form one stretch whatever order they were freed in, plus a stack of recently
//! freed slots for taking single ones quickly.
//!
//! Why a bitmap. Runs move to a stretch of free slots when they cannot grow in place
//! (`Shard::slot_under`), which is what keeps a session's blocks in consecutive slots. Under churn
//! (caches that overflow, so engines evict as they store) the free slots come from evictions, which
//! drop a chain's deepest block first: a stack of freed slots then holds each freed stretch in
//! descending order, and a stack-top check for an ascending stretch never found one. Runs could
//! only move to the slab's end until holes outnumbered live nodes, and from then on every new node
//! took a single hole: each block of a walk was a table probe and a cache miss (128-block matches
//! ~6x slower after churn than before it). The bitmap finds freed stretches as they are.

/// Most bitmap words one stretch search reads.
const SCAN_WORDS: usize = 64;

/// The free slots of one shard's slab.
#[derive(Default)]
pub(crate) struct FreeSlots {
    /// Bit `i % 64` of word `i / 64` is set when slot `i` is free.
    bits: Vec<u64>,
    /// Slots freed, most recent last (until a rebuild); may name slots taken since as part of a
    /// stretch (skipped), or a slot twice.
    stack: Vec<u32>,
    /// Free slots.
    count: usize,
    /// Where the next stretch search starts (a word index): next fit, so that successive searches
    /// do not rescan the same full words.
    cursor: usize,
}

impl FreeSlots {
    pub fn len(&self) -> usize {
        self.count
    }

    #[inline]
    fn is_free(&self, i: usize) -> bool {
        self.bits.get(i / 64).is_some_and(|w| w >> (i % 64) & 1 == 1)
    }

    /// Marks slot `i` free (it must not be already).
    #[inline]
    pub fn push(&mut self, i: u32) {
        let i = i as usize;
        if i / 64 >= self.bits.len() {
            self.bits.resize(i / 64 + 1, 0);
        }
        debug_assert!(!self.is_free(i), "slot {i} freed twice");
        self.bits[i / 64] |= 1 << (i % 64);
        self.count += 1;
        self.stack.push(i as u32);
        // Entries for slots a stretch took since are stale (and a slot freed again is named twice),
        // so once the stack is more than twice the free slots it is rebuilt from the bitmap: one
        // entry per free slot, at a cost the pushes since the last rebuild pay for.
        if self.stack.len() > 2 * self.count + 64 {
            self.stack.clear();
            for (w, &word) in self.bits.iter().enumerate() {
                let mut x = word;
                while x != 0 {
                    self.stack.push((w * 64) as u32 + x.trailing_zeros());
                    x &= x - 1;
                }
            }
        }
    }

    /// A free slot (the most recently freed one still free), taken.
    #[inline]
    pub fn pop(&mut self) -> Option<u32> {
        while let Some(i) = self.stack.pop() {
            if self.is_free(i as usize) {
                self.take(i as usize, 1);
                return Some(i);
            }
        }
        None
    }

    /// Marks `n` slots from `base` taken (all free).
    fn take(&mut self, base: usize, n: usize) {
        for i in base..base + n {
            debug_assert!(self.is_free(i));
            self.bits[i / 64] &= !(1 << (i % 64));
        }
        self.count -= n;
    }

    /// `n` consecutive free slots (`n >= 1`), taken, as the first one's index. Next fit: scans at
    /// most `SCAN_WORDS` words of the bitmap (4,096 slots) from where the last search stopped, so a
    /// search costs tens of nanoseconds whether or not it succeeds, and successive searches sweep
    /// the whole slab.
    pub fn take_stretch(&mut self, n: usize) -> Option<usize> {
        debug_assert!(n >= 1);
        let words = self.bits.len();
        if self.count < n || words == 0 {
            return None;
        }
        let start = self.cursor.min(words - 1);
        let (mut run_start, mut run_len) = (0usize, 0usize);
        for step in 0..words.min(SCAN_WORDS) {
            let w = (start + step) % words;
            if w == 0 {
                run_len = 0; // a stretch does not wrap around the slab's end
            }
            let word = self.bits[w];
            let mut b = 0u32;
            while b < 64 {
                let x = word >> b;
                if x & 1 == 1 {
                    let ones = x.trailing_ones().min(64 - b);
                    if run_len == 0 {
                        run_start = w * 64 + b as usize;
                    }
                    run_len += ones as usize;
                    if run_len >= n {
                        self.take(run_start, n);
                        self.cursor = (run_start + n) / 64 % words;
                        return Some(run_start);
                    }
                    b += ones;
                } else {
                    run_len = 0;
                    b += if x == 0 { 64 - b } else { x.trailing_zeros() };
                }
            }
            self.cursor = (w + 1) % words;
        }
        None
    }

    pub fn bytes(&self) -> usize {
        self.bits.capacity() * 8 + self.stack.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::FreeSlots;

    #[test]
    fn a_stretch_freed_deepest_first_is_found_whole() {
        let mut f = FreeSlots::default();
        for i in (100..140).rev() {
            f.push(i);
        }
        f.push(7);
        assert_eq!(f.take_stretch(40), Some(100));
        assert_eq!(f.len(), 1);
        assert_eq!(f.take_stretch(2), None);
        // The stack's entries for the taken slots are skipped.
        assert_eq!(f.pop(), Some(7));
        assert_eq!(f.pop(), None);
    }

    #[test]
    fn stretches_span_words_and_never_wrap() {
        let mut f = FreeSlots::default();
        for i in 60..200 {
            f.push(i);
        }
        for i in 250..256 {
            f.push(i);
        }
        for i in 0..4 {
            f.push(i);
        }
        assert_eq!(f.take_stretch(130), Some(60));
        // 10 left at 190..200, 6 at 250..256, 4 at 0..4: no 11, and 250..256 + 0..4 is not one.
        assert_eq!(f.take_stretch(11), None);
        assert_eq!(f.take_stretch(10), Some(190));
        assert_eq!(f.take_stretch(5), Some(250));
        assert_eq!(f.len(), 5);
        let mut rest: Vec<u32> = std::iter::from_fn(|| f.pop()).collect();
        rest.sort();
        assert_eq!(rest, vec![0, 1, 2, 3, 255]);
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn a_search_reads_a_bounded_part_of_the_bitmap_and_the_next_one_goes_on() {
        let mut f = FreeSlots::default();
        // Single free slots every other slot over 2 * SCAN_WORDS words, then one stretch of 16.
        let end = (2 * super::SCAN_WORDS * 64) as u32;
        for i in (0..end).step_by(2) {
            f.push(i);
        }
        for i in end..end + 16 {
            f.push(i);
        }
        // The first search reads the first SCAN_WORDS words only; the next goes on from there.
        assert_eq!(f.take_stretch(16), None);
        assert_eq!(f.take_stretch(16), None);
        assert_eq!(f.take_stretch(16), Some(end as usize));
    }

    #[test]
    fn the_stack_stays_bounded_when_stretches_take_what_it_names() {
        let mut f = FreeSlots::default();
        for round in 0..1000u32 {
            let base = (round % 50) * 100;
            for i in base..base + 64 {
                f.push(i);
            }
            // (A search reads SCAN_WORDS words at most; the next one goes on where it stopped.)
            let got = f.take_stretch(64).or_else(|| f.take_stretch(64));
            assert_eq!(got, Some(base as usize));
        }
        assert_eq!(f.len(), 0);
        assert!(f.stack.len() <= 2 * 64 + 64 + 1, "{}", f.stack.len());
    }

    #[test]
    fn a_slot_freed_taken_and_freed_again_is_popped_once() {
        let mut f = FreeSlots::default();
        for _ in 0..300 {
            for i in 0..8 {
                f.push(i);
            }
            assert_eq!(f.take_stretch(8), Some(0));
        }
        f.push(3);
        f.push(5);
        assert!(f.stack.len() <= 2 * 2 + 64 + 1, "{}", f.stack.len());
        let mut got: Vec<u32> = std::iter::from_fn(|| f.pop()).collect();
        got.sort();
        assert_eq!(got, vec![3, 5]);
    }
}
