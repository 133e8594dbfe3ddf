//! The index race: kvroute-core's `KvIndex` against Dynamo 1.6.1's `ConcurrentRadixTreeCompressed`
//! (CRTC) and `PositionalIndexer`, in one process, on the same event streams (README.md).
//!
//! Streams: `interleaved` and `churn` (the core benches' generators, `rust/core/benches/common`),
//! and `vllm-replay` (the recorded vLLM stream, `benches/data/vllm_events.json.gz`). Every stream is
//! turned into one list of operations (store a run of blocks under a parent, remove blocks, clear a
//! worker) whose blocks carry both a local hash and a Dynamo-scheme sequence hash; kvroute gets the
//! sequence hashes, Dynamo gets `(block_hash = sequence hash, tokens_hash = local hash)`, so both
//! describe the same blocks. Hashing is done before any timing, for both.
//!
//! Indexers: `kvroute` (`KvIndex::store`/`remove`/`clear` on one thread); `crtc-poolN` and
//! `positional-poolN` (Dynamo's `ThreadPoolIndexer` with N event threads: `enqueue_event` for every
//! event, then `flush`, timed together); `positional-direct` (`PositionalIndexer::apply_event` on one
//! thread). CRTC has no public synchronous apply (its `apply_event` is private and its per-worker
//! lookup lives in the pool thread), so `crtc-pool1` is its nearest single-thread variant.
//! Matches are inline on both: `KvIndex::find_matches(seq, ANY_TIER)` and
//! `SyncIndexer::find_matches(local, early_exit = false)` on the pool's backend, which is exactly
//! what `ThreadPoolIndexer::find_matches` runs on the caller's thread.
//!
//! Output: one JSON line per (workload, workers, indexer, figure) on stdout; a one-line summary
//! per figure and the final table (kvroute against the best Dynamo indexer) on stderr.

#[path = "../../../rust/core/benches/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hint::black_box;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::positional::{LevelIndex, SearchMode};
use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash,
    OverlapScores, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer};
use kvroute_core::hash::{chain_hash, chain_local_hashes, local_block_hash};
use kvroute_core::{KvIndex, Matches, Tier, ANY_TIER, DEFAULT_SEED};
use serde_json::{json, Value};

type Crtc = ConcurrentRadixTreeCompressed;
type WorkerBlocks = HashMap<WorkerWithDpRank, LevelIndex, rustc_hash::FxBuildHasher>;

/// Dynamo's `kv_block_size`: only its token-hashing request path reads it, which the race bypasses.
const DYN_BLOCK_SIZE: u32 = 32;
/// `PositionalIndexer` jump size: the one Dynamo's own tests and docs use, strided search pinned.
const JUMP: usize = 32;
/// Writer chunk in the concurrent case (as rust/core/benches/concurrency.rs).
const WRITER_CHUNK: usize = 64;

// ------------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Opts {
    quick: bool,
    entries: usize,
    workloads: Vec<String>,
    workers: Vec<u64>,
    pool_threads: Vec<usize>,
    reps: usize,
    check_queries: usize,
    events: String,
    seed: u64,
    measure: Duration,
    rate_window: Duration,
    min_rounds: usize,
    writer_rate: f64,
    skip_memory: bool,
    skip_concurrent: bool,
}

fn parse_list<T: std::str::FromStr>(s: &str) -> Vec<T> {
    s.split(',').filter(|x| !x.is_empty()).map(|x| x.trim().parse().unwrap_or_else(|_| die(&format!("bad list item {x:?}")))).collect()
}

fn die(msg: &str) -> ! {
    eprintln!("index_race: {msg}");
    std::process::exit(2)
}

fn opts(args: &[String]) -> Opts {
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = Opts {
        quick,
        entries: if quick { 300_000 } else { 1_000_000 },
        workloads: vec!["interleaved".into(), "churn".into(), "vllm-replay".into()],
        workers: vec![8, 64],
        pool_threads: vec![1, 4],
        reps: if quick { 1 } else { 3 },
        check_queries: if quick { 2000 } else { 4000 },
        events: concat!(env!("CARGO_MANIFEST_DIR"), "/../data/vllm_events.json.gz").into(),
        seed: 1,
        measure: Duration::from_millis(if quick { 50 } else { 500 }),
        rate_window: Duration::from_millis(if quick { 100 } else { 1000 }),
        min_rounds: if quick { 2 } else { 20 },
        writer_rate: 1e6,
        skip_memory: false,
        skip_concurrent: false,
    };
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        let val = |i: usize| args.get(i + 1).cloned().unwrap_or_else(|| die(&format!("{a} needs a value")));
        match a {
            "--quick" => {}
            "--skip-memory" => o.skip_memory = true,
            "--skip-concurrent" => o.skip_concurrent = true,
            "--entries" => {
                o.entries = val(i).parse().unwrap_or_else(|_| die("bad --entries"));
                i += 1
            }
            "--workloads" => {
                o.workloads = parse_list(&val(i));
                i += 1
            }
            "--workers" => {
                o.workers = parse_list(&val(i));
                i += 1
            }
            "--pool-threads" => {
                o.pool_threads = parse_list(&val(i));
                i += 1
            }
            "--reps" => {
                o.reps = val(i).parse().unwrap_or_else(|_| die("bad --reps"));
                i += 1
            }
            "--check-queries" => {
                o.check_queries = val(i).parse().unwrap_or_else(|_| die("bad --check-queries"));
                i += 1
            }
            "--events" => {
                o.events = val(i);
                i += 1
            }
            "--seed" => {
                o.seed = val(i).parse().unwrap_or_else(|_| die("bad --seed"));
                i += 1
            }
            "--measure-ms" => {
                o.measure = Duration::from_millis(val(i).parse().unwrap_or_else(|_| die("bad --measure-ms")));
                i += 1
            }
            "--rate-ms" => {
                o.rate_window = Duration::from_millis(val(i).parse().unwrap_or_else(|_| die("bad --rate-ms")));
                i += 1
            }
            "--writer-rate" => {
                o.writer_rate = val(i).parse().unwrap_or_else(|_| die("bad --writer-rate"));
                i += 1
            }
            "-h" | "--help" => {
                eprintln!(
                    "index_race [--quick] [--entries N] [--workloads interleaved,churn,vllm-replay] [--workers 8,64] \
                     [--pool-threads 1,4] [--reps R] [--check-queries N] [--events PATH] [--seed S] [--measure-ms MS] \
                     [--rate-ms MS] [--writer-rate BLOCKS_PER_S] [--skip-memory] [--skip-concurrent]"
                );
                std::process::exit(0)
            }
            _ => die(&format!("unknown argument {a:?} (--help)")),
        }
        i += 1;
    }
    if o.pool_threads.is_empty() || o.pool_threads.contains(&0) {
        die("--pool-threads must list numbers >= 1");
    }
    o
}

