use super::*;
use std::sync::atomic::Ordering::Relaxed;

fn chain(start: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| start * 1_000_003 + i + 1).collect()
}

fn depth(idx: &KvIndex, q: &[u64], w: WorkerId) -> Option<u32> {
    idx.find_matches(q, ANY_TIER).get(w)
}

#[test]
fn store_and_match_contiguous() {
    let idx = KvIndex::new(None);
    let c = chain(1, 10);
    assert_eq!(idx.store(7, &c[..6], None, Tier::Device), Ok(6));
    idx.store(8, &c[..3], None, Tier::Device).unwrap();
    assert_eq!(depth(&idx, &c, 7), Some(6));
    assert_eq!(depth(&idx, &c, 8), Some(3));
    assert_eq!(idx.len(), 6);
    assert_eq!(idx.num_blocks(7), 6);
    assert_eq!(idx.stats().entries, 9);
    // A lost middle block cuts the match there.
    idx.remove(7, &c[2..3], ANY_TIER);
    assert_eq!(depth(&idx, &c, 7), Some(2));
    assert_eq!(idx.len(), 6, "node 2 still held by worker 8");
}

#[test]
fn continuation_under_parent() {
    let idx = KvIndex::new(None);
    let c = chain(2, 8);
    idx.store(1, &c[..4], None, Tier::Device).unwrap();
    idx.store(1, &c[4..], Some(c[3]), Tier::Device).unwrap();
    assert_eq!(depth(&idx, &c, 1), Some(8));
    assert_eq!(idx.stats().orphan_stores, 0);
}

#[test]
fn orphan_store_links_when_gap_fills() {
    let idx = KvIndex::new(None);
    let c = chain(3, 8);
    idx.store(1, &c[..2], None, Tier::Device).unwrap();
    idx.store(1, &c[4..], Some(c[3]), Tier::Device).unwrap(); // blocks 2,3 never seen yet
    assert_eq!(idx.stats().orphan_stores, 1);
    assert_eq!(depth(&idx, &c, 1), Some(2));
    idx.store(1, &c[2..4], Some(c[1]), Tier::Device).unwrap();
    assert_eq!(depth(&idx, &c, 1), Some(8));
    assert_eq!(idx.len(), 8);
    assert_eq!(idx.num_blocks(1), 8);
}

#[test]
fn orphan_links_across_shards() {
    // Find chains whose orphan part lands in a different shard than the root.
    let mut tested = 0;
    for start in 0..200u64 {
        let c = chain(100 + start, 6);
        if root_shard(c[3]) == root_shard(c[0]) {
            continue;
        }
        let idx = KvIndex::new(None);
        idx.store(5, &c[3..], Some(c[2]), Tier::Host).unwrap();
        idx.store(6, &c[4..], Some(c[3]), Tier::Device).unwrap();
        idx.store(5, &c[..3], None, Tier::Host).unwrap();
        assert_eq!(depth(&idx, &c, 5), Some(6));
        assert_eq!(depth(&idx, &c, 6), None, "worker 6 lacks block 0");
        assert_eq!(idx.len(), 6);
        assert_eq!(idx.stats().entries, 8);
        tested += 1;
        if tested == 5 {
            break;
        }
    }
    assert_eq!(tested, 5);
}

#[test]
fn tiers_and_partial_removal() {
    let idx = KvIndex::new(None);
    let c = chain(4, 4);
    idx.store(1, &c, None, Tier::Device).unwrap();
    idx.store(1, &c[..2], None, Tier::Host).unwrap();
    assert_eq!(idx.find_matches(&c, Tier::Host.bit()).get(1), Some(2));
    idx.remove(1, &c[..1], Tier::Device.bit());
    assert_eq!(idx.find_matches(&c, Tier::Device.bit()).get(1), None);
    assert_eq!(idx.find_matches(&c, ANY_TIER).get(1), Some(4));
    assert_eq!(idx.num_blocks(1), 4);
}

