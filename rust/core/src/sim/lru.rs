//! An engine's LRU prefix cache of blocks keyed by sequence hash, as the seed's `OrderedDict`.
//! It reports which blocks it stored and evicted, so a simulator can publish KV events.

use hashbrown::HashMap;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// A fixed-capacity LRU set of block hashes (a doubly linked list over a slab, plus a map).
///
/// `access` has the seed's exact semantics: every block of the request is touched in order
/// (inserted if new, moved to the most-recent end if present), then the least recently used
/// blocks are evicted until at most `capacity` remain. Blocks of one request are therefore
/// ordered oldest-first from block 0, so a full cache evicts prefixes before suffixes — like
/// the seed, and unlike an engine that protects prefixes; matches stop at the first gap.
pub struct LruBlockCache {
    capacity: usize,
    map: HashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32, // least recently used
    tail: u32, // most recently used
}

impl LruBlockCache {
    pub fn new(capacity: usize) -> Self {
        LruBlockCache { capacity, map: HashMap::with_capacity(capacity + 1), nodes: Vec::new(), free: Vec::new(), head: NIL, tail: NIL }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// Number of leading blocks of `hashes` that are cached (the seed's `hit(i) / BLOCK`).
    pub fn prefix_len(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.map.contains_key(*h)).count()
    }

    /// Block hashes from least to most recently used.
    pub fn iter_lru(&self) -> impl Iterator<Item = u64> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let n = self.nodes[cur as usize];
            cur = n.next;
            Some(n.hash)
        })
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_back(&mut self, i: u32) {
        self.nodes[i as usize].prev = self.tail;
        self.nodes[i as usize].next = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.nodes[self.tail as usize].next = i;
        }
        self.tail = i;
    }

    /// Touches `hashes` in order and evicts down to capacity. `stored` receives the positions
    /// (indices into `hashes`) of blocks that were not cached before; `evicted` the hashes of
    /// evicted blocks, oldest first. A block stored and evicted in the same call (a request
    /// longer than the cache) appears in both.
    pub fn access(&mut self, hashes: &[u64], stored: &mut Vec<usize>, evicted: &mut Vec<u64>) {
        for (pos, &h) in hashes.iter().enumerate() {
            match self.map.get(&h) {
                Some(&i) => {
                    if self.tail != i {
                        self.unlink(i);
                        self.push_back(i);
                    }
                }
                None => {
                    let node = Node { hash: h, prev: NIL, next: NIL };
                    let i = match self.free.pop() {
                        Some(i) => {
                            self.nodes[i as usize] = node;
                            i
                        }
                        None => {
                            self.nodes.push(node);
                            (self.nodes.len() - 1) as u32
                        }
                    };
                    self.map.insert(h, i);
                    self.push_back(i);
                    stored.push(pos);
                }
            }
        }
        while self.map.len() > self.capacity {
            let i = self.head;
            let h = self.nodes[i as usize].hash;
            self.unlink(i);
            self.map.remove(&h);
            self.free.push(i);
            evicted.push(h);
        }
    }

    /// Drops every block, returning their hashes (oldest first).
    pub fn clear(&mut self) -> Vec<u64> {
        let all: Vec<u64> = self.iter_lru().collect();
        self.map.clear();
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// The seed's OrderedDict, naively: a queue with move-to-end.
    struct Naive {
        cap: usize,
        q: VecDeque<u64>,
    }
    impl Naive {
        fn access(&mut self, hs: &[u64]) {
            for &h in hs {
                if let Some(p) = self.q.iter().position(|&x| x == h) {
                    self.q.remove(p);
                }
                self.q.push_back(h);
            }
            while self.q.len() > self.cap {
                self.q.pop_front();
            }
        }
        fn prefix_len(&self, hs: &[u64]) -> usize {
            hs.iter().take_while(|h| self.q.contains(h)).count()
        }
    }

    #[test]
    fn matches_ordered_dict_semantics() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut lru = LruBlockCache::new(40);
        let mut naive = Naive { cap: 40, q: VecDeque::new() };
        for _ in 0..2000 {
            // Prefix-shaped requests over a small universe so blocks recur.
            let root = rnd(6);
            let len = 1 + rnd(30) as usize;
            let hs: Vec<u64> = (0..len as u64).map(|d| root * 1000 + d).collect();
            assert_eq!(lru.prefix_len(&hs), naive.prefix_len(&hs));
            let (mut st, mut ev) = (Vec::new(), Vec::new());
            let before: Vec<bool> = hs.iter().map(|h| lru.contains(*h)).collect();
            lru.access(&hs, &mut st, &mut ev);
            naive.access(&hs);
            let expect_new: Vec<usize> = (0..len).filter(|&p| !before[p]).collect();
            assert_eq!(st, expect_new);
            assert_eq!(lru.iter_lru().collect::<Vec<_>>(), naive.q.iter().copied().collect::<Vec<_>>());
            assert!(ev.iter().all(|h| !lru.contains(*h)));
        }
    }

    #[test]
    fn request_longer_than_cache_keeps_its_tail() {
        let mut lru = LruBlockCache::new(3);
        let (mut st, mut ev) = (Vec::new(), Vec::new());
        lru.access(&[1, 2, 3, 4, 5], &mut st, &mut ev);
        assert_eq!(st, vec![0, 1, 2, 3, 4]);
        assert_eq!(ev, vec![1, 2]);
        assert_eq!(lru.iter_lru().collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(lru.prefix_len(&[1, 2, 3]), 0);
        assert_eq!(lru.clear(), vec![3, 4, 5]);
        assert!(lru.is_empty());
    }
}