// ------------------------------------------------------------------------------------------------
// Streams
// ------------------------------------------------------------------------------------------------

enum Op {
    /// `w` stores `stream.seq[r]` (local hashes `stream.local[r]`) under `parent`.
    Store { w: u64, r: Range<usize>, parent: Option<u64> },
    /// `w` removes `stream.rm[r]` (sequence hashes).
    Remove { w: u64, r: Range<usize> },
    /// `w` drops everything (vLLM `AllBlocksCleared`).
    Clear { w: u64 },
}

/// One block chain a query can be cut from: sequence and local hashes, from block 0.
struct Chain {
    seq: Vec<u64>,
    local: Vec<u64>,
}

struct Stream {
    name: String,
    workers: u64,
    ops: Vec<Op>,
    seq: Vec<u64>,
    local: Vec<u64>,
    rm: Vec<u64>,
    /// What queries are cut from, the ones a router is most likely asked about first.
    chains: Vec<Chain>,
    stored: usize,
    removed: usize,
    note: String,
}

/// A bijective 64-bit mix (SplitMix64's finalizer): a block's local hash from the identity the
/// common generator gave it.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The common generator's stream in both indexes' terms. Its sessions are sequence hashes only;
/// each block gets local hash `mix64(its generator hash)`, and the sequence hashes are re-chained
/// from those (Dynamo's scheme, `chain_local_hashes`), so blocks shared by prefix stay shared and
/// every (sequence, local) pair is consistent for both indexes. Evictions are mapped the same way.
fn from_common(name: &str, workers: u64, sessions: Vec<common::Session>, stores: Vec<common::Store>, recent_first: bool) -> Stream {
    let mut map: HashMap<u64, u64> = HashMap::new();
    let has_evictions = stores.iter().any(|s| !s.evicted.is_empty());
    let mut chains: Vec<Chain> = Vec::with_capacity(sessions.len());
    for s in &sessions {
        let local: Vec<u64> = s.seq.iter().map(|&h| mix64(h)).collect();
        let seq = chain_local_hashes(&local, DEFAULT_SEED, None);
        if has_evictions {
            for (o, n) in s.seq.iter().zip(&seq) {
                map.insert(*o, *n);
            }
        }
        chains.push(Chain { seq, local });
    }
    drop(sessions);
    let mut st = Stream::new(name.into(), workers);
    for s in &stores {
        if !s.evicted.is_empty() {
            let a = st.rm.len();
            st.rm.extend(s.evicted.iter().map(|h| *map.get(h).expect("evicted block is in no session")));
            st.removed += s.evicted.len();
            st.ops.push(Op::Remove { w: s.worker, r: a..st.rm.len() });
        }
        let c = &chains[s.session];
        let a = st.seq.len();
        st.seq.extend_from_slice(&c.seq[s.start..s.end]);
        st.local.extend_from_slice(&c.local[s.start..s.end]);
        st.stored += s.end - s.start;
        st.ops.push(Op::Store { w: s.worker, r: a..st.seq.len(), parent: (s.start > 0).then(|| c.seq[s.start - 1]) });
    }
    if recent_first {
        chains.reverse();
    }
    st.chains = chains;
    st
}

fn common_stream(workload: &str, workers: u64, entries: usize, seed: u64) -> Stream {
    match workload {
        "interleaved" => {
            let (s, st) = common::interleaved_stream(workers, entries, seed);
            from_common(workload, workers, s, st, false)
        }
        // Under churn, queries come from the most recently opened sessions first (conversations
        // still in the caches, as compare_index.py picks them).
        "churn" => {
            let (s, st) = common::churn_stream(workers, entries, seed);
            from_common(workload, workers, s, st, true)
        }
        _ => die(&format!("unknown workload {workload:?}")),
    }
}

