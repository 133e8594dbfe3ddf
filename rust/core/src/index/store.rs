//! Storing chains of blocks: the store path in stages, and orphan chains (stored under a parent
//! the index does not know yet) adopted when their parent arrives.

use std::sync::atomic::Ordering::Relaxed;

use hashbrown::HashMap;
use parking_lot::RwLockWriteGuard;

use super::shard::{self, Shard, FREE, ORPHAN, ROOT};
use super::{root_shard, write_spinning, IndexError, KvIndex, Tier, TierMask, WorkerId, CLOCK_LIMIT, YIELD_EVERY};

impl KvIndex {
    /// Records that `worker` holds the blocks `hashes` (consecutive sequence hashes) on `tier`.
    /// `parent` is the sequence hash of the block before `hashes[0]`; `None` means block 0.
    /// Returns the number of (block, worker) entries that are new.
    ///
    /// In stages: take a recency tick; lock the shard the chain hangs in and find the node it hangs
    /// under (`chain_start`); write the chain block by block under that lock (`Chain::write`); then,
    /// with the lock released, adopt the orphan chains that waited for these blocks and register
    /// the new orphans (`after_store`).
    pub fn store(&self, worker: WorkerId, hashes: &[u64], parent: Option<u64>, tier: Tier) -> Result<usize, IndexError> {
        if hashes.is_empty() {
            return Ok(0);
        }
        let (reg, slot) = self.slot_for(worker)?;
        let tick = self.clock.fetch_add(1, Relaxed) + 1;
        if tick >= CLOCK_LIMIT {
            self.halve_clock();
        }
        let (s, g, prev) = self.chain_start(hashes, parent, slot);
        let mut chain = Chain {
            slot,
            tier: tier.bit(),
            tick,
            prev,
            prev_hash: parent,
            orphan_of: if prev == ORPHAN { parent } else { None },
            guess: u32::MAX,
            waiting: self.awaiting_len.load(Relaxed) > 0,
            created: 0,
            new_entries: 0,
            linked: Vec::new(),
            new_orphans: Vec::new(),
        };
        let full = chain.write(self, s, g, hashes);
        self.after_store(s, hashes, &mut chain, slot);
        drop(reg);
        self.maybe_evict();
        if full {
            return Err(IndexError::Full(shard::MAX_NODES_PER_SHARD));
        }
        Ok(chain.new_entries)
    }

    /// The shard a chain is stored in, locked with room for it, and the node it hangs under:
    /// `ROOT` for block 0, the parent's node, or `ORPHAN` when the parent is unknown.
    fn chain_start(&self, hashes: &[u64], parent: Option<u64>, slot: u32) -> (usize, RwLockWriteGuard<'_, Shard>, u32) {
        // A continuation usually extends the tail of an earlier store, whose shard the hint
        // remembers: lock it straight away.
        let room = hashes.len();
        let hinted = parent.and_then(|p| self.hinted_shard(p)).map(|s| (s, self.write_with_room(s, room)));
        // (The parent is looked up once, under the lock that the store then keeps.)
        let (s, g, found) = match (parent, hinted) {
            (None, _) => {
                let s = root_shard(hashes[0]);
                (s, self.write_with_room(s, room), None)
            }
            (Some(p), hinted) => match hinted.and_then(|(s, held)| held.find(p).map(|i| (s, held, i))) {
                Some((s, held, i)) => (s, held, Some(i)),
                None => {
                    // (A hinted shard without the parent was unlocked when `and_then` dropped it.)
                    let s = self.locate(p, Some(slot), None).unwrap_or_else(|| root_shard(hashes[0]));
                    let held = self.write_with_room(s, room);
                    let i = held.find(p);
                    (s, held, i)
                }
            },
        };
        let prev = match (parent, found) {
            (None, _) => ROOT,
            (Some(_), Some(i)) => {
                if g.arena.tiers(g.node(i).holders(), slot) == 0 {
                    self.counters.orphan_stores.fetch_add(1, Relaxed);
                }
                i
            }
            (Some(_), None) => {
                self.counters.orphan_stores.fetch_add(1, Relaxed);
                ORPHAN
            }
        };
        (s, g, prev)
    }

    /// After a store, with its shard unlocked: orphan chains that waited for the blocks it created
    /// are adopted, and the orphan roots it created wait for their parents.
    fn after_store(&self, s: usize, hashes: &[u64], chain: &mut Chain, slot: u32) {
        // A table this shard outgrew is freed here, by the writer, once no match can hold it.
        self.shards[s].shared.free_retired_tables();
        self.nodes.fetch_add(chain.created, Relaxed);
        self.remember_shard(*hashes.last().expect("a store has blocks"), s);
        if !chain.linked.is_empty() {
            self.adopt_orphans(&chain.linked, s);
        }
        for (p, i) in chain.new_orphans.drain(..) {
            self.await_parent(p, s, i, slot);
        }
    }