#[test]
fn clear_and_remove_worker_unknowns_are_noops() {
    let idx = KvIndex::new(None);
    let c = chain(5, 5);
    idx.store(1, &c, None, Tier::Device).unwrap();
    idx.store(2, &c[..2], None, Tier::Device).unwrap();
    assert_eq!(idx.clear(99), 0);
    assert_eq!(idx.remove(99, &c, ANY_TIER), 0);
    assert_eq!(idx.stats().unknown_removals, 5);
    assert_eq!(idx.clear(1), 5);
    assert_eq!(idx.len(), 2);
    assert_eq!(idx.remove_worker(2), 2);
    assert!(idx.is_empty());
    assert_eq!(idx.workers(), vec![1]);
    // The freed slot is reused without leaking old membership.
    idx.store(3, &c[..1], None, Tier::Device).unwrap();
    assert_eq!(idx.find_matches(&c, ANY_TIER), Matches { workers: vec![3], depths: vec![1] });
}

#[test]
fn many_workers_spill() {
    let idx = KvIndex::new(None);
    let c = chain(6, 16);
    for w in 0..200u64 {
        idx.store(w * 11, &c[..(w as usize % 16) + 1], None, Tier::Device).unwrap();
    }
    let m = idx.find_matches(&c, ANY_TIER);
    assert_eq!(m.len(), 200);
    for w in 0..200u64 {
        assert_eq!(m.get(w * 11), Some((w as u32 % 16) + 1));
    }
    for w in 0..200u64 {
        idx.remove_worker(w * 11);
    }
    assert!(idx.is_empty());
    assert_eq!(idx.stats().entries, 0);
}

#[test]
fn eviction_respects_cap_and_never_overreports() {
    let idx = KvIndex::new(Some(100));
    let mut all = Vec::new();
    for k in 0..50u64 {
        let c = chain(1000 + k, 8);
        idx.store(k % 4, &c, None, Tier::Device).unwrap();
        all.push((k % 4, c));
        assert!(idx.len() <= 100);
    }
    assert!(idx.stats().evictions > 0);
    for (w, c) in &all {
        if let Some(d) = depth(&idx, c, *w) {
            assert!(d <= 8);
        }
    }
    // The most recent chain survives whole.
    let (w, c) = all.last().unwrap();
    assert_eq!(depth(&idx, c, *w), Some(8));
}

#[test]
fn dump_load_round_trip_and_corruption() {
    let idx = KvIndex::new(None);
    for k in 0..30u64 {
        let c = chain(2000 + k, 5 + k as usize % 7);
        idx.store(k % 5, &c, None, if k % 3 == 0 { Tier::Host } else { Tier::Device }).unwrap();
    }
    let c = chain(9999, 6);
    idx.store(2, &c[3..], Some(c[2]), Tier::Device).unwrap(); // an orphan survives the round trip
    let bytes = idx.dump();
    let back = KvIndex::load(&bytes, None).unwrap();
    assert_eq!(back.stats().nodes, idx.stats().nodes);
    assert_eq!(back.stats().entries, idx.stats().entries);
    assert_eq!(back.dump(), bytes);
    back.store(2, &c[..3], None, Tier::Device).unwrap();
    assert_eq!(depth(&back, &c, 2), Some(6));
    for cut in [0, 7, 20, bytes.len() / 2, bytes.len() - 1] {
        assert!(KvIndex::load(&bytes[..cut], None).is_err());
    }
    let mut bad = bytes.clone();
    bad.push(0);
    assert!(KvIndex::load(&bad, None).is_err());
}

#[test]
fn parent_check_rejects_non_chains() {
    let idx = KvIndex::new(None);
    let a = chain(7, 3);
    idx.store(1, &a, None, Tier::Device).unwrap();
    // A query whose second block exists but under another parent does not match past block 0.
    let q = [a[0], a[2]];
    assert_eq!(depth(&idx, &q, 1), Some(1));
}