/// The recorded vLLM stream (record_vllm_events.py): batches decoded with kvroute's decoder, each
/// stored block hashed from its token ids (local hash, then the chain from its parent's sequence
/// hash), engine block hashes resolved to those sequence hashes. Several engine hashes naming the
/// same prefix count as one block (stored on the first, removed with the last), as kvroute's
/// event path does; both indexes get exactly the resulting stores and removals. Queries: every
/// stored chain's prompt, block 0 to the end of its last store (as compare_index.py).
fn vllm_stream(path: &str) -> Stream {
    use base64::Engine;
    let f = std::fs::File::open(path).unwrap_or_else(|e| die(&format!("cannot open {path}: {e}")));
    let doc: Value = serde_json::from_reader(flate2::read::GzDecoder::new(f)).unwrap_or_else(|e| die(&format!("{path}: {e}")));
    let bs = doc["block_size"].as_u64().unwrap_or_else(|| die("recording has no block_size")) as usize;
    let mut st = Stream::new("vllm-replay".into(), 1);
    let mut eng: HashMap<u64, u64> = HashMap::new(); // engine hash -> sequence hash
    let mut aliases: HashMap<u64, u32> = HashMap::new(); // sequence hash -> engine hashes naming it
    let mut info: HashMap<u64, (Option<u64>, u64)> = HashMap::new(); // seq -> (parent seq, local)
    let mut leaves: HashMap<u64, usize> = HashMap::new();
    let mut batch = kvroute_core::events::DecodedBatch::default();
    let (mut non_device, mut unknown_removals, mut duplicates, mut skipped) = (0usize, 0usize, 0usize, 0usize);
    let mut order = 0usize;
    for b in doc["batches"].as_array().unwrap_or_else(|| die("recording has no batches")) {
        let payload =
            base64::engine::general_purpose::STANDARD.decode(b.as_str().unwrap_or("")).unwrap_or_else(|e| die(&format!("batch: {e}")));
        kvroute_core::events::decode_batch(&payload, bs, &mut batch).unwrap_or_else(|e| die(&format!("batch: {e}")));
        let w = batch.dp_rank as u64;
        st.workers = st.workers.max(w + 1);
        for ev in &batch.events {
            match ev {
                kvroute_core::events::DecodedEvent::Stored { hashes, parent, tokens, tier, root, mixes } => {
                    if root.is_some() || !mixes.is_empty() {
                        die("the recording has LoRA/salt/multimodal identities; the race does not model them");
                    }
                    non_device += (*tier != Tier::Device) as usize;
                    let mut prev =
                        parent.map(|p| *eng.get(&p).unwrap_or_else(|| die("a stored block's parent is unknown (gap in the recording)")));
                    let parent_seq = prev;
                    let toks = &batch.tokens[tokens.clone()];
                    let mut run: Option<(usize, Option<u64>)> = None;
                    let mut last = None;
                    for (k, &h) in batch.hashes[hashes.clone()].iter().enumerate() {
                        let local = local_block_hash(&toks[k * bs..(k + 1) * bs], DEFAULT_SEED);
                        let seq = match prev {
                            None => local,
                            Some(p) => chain_hash(p, local, DEFAULT_SEED),
                        };
                        info.insert(seq, (prev, local));
                        let fresh = match eng.insert(h, seq) {
                            Some(old) if old == seq => false, // the same engine block again
                            Some(_) => die("an engine hash was reused for other tokens without a removal"),
                            None => {
                                let c = aliases.entry(seq).or_insert(0);
                                *c += 1;
                                *c == 1
                            }
                        };
                        if fresh {
                            if run.is_none() {
                                run = Some((st.seq.len(), prev));
                            }
                            st.seq.push(seq);
                            st.local.push(local);
                            st.stored += 1;
                        } else {
                            duplicates += 1;
                            if let Some((a, p)) = run.take() {
                                st.ops.push(Op::Store { w, r: a..st.seq.len(), parent: p });
                            }
                        }
                        prev = Some(seq);
                        last = Some(seq);
                    }
                    if let Some((a, p)) = run.take() {
                        st.ops.push(Op::Store { w, r: a..st.seq.len(), parent: p });
                    }
                    if let Some(p) = parent_seq {
                        leaves.remove(&p);
                    }
                    if let Some(l) = last {
                        order += 1;
                        leaves.insert(l, order);
                    }
                }
                kvroute_core::events::DecodedEvent::Removed { hashes, tier } => {
                    non_device += (*tier != Tier::Device) as usize;
                    let a = st.rm.len();
                    for h in &batch.hashes[hashes.clone()] {
                        let Some(seq) = eng.remove(h) else {
                            unknown_removals += 1;
                            continue;
                        };
                        let c = aliases.get_mut(&seq).unwrap();
                        *c -= 1;
                        if *c == 0 {
                            aliases.remove(&seq);
                            st.rm.push(seq);
                        }
                    }
                    if st.rm.len() > a {
                        st.removed += st.rm.len() - a;
                        st.ops.push(Op::Remove { w, r: a..st.rm.len() });
                    }
                }
                kvroute_core::events::DecodedEvent::Cleared => {
                    eng.clear();
                    aliases.clear();
                    st.ops.push(Op::Clear { w });
                }
                kvroute_core::events::DecodedEvent::Skipped => skipped += 1,
            }
        }
    }
    let mut leaves: Vec<(usize, u64)> = leaves.into_iter().map(|(s, o)| (o, s)).collect();
    leaves.sort_unstable();
    for (_, leaf) in leaves {
        let (mut seq, mut local) = (Vec::new(), Vec::new());
        let mut cur = Some(leaf);
        while let Some(s) = cur {
            let (p, l) = info[&s];
            seq.push(s);
            local.push(l);
            cur = p;
        }
        seq.reverse();
        local.reverse();
        st.chains.push(Chain { seq, local });
    }
    st.note = format!(
        "block_size {bs}; {} ops; {duplicates} duplicate stored blocks and {unknown_removals} unknown removals folded away; \
         {non_device} events on a non-device medium applied as device; {skipped} skipped events",
        st.ops.len()
    );
    st
}

impl Stream {
    /// (block, worker) entries live at the end of the stream, by a plain set.
    fn live_entries(&self) -> usize {
        let mut live: HashSet<(u64, u64)> = HashSet::new();
        for op in &self.ops {
            match op {
                Op::Store { w, r, .. } => live.extend(self.seq[r.clone()].iter().map(|&h| (*w, h))),
                Op::Remove { w, r } => {
                    for &h in &self.rm[r.clone()] {
                        live.remove(&(*w, h));
                    }
                }
                Op::Clear { w } => live.retain(|&(x, _)| x != *w),
            }
        }
        live.len()
    }

    fn dyn_event(&self, op: &Op, id: u64) -> RouterEvent {
        let (w, data) = match op {
            Op::Store { w, r, parent } => (
                *w,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: self.seq[r.clone()]
                        .iter()
                        .zip(&self.local[r.clone()])
                        .map(|(&h, &l)| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(h),
                            tokens_hash: LocalBlockHash(l),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
            ),
            Op::Remove { w, r } => (
                *w,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: self.rm[r.clone()].iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
                }),
            ),
            Op::Clear { w } => (*w, KvCacheEventData::Cleared),
        };
        RouterEvent::new(w, KvCacheEvent { event_id: id, data, dp_rank: 0 })
    }

    fn dyn_events(&self) -> Vec<RouterEvent> {
        self.ops.iter().enumerate().map(|(i, op)| self.dyn_event(op, i as u64)).collect()
    }
}

