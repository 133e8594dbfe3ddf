//! Binary snapshot of the index for warm restarts: `KvIndex::dump` and `KvIndex::load`.
//! Little-endian; per shard the nodes come parents first, children name their parent by position.

use std::sync::atomic::Ordering::Relaxed;

use super::shard::{FREE, ORPHAN, ROOT};
use super::{IndexError, KvIndex, WorkerId, NUM_SHARDS};

const MAGIC: &[u8; 8] = b"KVRIDX02";

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], IndexError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| IndexError::Corrupt(format!("truncated while reading {what} at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, IndexError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, IndexError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, IndexError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
}

impl KvIndex {
    /// Serializes the whole index (workers, blocks, holders, tiers, recency).
    pub fn dump(&self) -> Vec<u8> {
        let reg = self.registry.write(); // no writer may run while we copy
        let mut out = Vec::with_capacity(64 + self.len() * 40);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(NUM_SHARDS as u32).to_le_bytes());
        out.extend_from_slice(&self.clock.load(Relaxed).to_le_bytes());
        out.extend_from_slice(&(reg.slot_of.len() as u32).to_le_bytes());
        let mut workers: Vec<(WorkerId, u32)> = reg.slot_of.iter().map(|(&w, &s)| (w, s)).collect();
        workers.sort_unstable_by_key(|&(_, s)| s);
        for (w, s) in workers {
            out.extend_from_slice(&w.to_le_bytes());
            out.extend_from_slice(&s.to_le_bytes());
        }
        let mut list = Vec::new();
        for s in 0..NUM_SHARDS {
            let g = self.shard(s).read();
            let order = g.topo_order();
            let mut pos = vec![u32::MAX; g.nodes.len()];
            out.extend_from_slice(&(order.len() as u64).to_le_bytes());
            for (k, &i) in order.iter().enumerate() {
                pos[i as usize] = k as u32;
                let n = g.node(i);
                out.extend_from_slice(&n.hash().to_le_bytes());
                out.extend_from_slice(&g.nodes.tick(i as usize).to_le_bytes());
                match n.parent() {
                    ROOT => out.push(0),
                    ORPHAN => {
                        out.push(2);
                        out.extend_from_slice(&g.orphan_parent[&i].to_le_bytes());
                    }
                    p => {
                        out.push(1);
                        out.extend_from_slice(&pos[p as usize].to_le_bytes());
                    }
                }
                g.arena.list(n.holders(), &mut list);
                out.extend_from_slice(&(list.len() as u32).to_le_bytes());
                for &(slot, tiers) in &list {
                    out.extend_from_slice(&slot.to_le_bytes());
                    out.push(tiers);
                }
            }
        }
        out
    }

    /// Rebuilds an index from `dump` output. Corrupt input is an error, never a panic.
    pub fn load(data: &[u8], max_nodes: Option<usize>) -> Result<KvIndex, IndexError> {
        let mut r = Reader { buf: data, pos: 0 };
        if r.take(8, "magic")? != MAGIC {
            return Err(IndexError::Corrupt("not a kvroute index dump (bad magic)".into()));
        }
        let shards = r.u32("shard count")? as usize;
        if shards != NUM_SHARDS {
            return Err(IndexError::Corrupt(format!("dump has {shards} shards, this build uses {NUM_SHARDS}")));
        }
        let idx = KvIndex::new(max_nodes);
        idx.clock.store(r.u32("clock")?, Relaxed);
        let nworkers = r.u32("worker count")? as usize;
        {
            let mut reg = idx.registry.write();
            for _ in 0..nworkers {
                let w = r.u64("worker id")?;
                let s = r.u32("worker slot")?;
                if s as usize > nworkers.max(1) * 4 + 1024 || reg.slot_of.contains_key(&w) {
                    return Err(IndexError::Corrupt(format!("bad slot {s} for worker {w}")));
                }
                if reg.ids.len() <= s as usize {
                    reg.ids.resize(s as usize + 1, None);
                }
                if reg.ids[s as usize].is_some() {
                    return Err(IndexError::Corrupt(format!("slot {s} used twice")));
                }
                reg.ids[s as usize] = Some(w);
                reg.slot_of.insert(w, s);
            }
            reg.free = (0..reg.ids.len() as u32).filter(|&s| reg.ids[s as usize].is_none()).rev().collect();
            idx.publish_slot_ids(reg.ids.clone());
        }
        let known: Vec<bool> = idx.registry.read().ids.iter().map(Option::is_some).collect();
        let nslots = known.len() as u32;
        let mut total = 0usize;
        for s in 0..NUM_SHARDS {
            let count = r.u64("node count")? as usize;
            // Each node takes at least 17 bytes: refuse counts the data cannot hold.
            if count > (data.len() - r.pos) / 17 {
                return Err(IndexError::Corrupt(format!("shard {s} claims {count} nodes, more than the data holds")));
            }
            let mut g = idx.shard(s).write();
            let mut at: Vec<u32> = Vec::with_capacity(count);
            let mut orphans = Vec::new();
            for k in 0..count {
                let hash = r.u64("block hash")?;
                let tick = r.u32("tick")?;
                let parent = match r.u8("parent kind")? {
                    0 => ROOT,
                    1 => {
                        let p = r.u32("parent position")? as usize;
                        *at.get(p)
                            .filter(|_| p < k)
                            .ok_or_else(|| IndexError::Corrupt(format!("node {k} of shard {s} names parent {p} not before it")))?
                    }
                    2 => {
                        orphans.push((k, r.u64("orphan parent hash")?));
                        ORPHAN
                    }
                    x => return Err(IndexError::Corrupt(format!("bad parent kind {x}"))),
                };
                if g.find(hash).is_some() {
                    return Err(IndexError::Corrupt(format!("block hash {hash} twice in shard {s}")));
                }
                let i = g.create(hash, parent, tick).ok_or(IndexError::Full(count))?;
                at.push(i);
                let nh = r.u32("holder count")?;
                if nh > nslots {
                    return Err(IndexError::Corrupt(format!("node {k} has {nh} holders but there are {nslots} workers")));
                }
                for _ in 0..nh {
                    let slot = r.u32("holder slot")?;
                    let tiers = r.u8("holder tiers")?;
                    if slot >= nslots || !known[slot as usize] || tiers == 0 || tiers > 7 {
                        return Err(IndexError::Corrupt(format!("bad holder (slot {slot}, tiers {tiers})")));
                    }
                    g.add_holder(i, slot, tiers);
                }
            }
            for (k, p) in orphans {
                let i = at[k];
                g.orphan_parent.insert(i, p);
                idx.awaiting.lock().entry(p).or_default().push((s as u32, i));
                idx.awaiting_len.fetch_add(1, Relaxed);
            }
            g.arena.retire_pending();
            total += g.live;
            debug_assert!(at.iter().all(|&i| g.node(i).parent() != FREE));
        }
        if r.pos != data.len() {
            return Err(IndexError::Corrupt(format!("{} trailing bytes", data.len() - r.pos)));
        }
        idx.nodes.store(total, Relaxed);
        Ok(idx)
    }
}
