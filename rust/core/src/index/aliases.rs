//! Block aliases: another party's ids for the index's blocks, per worker. An engine names its KV
//! blocks by its own hashes; the index keys them by the router's sequence hashes. The events layer
//! (`crate::events`) decodes the engines' wire format and keeps these aliases current; the index
//! only holds them, so a worker's aliases go with its blocks (`KvIndex::clear`, `remove_worker`).

use std::sync::Arc;

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock};

use super::WorkerId;

/// What one alias names: a sequence hash, and the tiers (bits) the worker holds it on under this id.
#[derive(Clone, Copy)]
pub(crate) struct Alias {
    pub(crate) seq: u64,
    pub(crate) tiers: u8,
}

/// One worker's aliases: its own block id -> sequence hash (and the tiers it holds it on), with
/// per-tier reference counts of sequence hashes (several ids may name one prefix).
#[derive(Default)]
pub(crate) struct WorkerAliases {
    pub(crate) blocks: HashMap<u64, Alias>,
    pub(crate) held: HashMap<u64, [u32; 3]>,
}

impl WorkerAliases {
    /// Drops one `tier` reference to `seq`; returns true when the sequence hash's last holder on
    /// that tier went (so the index entry must go too).
    pub(crate) fn release(held: &mut HashMap<u64, [u32; 3]>, seq: u64, tier: usize) -> bool {
        let Entry::Occupied(mut c) = held.entry(seq) else { return false };
        let counts = c.get_mut();
        counts[tier] = counts[tier].saturating_sub(1);
        let gone = counts[tier] == 0;
        if counts.iter().all(|&n| n == 0) {
            c.remove();
        }
        gone
    }
}

/// Every worker's aliases. Kept with the index so that `clear` and `remove_worker` drop a worker's
/// aliases with its blocks, whoever calls them (the Router, the data plane, a subscriber).
#[derive(Default)]
pub(crate) struct BlockAliases {
    workers: RwLock<HashMap<WorkerId, Arc<Mutex<WorkerAliases>>>>,
}

impl BlockAliases {
    pub(crate) fn get(&self, worker: WorkerId) -> Arc<Mutex<WorkerAliases>> {
        if let Some(m) = self.workers.read().get(&worker) {
            return m.clone();
        }
        self.workers.write().entry(worker).or_default().clone()
    }

    /// Forgets `worker`'s map (its cache is gone).
    pub(crate) fn forget(&self, worker: WorkerId) {
        self.workers.write().remove(&worker);
    }

    /// Aliases held for `worker`.
    pub(crate) fn len(&self, worker: WorkerId) -> usize {
        self.workers.read().get(&worker).map_or(0, |m| m.lock().blocks.len())
    }
}