fn store_event(w: u64, seq: &[u64], local: &[u64], parent: Option<u64>, id: u64) -> RouterEvent {
    let blocks = seq
        .iter()
        .zip(local)
        .map(|(&h, &l)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(h),
            tokens_hash: LocalBlockHash(l),
            mm_extra_info: None,
        })
        .collect();
    RouterEvent::new(
        w,
        KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks,
            }),
            dp_rank: 0,
        },
    )
}

// ------------------------------------------------------------------------------------------------
// The indexes
// ------------------------------------------------------------------------------------------------

enum Side {
    /// Boxed: the index lives on the heap, as in a server (`Arc<KvIndex>`), not in a stack frame.
    Kv(Box<KvIndex>),
    CrtcPool(ThreadPoolIndexer<Crtc>),
    PosPool(ThreadPoolIndexer<PositionalIndexer>),
    PosDirect(PositionalIndexer, #[allow(dead_code)] Mutex<WorkerBlocks>),
}

struct Query {
    seq: Vec<u64>,
    local: Vec<LocalBlockHash>,
}

impl Query {
    fn new(seq: &[u64], local: &[u64]) -> Self {
        Query { seq: seq.to_vec(), local: local.iter().map(|&l| LocalBlockHash(l)).collect() }
    }
}

fn positional() -> PositionalIndexer {
    PositionalIndexer::new_with_mode(JUMP, SearchMode::Strided)
}

/// Per-worker depths, sorted, nonzero.
type Depths = Vec<(u64, u32)>;

fn kv_depths(m: &Matches) -> Depths {
    let mut v: Depths = m.workers.iter().copied().zip(m.depths.iter().copied()).filter(|&(_, d)| d > 0).collect();
    v.sort_unstable();
    v
}

/// Zero scores Dynamo returned (dropped before comparing; kvroute never lists a worker at depth 0).
static DYN_ZERO_SCORES: AtomicU64 = AtomicU64::new(0);

fn dyn_depths(s: &OverlapScores) -> Depths {
    let zeros = s.scores.values().filter(|&&d| d == 0).count();
    if zeros > 0 {
        DYN_ZERO_SCORES.fetch_add(zeros as u64, Ordering::Relaxed);
    }
    let mut v: Depths = s
        .scores
        .iter()
        .filter(|&(_, &d)| d > 0)
        .map(|(w, &d)| {
            assert_eq!(w.dp_rank, 0, "Dynamo answered for dp_rank {}; the race uses rank 0 only", w.dp_rank);
            (w.worker_id, d)
        })
        .collect();
    v.sort_unstable();
    v
}

impl Stream {
    fn new(name: String, workers: u64) -> Self {
        Stream {
            name,
            workers,
            ops: Vec::new(),
            seq: Vec::new(),
            local: Vec::new(),
            rm: Vec::new(),
            chains: Vec::new(),
            stored: 0,
            removed: 0,
            note: String::new(),
        }
    }
}

impl Side {
    /// One inline match, its answer dropped (the size returned so it is not optimised away).
    #[inline]
    fn find(&self, q: &Query) -> usize {
        match self {
            Side::Kv(i) => i.find_matches(&q.seq, ANY_TIER).len(),
            Side::CrtcPool(p) => p.backend().find_matches(&q.local, false).scores.len(),
            Side::PosPool(p) => p.backend().find_matches(&q.local, false).scores.len(),
            Side::PosDirect(b, _) => b.find_matches(&q.local, false).scores.len(),
        }
    }

    fn depths(&self, q: &Query) -> Depths {
        match self {
            Side::Kv(i) => kv_depths(&i.find_matches(&q.seq, ANY_TIER)),
            Side::CrtcPool(p) => dyn_depths(&p.backend().find_matches(&q.local, false)),
            Side::PosPool(p) => dyn_depths(&p.backend().find_matches(&q.local, false)),
            Side::PosDirect(b, _) => dyn_depths(&b.find_matches(&q.local, false)),
        }
    }

    /// (block, worker) entries the index's own bookkeeping reports, where it reports them.
    fn reported_entries(&self) -> Option<u64> {
        match self {
            Side::Kv(i) => Some(i.stats().entries),
            Side::CrtcPool(p) => futures::executor::block_on(KvIndexerInterface::shard_sizes(p)).first().map(|s| s.block_count as u64),
            Side::PosPool(p) => futures::executor::block_on(KvIndexerInterface::shard_sizes(p)).first().map(|s| s.block_count as u64),
            Side::PosDirect(_, wb) => Some(wb.lock().unwrap().values().map(|m| m.len() as u64).sum()),
        }
    }

    /// The concurrent writer's path for one store: kvroute stores; a pool gets the event enqueued
    /// (its threads apply it); the direct positional index applies it on the writer's thread.
    fn write(&self, wb: &mut WorkerBlocks, w: u64, seq: &[u64], local: &[u64], parent: Option<u64>, id: u64) {
        match self {
            Side::Kv(i) => {
                i.store(w, seq, parent, Tier::Device).unwrap();
            }
            Side::CrtcPool(p) => p.enqueue_event(store_event(w, seq, local, parent, id)).unwrap(),
            Side::PosPool(p) => p.enqueue_event(store_event(w, seq, local, parent, id)).unwrap(),
            Side::PosDirect(b, _) => {
                let _ = b.apply_event(wb, store_event(w, seq, local, parent, id), None);
            }
        }
    }

