//! Live KV events from vLLM and SGLang: decode an engine's msgpack event batch and mirror it in the index.
//! The tree stays keyed by our own sequence hashes; a per-worker map resolves the engine's block hashes.
//!
//! Wire format (verified against the engines' sources; see docs/events.md): a batch is
//! `[ts, events, data_parallel_rank]` (positional; vLLM and SGLang) or, tolerated here, a map with
//! those keys. Each event is either a legacy tagged array `["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, ...]` or a tagged map
//! `{"type": "BlockStored", "block_hashes": ..., ...}`; unknown fields are skipped. Block hashes
//! are u64 or i64 ints, or digests as msgpack bin (folded to their last 8 bytes, big-endian, which
//! is exactly vLLM's int form).
//!
//! Keying. The router never reproduces an engine's hash function or seed: for every
//! `BlockStored` it recomputes Dynamo-style sequence hashes from `token_ids` (`crate::hash`, with
//! the router's block size and seed) and remembers engine hash -> sequence hash per worker, so
//! `BlockRemoved` resolves through that map (llm-d's dual-key design). Several engine hashes may
//! name the same token prefix; a per-tier count keeps the index entry until the last of them is removed.
//!
//! Identity. vLLM mixes more than tokens into a block's key: the LoRA adapter, the request's
//! `cache_salt`, multimodal `(identifier, offset)` pairs and prompt-embedding digests, published as
//! `lora_name` and per-block `extra_keys`. The same tokens under another identity are other KV, so
//! they are other blocks here too: a chain that starts under an adapter or a salt hangs from
//! `crate::hash::identity_root(lora, salt)` (a request to that adapter with that salt computes the
//! same root), and a block with multimodal or embedding keys mixes their digest into its local hash
//! (no request reproduces it, so a match stops before the first media block). Events without
//! identity hash exactly as before. SGLang publishes no extra keys: its LoRA blocks key as base-model blocks.
//!
//! Unknown parents. A `BlockStored` whose `parent_block_hash` this worker's map does not know (the
//! router joined mid-stream, or lost events) cannot be placed: its true sequence hashes depend on
//! tokens we never saw. It is stored as an orphan chain under the anchor
//! `chain_hash(ORPHAN_ANCHOR, parent_block_hash, seed)`, a hash no real prefix produces, so it is
//! tracked (its removals and children resolve) but never matches a request.
//!
//! Data-parallel ranks. An engine with data parallelism publishes one stream per rank, and each
//! batch names its rank (`data_parallel_rank` in vLLM, `attn_dp_rank` in SGLang). Its events
//! apply to worker `worker + rank`: give each engine a base worker id and leave the next
//! `dp_size - 1` ids free for its other ranks.
//!
//! Skipped events (counted, not applied). Events carrying a `group_idx` other than 0 (a second
//! KV-cache group of a hybrid model, e.g. the sliding-window layers): the index tracks the first
//! group's prefix. `BlockStored` events whose `block_size` is not the router's (e.g. a KV
//! connector's chunks published in the same batch): a tree of one block size cannot key them.

mod decode;
mod msgpack;
#[cfg(test)]
mod tests;

use std::cell::RefCell;

use hashbrown::hash_map::Entry;

pub use decode::{decode_batch, medium_tier, DecodedBatch, DecodedEvent};

use crate::hash::{chain_hash, extend_sequence_hashes, extend_sequence_hashes_mixed};
use crate::index::aliases::{Alias, WorkerAliases};
use crate::index::{KvIndex, Tier, WorkerId};

/// Mixed into an unknown parent's engine hash to make the orphan anchor (see the module docs).
pub const ORPHAN_ANCHOR: u64 = 0x6f72_7068_616e_0b1c;