#[test]
fn concurrent_readers_and_writers() {
    use std::sync::Arc;
    let idx = Arc::new(KvIndex::new(Some(5000)));
    let chains: Arc<Vec<Vec<u64>>> = Arc::new((0..64).map(|k| chain(5000 + k, 32)).collect());
    let mut hs = Vec::new();
    for t in 0..2u64 {
        let (idx, chains) = (idx.clone(), chains.clone());
        hs.push(std::thread::spawn(move || {
            for r in 0..3000u64 {
                let c = &chains[((r * 7 + t) % 64) as usize];
                let w = (r + t) % 8;
                if r % 5 == 4 {
                    idx.remove(w, &c[16..], ANY_TIER);
                } else {
                    idx.store(w, c, None, Tier::Device).unwrap();
                }
                if r % 997 == 0 {
                    idx.clear(w);
                }
            }
        }));
    }
    for _ in 0..2 {
        let (idx, chains) = (idx.clone(), chains.clone());
        hs.push(std::thread::spawn(move || {
            let mut n = 0usize;
            for r in 0..20000usize {
                let m = idx.find_matches(&chains[r % 64], ANY_TIER);
                n += m.len();
                let _ = n;
                assert!(m.depths.iter().all(|&d| (1..=32).contains(&d)));
            }
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    let st = idx.stats();
    assert_eq!(st.nodes as usize, idx.len());
    let total: u64 = (0..8).map(|w| idx.num_blocks(w)).sum();
    assert_eq!(total, st.entries);
}

#[test]
fn permanent_orphans_do_not_grow_the_waiting_list() {
    let idx = KvIndex::new(None);
    for k in 0..5000u64 {
        let c = chain(50_000 + k, 3);
        // Parent hash that will never be stored (an event stream that lost it for good).
        idx.store(1, &c[1..], Some(u64::MAX - k), Tier::Device).unwrap();
        idx.remove(1, &c[1..], ANY_TIER);
    }
    assert!(idx.is_empty());
    assert!(idx.awaiting_len.load(Relaxed) <= 2048, "{}", idx.awaiting_len.load(Relaxed));
    assert!(idx.awaiting.lock().values().map(Vec::len).sum::<usize>() <= 2048);
}

#[test]
fn orphan_adopted_when_parent_arrives_in_between() {
    // The parent exists in another shard by the time the orphan registers: adopted at once.
    let idx = KvIndex::new(None);
    let c = chain(77, 4);
    idx.store(2, &c[..2], None, Tier::Device).unwrap();
    idx.store(2, &c[2..], Some(c[1]), Tier::Device).unwrap();
    assert_eq!(depth(&idx, &c, 2), Some(4));
    assert_eq!(idx.awaiting_len.load(Relaxed), 0);
}

#[test]
fn long_stores_yield_while_blocks_they_chain_under_are_removed() {
    use std::sync::Arc;
    let idx = Arc::new(KvIndex::new(None));
    let chains: Arc<Vec<Vec<u64>>> = Arc::new((0..8).map(|k| chain(90_000 + k, 100)).collect());
    let mut hs = Vec::new();
    for t in 0..2u64 {
        let (idx, chains) = (idx.clone(), chains.clone());
        hs.push(std::thread::spawn(move || {
            for r in 0..400usize {
                let c = &chains[r % 8];
                if t == 0 {
                    idx.store(r as u64 % 3, c, None, Tier::Device).unwrap();
                } else {
                    // Remove around the yield points (every 16 blocks) of the other thread's stores.
                    let at = 15 + 16 * (r % 5);
                    idx.remove(r as u64 % 3, &c[at..at + 2], ANY_TIER);
                }
            }
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    let st = idx.stats();
    let total: u64 = (0..3).map(|w| idx.num_blocks(w)).sum();
    assert_eq!(total, st.entries);
    assert_eq!(st.nodes as usize, idx.len());
    // Whatever interleaving happened, a fresh full store makes every chain whole again.
    for (k, c) in chains.iter().enumerate() {
        idx.store(7, c, None, Tier::Device).unwrap();
        assert_eq!(depth(&idx, c, 7), Some(100), "chain {k}");
    }
}

fn live_sets(idx: &KvIndex) -> usize {
    (0..NUM_SHARDS).map(|s| idx.shard(s).read().arena.live_sets()).sum()
}

#[test]
fn turns_taken_over_by_another_worker_share_one_holder_set() {
    let idx = KvIndex::new(None);
    let c = chain(8, 40);
    // Worker 1 stores a session in turns, each under its parent; worker 2 takes the conversation
    // over and prefills the first 30 blocks, then stores the next turn alone.
    for t in (0..30).step_by(5) {
        idx.store(1, &c[t..t + 5], (t > 0).then(|| c[t - 1]), Tier::Device).unwrap();
    }
    idx.store(2, &c[..16], None, Tier::Device).unwrap();
    idx.store(2, &c[16..30], Some(c[15]), Tier::Device).unwrap();
    idx.store(2, &c[30..40], Some(c[29]), Tier::Device).unwrap();
    assert_eq!(live_sets(&idx), 1, "30 blocks held by {{1, 2}}: one set");
    assert_eq!(depth(&idx, &c, 1), Some(30));
    assert_eq!(depth(&idx, &c, 2), Some(40));
    // A middle removal gives that block its own (inline) holders; the others keep sharing.
    idx.remove(1, &c[12..13], ANY_TIER);
    assert_eq!(depth(&idx, &c, 1), Some(12));
    assert_eq!(depth(&idx, &c, 2), Some(40));
    assert_eq!(live_sets(&idx), 1);
    // A host copy of one block is another holder pattern, so another set.
    idx.store(1, &c[20..21], Some(c[19]), Tier::Host).unwrap();
    assert_eq!(live_sets(&idx), 2);
    assert_eq!(idx.find_matches(&c, Tier::Host.bit()).get(1), None, "host holds block 20 only");
    // Stored again, the block rejoins the shared set.
    idx.store(1, &c[12..13], Some(c[11]), Tier::Device).unwrap();
    assert_eq!(depth(&idx, &c, 1), Some(30));
    assert_eq!(live_sets(&idx), 2);
    assert_eq!(idx.stats().entries, 30 + 40);
    idx.remove_worker(1);
    assert_eq!(live_sets(&idx), 0, "one holder left everywhere: no set is kept");
    assert_eq!(depth(&idx, &c, 2), Some(40));
    idx.clear(2);
    assert!(idx.is_empty());
}

/// Slab slots of `hashes` in their shard.
fn slots_of(idx: &KvIndex, hashes: &[u64]) -> Vec<u32> {
    let g = idx.shard(root_shard(hashes[0])).read();
    hashes.iter().map(|&h| g.find(h).expect("stored")).collect()
}

#[test]
fn interleaved_turns_grow_their_runs_in_place() {
    let idx = KvIndex::new(None);
    // Two sessions under one root, stored turn by turn, alternately: each session's blocks
    // still end up in consecutive slots, so a walk never needs the table inside a run.
    let root = chain(20, 1);
    let a: Vec<u64> = root.iter().copied().chain(chain(21, 60)).collect();
    let b: Vec<u64> = root.iter().copied().chain(chain(22, 60)).collect();
    idx.store(1, &root, None, Tier::Device).unwrap();
    idx.store(2, &root, None, Tier::Device).unwrap();
    for t in (1..61).step_by(3) {
        idx.store(1, &a[t..t + 3], Some(a[t - 1]), Tier::Device).unwrap();
        idx.store(2, &b[t..t + 3], Some(b[t - 1]), Tier::Device).unwrap();
    }
    for s in [&a, &b] {
        let slots = slots_of(&idx, &s[1..]);
        let breaks = slots.windows(2).filter(|w| w[1] != w[0] + 1).count();
        assert_eq!(breaks, 0, "{slots:?}");
    }
    assert_eq!(depth(&idx, &a, 1), Some(61));
    assert_eq!(depth(&idx, &b, 2), Some(61));
    assert_eq!(depth(&idx, &b, 1), Some(1));
    assert_eq!(idx.len(), 121);
    assert_eq!(idx.stats().entries, 122);
}

#[test]
fn runs_move_only_above_branches_and_never_move_orphan_roots() {
    let idx = KvIndex::new(None);
    let c = chain(30, 12);
    let side = chain(31, 3);
    idx.store(1, &c[..6], None, Tier::Device).unwrap();
    idx.store(1, &side, Some(c[2]), Tier::Device).unwrap(); // a branch under block 2
    idx.store(9, &chain(32, 5), None, Tier::Device).unwrap(); // something else after the run
    idx.store(1, &c[6..9], Some(c[5]), Tier::Device).unwrap(); // the run must move to grow
    let branch = [c[..3].to_vec(), side.clone()].concat();
    assert_eq!(depth(&idx, &c, 1), Some(9));
    assert_eq!(depth(&idx, &branch, 1), Some(6), "the branch still hangs under block 2");
    // An orphan turn, a turn under it, then its parent: adopted and whole.
    let o = chain(33, 9);
    idx.store(2, &o[..3], None, Tier::Device).unwrap();
    idx.store(2, &o[5..7], Some(o[4]), Tier::Device).unwrap();
    idx.store(9, &chain(34, 2), None, Tier::Device).unwrap();
    idx.store(2, &o[7..9], Some(o[6]), Tier::Device).unwrap();
    idx.store(2, &o[3..5], Some(o[2]), Tier::Device).unwrap();
    assert_eq!(depth(&idx, &o, 2), Some(9));
    assert_eq!(idx.awaiting_len.load(Relaxed), 0);
    let kv = KvIndex::load(&idx.dump(), None).unwrap();
    assert_eq!(depth(&kv, &o, 2), Some(9));
    assert_eq!(depth(&kv, &branch, 1), Some(6));
}

#[test]
fn churn_does_not_grow_the_slab_without_bound() {
    let idx = KvIndex::new(None);
    let slab_len = || (0..NUM_SHARDS).map(|s| idx.shard(s).read().nodes.len()).sum::<usize>();
    let mut at_half = 0;
    for round in 0..600u64 {
        let c = chain(41 + round % 3, 40);
        for t in (0..40).step_by(4) {
            idx.store(1, &c[t..t + 4], (t > 0).then(|| c[t - 1]), Tier::Device).unwrap();
            idx.store(5, &chain(500 + round * 10 + t as u64, 1), None, Tier::Device).unwrap();
        }
        idx.remove(1, &c, ANY_TIER);
        idx.clear(5);
        if round == 299 {
            at_half = slab_len();
        }
    }
    assert!(idx.is_empty());
    // Holes are capped per shard (HOLES_ALLOWED plus one run), so the slab stops growing.
    assert!(slab_len() <= at_half + NUM_SHARDS * super::shard::MAX_RUN, "{at_half} -> {}", slab_len());
    assert!(slab_len() <= NUM_SHARDS * (1024 + 2 * super::shard::MAX_RUN));
}

#[test]
fn runs_are_followed_across_chunks_and_stop_where_holders_change() {
    // One store of 9000 blocks spans three slab chunks (4096 slots each): the walk along the run
    // must cross chunk ends; a second worker on a middle stretch changes the holders there.
    let idx = KvIndex::new(None);
    let c = chain(77, 9000);
    idx.store(1, &c, None, Tier::Device).unwrap();
    idx.store(2, &c[..5000], None, Tier::Device).unwrap();
    let m = idx.find_matches(&c, ANY_TIER);
    assert_eq!((m.get(1), m.get(2)), (Some(9000), Some(5000)));
    // Worker 2 loses a block inside the first chunk: its depth stops there, worker 1's does not.
    idx.remove(2, &c[4095..4096], ANY_TIER);
    let m = idx.find_matches(&c, ANY_TIER);
    assert_eq!((m.get(1), m.get(2)), (Some(9000), Some(4095)));
    // A query that leaves the chain mid-run (from there on its sequence hashes are another
    // chain's), and one that ends mid-run.
    let mut q = c[..6000].to_vec();
    q[5500..].iter_mut().for_each(|h| *h ^= 1);
    assert_eq!(depth(&idx, &q, 1), Some(5500));
    assert_eq!(depth(&idx, &c[..4097], 1), Some(4097));
    // A block deep inside a run (whose ends are untouched) loses its holder: the walk stops there.
    idx.remove(1, &c[7000..7001], ANY_TIER);
    let m = idx.find_matches(&c, ANY_TIER);
    assert_eq!((m.get(1), m.get(2)), (Some(7000), Some(4095)));
    // And gets it back: the run words cover the run again.
    idx.store(1, &c[7000..7001], Some(c[6999]), Tier::Device).unwrap();
    assert_eq!(depth(&idx, &c, 1), Some(9000));
}

#[test]
fn lock_free_matches_never_over_report_under_concurrent_writes() {
    // Writers store chains turn by turn (runs grow and move), remove middle blocks (slots freed
    // and refilled), share blocks between workers (spilled sets interned and retired), and
    // remove workers whose slots are then reused by new ids; readers match meanwhile, without a
    // lock. Each worker id only ever stores the first `limit(id)` blocks of a chain, so a match
    // that names it deeper read a torn node, another block's holders or a reused slot.
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    const LEN: usize = 64;
    fn limit(id: u64) -> usize {
        4 + (id.wrapping_mul(7919) % 60) as usize
    }
    let idx = Arc::new(KvIndex::new(None));
    let chains: Arc<Vec<Vec<u64>>> = Arc::new((0..24).map(|k| chain(777_000 + k, LEN)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for t in 0..2u64 {
        let (idx, chains) = (idx.clone(), chains.clone());
        writers.push(std::thread::spawn(move || {
            let mut rng = 0x9E37_79B9u64 ^ t;
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut gen = 0u64;
            for r in 0..(if cfg!(miri) { 50 } else { 6000 }) {
                let id = t * 1_000_000 + gen * 4 + next() % 4;
                let c = &chains[(next() % chains.len() as u64) as usize];
                let lim = limit(id);
                match next() % 8 {
                    0..=4 => {
                        // In turns of 1-8 blocks, each under its parent.
                        let mut at = 0;
                        while at < lim {
                            let end = (at + 1 + (next() % 8) as usize).min(lim);
                            idx.store(id, &c[at..end], (at > 0).then(|| c[at - 1]), Tier::Device).unwrap();
                            at = end;
                        }
                    }
                    5 | 6 => {
                        let a = (next() % LEN as u64) as usize;
                        let b = (a + 1 + (next() % 8) as usize).min(LEN);
                        idx.remove(id, &c[a..b], ANY_TIER);
                    }
                    _ => {
                        for k in 0..4 {
                            idx.remove_worker(t * 1_000_000 + gen * 4 + k);
                        }
                        gen += 1;
                    }
                }
                if r % 1000 == 999 {
                    idx.clear(id);
                }
            }
        }));
    }
    let mut readers = Vec::new();
    for _ in 0..2 {
        let (idx, chains, stop) = (idx.clone(), chains.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Relaxed) || n < 1000 {
                for c in chains.iter() {
                    let m = idx.find_matches(c, ANY_TIER);
                    for (&w, &d) in m.workers.iter().zip(&m.depths) {
                        assert!(d as usize <= limit(w), "worker {w} matched {d} blocks, stores at most {}", limit(w));
                    }
                    n += 1;
                }
            }
        }));
    }
    for h in writers {
        h.join().unwrap();
    }
    stop.store(true, Relaxed);
    for h in readers {
        h.join().unwrap();
    }
    let st = idx.stats();
    assert_eq!(st.nodes as usize, idx.len());
}

#[test]
fn matches_do_not_wait_for_a_writer_holding_the_shard() {
    // A writer descheduled mid-store holds its shard's lock: a match of a chain in that shard
    // still answers (with the lock-based read path, this very thread would deadlock here).
    let idx = KvIndex::new(None);
    let c = chain(31, 300);
    idx.store(1, &c, None, Tier::Device).unwrap();
    idx.store(2, &c[..100], None, Tier::Device).unwrap();
    let held = idx.shard(root_shard(c[0])).write();
    assert_eq!(depth(&idx, &c, 1), Some(300));
    assert_eq!(depth(&idx, &c, 2), Some(100));
    drop(held);
    let held = idx.shard(root_shard(c[0])).upgradable_read();
    assert_eq!(depth(&idx, &c, 1), Some(300));
    drop(held);
}

/// A node's child count lives in 2 bits of its `hp` word up to 2, and in the slab's side map from
/// 3 on: a branch point with many children must count them exactly through adds, removals, run
/// moves and eviction, and go away only with its last child.
#[test]
fn branch_points_with_many_children_count_them_exactly() {
    for max_nodes in [None, Some(400)] {
        let idx = KvIndex::new(max_nodes);
        let root = chain(9, 2);
        for w in 1..=3 {
            idx.store(w, &root, None, Tier::Device).unwrap();
        }
        // 40 branches under root[1], each stored in two turns (the second grows or moves a run).
        let branches: Vec<Vec<u64>> = (0..40u64).map(|b| chain(5000 + b, 6)).collect();
        for (k, b) in branches.iter().enumerate() {
            idx.store(1 + (k as u64 % 3), &b[..3], Some(root[1]), Tier::Device).unwrap();
        }
        for (k, b) in branches.iter().enumerate() {
            idx.store(1 + (k as u64 % 3), &b[3..], Some(b[2]), Tier::Device).unwrap();
        }
        let (s, i) = (root_shard(root[0]), 1);
        let g = idx.shard(s).read();
        let ri = g.find(root[1]).unwrap();
        assert_eq!(g.nodes.children(ri as usize), 40);
        assert_eq!(g.nodes.children(g.find(root[0]).unwrap() as usize), i);
        drop(g);
        for (k, b) in branches.iter().enumerate() {
            let mut q = root.clone();
            q.extend_from_slice(b);
            assert_eq!(depth(&idx, &q, 1 + (k as u64 % 3)), Some(8), "branch {k}");
        }
        // The root's holders let go: the branch point stays while any branch does.
        for w in 1..=3 {
            idx.remove(w, &root, ANY_TIER);
        }
        for (k, b) in branches.iter().enumerate().take(38) {
            idx.remove(1 + (k as u64 % 3), b, ANY_TIER);
            let g = idx.shard(s).read();
            let ri = g.find(root[1]).expect("branch point kept while it has children");
            assert_eq!(g.nodes.children(ri as usize), 40 - k as u32 - 1);
        }
        assert_eq!(idx.len(), 2 + 2 * 6);
        for k in [39, 38] {
            idx.remove(1 + (k as u64 % 3), &branches[k], ANY_TIER);
        }
        assert_eq!(idx.len(), 0, "the holder-less branch point goes with its last child");
    }
}

/// An index without `max_nodes` keeps no recency, so its snapshot says 0 for every node: loaded
/// into an index with a cap, those nodes are evicted before anything stored after the load.
#[test]
fn a_snapshot_without_recency_loads_as_older_than_what_follows() {
    let idx = KvIndex::new(None);
    let (a, b) = (chain(71, 10), chain(72, 10));
    idx.store(1, &a, None, Tier::Device).unwrap();
    let capped = KvIndex::load(&idx.dump(), Some(12)).unwrap();
    assert_eq!(depth(&capped, &a, 1), Some(10));
    capped.store(1, &b, None, Tier::Device).unwrap();
    assert!(capped.len() <= 12, "{}", capped.len());
    assert_eq!(depth(&capped, &b, 1), Some(10), "what was stored after the load stays");
    assert!(depth(&capped, &a, 1).unwrap_or(0) < 10, "the loaded chain is evicted first");
}

#[test]
fn chains_stay_in_consecutive_slots_under_churn() {
    // Eight sessions at a time under one shared root grow in interleaved 4-block turns, while an
    // overflowing cache evicts the oldest session deepest block first, one removal per block (as
    // vLLM publishes them). The freed stretches must be found again, so that a session's blocks
    // keep sitting in a few runs of consecutive slots (walks follow runs without the table);
    // before, the slots freed in descending order were taken one by one, a run per block.
    let idx = KvIndex::new(None);
    let root = chain(900, 1);
    idx.store(1, &root, None, Tier::Device).unwrap();
    const LEN: usize = 64;
    const CAP: usize = 2000;
    let sessions: Vec<Vec<u64>> = (0..400).map(|k| [root.clone(), chain(1000 + k, LEN)].concat()).collect();
    let mut grown = vec![1usize; sessions.len()]; // blocks stored (block 0 is the root)
    let mut kept = vec![0usize; sessions.len()]; // blocks still held past the root
    let (mut next, mut oldest, mut live) = (0usize, 0usize, 0usize);
    let mut open: Vec<usize> = Vec::new();
    while next < sessions.len() || !open.is_empty() {
        while open.len() < 8 && next < sessions.len() {
            open.push(next);
            next += 1;
        }
        for k in std::mem::take(&mut open) {
            let (c, g) = (&sessions[k], grown[k]);
            let end = (g + 4).min(LEN + 1);
            while live + (end - g) > CAP {
                // Evict the oldest session's deepest blocks.
                let d = kept[oldest];
                if d == 0 {
                    oldest += 1;
                    continue;
                }
                idx.remove(1, &sessions[oldest][d..d + 1], ANY_TIER);
                kept[oldest] -= 1;
                live -= 1;
            }
            idx.store(1, &c[g..end], Some(c[g - 1]), Tier::Device).unwrap();
            (grown[k], kept[k]) = (end, end - 1);
            live += end - g;
            if end <= LEN {
                open.push(k);
            }
        }
    }
    let shard = idx.shard(root_shard(root[0])).read();
    let free_before = shard.free_slots();
    assert!(free_before > 0, "the cache overflowed");
    for c in &sessions[sessions.len() - 8..] {
        let slots: Vec<u32> = c.iter().map(|&h| shard.find(h).expect("a recent session is held")).collect();
        let runs = 1 + slots.windows(2).filter(|w| w[1] != w[0] + 1).count();
        assert!(runs <= 8, "{runs} runs for {} blocks: {slots:?}", c.len());
    }
}

/// Long sessions grown turn by turn by several workers, with blocks lost in the middle, whole
/// workers cleared and runs moved as they grow: every match against a reference that walks the
/// blocks one by one (the run words let a match check only a run's last slot; this is where a
/// word that outlived a change would show).
#[test]
fn long_runs_agree_with_a_block_by_block_reference() {
    use crate::random::SplitMix64;
    use std::collections::{HashMap, HashSet};
    let mut rng = SplitMix64::new(7);
    let idx = KvIndex::new(None);
    // Four sessions of up to 600 blocks on two shared prefixes of 40 blocks.
    let prefixes: Vec<Vec<u64>> = (0..2).map(|p| chain(900 + p, 40)).collect();
    let sessions: Vec<Vec<u64>> = (0..4).map(|s| prefixes[s % 2].iter().copied().chain(chain(1000 + s as u64, 560)).collect()).collect();
    let mut held: HashMap<WorkerId, HashSet<u64>> = HashMap::new();
    let mut grown: HashMap<(usize, WorkerId), usize> = HashMap::new();
    let reference = |held: &HashMap<WorkerId, HashSet<u64>>, q: &[u64]| -> Vec<(WorkerId, u32)> {
        let mut v: Vec<(WorkerId, u32)> =
            held.iter().map(|(&w, set)| (w, q.iter().take_while(|h| set.contains(h)).count() as u32)).filter(|&(_, d)| d > 0).collect();
        v.sort_unstable();
        v
    };
    for step in 0..4000 {
        let s = rng.below(4) as usize;
        let w = rng.below(5);
        let p = &sessions[s];
        match rng.below(10) {
            0..=5 => {
                // A turn: the worker stores the next 1-64 blocks of the session (from block 0 if
                // it has none: a worker prefills the prefix it lacks).
                let at = *grown.get(&(s, w)).unwrap_or(&0);
                let end = (at + 1 + rng.below(64) as usize).min(p.len());
                if at < end {
                    idx.store(w, &p[at..end], at.checked_sub(1).map(|i| p[i]), Tier::Device).unwrap();
                    held.entry(w).or_default().extend(&p[at..end]);
                    grown.insert((s, w), end);
                }
            }
            6 | 7 => {
                let i = rng.below(p.len() as u64) as usize;
                let j = (i + 1 + rng.below(3) as usize).min(p.len());
                idx.remove(w, &p[i..j], ANY_TIER);
                if let Some(set) = held.get_mut(&w) {
                    p[i..j].iter().for_each(|h| {
                        set.remove(h);
                    });
                }
            }
            8 if rng.below(8) == 0 => {
                idx.clear(w);
                held.remove(&w);
                grown.retain(|&(_, x), _| x != w);
            }
            _ => {}
        }
        for (q, p) in sessions.iter().enumerate() {
            let k = 1 + rng.below(p.len() as u64) as usize;
            let mut got: Vec<(WorkerId, u32)> = {
                let m = idx.find_matches(&p[..k], ANY_TIER);
                m.workers.iter().copied().zip(m.depths.iter().copied()).collect()
            };
            got.sort_unstable();
            assert_eq!(got, reference(&held, &p[..k]), "step {step}, session {q}, {k} blocks");
        }
    }
}