    /// Registers orphan root `i` of shard `s` as waiting for parent `p`. Registration happens after
    /// the shard lock is released (lock order: a shard is never held while taking `awaiting`), so
    /// a parent stored meanwhile is looked for once more here. Stale entries (orphans deleted
    /// since) are swept when the list has doubled since the last sweep, so it cannot grow without
    /// bound under event streams that orphan chains permanently.
    fn await_parent(&self, p: u64, s: usize, i: u32, slot: u32) {
        let len = {
            let mut aw = self.awaiting.lock();
            aw.entry(p).or_default().push((s as u32, i));
            self.awaiting_len.fetch_add(1, Relaxed) + 1
        };
        if let Some(ps) = self.locate(p, Some(slot), None) {
            self.adopt_orphans(&[p], ps);
        }
        if len > 1024 && len > 2 * self.awaiting_swept.load(Relaxed) {
            self.sweep_awaiting();
        }
    }

    /// Drops waiting entries whose orphan root no longer exists.
    fn sweep_awaiting(&self) {
        let mut aw = self.awaiting.lock();
        aw.retain(|&p, list| {
            list.retain(|&(s, i)| {
                let g = self.shard(s as usize).read();
                g.is_live(i) && g.node(i).parent() == ORPHAN && g.orphan_parent.get(&i) == Some(&p)
            });
            !list.is_empty()
        });
        let live = aw.values().map(Vec::len).sum();
        self.awaiting_len.store(live, Relaxed);
        self.awaiting_swept.store(live, Relaxed);
    }

    /// Hangs the orphan chains that were waiting for any of `created` (now in shard `s`) under it.
    fn adopt_orphans(&self, created: &[u64], s: usize) {
        let found: Vec<(u64, Vec<(u32, u32)>)> = {
            let mut aw = self.awaiting.lock();
            created.iter().filter_map(|h| aw.remove(h).map(|l| (*h, l))).collect()
        };
        for (h, list) in found {
            self.adopt_list(h, s, list);
        }
    }

    fn adopt_list(&self, h: u64, s: usize, list: Vec<(u32, u32)>) {
        self.awaiting_len.fetch_sub(list.len(), Relaxed);
        for (os, oi) in list {
            let os = os as usize;
            if os == s {
                let mut g = self.shard(s).write();
                let Some(pi) = g.find(h) else { continue };
                if g.is_live(oi) && g.node(oi).parent() == ORPHAN && g.orphan_parent.get(&oi) == Some(&h) {
                    g.orphan_parent.remove(&oi);
                    g.nodes.set_parent(oi as usize, pi);
                    let c = g.nodes.children(pi as usize);
                    g.nodes.set_children(pi as usize, c + 1);
                }
            } else {
                self.migrate_orphan(os, oi, s, h);
            }
        }
    }

    /// Moves the subtree rooted at orphan `oi` of shard `from` under node `parent` of shard `to`.
    fn migrate_orphan(&self, from: usize, oi: u32, to: usize, parent: u64) {
        let (lo, hi) = (from.min(to), from.max(to));
        let mut glo = self.shard(lo).write();
        let mut ghi = self.shard(hi).write();
        let (src, dst) = if from == lo { (&mut *glo, &mut *ghi) } else { (&mut *ghi, &mut *glo) };
        if !src.is_live(oi) || src.node(oi).parent() != ORPHAN || src.orphan_parent.get(&oi) != Some(&parent) {
            return;
        }
        let Some(pi) = dst.find(parent) else { return };
        // Collect the subtree, parents first.
        let order = src.topo_order();
        let mut inside = vec![false; src.nodes.len()];
        let mut sub = Vec::new();
        for i in order {
            let p = src.node(i).parent();
            if i == oi || (p < FREE && inside[p as usize]) {
                inside[i as usize] = true;
                sub.push(i);
            }
        }
        let mut map: HashMap<u32, u32> = HashMap::new();
        let mut list = Vec::new();
        let mut moved_nodes = 0isize;
        for &i in &sub {
            let n = src.node(i);
            let (h, tick) = (n.hash(), src.nodes.tick(i as usize));
            let new_parent = if i == oi { pi } else { map[&n.parent()] };
            let j = match dst.find(h) {
                Some(j) => j,
                None => match dst.create(h, new_parent, tick) {
                    Some(j) => {
                        moved_nodes += 1;
                        j
                    }
                    None => break,
                },
            };
            map.insert(i, j);
            src.arena.list(src.node(i).holders(), &mut list);
            for &(slot, tiers) in &list {
                dst.add_holder(j, slot, tiers);
            }
        }
        // Delete the source subtree, leaves first.
        for &i in sub.iter().rev() {
            if src.is_live(i) {
                src.evict_leaf(i);
                moved_nodes -= 1;
            }
        }
        dst.arena.retire_pending();
        self.nodes.fetch_add(moved_nodes.max(0) as usize, Relaxed);
        self.nodes.fetch_sub((-moved_nodes).max(0) as usize, Relaxed);
    }
}