    /// Waits for queued writes (pools); returns how long that took.
    fn settle(&self) -> Duration {
        let t = Instant::now();
        match self {
            Side::CrtcPool(p) => futures::executor::block_on(p.flush()),
            Side::PosPool(p) => futures::executor::block_on(p.flush()),
            _ => {}
        }
        t.elapsed()
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Kv,
    Crtc(usize),
    PosPool(usize),
    PosDirect,
}

impl Kind {
    fn name(self) -> String {
        match self {
            Kind::Kv => "kvroute".into(),
            Kind::Crtc(n) => format!("crtc-pool{n}"),
            Kind::PosPool(n) => format!("positional-pool{n}"),
            Kind::PosDirect => "positional-direct".into(),
        }
    }
}

/// Builds a fresh index of `kind` from the whole stream; returns it and the seconds the writes
/// took (pools: enqueueing every event plus the flush). Dynamo's events are built before timing.
/// A Dynamo backend behind a `ThreadPoolIndexer` of `n` threads, fed the stream's events: enqueued,
/// then flushed, timed together.
fn pool_build<T: SyncIndexer>(backend: T, n: usize, s: &Stream) -> (ThreadPoolIndexer<T>, f64) {
    let p = ThreadPoolIndexer::new(backend, n, DYN_BLOCK_SIZE);
    let evs = s.dyn_events();
    let t = Instant::now();
    for e in evs {
        p.enqueue_event(e).unwrap();
    }
    futures::executor::block_on(p.flush());
    (p, t.elapsed().as_secs_f64())
}

fn build(kind: Kind, s: &Stream) -> (Side, f64) {
    match kind {
        Kind::Kv => {
            let idx = Box::new(KvIndex::new(None));
            let t = Instant::now();
            for op in &s.ops {
                match op {
                    Op::Store { w, r, parent } => {
                        idx.store(*w, &s.seq[r.clone()], *parent, Tier::Device).unwrap();
                    }
                    Op::Remove { w, r } => {
                        idx.remove(*w, &s.rm[r.clone()], ANY_TIER);
                    }
                    Op::Clear { w } => {
                        idx.clear(*w);
                    }
                }
            }
            let secs = t.elapsed().as_secs_f64();
            (Side::Kv(idx), secs)
        }
        Kind::Crtc(n) => {
            let (p, secs) = pool_build(Crtc::new(), n, s);
            (Side::CrtcPool(p), secs)
        }
        Kind::PosPool(n) => {
            let (p, secs) = pool_build(positional(), n, s);
            (Side::PosPool(p), secs)
        }
        Kind::PosDirect => {
            let b = positional();
            let mut wb = WorkerBlocks::default();
            let evs = s.dyn_events();
            let mut errors = 0usize;
            let t = Instant::now();
            for e in evs {
                errors += b.apply_event(&mut wb, e, None).is_err() as usize;
            }
            let secs = t.elapsed().as_secs_f64();
            if errors > 0 {
                eprintln!("  note: positional-direct rejected {errors} events");
            }
            (Side::PosDirect(b, Mutex::new(wb)), secs)
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Measurements
// ------------------------------------------------------------------------------------------------

fn pct(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs[((xs.len() as f64 * q) as usize).min(xs.len() - 1)]
}

/// Match latencies (us, sorted): one warm-up round, then `common::latencies`.
fn latencies(side: &Side, qs: &[Query], rounds: usize, min_time: Duration) -> Vec<f64> {
    for q in qs {
        black_box(side.find(q));
    }
    common::latencies(qs, rounds, min_time, |q| {
        black_box(side.find(q));
    })
}

/// Matches per second over `window` with `threads` reader threads.
fn match_rate(side: &Side, qs: &[Query], threads: usize, window: Duration) -> f64 {
    let stop = AtomicBool::new(false);
    let total = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, total) = (&stop, &total);
            s.spawn(move || {
                let (mut n, mut i) = (0u64, t * 7);
                while !stop.load(Ordering::Relaxed) {
                    black_box(side.find(&qs[i % qs.len()]));
                    i += 1;
                    n += 1;
                }
                total.fetch_add(n, Ordering::Relaxed);
            });
        }
        std::thread::sleep(window);
        stop.store(true, Ordering::Relaxed);
    });
    total.load(Ordering::Relaxed) as f64 / window.as_secs_f64()
}

/// The concurrent case's writer: new sessions on workers 1000..1007, 64-block stores, paced.
struct WriterStream {
    sessions: Vec<(u64, Chain)>,
}

fn writer_stream(blocks: usize) -> WriterStream {
    let sessions = common::chat_workload(8, blocks, 99)
        .into_iter()
        .enumerate()
        .map(|(k, s)| {
            let local: Vec<u64> = s.seq.iter().map(|&h| mix64(h)).collect();
            let seq = chain_local_hashes(&local, DEFAULT_SEED, None);
            (1000 + (k as u64 % 8), Chain { seq, local })
        })
        .collect();
    WriterStream { sessions }
}

struct Busy {
    lat: Vec<f64>,
    rate: f64,
    settle_ms: f64,
}

/// Reader latencies while a writer stores into the same index at `rate` blocks/s (as
/// rust/core/benches/concurrency.rs: measured from the writer's first store on). `cursor` is the
/// writer's next session, so every measurement stores new blocks.
fn with_writer(side: &Side, qs: &[Query], ws: &WriterStream, cursor: &mut usize, o: &Opts) -> Busy {
    let stop = AtomicBool::new(false);
    let stored = AtomicU64::new(0);
    let first = *cursor;
    let (lat, secs, reached) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut wb = WorkerBlocks::default();
            let t0 = Instant::now();
            let mut k = first;
            let mut id = 0u64;
            'outer: while k < ws.sessions.len() {
                let (w, c) = &ws.sessions[k];
                for (j, (seq, local)) in c.seq.chunks(WRITER_CHUNK).zip(c.local.chunks(WRITER_CHUNK)).enumerate() {
                    if stop.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    let parent = (j > 0).then(|| c.seq[j * WRITER_CHUNK - 1]);
                    side.write(&mut wb, *w, seq, local, parent, id);
                    id += 1;
                    let n = stored.fetch_add(seq.len() as u64, Ordering::Relaxed) + seq.len() as u64;
                    common::pace(t0, n, o.writer_rate, false);
                }
                k += 1;
            }
            k + 1
        });
        common::wait_started(&stored);
        let t0 = Instant::now();
        let lat = latencies(side, qs, o.min_rounds, o.measure);
        let secs = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        (lat, secs, writer.join().unwrap())
    });
    *cursor = reached;
    let rate = stored.load(Ordering::Relaxed) as f64 / secs;
    let settle_ms = side.settle().as_secs_f64() * 1e3;
    Busy { lat, rate, settle_ms }
}

