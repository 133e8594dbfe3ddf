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
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.held.clear();
    }

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
    /// `worker`'s aliases if it has any. Whoever drops the worker's blocks holds their lock while it
    /// does (see `KvIndex::clear`), as a batch does while it applies: a batch that raced a clear either
    /// ran before it (and is cleared) or after it (and its blocks are aliased).
    pub(crate) fn existing(&self, worker: WorkerId) -> Option<Arc<Mutex<WorkerAliases>>> {
        self.workers.read().get(&worker).cloned()
    }

    /// Aliases held for `worker`.
    pub(crate) fn len(&self, worker: WorkerId) -> usize {
        self.workers.read().get(&worker).map_or(0, |m| m.lock().blocks.len())
    }
}
