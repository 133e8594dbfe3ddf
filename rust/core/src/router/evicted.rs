//! How likely a block an engine evicts is asked for again: the reuse the "capacity" policy charges
//! an eviction with.
//!
//! An LRU evicts its coldest block, so the chance that an *evicted* block comes back is not the
//! cache's hit rate: a cache whose hot prefixes are asked for by nearly every request (agents'
//! tool prefixes) can evict blocks nobody asks for again. This estimator measures the evicted
//! blocks themselves, as ARC's ghost lists do: the engines' removals (the index's removal log) go
//! into a bounded set of recently evicted block hashes; an arriving prompt whose blocks past
//! every worker's cached prefix are in that set asks for evicted blocks again (each is counted
//! once and leaves the set). The estimate is reused / evicted, both decaying averages over the
//! load window, so in a steady state it is the fraction of evictions that are asked for again,
//! however long after. A block evicted on two workers and asked for once is recomputed once: one
//! reuse for two evictions.
//!
//! Bounded: the set keeps the most recent `cap` evictions (the workers' prefix-cache sizes added
//! up: an eviction older than a whole cache's worth of later ones is one the cache would not have
//! kept either).

use std::collections::VecDeque;

use hashbrown::HashMap;

/// Fewest and most evictions the set remembers, whatever the caches' sizes.
const MIN_CAP: usize = 1 << 10;
const MAX_CAP: usize = 1 << 20;

pub struct EvictedReuse {
    /// Block hash -> serial of its latest eviction still remembered.
    set: HashMap<u64, u64>,
    /// (hash, serial) in eviction order; an entry whose serial is no longer the set's is stale.
    order: VecDeque<(u64, u64)>,
    serial: u64,
    /// Most evictions remembered, in [`MIN_CAP`, `MAX_CAP`].
    cap: usize,
    evicted: f64,
    reused: f64,
    at: Option<f64>,
}

impl Default for EvictedReuse {
    fn default() -> Self {
        EvictedReuse { set: HashMap::new(), order: VecDeque::new(), serial: 0, cap: MIN_CAP, evicted: 0.0, reused: 0.0, at: None }
    }
}

impl EvictedReuse {
    /// Remembers up to `blocks` evictions (clamped to [`MIN_CAP`, `MAX_CAP`]).
    pub fn set_capacity(&mut self, blocks: u64) {
        self.cap = (blocks as usize).clamp(MIN_CAP, MAX_CAP);
        self.trim();
    }

    fn trim(&mut self) {
        while self.set.len() > self.cap {
            let Some((h, s)) = self.order.pop_front() else { break };
            if self.set.get(&h) == Some(&s) {
                self.set.remove(&h);
            }
        }
        // Stale entries (re-evicted or asked for since) must not grow the queue without bound.
        if self.order.len() > 2 * self.cap {
            let set = &self.set;
            self.order.retain(|(h, s)| set.get(h) == Some(s));
        }
    }

    fn decay(&mut self, now: f64, tau: f64) {
        let keep = super::decay_since(&mut self.at, now, tau);
        self.evicted *= keep;
        self.reused *= keep;
    }

    /// An engine evicted block `hash` (its removal reached the index).
    pub fn evicted(&mut self, hash: u64, now: f64, tau: f64) {
        self.decay(now, tau);
        self.evicted += 1.0;
        self.serial += 1;
        self.set.insert(hash, self.serial);
        self.order.push_back((hash, self.serial));
        self.trim();
    }

    /// A prompt arrived whose blocks from `from` on are cached nowhere: the leading ones that were
    /// evicted are asked for again (the walk stops at the first block not remembered: an LRU
    /// drops a sequence's blocks tail first, so what was evicted of a prefix is one run).
    pub fn asked(&mut self, hashes: &[u64], from: usize, now: f64, tau: f64) {
        if self.set.is_empty() {
            return;
        }
        self.decay(now, tau);
        for h in hashes.get(from..).unwrap_or(&[]) {
            if self.set.remove(h).is_none() {
                break;
            }
            self.reused += 1.0;
        }
    }

    /// Drops every remembered eviction (the removal log was lost); the averages stay.
    pub fn forget(&mut self) {
        self.set.clear();
        self.order.clear();
    }

    /// The fraction of evicted blocks asked for again (0 before any eviction).
    pub fn p(&self) -> f64 {
        if self.evicted > 0.0 {
            (self.reused / self.evicted).min(1.0)
        } else {
            0.0
        }
    }

    /// Evictions remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.set.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_is_the_fraction_of_evictions_asked_for_again() {
        let mut e = EvictedReuse::default();
        e.set_capacity(0);
        assert_eq!(e.p(), 0.0);
        for h in 0..10 {
            e.evicted(h, 0.0, 10.0);
        }
        // A prompt whose blocks 2.. are cached nowhere: 2, 3, 4 were evicted, 99 was not; 5 after it is not counted.
        e.asked(&[0, 1, 2, 3, 4, 99, 5], 2, 0.0, 10.0);
        assert!((e.p() - 0.3).abs() < 1e-12, "{}", e.p());
        // Each eviction counts once.
        e.asked(&[2, 3, 4], 0, 0.0, 10.0);
        assert!((e.p() - 0.3).abs() < 1e-12);
        assert_eq!(e.len(), 7);
    }

    #[test]
    fn the_set_is_bounded_and_a_re_eviction_is_remembered_from_its_latest() {
        let mut e = EvictedReuse::default();
        e.set_capacity(0); // MIN_CAP
        e.evicted(7, 0.0, 10.0);
        for h in 1000..1000 + MIN_CAP as u64 - 1 {
            e.evicted(h, 0.0, 10.0);
        }
        e.evicted(7, 0.0, 10.0); // evicted again (stored and evicted once more)
        e.evicted(1, 0.0, 10.0); // one too many: the oldest live entry (1000) goes; 7's first is stale
        assert_eq!(e.len(), MIN_CAP);
        e.asked(&[7], 0, 0.0, 10.0);
        assert!(e.reused == 1.0);
        for h in 0..10 * MIN_CAP as u64 {
            e.evicted(5000 + h, 0.0, 10.0);
        }
        assert!(e.len() <= MIN_CAP && e.order.len() <= 2 * MIN_CAP + 1);
    }

    #[test]
    fn old_evictions_and_reuses_decay_together() {
        let mut e = EvictedReuse::default();
        e.set_capacity(0);
        for h in 0..4 {
            e.evicted(h, 0.0, 1.0);
        }
        e.asked(&[0, 1, 2, 3], 0, 0.0, 1.0); // all reused early
        for h in 10..14 {
            e.evicted(h, 50.0, 1.0); // much later: none reused
        }
        assert!(e.p() < 0.01, "{}", e.p());
    }
}