/// One store's chain as it is written: where it hangs, what it created, what waits.
struct Chain {
    slot: u32,
    tier: TierMask,
    tick: u32,
    /// The node the next block hangs under (`ROOT`, `ORPHAN`, or a node of the locked shard).
    prev: u32,
    prev_hash: Option<u64>,
    /// The unknown parent of an orphan chain.
    orphan_of: Option<u64>,
    /// Where the next block is expected (the slot after the last one written).
    guess: u32,
    /// Whether orphan chains wait for some parent (then the created hashes are collected in `linked`).
    waiting: bool,
    created: usize,
    new_entries: usize,
    linked: Vec<u64>,
    new_orphans: Vec<(u64, u32)>,
}

impl Chain {
    /// Writes `hashes` under the shard lock `g` of shard `s`, letting other writers in every
    /// `YIELD_EVERY` blocks; returns whether the shard was full (the rest is not stored).
    #[inline]
    fn write<'i>(&mut self, index: &'i KvIndex, s: usize, mut g: RwLockWriteGuard<'i, Shard>, hashes: &[u64]) -> bool {
        let mut full = false;
        let mut k = 0;
        while k < hashes.len() {
            if k % YIELD_EVERY == 0 && k > 0 {
                // Let other writers in every few blocks, so a long store never holds them up for
                // long; then make sure the block we chain under is still there.
                g.arena.retire_pending();
                drop(g);
                g = write_spinning(index.shard(s));
                if let (true, Some(ph)) = (self.prev < FREE, self.prev_hash) {
                    if !(g.is_live(self.prev) && g.node(self.prev).hash() == ph) {
                        self.prev = g.find(ph).unwrap_or(ORPHAN);
                        if self.prev == ORPHAN {
                            self.orphan_of = Some(ph);
                        }
                    }
                }
            }
            // The common case first: blocks the shard lacks, extending the run that ends at the
            // leaf we chain under, in place (up to the next yield).
            if self.prev < FREE {
                let end = ((k / YIELD_EVERY + 1) * YIELD_EVERY).min(hashes.len());
                let n = g.extend_run(self.prev, &hashes[k..end], self.tick, self.slot, self.tier);
                if n > 0 {
                    self.created += n;
                    self.new_entries += n;
                    if self.waiting {
                        self.linked.extend_from_slice(&hashes[k..k + n]);
                    }
                    self.prev += n as u32;
                    self.prev_hash = Some(hashes[k + n - 1]);
                    self.guess = self.prev.wrapping_add(1);
                    k += n;
                    continue;
                }
            }
            let h = hashes[k];
            k += 1;
            let (i, fresh) = match g.is_guess(h, self.prev, self.guess) {
                true => (self.guess, false),
                false => match g.find_or_create(h, self.prev, self.tick, true) {
                    Some(x) => x,
                    None => {
                        full = true;
                        break;
                    }
                },
            };
            self.guess = i.wrapping_add(1);
            let i = match fresh {
                false => {
                    if g.node(i).parent() != self.prev && !(self.prev == ORPHAN && g.node(i).parent() == ORPHAN) {
                        index.counters.parent_mismatches.fetch_add(1, Relaxed);
                    }
                    g.nodes.set_tick(i as usize, self.tick);
                    i
                }
                true => {
                    if self.prev == ORPHAN {
                        let p = self.orphan_of.expect("an orphan chain knows its parent hash");
                        g.orphan_parent.insert(i, p);
                        self.new_orphans.push((p, i));
                    }
                    self.created += 1;
                    if self.waiting {
                        self.linked.push(h);
                    }
                    i
                }
            };
            if fresh {
                g.first_holder(i, self.slot, self.tier);
                self.new_entries += 1;
            } else {
                let (new_entry, dup) = g.add_holder(i, self.slot, self.tier);
                self.new_entries += new_entry as usize;
                if dup {
                    index.counters.duplicate_stores.fetch_add(1, Relaxed);
                }
            }
            self.prev = i;
            self.prev_hash = Some(h);
        }
        g.arena.retire_pending();
        full
    }
}
