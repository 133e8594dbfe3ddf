//! Simulated prefill engines: per worker an LRU prefix cache and a FIFO queue in virtual time,
//! publishing block stored/removed events into a `KvIndex` as real engines do (optionally late).

use std::collections::VecDeque;
use std::sync::Arc;

use crate::index::{IndexError, KvIndex, Tier, WorkerId, ANY_TIER};

use super::lru::LruBlockCache;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SimError {
    #[error("worker index {0} is out of range (the cluster has {1} workers)")]
    UnknownWorker(usize, usize),
    #[error("time went backwards: now = {now} is before the last time {last}")]
    TimeWentBackwards { now: f64, last: f64 },
    #[error("invalid simulator setting: {0}")]
    Invalid(String),
    #[error("publishing a KV event failed: {0}")]
    Index(#[from] IndexError),
}

enum Event {
    Stored { worker: WorkerId, hashes: Vec<u64>, parent: Option<u64> },
    Removed { worker: WorkerId, hashes: Vec<u64> },
}

/// What one prefill did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prefill {
    /// Leading blocks found in the worker's cache.
    pub hit_blocks: usize,
    /// Prompt tokens served from cache (`min(hit_blocks * block_size, num_tokens)`).
    pub hit_tokens: usize,
    /// When the prefill starts (after the worker's queue drains) and finishes.
    pub start: f64,
    pub finish: f64,
}

/// The seed's prefill cluster: worker `i` (index) has cache `caches[i]` and a queue that is busy
/// until `busy_until[i]`; a prefill of `n` tokens with `h` cached takes `(n - h) / speed` seconds.
pub struct PrefillEngines {
    ids: Vec<WorkerId>,
    caches: Vec<LruBlockCache>,
    busy_until: Vec<f64>,
    speed: Vec<f64>,
    block_size: usize,
    index: Option<Arc<KvIndex>>,
    event_lag: f64,
    pending: VecDeque<(f64, Event)>,
    last_now: f64,
    stored: Vec<usize>,
    evicted: Vec<u64>,
    events_published: u64,
    /// One cache shared by every engine (`caches` has one entry); see `PrefillEngines::shared`.
    shared: bool,
}