/// Why an event batch was rejected. Nothing of a rejected batch is applied, except on `Capacity`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("truncated payload: ran out of bytes reading {at} (byte {offset})")]
    Truncated { at: String, offset: usize },
    #[error("wrong type at {at} (byte {offset}): expected {expected}, found {found}")]
    WrongType { at: String, offset: usize, expected: &'static str, found: &'static str },
    #[error("{at} (byte {offset}): values nested more than 64 levels deep")]
    TooDeep { at: String, offset: usize },
    #[error("{at}: missing required field `{field}`")]
    MissingField { at: String, field: &'static str },
    #[error("{at}: field `{field}` appears twice")]
    Duplicate { at: String, field: &'static str },
    #[error("{at}: unknown event type {name:?} (expected BlockStored, BlockRemoved or AllBlocksCleared)")]
    UnknownEventType { at: String, name: String },
    #[error("{at}: unknown medium {medium:?} (expected GPU, CPU, CPU_PINNED, DISK, STORAGE, EXTERNAL or nil)")]
    UnknownMedium { at: String, medium: String },
    #[error("{at}: a block hash given as {len} bytes; expected an int or a bin of 8 to 64 bytes")]
    BadHash { at: String, len: usize },
    #[error("{at}: out of range, expected {what}")]
    OutOfRange { at: String, what: &'static str },
    #[error("{at}: {tokens} token ids for {blocks} blocks of {block_size} tokens; expected {}", blocks * block_size)]
    TokenCount { at: String, tokens: usize, blocks: usize, block_size: usize },
    #[error("{len}-byte payload, but the batch ends at byte {offset}: trailing bytes")]
    TrailingBytes { offset: usize, len: usize },
    #[error("block_size must be >= 1, got {0}")]
    InvalidBlockSize(usize),
    #[error("worker id {worker} + data_parallel_rank {rank} overflows u64")]
    WorkerOverflow { worker: u64, rank: u32 },
    /// The index is out of room. Unlike every other error this one comes while applying: the
    /// first `applied` events of the batch took effect (callers should resync the worker).
    #[error("{source} (after applying {applied} events of the batch)")]
    Capacity { applied: usize, source: crate::index::IndexError },
}

/// What one applied batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ApplyStats {
    /// The worker the batch applied to (`worker + data_parallel_rank`).
    pub worker: WorkerId,
    /// Events applied (skipped ones excluded).
    pub events: usize,
    /// Events skipped (`group_idx` other than 0, or blocks of another size).
    pub skipped: usize,
    pub blocks_stored: usize,
    pub blocks_removed: usize,
    /// Stored blocks whose chain hangs under an unknown parent.
    pub orphan_blocks: usize,
    /// Removed engine hashes this worker's map did not hold on that tier.
    pub unknown_removals: usize,
}

/// Reusable buffers for `KvIndex::apply_event_batch_with`.
#[derive(Default)]
pub struct EventScratch {
    batch: DecodedBatch,
    seqs: Vec<u64>,
    removals: Vec<u64>,
}

thread_local! {
    static SCRATCH: RefCell<EventScratch> = RefCell::new(EventScratch::default());
}

impl KvIndex {
    /// Decodes an engine's event-batch payload and applies it to worker `worker + data_parallel_rank`.
    /// `block_size` and `seed` are the router's (the ones its requests are hashed with). The whole
    /// batch is validated before anything is applied, so an error leaves the index unchanged.
    pub fn apply_event_batch(&self, worker: WorkerId, payload: &[u8], block_size: usize, seed: u64) -> Result<ApplyStats, EventError> {
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut s) => self.apply_event_batch_with(worker, payload, block_size, seed, &mut s),
            Err(_) => self.apply_event_batch_with(worker, payload, block_size, seed, &mut EventScratch::default()),
        })
    }

    /// `apply_event_batch` with caller-owned buffers.
    pub fn apply_event_batch_with(
        &self,
        worker: WorkerId,
        payload: &[u8],
        block_size: usize,
        seed: u64,
        scratch: &mut EventScratch,
    ) -> Result<ApplyStats, EventError> {
        if block_size == 0 {
            return Err(EventError::InvalidBlockSize(0));
        }
        let EventScratch { batch, seqs, removals } = scratch;
        decode_batch(payload, block_size, batch)?;
        self.apply_decoded(worker, batch, block_size, seed, seqs, removals)
    }

    /// Applies a batch already decoded (or built in process, as the simulator's engines do) to
    /// worker `worker + batch.dp_rank`: the second half of `apply_event_batch_with`, so an
    /// in-process event source takes the same path as a live engine's payload after decoding.
    /// `seqs` and `removals` are scratch buffers.
    pub fn apply_decoded(
        &self,
        worker: WorkerId,
        batch: &DecodedBatch,
        block_size: usize,
        seed: u64,
        seqs: &mut Vec<u64>,
        removals: &mut Vec<u64>,
    ) -> Result<ApplyStats, EventError> {
        if block_size == 0 {
            return Err(EventError::InvalidBlockSize(0));
        }
        // `decode_batch` checks this for a payload; a batch built in process is checked here, before
        // anything is applied, so a bad batch still leaves the index unchanged.
        let outside = |i: usize, field: &str| EventError::OutOfRange {
            at: format!("events[{i}].{field}"),
            what: "a range inside the batch's buffers",
        };
        for (i, ev) in batch.events.iter().enumerate() {
            let hashes = match ev {
                DecodedEvent::Stored { hashes, .. } | DecodedEvent::Removed { hashes, .. } => hashes,
                DecodedEvent::Cleared | DecodedEvent::Skipped => continue,
            };
            if hashes.end > batch.hashes.len() {
                return Err(outside(i, "block_hashes"));
            }
            if let DecodedEvent::Stored { tokens, mixes, .. } = ev {
                if tokens.end > batch.tokens.len() {
                    return Err(outside(i, "token_ids"));
                }
                if mixes.end > batch.mixes.len() || mixes.start > mixes.end {
                    return Err(outside(i, "extra_keys"));
                }
                let (blocks, n) = (hashes.len(), tokens.len());
                if n != blocks * block_size {
                    return Err(EventError::TokenCount { at: format!("events[{i}].token_ids"), tokens: n, blocks, block_size });
                }
            }
        }
        let w = worker.checked_add(batch.dp_rank as u64).ok_or(EventError::WorkerOverflow { worker, rank: batch.dp_rank })?;
        let mut st = ApplyStats { worker: w, ..Default::default() };
        let map = self.aliases.get(w);
        let mut map = map.lock();
        let WorkerAliases { blocks, held } = &mut *map;
        for ev in &batch.events {
            match ev {
                DecodedEvent::Skipped => st.skipped += 1,
                DecodedEvent::Cleared => {
                    blocks.clear();
                    held.clear();
                    self.clear_blocks(w);
                    st.events += 1;
                }
                DecodedEvent::Removed { hashes, tier } => {
                    let t = *tier as usize;
                    removals.clear();
                    for h in &batch.hashes[hashes.clone()] {
                        let Entry::Occupied(mut e) = blocks.entry(*h) else {
                            st.unknown_removals += 1;
                            continue;
                        };
                        let m = e.get_mut();
                        if m.tiers & tier.bit() == 0 {
                            st.unknown_removals += 1;
                            continue;
                        }
                        m.tiers &= !tier.bit();
                        let seq = m.seq;
                        if m.tiers == 0 {
                            e.remove();
                        }
                        if WorkerAliases::release(held, seq, t) {
                            removals.push(seq);
                        }
                    }
                    st.blocks_removed += self.remove(w, removals, tier.bit());
                    st.events += 1;
                }
                DecodedEvent::Stored { hashes, parent, tokens, tier, root, mixes } => {
                    let parent_seq = match parent {
                        None => None,
                        Some(p) => match blocks.get(p) {
                            Some(m) => Some(m.seq),
                            None => {
                                st.orphan_blocks += hashes.len();
                                Some(chain_hash(ORPHAN_ANCHOR, *p, seed))
                            }
                        },
                    };
                    seqs.clear();
                    // A chain that starts here hangs from its identity (LoRA, salt): the root seeds
                    // the hashes, but the chain is stored from block 0 (the index never holds it).
                    let prev = parent_seq.or(*root);
                    let toks = &batch.tokens[tokens.clone()];
                    if mixes.is_empty() {
                        extend_sequence_hashes(seqs, toks, block_size, seed, prev);
                    } else {
                        extend_sequence_hashes_mixed(seqs, toks, block_size, seed, prev, &batch.mixes[mixes.clone()]);
                    }
                    removals.clear();
                    let t = *tier as usize;
                    for (&h, &seq) in batch.hashes[hashes.clone()].iter().zip(seqs.iter()) {
                        let m = blocks.entry(h).or_insert(Alias { seq, tiers: 0 });
                        if m.seq != seq {
                            // The engine reused a hash for other content: its old blocks are gone.
                            let (old, old_tiers) = (m.seq, m.tiers);
                            *m = Alias { seq, tiers: 0 };
                            for tt in Tier::ALL {
                                if old_tiers & tt.bit() != 0 && WorkerAliases::release(held, old, tt as usize) {
                                    self.remove(w, &[old], tt.bit());
                                }
                            }
                        }
                        if m.tiers & tier.bit() == 0 {
                            m.tiers |= tier.bit();
                            held.entry(seq).or_insert([0; 3])[t] += 1;
                        }
                    }
                    self.store(w, seqs, parent_seq, *tier).map_err(|source| EventError::Capacity { applied: st.events, source })?;
                    st.blocks_stored += seqs.len();
                    st.events += 1;
                }
            }
        }
        Ok(st)
    }

    /// Engine block hashes currently mapped for `worker` (diagnostics and tests).
    pub fn engine_hashes(&self, worker: WorkerId) -> usize {
        self.aliases.len(worker)
    }
}