// ------------------------------------------------------------------------------------------------
// Memory (in a child process: `index_race --mem-child KIND WORKLOAD W ENTRIES SEED`)
// ------------------------------------------------------------------------------------------------

fn rss_bytes() -> u64 {
    // SAFETY: malloc_trim only returns free heap memory to the OS (glibc).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
    let s = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Builds one index from the stream in a fresh process and prints the RSS growth. Dynamo's events
/// are built one at a time as they are applied (none held in advance); the CRTC pool (one thread)
/// is flushed every 4096 events so its queue never holds more. The stream is allocated first, for all.
fn mem_child(args: &[String]) {
    let kind = args[0].as_str();
    let workload = args[1].as_str();
    let w: u64 = args[2].parse().unwrap();
    let entries: usize = args[3].parse().unwrap();
    let seed: u64 = args[4].parse().unwrap();
    let s = common_stream(workload, w, entries, seed);
    let before = rss_bytes();
    let keep: Box<dyn std::any::Any> = match kind {
        "kvroute" => Box::new(build(Kind::Kv, &s).0),
        "crtc" => {
            let p = ThreadPoolIndexer::new(Crtc::new(), 1, DYN_BLOCK_SIZE);
            for (i, op) in s.ops.iter().enumerate() {
                p.enqueue_event(s.dyn_event(op, i as u64)).unwrap();
                if i % 4096 == 4095 {
                    futures::executor::block_on(p.flush());
                }
            }
            futures::executor::block_on(p.flush());
            Box::new(p)
        }
        "positional" => {
            let b = positional();
            let mut wb = WorkerBlocks::default();
            for (i, op) in s.ops.iter().enumerate() {
                let _ = b.apply_event(&mut wb, s.dyn_event(op, i as u64), None);
            }
            Box::new((b, wb))
        }
        _ => die("mem-child: unknown kind"),
    };
    let used = rss_bytes().saturating_sub(before);
    println!("{}", json!({"used_bytes": used}));
    drop(keep);
}

fn measure_memory(kind: &str, workload: &str, w: u64, o: &Opts) -> Option<u64> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .args(["--mem-child", kind, workload, &w.to_string(), &o.entries.to_string(), &o.seed.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!("  memory child {kind} failed: {}", out.status);
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout).lines().last()?.to_string();
    serde_json::from_str::<Value>(&line).ok()?["used_bytes"].as_u64()
}

// ------------------------------------------------------------------------------------------------
// Reporting
// ------------------------------------------------------------------------------------------------

/// A summary row's key: (workload order, workload, workers, figure order, figure).
type RowKey = (usize, String, u64, usize, String);

/// One summary cell: (workload, workers, figure) -> indexer -> value; `higher` says which way is better.
#[derive(Default)]
struct Summary {
    rows: BTreeMap<RowKey, (bool, BTreeMap<String, f64>)>,
    order: HashMap<String, usize>,
}

impl Summary {
    fn add(&mut self, workload: &str, w: u64, figure: &str, indexer: &str, value: f64, higher: bool) {
        if !value.is_finite() {
            return;
        }
        let n = self.order.len();
        let wo = *self.order.entry(workload.to_string()).or_insert(n);
        // Figures in a fixed order: writes, match latency, concurrent, memory.
        let fo = ["store", "match p50", "match p99", "conc p99 us", "conc p99 writer", "conc 2-reader", "bytes"]
            .iter()
            .position(|p| figure.starts_with(p))
            .unwrap_or(99)
            * 100_000
            + figure.rsplit('@').next().and_then(|b| b.parse::<usize>().ok()).unwrap_or(0);
        self.rows
            .entry((wo, workload.to_string(), w, fo, figure.to_string()))
            .or_insert_with(|| (higher, BTreeMap::new()))
            .1
            .insert(indexer.to_string(), value);
    }

    fn print(&self) {
        eprintln!();
        eprintln!("SUMMARY  (advantage = kvroute/Dynamo for rates, Dynamo/kvroute for latencies and bytes: >1 means kvroute better)");
        eprintln!(
            "{:<12} {:>3}  {:<34} {:>13} {:>13}  {:<20} {:>9}",
            "workload", "W", "figure", "kvroute", "best Dynamo", "(which)", "advantage"
        );
        let mut out = Vec::new();
        for ((_, wl, w, _, fig), (higher, vals)) in &self.rows {
            let kv = vals.get("kvroute").copied();
            let best = vals.iter().filter(|(k, _)| k.as_str() != "kvroute").fold(None::<(&String, f64)>, |acc, (k, &v)| match acc {
                Some((_, b)) if (*higher && b >= v) || (!*higher && b <= v) => acc,
                _ => Some((k, v)),
            });
            let adv = match (kv, best) {
                (Some(kv), Some((_, b))) if *higher => kv / b,
                (Some(kv), Some((_, b))) => b / kv,
                _ => f64::NAN,
            };
            let fmt =
                |v: Option<f64>| v.map(|v| if v >= 1e5 { format!("{:.3e}", v) } else { format!("{v:.3}") }).unwrap_or_else(|| "-".into());
            eprintln!(
                "{:<12} {:>3}  {:<34} {:>13} {:>13}  {:<20} {:>9}",
                wl,
                w,
                fig,
                fmt(kv),
                fmt(best.map(|b| b.1)),
                best.map(|b| b.0.as_str()).unwrap_or("-"),
                if adv.is_finite() { format!("{adv:.2}x") } else { "-".into() }
            );
            out.push(json!({"workload": wl, "workers": w, "figure": fig, "kvroute": kv, "best_dynamo": best.map(|b| b.1),
                "best_dynamo_indexer": best.map(|b| b.0), "kvroute_advantage": if adv.is_finite() { Some(adv) } else { None }, "all": vals}));
        }
        println!("{}", json!({"summary": out}));
    }
}

fn emit(rec: Value) {
    println!("{rec}");
}

// ------------------------------------------------------------------------------------------------
// The race
// ------------------------------------------------------------------------------------------------

/// Equality queries: prefixes of the stream's chains of random lengths (plus whole chains), a
/// share of them diverging at a random block (local hash changed, sequence hashes re-chained).
fn check_queries(s: &Stream, n: usize, seed: u64) -> Vec<Query> {
    let mut rng = common::Rng::new(seed ^ 0xc0ffee);
    let chains: Vec<&Chain> = s.chains.iter().filter(|c| !c.seq.is_empty()).collect();
    if chains.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(n);
    for (k, c) in chains.iter().enumerate().take(n / 4) {
        let _ = k;
        out.push(Query::new(&c.seq, &c.local));
    }
    while out.len() < n {
        let c = chains[rng.below(chains.len() as u64) as usize];
        let len = 1 + rng.below(c.seq.len() as u64) as usize;
        let mut local = c.local[..len].to_vec();
        let mut seq = c.seq[..len].to_vec();
        if rng.below(100) < 15 {
            let at = rng.below(len as u64) as usize;
            local[at] = rng.next_u64();
            let parent = (at > 0).then(|| seq[at - 1]);
            let tail = chain_local_hashes(&local[at..], DEFAULT_SEED, parent);
            seq.truncate(at);
            seq.extend(tail);
        }
        out.push(Query::new(&seq, &local));
    }
    out
}

/// Latency queries: the first `blocks` blocks of up to 256 chains that long.
fn length_queries(s: &Stream, blocks: usize) -> Vec<Query> {
    s.chains.iter().filter(|c| c.seq.len() >= blocks).take(256).map(|c| Query::new(&c.seq[..blocks], &c.local[..blocks])).collect()
}

fn run_case(s: &Stream, o: &Opts, sum: &mut Summary) {
    let (wl, w) = (s.name.clone(), s.workers);
    let base = || json!({"workload": wl, "workers": w});
    let with = |extra: Value| {
        let mut v = base();
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v
    };
    let live = s.live_entries();
    let vllm = wl == "vllm-replay";
    emit(with(json!({"figure": "stream", "ops": s.ops.len(), "stored_blocks": s.stored, "removed_blocks": s.removed,
        "live_entries": live, "chains": s.chains.len(), "note": s.note})));
    eprintln!(
        "== {wl} W={w}: {} ops, {} stored + {} removed blocks, {live} live (block, worker) entries {}",
        s.ops.len(),
        s.stored,
        s.removed,
        s.note
    );

    let mut kinds = vec![Kind::Kv];
    for &n in &o.pool_threads {
        kinds.push(Kind::Crtc(n));
    }
    for &n in &o.pool_threads {
        kinds.push(Kind::PosPool(n));
    }
    kinds.push(Kind::PosDirect);
    let max_pool = *o.pool_threads.iter().max().unwrap();

    let checks = check_queries(s, o.check_queries, o.seed);
    let mut reference: Vec<Depths> = Vec::new();
    let lengths: Vec<(String, Vec<Query>)> = if vllm {
        vec![("replayed".into(), s.chains.iter().map(|c| Query::new(&c.seq, &c.local)).collect())]
    } else {
        [128usize, 1024].iter().map(|&b| (b.to_string(), length_queries(s, b))).collect()
    };
    for (l, qs) in &lengths {
        if qs.is_empty() {
            eprintln!("  note: no chain reaches {l} blocks; that length's figures are skipped (a larger --entries fixes it)");
        }
    }
    // Small streams (the vLLM recording) are rebuilt until the best of at least 0.3 s of builds.
    let (reps, min_build_time) = if vllm { (o.reps.max(20), Duration::from_millis(300)) } else { (o.reps, Duration::ZERO) };
    let ws = if !o.skip_concurrent && !vllm {
        let secs = (o.measure.as_secs_f64() + 0.1) * 2.0 * 1.5;
        Some(writer_stream((o.writer_rate * secs) as usize + 200_000))
    } else {
        None
    };

    for kind in kinds {
        let name = kind.name();
        // Store (+ remove) throughput: best of fresh builds.
        let mut best = f64::INFINITY;
        let t_all = Instant::now();
        let mut side = None;
        let mut r = 0;
        while r < reps || t_all.elapsed() < min_build_time {
            r += 1;
            drop(side.take());
            let (sd, secs) = build(kind, s);
            best = best.min(secs);
            side = Some(sd);
        }
        let side = side.unwrap();
        let blocks = (s.stored + s.removed) as f64;
        let rate = blocks / best;
        let figure = if s.removed > 0 { "store_remove_blocks_per_s" } else { "store_blocks_per_s" };
        emit(with(json!({"indexer": name, "figure": figure, "blocks_per_s": rate, "best_secs": best, "builds": r,
            "stored_blocks": s.stored, "removed_blocks": s.removed})));
        eprintln!("  {name:<18} {figure}: {:.3}M blocks/s (best of {r}, {:.3} s)", rate / 1e6, best);
        sum.add(&wl, w, figure, &name, rate, true);

        // Same (block, worker) entries, where the index reports them.
        if let Some(e) = side.reported_entries() {
            if e != live as u64 {
                eprintln!("  note: {name} reports {e} (block, worker) entries, the stream leaves {live}");
            }
        }

        // Equality: the same per-worker depths as kvroute on every check query.
        let answers: Vec<Depths> = checks.iter().map(|q| side.depths(q)).collect();
        if kind == Kind::Kv {
            reference = answers;
        } else {
            for (i, (a, b)) in reference.iter().zip(&answers).enumerate() {
                if a != b {
                    eprintln!(
                        "index_race: MISMATCH on {wl} W={w}: query {i} ({} blocks): kvroute {:?} vs {name} {:?}",
                        checks[i].seq.len(),
                        a,
                        b
                    );
                    std::process::exit(1);
                }
            }
            let nonempty = answers.iter().filter(|a| !a.is_empty()).count();
            emit(with(
                json!({"indexer": name, "figure": "equality", "queries": checks.len(), "nonempty_answers": nonempty, "equal": true}),
            ));
            eprintln!("  {name:<18} equality: {} queries ({} with matches) give kvroute's per-worker depths", checks.len(), nonempty);
        }

        // Match latency at 128 / 1024 blocks (vLLM: the replayed prompts), idle.
        for (l, qs) in &lengths {
            if qs.is_empty() {
                continue;
            }
            let lat = latencies(&side, qs, o.min_rounds, o.measure);
            let (p50, p99) = (pct(&lat, 0.5), pct(&lat, 0.99));
            emit(with(json!({"indexer": name, "figure": "match", "blocks": l, "queries": qs.len(), "calls": lat.len(),
                "p50_us": p50, "p99_us": p99, "p999_us": pct(&lat, 0.999),
                "mean_query_blocks": qs.iter().map(|q| q.seq.len()).sum::<usize>() as f64 / qs.len() as f64})));
            eprintln!("  {name:<18} match @{l}: p50 {p50:.2} us, p99 {p99:.2} us ({} calls)", lat.len());
            sum.add(&wl, w, &format!("match p50 us @{l}"), &name, p50, false);
            sum.add(&wl, w, &format!("match p99 us @{l}"), &name, p99, false);
        }

        // Concurrent: 1 and 2 readers idle, and p99 beside a paced writer (pools at the default width only).
        let concurrent = match kind {
            Kind::Kv | Kind::PosDirect => true,
            Kind::Crtc(n) | Kind::PosPool(n) => n == max_pool,
        };
        if let (Some(ws), true) = (&ws, concurrent) {
            let mut cursor = 0usize;
            for (l, qs) in &lengths {
                if qs.is_empty() {
                    continue;
                }
                let r1 = match_rate(&side, qs, 1, o.rate_window);
                let r2 = match_rate(&side, qs, 2, o.rate_window);
                let idle = latencies(&side, qs, o.min_rounds, o.measure);
                let busy = with_writer(&side, qs, ws, &mut cursor, o);
                let (pi, pb) = (pct(&idle, 0.99), pct(&busy.lat, 0.99));
                emit(with(json!({"indexer": name, "figure": "concurrent", "blocks": l,
                    "one_reader_matches_per_s": r1, "two_reader_matches_per_s": r2, "two_thread_scaling": r2 / r1,
                    "idle_p50_us": pct(&idle, 0.5), "idle_p99_us": pi, "writer_p50_us": pct(&busy.lat, 0.5), "writer_p99_us": pb,
                    "writer_p999_us": pct(&busy.lat, 0.999), "p99_ratio": pb / pi, "writer_blocks_per_s": busy.rate,
                    "writer_settle_ms": busy.settle_ms})));
                eprintln!(
                    "  {name:<18} concurrent @{l}: 2 readers {:.3}M match/s ({:.2}x 1 reader); p99 idle {pi:.2} us, beside writer at {:.2}M blocks/s {pb:.2} us ({:.2}x){}",
                    r2 / 1e6,
                    r2 / r1,
                    busy.rate / 1e6,
                    pb / pi,
                    if busy.settle_ms > 1.0 { format!(", pool backlog drained {:.0} ms after", busy.settle_ms) } else { String::new() }
                );
                sum.add(&wl, w, &format!("conc p99 us beside writer @{l}"), &name, pb, false);
                sum.add(&wl, w, &format!("conc p99 writer/idle @{l}"), &name, pb / pi, false);
                sum.add(&wl, w, &format!("conc 2-reader match/s @{l}"), &name, r2, true);
            }
        }
        drop(side);
    }

    // Bytes per (block, worker) entry, each index built in a fresh child process.
    if !o.skip_memory && !vllm {
        for (kind, label) in [("kvroute", "kvroute"), ("crtc", "crtc"), ("positional", "positional")] {
            if let Some(used) = measure_memory(kind, &wl, w, o) {
                let per = used as f64 / live as f64;
                emit(with(
                    json!({"indexer": label, "figure": "bytes_per_entry", "rss_growth_bytes": used, "live_entries": live, "bytes_per_entry": per}),
                ));
                eprintln!("  {label:<18} memory: {per:.1} bytes per (block, worker) entry ({:.1} MB RSS growth)", used as f64 / 1e6);
                sum.add(&wl, w, "bytes per entry", label, per, false);
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--mem-child") {
        mem_child(&args[1..]);
        return;
    }
    let o = opts(&args);
    // Both sides hash alike: Dynamo's chain step is kvroute's `chain_hash` with seed 1337.
    for (p, l) in [(0u64, 0u64), (1, 2), (u64::MAX, 0x1234_5678_9abc_def0)] {
        assert_eq!(dynamo_tokens::compute_next_sequence_hash(p, l), chain_hash(p, l, DEFAULT_SEED), "hash schemes differ");
    }
    eprintln!(
        "index_race: {} entries, workloads {:?}, W {:?}, pool threads {:?}, {} builds, {} check queries, {:?} per latency figure{}",
        o.entries,
        o.workloads,
        o.workers,
        o.pool_threads,
        o.reps,
        o.check_queries,
        o.measure,
        if o.quick { " (--quick)" } else { "" }
    );
    emit(json!({"figure": "config", "entries": o.entries, "workloads": o.workloads, "workers": o.workers, "pool_threads": o.pool_threads,
        "reps": o.reps, "check_queries": o.check_queries, "measure_ms": o.measure.as_millis() as u64, "writer_rate": o.writer_rate,
        "jump_size": JUMP, "quick": o.quick, "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)}));
    let mut sum = Summary::default();
    let t0 = Instant::now();
    for wl in &o.workloads {
        if wl == "vllm-replay" {
            let s = vllm_stream(&o.events);
            run_case(&s, &o, &mut sum);
            continue;
        }
        for &w in &o.workers {
            let s = common_stream(wl, w, o.entries, o.seed);
            run_case(&s, &o, &mut sum);
        }
    }
    sum.print();
    let zeros = DYN_ZERO_SCORES.load(Ordering::Relaxed);
    if zeros > 0 {
        eprintln!("note: Dynamo returned {zeros} zero scores (dropped before the equality check)");
    }
    eprintln!("index_race: done in {:.1} s", t0.elapsed().as_secs_f64());
}