impl PrefillEngines {
    /// `ids[i]` is the worker id engine `i` publishes events under.
    pub fn new(
        ids: Vec<WorkerId>,
        capacity_blocks: usize,
        tokens_per_s: f64,
        block_size: usize,
        index: Option<Arc<KvIndex>>,
        event_lag: f64,
    ) -> Result<Self, SimError> {
        if ids.is_empty() {
            return Err(SimError::Invalid("need at least one worker".into()));
        }
        if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
            return Err(SimError::Invalid(format!("prefill speed must be a positive number of tokens/s, got {tokens_per_s}")));
        }
        if block_size == 0 {
            return Err(SimError::Invalid("block_size must be >= 1".into()));
        }
        if !(event_lag.is_finite() && event_lag >= 0.0) {
            return Err(SimError::Invalid(format!("event_lag must be a finite number of seconds >= 0, got {event_lag}")));
        }
        let n = ids.len();
        Ok(PrefillEngines {
            ids,
            caches: (0..n).map(|_| LruBlockCache::new(capacity_blocks)).collect(),
            busy_until: vec![0.0; n],
            speed: vec![tokens_per_s; n],
            block_size,
            index,
            event_lag,
            pending: VecDeque::new(),
            last_now: f64::NEG_INFINITY,
            stored: Vec::new(),
            evicted: Vec::new(),
            events_published: 0,
            shared: false,
        })
    }

    /// An upper bound on what routing can gain from caching: the engines' queues as in `new`, but
    /// one LRU prefix cache of `capacity_blocks` x (number of engines) blocks that every engine
    /// reads and fills (as if the cluster had one global cache of the same total size, with no
    /// duplication). Every block event is published under every worker id, so the router's index
    /// sees each prefix on every worker.
    pub fn shared(
        ids: Vec<WorkerId>,
        capacity_blocks: usize,
        tokens_per_s: f64,
        block_size: usize,
        index: Option<Arc<KvIndex>>,
        event_lag: f64,
    ) -> Result<Self, SimError> {
        let n = ids.len();
        let mut e = Self::new(ids, capacity_blocks.saturating_mul(n.max(1)), tokens_per_s, block_size, index, event_lag)?;
        e.caches.truncate(1);
        e.shared = true;
        Ok(e)
    }

    /// Whether the engines share one cache (`PrefillEngines::shared`).
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// Which cache engine `i` reads and fills.
    #[inline]
    fn cache_of(&self, i: usize) -> usize {
        if self.shared {
            0
        } else {
            i
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn ids(&self) -> &[WorkerId] {
        &self.ids
    }

    pub fn busy_until(&self) -> &[f64] {
        &self.busy_until
    }

    pub fn cache(&self, i: usize) -> Result<&LruBlockCache, SimError> {
        self.check(i)?;
        Ok(&self.caches[self.cache_of(i)])
    }

    pub fn events_published(&self) -> u64 {
        self.events_published
    }

    pub fn pending_events(&self) -> usize {
        self.pending.len()
    }

    fn check(&self, i: usize) -> Result<(), SimError> {
        if i >= self.ids.len() {
            return Err(SimError::UnknownWorker(i, self.ids.len()));
        }
        Ok(())
    }

    fn check_time(&mut self, now: f64) -> Result<(), SimError> {
        if now.is_nan() || now < self.last_now {
            return Err(SimError::TimeWentBackwards { now, last: self.last_now });
        }
        self.last_now = now;
        Ok(())
    }

    /// The true cached prefix of `hashes` on engine `i`, in blocks.
    pub fn hit_blocks(&self, i: usize, hashes: &[u64]) -> Result<usize, SimError> {
        self.check(i)?;
        Ok(self.caches[self.cache_of(i)].prefix_len(hashes))
    }

    /// Publishes every event due by `now` (emitted at or before `now - event_lag`).
    pub fn advance(&mut self, now: f64) -> Result<(), SimError> {
        self.check_time(now)?;
        while let Some((due, _)) = self.pending.front() {
            if *due > now {
                break;
            }
            let (_, ev) = self.pending.pop_front().expect("front exists");
            self.apply(ev)?;
        }
        Ok(())
    }

    /// Publishes every pending event now, whatever its due time.
    pub fn flush(&mut self) -> Result<(), SimError> {
        while let Some((_, ev)) = self.pending.pop_front() {
            self.apply(ev)?;
        }
        Ok(())
    }

    fn apply(&mut self, ev: Event) -> Result<(), SimError> {
        let Some(index) = &self.index else { return Ok(()) };
        self.events_published += 1;
        match ev {
            Event::Stored { worker, hashes, parent } => {
                index.store(worker, &hashes, parent, Tier::Device)?;
            }
            Event::Removed { worker, hashes } => {
                index.remove(worker, &hashes, ANY_TIER);
            }
        }
        Ok(())
    }

    fn emit(&mut self, now: f64, ev: Event) -> Result<(), SimError> {
        if self.index.is_none() {
            return Ok(());
        }
        if self.event_lag == 0.0 {
            self.apply(ev)
        } else {
            self.pending.push_back((now + self.event_lag, ev));
            Ok(())
        }
    }

    /// Enqueues a prefill of a `num_tokens`-token prompt with block hashes `hashes` on engine `i`
    /// at time `now`: the seed's `busy = max(busy, now) + (num_tokens - hit) / speed`, then the
    /// prompt's blocks enter the cache (stored events for new blocks, removed for evicted ones).
    pub fn prefill(&mut self, i: usize, hashes: &[u64], num_tokens: usize, now: f64) -> Result<Prefill, SimError> {
        self.check(i)?;
        self.advance(now)?;
        let c = self.cache_of(i);
        let hit_blocks = self.caches[c].prefix_len(hashes);
        let hit_tokens = (hit_blocks * self.block_size).min(num_tokens);
        let start = self.busy_until[i].max(now);
        let finish = start + (num_tokens - hit_tokens) as f64 / self.speed[i];
        self.busy_until[i] = finish;
        let mut stored = std::mem::take(&mut self.stored);
        let mut evicted = std::mem::take(&mut self.evicted);
        stored.clear();
        evicted.clear();
        self.caches[c].access(hashes, &mut stored, &mut evicted);
        let workers: Vec<WorkerId> = if self.shared { self.ids.clone() } else { vec![self.ids[i]] };
        // New blocks as contiguous runs, each hung under the block before it, like engine events.
        let mut k = 0;
        while k < stored.len() {
            let first = stored[k];
            let mut end = k + 1;
            while end < stored.len() && stored[end] == stored[end - 1] + 1 {
                end += 1;
            }
            let last = stored[end - 1];
            let parent = (first > 0).then(|| hashes[first - 1]);
            for &worker in &workers {
                self.emit(now, Event::Stored { worker, hashes: hashes[first..=last].to_vec(), parent })?;
            }
            k = end;
        }
        let mut res = Ok(());
        if !evicted.is_empty() {
            for &worker in &workers {
                res = res.and_then(|_| self.emit(now, Event::Removed { worker, hashes: evicted.clone() }));
            }
        }
        self.stored = stored;
        self.evicted = evicted;
        res?;
        Ok(Prefill { hit_blocks, hit_tokens, start, finish })
    }

    /// Drops engine `i`'s cache (as on an engine restart), publishing the removals.
    pub fn clear(&mut self, i: usize, now: f64) -> Result<usize, SimError> {
        self.check(i)?;
        let c = self.cache_of(i);
        let all = self.caches[c].clear();
        let n = all.len();
        if n > 0 {
            let workers: Vec<WorkerId> = if self.shared { self.ids.clone() } else { vec![self.ids[i]] };
            for worker in workers {
                self.emit(now, Event::Removed { worker, hashes: all.clone() })?;
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(root: u64, n: usize) -> Vec<u64> {
        crate::hash::chain_local_hashes(&(0..n as u64).map(|d| root * 10_000 + d).collect::<Vec<_>>(), 7, None)
    }

    #[test]
    fn seed_arithmetic_and_index_mirrors_caches() {
        let index = Arc::new(KvIndex::new(None));
        let mut e = PrefillEngines::new(vec![10, 11], 8, 20000.0, 64, Some(index.clone()), 0.0).unwrap();
        let a = chain(1, 6);
        let p = e.prefill(0, &a, 6 * 64 + 10, 1.0).unwrap();
        assert_eq!((p.hit_blocks, p.start), (0, 1.0));
        assert_eq!(p.finish, 1.0 + (6.0 * 64.0 + 10.0) / 20000.0);
        let p2 = e.prefill(0, &a[..4], 4 * 64, 1.0).unwrap();
        assert_eq!(p2.hit_blocks, 4);
        assert_eq!(p2.start, p.finish);
        assert_eq!(p2.finish, p.finish);
        assert_eq!(index.find_matches(&a, ANY_TIER).get(10), Some(6));
        // Overflow the 8-block cache: the oldest blocks (a's prefix) are evicted and unpublished.
        let b = chain(2, 5);
        e.prefill(0, &b, 5 * 64, 2.0).unwrap();
        assert_eq!(e.hit_blocks(0, &a).unwrap(), 0);
        assert_eq!(index.find_matches(&a, ANY_TIER).get(10), None);
        assert_eq!(index.find_matches(&b, ANY_TIER).get(10), Some(5));
        assert_eq!(index.num_blocks(10), 8);
    }

    #[test]
    fn lagged_events_arrive_late() {
        let index = Arc::new(KvIndex::new(None));
        let mut e = PrefillEngines::new(vec![0], 100, 1000.0, 4, Some(index.clone()), 0.5).unwrap();
        let a = chain(3, 3);
        e.prefill(0, &a, 12, 1.0).unwrap();
        assert!(index.find_matches(&a, ANY_TIER).is_empty());
        e.advance(1.4).unwrap();
        assert!(index.find_matches(&a, ANY_TIER).is_empty());
        e.advance(1.5).unwrap();
        assert_eq!(index.find_matches(&a, ANY_TIER).get(0), Some(3));
        assert_eq!(e.advance(1.0), Err(SimError::TimeWentBackwards { now: 1.0, last: 1.5 }));
    }

    #[test]
    fn shared_cache_is_one_lru_seen_by_every_worker() {
        let index = Arc::new(KvIndex::new(None));
        let mut e = PrefillEngines::shared(vec![0, 1], 4, 1000.0, 4, Some(index.clone()), 0.0).unwrap();
        assert!(e.is_shared());
        let a = chain(5, 6);
        e.prefill(0, &a, 24, 0.0).unwrap();
        // Engine 1 hits what engine 0 stored (one cache of 2 x 4 blocks), and the index says so.
        assert_eq!(e.hit_blocks(1, &a).unwrap(), 6);
        let p = e.prefill(1, &a, 24, 0.0).unwrap();
        assert_eq!((p.hit_blocks, p.start, p.finish), (6, 0.0, 0.0));
        assert_eq!(index.find_matches(&a, ANY_TIER).get(0), Some(6));
        assert_eq!(index.find_matches(&a, ANY_TIER).get(1), Some(6));
        // Queues stay per engine; the 8-block capacity evicts for both.
        let b = chain(6, 4);
        e.prefill(0, &b, 16, 1.0).unwrap();
        assert_eq!(e.hit_blocks(1, &a).unwrap(), 0);
        assert_eq!(index.num_blocks(0), 8);
        assert_eq!(index.num_blocks(1), 8);
        assert_eq!(e.clear(1, 2.0).unwrap(), 8);
        assert_eq!(index.num_blocks(0), 0);
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(PrefillEngines::new(vec![], 1, 1.0, 1, None, 0.0).is_err());
        assert!(PrefillEngines::new(vec![0], 1, f64::NAN, 1, None, 0.0).is_err());
        assert!(PrefillEngines::new(vec![0], 1, 1.0, 0, None, 0.0).is_err());
        assert!(PrefillEngines::new(vec![0], 1, 1.0, 1, None, -1.0).is_err());
        let mut e = PrefillEngines::new(vec![0], 1, 1.0, 1, None, 0.0).unwrap();
        assert_eq!(e.prefill(3, &[1], 1, 0.0), Err(SimError::UnknownWorker(3, 1)));
    }
}
