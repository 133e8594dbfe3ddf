//! The router's own decisions as cache state (approximate mode): each routed prompt's blocks are stored
//! for its worker and removed `ttl` after their last use. The one TTL owner when the data plane runs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use kvroute_core::{KvIndex, Tier, WorkerId, ANY_TIER};
use parking_lot::Mutex;

/// A block's TTL restarts whenever a routed prompt touches it. The one implementation: Python's
/// `kvroute.prompt.ApproxCache` is this (`rust/py/src/prompt.rs`).
pub struct ApproxCache {
    index: Arc<KvIndex>,
    ttl: f64,
    epoch: Instant,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    // foldhash (hashbrown's default): this map takes a prompt's every block per request.
    touched: HashMap<(WorkerId, u64), f64>,
    log: VecDeque<(f64, WorkerId, Arc<[u64]>)>,
    store_errors: u64,
}

impl ApproxCache {
    pub fn new(index: Arc<KvIndex>, ttl: Duration) -> Self {
        ApproxCache { index, ttl: ttl.as_secs_f64(), epoch: Instant::now(), inner: Mutex::new(Inner::default()) }
    }

    /// Seconds on this cache's clock.
    pub fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    pub fn ttl(&self) -> Duration {
        Duration::from_secs_f64(self.ttl)
    }

    /// Records that `worker` was sent a prompt with these sequence hashes at `now`.
    pub fn insert(&self, worker: WorkerId, hashes: &[u64], now: f64) {
        if hashes.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        // Under the lock, so an expiry cannot interleave between the store and the bookkeeping.
        if self.index.store(worker, hashes, None, Tier::Device).is_err() {
            g.store_errors += 1;
        }
        for &h in hashes {
            g.touched.insert((worker, h), now);
        }
        g.log.push_back((now, worker, Arc::from(hashes)));
    }

    /// Removes blocks untouched for `ttl`; returns how many.
    pub fn expire(&self, now: f64) -> usize {
        let cutoff = now - self.ttl;
        let mut removed = 0;
        let mut g = self.inner.lock();
        while g.log.front().is_some_and(|e| e.0 <= cutoff) {
            let (t, worker, hashes) = g.log.pop_front().expect("front checked");
            let stale: Vec<u64> = hashes.iter().copied().filter(|&h| g.touched.get(&(worker, h)).is_some_and(|&last| last <= t)).collect();
            if !stale.is_empty() {
                for h in &stale {
                    g.touched.remove(&(worker, *h));
                }
                self.index.remove(worker, &stale, ANY_TIER);
                removed += stale.len();
            }
        }
        removed
    }

    /// Forgets a worker's blocks (it failed or left: its cache is presumed gone).
    pub fn drop_worker(&self, worker: WorkerId) {
        let mut g = self.inner.lock();
        g.touched.retain(|k, _| k.0 != worker);
        g.log.retain(|e| e.1 != worker);
        self.index.clear(worker);
    }

    /// (worker, block) entries currently tracked.
    pub fn len(&self) -> usize {
        self.inner.lock().touched.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Index stores that failed (the index refused the blocks); counted, never raised on the hot path.
    pub fn store_errors(&self) -> u64 {
        self.inner.lock().store_errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_restarts_on_touch_and_expiry_removes_from_index() {
        let index = Arc::new(KvIndex::new(None));
        let c = ApproxCache::new(index.clone(), Duration::from_secs(10));
        c.insert(1, &[10, 11, 12], 0.0);
        c.insert(2, &[10], 1.0);
        c.insert(1, &[10, 11], 5.0); // re-touched: only block 12 goes at t=10
        assert_eq!(c.len(), 4);
        assert_eq!(c.expire(9.0), 0);
        assert_eq!(c.expire(10.0), 1);
        assert_eq!(c.expire(11.0), 1); // worker 2's block
        assert_eq!(c.expire(15.0), 2);
        assert!(c.is_empty());
        assert_eq!((index.num_blocks(1), index.num_blocks(2)), (0, 0));
    }

    #[test]
    fn drop_worker_forgets_its_blocks_only() {
        let index = Arc::new(KvIndex::new(None));
        let c = ApproxCache::new(index.clone(), Duration::from_secs(10));
        c.insert(1, &[10, 11], 0.0);
        c.insert(2, &[10, 11], 0.0);
        c.drop_worker(1);
        assert_eq!(c.len(), 2);
        assert_eq!(index.find_matches(&[10, 11], ANY_TIER).workers, vec![2]);
        assert_eq!(c.expire(20.0), 2);
    }
}
