use super::*;
use crate::hash::{sequence_hashes, DEFAULT_SEED};
use crate::index::ANY_TIER;

/// A small msgpack writer for building engine-shaped payloads in tests.
#[derive(Clone, Debug)]
enum V {
    Nil,
    U(u64),
    I(i64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::U(u) => {
            if *u < 128 {
                out.push(*u as u8)
            } else if *u <= u16::MAX as u64 {
                out.push(0xcd);
                out.extend_from_slice(&(*u as u16).to_be_bytes())
            } else {
                out.push(0xcf);
                out.extend_from_slice(&u.to_be_bytes())
            }
        }
        V::I(i) => {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes())
        }
        V::F(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_bits().to_be_bytes())
        }
        V::S(s) => {
            out.push(0xd9);
            out.push(s.len() as u8);
            out.extend_from_slice(s.as_bytes())
        }
        V::B(b) => {
            out.push(0xc4);
            out.push(b.len() as u8);
            out.extend_from_slice(b)
        }
        V::A(a) => {
            out.push(0xdc);
            out.extend_from_slice(&(a.len() as u16).to_be_bytes());
            a.iter().for_each(|x| enc(x, out))
        }
        V::M(m) => {
            out.push(0xde);
            out.extend_from_slice(&(m.len() as u16).to_be_bytes());
            for (k, x) in m {
                enc(&V::S(k), out);
                enc(x, out);
            }
        }
    }
}

fn bytes(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(v, &mut out);
    out
}

fn toks(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

fn ua(xs: &[u64]) -> V {
    V::A(xs.iter().map(|&x| V::U(x)).collect())
}

fn ta(xs: &[u32]) -> V {
    V::A(xs.iter().map(|&x| V::U(x as u64)).collect())
}

fn stored_map(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u64, medium: Option<&'static str>) -> V {
    V::M(vec![
        ("type", V::S("BlockStored")),
        ("block_hashes", ua(hashes)),
        ("parent_block_hash", parent.map_or(V::Nil, V::U)),
        ("token_ids", ta(tokens)),
        ("block_size", V::U(bs)),
        ("lora_id", V::Nil),
        ("medium", medium.map_or(V::Nil, V::S)),
        ("lora_name", V::Nil),
        ("extra_keys", V::Nil),
        ("kv_cache_spec_kind", V::S("full_attention")),
    ])
}

/// vLLM's full positional form, identity fields included (`lora_id`, `medium`, `lora_name`, `extra_keys`).
fn stored_arr_id(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u64, lora: Option<&'static str>, extra: V) -> V {
    V::A(vec![
        V::S("BlockStored"),
        ua(hashes),
        parent.map_or(V::Nil, V::U),
        ta(tokens),
        V::U(bs),
        V::Nil,
        V::S("GPU"),
        lora.map_or(V::Nil, V::S),
        extra,
    ])
}

fn stored_map_id(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u64, lora: Option<&'static str>, extra: V) -> V {
    let V::M(mut fields) = stored_map(hashes, parent, tokens, bs, None) else { unreachable!() };
    for (k, v) in fields.iter_mut() {
        match *k {
            "lora_name" => *v = lora.map_or(V::Nil, V::S),
            "extra_keys" => *v = extra.clone(),
            _ => {}
        }
    }
    V::M(fields)
}

fn stored_arr(hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u64) -> V {
    V::A(vec![V::S("BlockStored"), ua(hashes), parent.map_or(V::Nil, V::U), ta(tokens), V::U(bs), V::Nil, V::S("GPU")])
}

fn removed_map(hashes: &[u64], medium: Option<&'static str>) -> V {
    V::M(vec![("type", V::S("BlockRemoved")), ("block_hashes", ua(hashes)), ("medium", medium.map_or(V::Nil, V::S))])
}

fn batch(events: Vec<V>, rank: u64) -> Vec<u8> {
    bytes(&V::A(vec![V::F(1.5), V::A(events), V::U(rank)]))
}

const BS: usize = 4;

fn seqs(tokens: &[u32]) -> Vec<u64> {
    sequence_hashes(tokens, BS, DEFAULT_SEED, None)
}

#[test]
fn map_events_store_chain_and_resolve_parent() {
    let idx = KvIndex::new(None);
    let t = toks(0, 16);
    let p1 = batch(vec![stored_map(&[101, 102], None, &t[..8], 4, Some("GPU"))], 0);
    let st = idx.apply_event_batch(7, &p1, BS, DEFAULT_SEED).unwrap();
    assert_eq!((st.worker, st.events, st.blocks_stored, st.orphan_blocks), (7, 1, 2, 0));
    let p2 = batch(vec![stored_map(&[103, 104], Some(102), &t[8..], 4, None)], 0);
    idx.apply_event_batch(7, &p2, BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.find_matches(&seqs(&t), ANY_TIER).get(7), Some(4));
    assert_eq!(idx.engine_hashes(7), 4);
    // Removing block 3 by its engine hash cuts the match at 2... block 2 (index) = hash 103.
    idx.apply_event_batch(7, &batch(vec![removed_map(&[103], Some("GPU"))], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.find_matches(&seqs(&t), ANY_TIER).get(7), Some(2));
    assert_eq!(idx.num_blocks(7), 3);
}

#[test]
fn legacy_array_events_and_dp_rank() {
    let idx = KvIndex::new(None);
    let t = toks(100, 8);
    let st = idx.apply_event_batch(10, &batch(vec![stored_arr(&[1, 2], None, &t, 4)], 2), BS, DEFAULT_SEED).unwrap();
    assert_eq!(st.worker, 12);
    assert_eq!(idx.find_matches(&seqs(&t), ANY_TIER).get(12), Some(2));
    let cleared = bytes(&V::A(vec![V::F(2.0), V::A(vec![V::A(vec![V::S("AllBlocksCleared")])]), V::U(2)]));
    idx.apply_event_batch(10, &cleared, BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.num_blocks(12), 0);
    assert_eq!(idx.engine_hashes(12), 0);
}

#[test]
fn map_shaped_batch_with_sglang_rank_and_signed_and_bin_hashes() {
    let idx = KvIndex::new(None);
    let t = toks(5, 8);
    let mut digest = vec![0xAAu8; 24];
    digest.extend_from_slice(&77u64.to_be_bytes());
    let ev = V::M(vec![
        ("type", V::S("BlockStored")),
        ("block_hashes", V::A(vec![V::I(-5), V::B(digest)])),
        ("parent_block_hash", V::Nil),
        ("token_ids", ta(&t)),
        ("block_size", V::U(4)),
        ("medium", V::S("CPU_PINNED")),
    ]);
    let p = bytes(&V::M(vec![("ts", V::U(3)), ("events", V::A(vec![ev])), ("attn_dp_rank", V::U(1))]));
    let st = idx.apply_event_batch(0, &p, BS, DEFAULT_SEED).unwrap();
    assert_eq!(st.worker, 1);
    assert_eq!(idx.find_matches(&seqs(&t), Tier::Host.bit()).get(1), Some(2));
    assert_eq!(idx.find_matches(&seqs(&t), Tier::Device.bit()).get(1), None);
    // The bin hash folds to its last 8 bytes: removing int 77 removes it.
    idx.apply_event_batch(0, &batch(vec![removed_map(&[77], Some("CPU_PINNED"))], 1), BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.find_matches(&seqs(&t), ANY_TIER).get(1), Some(1));
    let p = batch(vec![V::M(vec![("type", V::S("BlockRemoved")), ("block_hashes", V::A(vec![V::I(-5)])), ("medium", V::S("CPU"))])], 1);
    idx.apply_event_batch(0, &p, BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.num_blocks(1), 0);
}

#[test]
fn unknown_parent_is_an_unmatchable_orphan_whose_children_and_removals_resolve() {
    let idx = KvIndex::new(None);
    let t = toks(0, 12);
    idx.apply_event_batch(1, &batch(vec![stored_map(&[11], Some(999), &t[4..8], 4, None)], 0), BS, DEFAULT_SEED).unwrap();
    idx.apply_event_batch(1, &batch(vec![stored_map(&[12], Some(11), &t[8..12], 4, None)], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.num_blocks(1), 2);
    assert!(idx.find_matches(&seqs(&t), ANY_TIER).is_empty());
    idx.apply_event_batch(1, &batch(vec![removed_map(&[11, 12], None)], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.num_blocks(1), 0);
    assert_eq!(idx.engine_hashes(1), 0);
}

#[test]
fn shared_prefix_under_two_engine_hashes_is_refcounted_and_tiers_are_separate() {
    let idx = KvIndex::new(None);
    let t = toks(0, 4);
    // Same tokens, two engine hashes (e.g. two cache salts).
    idx.apply_event_batch(1, &batch(vec![stored_map(&[1], None, &t, 4, None), stored_map(&[2], None, &t, 4, None)], 0), BS, DEFAULT_SEED)
        .unwrap();
    idx.apply_event_batch(1, &batch(vec![stored_map(&[1], None, &t, 4, Some("DISK"))], 0), BS, DEFAULT_SEED).unwrap();
    idx.apply_event_batch(1, &batch(vec![removed_map(&[1], Some("GPU"))], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.find_matches(&seqs(&t), Tier::Device.bit()).get(1), Some(1), "engine hash 2 still holds it");
    idx.apply_event_batch(1, &batch(vec![removed_map(&[2], Some("GPU"))], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.find_matches(&seqs(&t), Tier::Device.bit()).get(1), None);
    assert_eq!(idx.find_matches(&seqs(&t), Tier::Disk.bit()).get(1), Some(1));
    let st = idx.apply_event_batch(1, &batch(vec![removed_map(&[2], Some("GPU"))], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!(st.unknown_removals, 1);
}

#[test]
fn group_idx_nonzero_is_skipped() {
    let idx = KvIndex::new(None);
    let t = toks(0, 4);
    let mut ev = stored_map(&[1], None, &t, 4, None);
    if let V::M(m) = &mut ev {
        m.push(("group_idx", V::U(1)));
    }
    let st = idx.apply_event_batch(1, &batch(vec![ev], 0), BS, DEFAULT_SEED).unwrap();
    assert_eq!((st.events, st.skipped), (0, 1));
    assert_eq!(idx.num_blocks(1), 0);
}

#[test]
fn blocks_of_another_size_are_skipped() {
    let idx = KvIndex::new(None);
    let t = toks(0, 16);
    let st = idx
        .apply_event_batch(
            1,
            &batch(vec![stored_map(&[1], None, &t, 16, Some("CPU")), stored_map(&[2], None, &t[..4], 4, None)], 0),
            BS,
            DEFAULT_SEED,
        )
        .unwrap();
    assert_eq!((st.events, st.skipped, st.blocks_stored), (1, 1, 1));
    assert_eq!(idx.num_blocks(1), 1);
    assert_eq!(idx.engine_hashes(1), 1);
}

#[test]
fn clear_and_remove_worker_drop_the_engine_map() {
    let idx = KvIndex::new(None);
    let t = toks(0, 8);
    idx.apply_event_batch(3, &batch(vec![stored_map(&[1, 2], None, &t, 4, None)], 0), BS, DEFAULT_SEED).unwrap();
    idx.clear(3);
    assert_eq!(idx.engine_hashes(3), 0);
    idx.apply_event_batch(3, &batch(vec![stored_map(&[1, 2], None, &t, 4, None)], 0), BS, DEFAULT_SEED).unwrap();
    idx.remove_worker(3);
    assert_eq!(idx.engine_hashes(3), 0);
    assert!(idx.workers().is_empty());
}

fn err(p: &[u8]) -> EventError {
    let idx = KvIndex::new(None);
    let t = toks(0, 8);
    idx.apply_event_batch(9, &batch(vec![stored_map(&[1, 2], None, &t, 4, None)], 0), BS, DEFAULT_SEED).unwrap();
    let before = idx.dump();
    let e = idx.apply_event_batch(9, p, BS, DEFAULT_SEED).unwrap_err();
    assert_eq!(idx.dump(), before, "a rejected batch must change nothing");
    assert_eq!(idx.engine_hashes(9), 2);
    e
}

#[test]
fn malformed_batches_are_rejected_whole_with_a_named_problem() {
    let t = toks(0, 8);
    let good = stored_map(&[5, 6], None, &t, 4, None);
    // A valid event followed by a bad one: nothing is applied.
    let e = err(&batch(vec![good.clone(), V::M(vec![("type", V::S("BlockMoved"))])], 0));
    assert!(matches!(&e, EventError::UnknownEventType { name, .. } if name == "BlockMoved"), "{e}");
    assert!(e.to_string().contains("events[1]"), "{e}");
    let e = err(&batch(vec![good.clone(), stored_map(&[7], None, &t[..3], 4, None)], 0));
    assert!(matches!(e, EventError::TokenCount { tokens: 3, blocks: 1, block_size: 4, .. }), "{e}");
    let e = err(&batch(vec![good.clone(), stored_map(&[7], None, &t[..4], 8, None)], 0));
    assert!(matches!(e, EventError::TokenCount { tokens: 4, blocks: 1, block_size: 8, .. }), "{e}");
    let e = err(&batch(vec![stored_map(&[7], None, &[], 0, None)], 0));
    assert!(matches!(e, EventError::OutOfRange { .. }), "{e}");
    let e = err(&batch(vec![good.clone(), removed_map(&[5], Some("TAPE"))], 0));
    assert!(matches!(e, EventError::UnknownMedium { .. }), "{e}");
    let full = batch(vec![good.clone()], 0);
    let e = err(&full[..full.len() - 3]);
    assert!(matches!(e, EventError::Truncated { .. }), "{e}");
    let e = err(b"\xc1garbage");
    assert!(matches!(e, EventError::WrongType { .. }), "{e}");
    let e = err(&bytes(&V::A(vec![V::F(1.0), V::A(vec![V::M(vec![("type", V::S("BlockStored")), ("block_hashes", V::S("no"))])])])));
    assert!(matches!(e, EventError::WrongType { expected: "array", found: "str", .. }), "{e}");
    let mut trailing = full.clone();
    trailing.push(0);
    assert!(matches!(err(&trailing), EventError::TrailingBytes { .. }));
    let e = err(&batch(vec![V::M(vec![("type", V::S("BlockRemoved")), ("block_hashes", V::A(vec![V::B(vec![1, 2, 3])]))])], 0));
    assert!(matches!(e, EventError::BadHash { len: 3, .. }), "{e}");
    let e = err(&batch(vec![V::M(vec![("type", V::S("BlockStored")), ("block_hashes", ua(&[1]))])], 0));
    assert!(matches!(e, EventError::MissingField { field: "token_ids", .. }), "{e}");
    // A forged huge array count is truncation, not an allocation.
    let e = err(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x90]);
    assert!(matches!(e, EventError::MissingField { field: "type", .. }), "{e}");
    let e = err(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(e, EventError::Truncated { .. }), "{e}");
    let mut deep = vec![0x92, 0x00, 0x91, 0x82, 0xa4];
    deep.extend_from_slice(b"type");
    deep.extend_from_slice(&[0xa3, b'x', b'y', b'z']);
    deep.extend(std::iter::repeat_n(0x91, 200));
    assert!(matches!(err(&deep), EventError::UnknownEventType { .. } | EventError::TooDeep { .. } | EventError::Truncated { .. }));
}

#[test]
fn token_ids_in_any_int_encoding_decode_alike() {
    // uint64 and int64 encodings of small ids (msgspec picks the smallest; others may not).
    let mut p = vec![0x92, 0x00, 0x91, 0x85];
    for (k, v) in [("type", &b"\xabBlockStored"[..]), ("block_hashes", &[0x91, 0x07][..]), ("block_size", &[0x04][..])] {
        p.push(0xa0 | k.len() as u8);
        p.extend_from_slice(k.as_bytes());
        p.extend_from_slice(v);
    }
    p.extend_from_slice(
        b"\xa9token_ids\x94\x01\xcf\x00\x00\x00\x00\x00\x00\x01\x00\xd3\x00\x00\x00\x00\x00\x00\x00\x03\xce\x00\x01\x00\x00",
    );
    p.extend_from_slice(b"\xa6medium\xc0");
    let idx = KvIndex::new(None);
    idx.apply_event_batch(1, &p, BS, DEFAULT_SEED).unwrap();
    assert_eq!(idx.find_matches(&seqs(&[1, 256, 3, 65536]), ANY_TIER).get(1), Some(1));
}

#[test]
fn skip_rejects_deep_nesting_without_recursion() {
    let mut p = vec![0x92, 0x00, 0x91, 0x82, 0xa1, b'z'];
    p.extend(std::iter::repeat_n(0x91, 100));
    p.push(0xc0);
    p.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e', 0xa3, b'a', b'b', b'c']);
    let e = err(&p);
    assert!(matches!(e, EventError::TooDeep { .. }), "{e}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
        let idx = KvIndex::new(None);
        let before = idx.dump();
        if idx.apply_event_batch(1, &data, BS, DEFAULT_SEED).is_err() {
            proptest::prop_assert_eq!(idx.dump(), before);
        }
    }

    #[test]
    fn mutated_batches_never_panic(pos in 0usize..400, byte in proptest::prelude::any::<u8>(), cut in 0usize..400) {
        let t = toks(0, 8);
        let mut p = batch(vec![stored_map(&[1, 2], None, &t, 4, Some("GPU")), removed_map(&[1], None), stored_arr(&[3], Some(2), &t[..4], 4)], 0);
        let n = p.len();
        p[pos % n] = byte;
        p.truncate(n - cut % n);
        let idx = KvIndex::new(None);
        let before = idx.dump();
        if idx.apply_event_batch(1, &p, BS, DEFAULT_SEED).is_err() {
            proptest::prop_assert_eq!(idx.dump(), before);
        }
    }
}

#[test]
fn apply_decoded_takes_in_process_batches_and_refuses_bad_ones_whole() {
    let idx = KvIndex::new(None);
    let tokens: Vec<u32> = (0..8).collect();
    let mut b = DecodedBatch::default();
    b.hashes.extend([11, 12]);
    b.tokens.extend_from_slice(&tokens);
    b.events.push(DecodedEvent::Stored { hashes: 0..2, parent: None, tokens: 0..8, tier: Tier::Device, root: None, mixes: 0..0 });
    let (mut seqs, mut rem) = (Vec::new(), Vec::new());
    let st = idx.apply_decoded(3, &b, 4, DEFAULT_SEED, &mut seqs, &mut rem).unwrap();
    assert_eq!(st.blocks_stored, 2);
    // The same blocks as a live payload would give: the router's own sequence hashes.
    let m = idx.find_matches(&sequence_hashes(&tokens, 4, DEFAULT_SEED, None), ANY_TIER);
    assert_eq!(m.get(3), Some(2));
    // A Stored event whose tokens do not fill its blocks is refused before anything applies.
    let mut bad = DecodedBatch::default();
    bad.hashes.extend([21, 22]);
    bad.tokens.extend_from_slice(&tokens[..7]);
    bad.events.push(DecodedEvent::Removed { hashes: 0..1, tier: Tier::Device });
    bad.events.push(DecodedEvent::Stored { hashes: 0..2, parent: None, tokens: 0..7, tier: Tier::Device, root: None, mixes: 0..0 });
    let e = idx.apply_decoded(3, &bad, 4, DEFAULT_SEED, &mut seqs, &mut rem).unwrap_err();
    assert!(matches!(e, EventError::TokenCount { tokens: 7, blocks: 2, block_size: 4, .. }), "{e}");
    // A range outside the batch's buffers is refused too.
    let mut oob = DecodedBatch::default();
    oob.events.push(DecodedEvent::Removed { hashes: 0..3, tier: Tier::Device });
    let e = idx.apply_decoded(3, &oob, 4, DEFAULT_SEED, &mut seqs, &mut rem).unwrap_err();
    assert!(matches!(e, EventError::OutOfRange { .. }), "{e}");
    assert_eq!(idx.num_blocks(3), 2);
}

#[test]
fn a_clear_racing_a_batch_leaves_no_block_the_events_cannot_remove() {
    // Every block the index holds for a worker must be one its aliases resolve, or no BlockRemoved
    // can take it out: a clear or remove_worker landing in the middle of a batch must not leave that
    // batch's blocks in the index under aliases already dropped. (Found by a review of this code.)
    let idx = KvIndex::new(None);
    let done = std::sync::atomic::AtomicBool::new(false);
    let stale = std::thread::scope(|s| {
        s.spawn(|| {
            let mut n = 0u64;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                if n % 2 == 0 {
                    idx.clear(5);
                } else {
                    idx.remove_worker(5);
                }
                n += 1;
            }
        });
        let (mut seqs, mut rem) = (Vec::new(), Vec::new());
        let mut stale = 0;
        for i in 0..10_000u64 {
            let mut b = DecodedBatch::default();
            b.hashes.extend(16 * i..16 * i + 16);
            b.tokens.extend(toks(64 * i as u32, 64));
            b.events.push(DecodedEvent::Stored { hashes: 0..16, parent: None, tokens: 0..64, tier: Tier::Device, root: None, mixes: 0..0 });
            idx.apply_decoded(5, &b, BS, DEFAULT_SEED, &mut seqs, &mut rem).unwrap();
            b.events[0] = DecodedEvent::Removed { hashes: 0..16, tier: Tier::Device };
            idx.apply_decoded(5, &b, BS, DEFAULT_SEED, &mut seqs, &mut rem).unwrap();
            // Clears only take blocks away: after the removal none of this batch's may be left.
            stale += idx.num_blocks(5);
        }
        done.store(true, std::sync::atomic::Ordering::Release);
        stale
    });
    assert_eq!(stale, 0, "blocks left in the index that no engine hash maps to");
}

mod identity {
    use super::*;
    use crate::hash::identity_root;

    const BS: usize = 4;

    fn depth(ix: &KvIndex, tokens: &[u32], root: Option<u64>) -> u32 {
        let h = sequence_hashes(tokens, BS, DEFAULT_SEED, root);
        ix.find_matches(&h, ANY_TIER).depths.first().copied().unwrap_or(0)
    }

    fn keys(per_block: Vec<Vec<V>>) -> V {
        V::A(per_block.into_iter().map(|k| if k.is_empty() { V::Nil } else { V::A(k) }).collect())
    }

    /// Each identity vLLM publishes keys its blocks apart, in both event encodings, and a request
    /// with that identity (and only it) matches them.
    #[test]
    fn adapters_and_salts_key_blocks_apart() {
        let t = toks(100, 3 * BS);
        let a = Some(b"tenant-a".as_slice());
        let cases: Vec<(Option<&'static str>, V, Option<u64>)> = vec![
            (None, V::Nil, None),
            (Some("tenant-a"), keys(vec![vec![V::S("tenant-a")]; 3]), identity_root(a, None)),
            (None, keys(vec![vec![V::S("s1")], vec![], vec![]]), identity_root(None, Some(b"s1"))),
            (
                Some("tenant-a"),
                keys(vec![vec![V::S("tenant-a"), V::S("s1")], vec![V::S("tenant-a")], vec![V::S("tenant-a")]]),
                identity_root(a, Some(b"s1")),
            ),
        ];
        let roots = [
            None,
            identity_root(a, None),
            identity_root(None, Some(b"s1")),
            identity_root(a, Some(b"s1")),
            identity_root(Some(b"tenant-b"), None),
        ];
        for form in 0..2 {
            for (lora, extra, root) in &cases {
                let ev = if form == 0 {
                    stored_arr_id(&[1, 2, 3], None, &t, BS as u64, *lora, extra.clone())
                } else {
                    stored_map_id(&[1, 2, 3], None, &t, BS as u64, *lora, extra.clone())
                };
                let ix = KvIndex::new(None);
                ix.apply_event_batch(0, &batch(vec![ev], 0), BS, DEFAULT_SEED).unwrap();
                for r in roots {
                    let want = if r == *root { 3 } else { 0 };
                    assert_eq!(depth(&ix, &t, r), want, "form {form}, lora {lora:?}, request root {r:?}");
                }
                // The engine's hashes still resolve removals.
                ix.apply_event_batch(0, &batch(vec![removed_map(&[3], None)], 0), BS, DEFAULT_SEED).unwrap();
                assert_eq!(depth(&ix, &t, *root), 2);
            }
        }
    }

    /// A chain continued under a known parent keeps its identity (later blocks carry only the LoRA name).
    #[test]
    fn a_continued_chain_keeps_its_identity() {
        let t = toks(7, 4 * BS);
        let root = identity_root(Some(b"a"), Some(b"s"));
        let ix = KvIndex::new(None);
        let first =
            stored_map_id(&[1, 2], None, &t[..2 * BS], BS as u64, Some("a"), keys(vec![vec![V::S("a"), V::S("s")], vec![V::S("a")]]));
        let next = stored_map_id(&[3, 4], Some(2), &t[2 * BS..], BS as u64, Some("a"), keys(vec![vec![V::S("a")], vec![V::S("a")]]));
        ix.apply_event_batch(0, &batch(vec![first, next], 0), BS, DEFAULT_SEED).unwrap();
        assert_eq!(depth(&ix, &t, root), 4);
        assert_eq!(depth(&ix, &t, identity_root(Some(b"a"), None)), 0);
    }

    /// Blocks with multimodal pairs or embedding digests are never matched by plain tokens: a
    /// request is credited with the blocks before the first one, never more; another image at the
    /// same place is another block.
    #[test]
    fn media_blocks_stop_the_match() {
        let t = toks(0, 4 * BS);
        let img = |id: &'static str| V::A(vec![V::S(id), V::U(1)]);
        let ix = KvIndex::new(None);
        let ev = stored_map_id(&[1, 2, 3, 4], None, &t, BS as u64, None, keys(vec![vec![], vec![], vec![img("img-1")], vec![]]));
        ix.apply_event_batch(0, &batch(vec![ev], 0), BS, DEFAULT_SEED).unwrap();
        assert_eq!(depth(&ix, &t, None), 2);
        let ev = stored_arr_id(&[5, 6, 7, 8], None, &t, BS as u64, None, keys(vec![vec![], vec![], vec![img("img-2")], vec![]]));
        ix.apply_event_batch(1, &batch(vec![ev], 0), BS, DEFAULT_SEED).unwrap();
        // The two workers share blocks 0-1 only: the media blocks differ.
        let h = sequence_hashes(&t, BS, DEFAULT_SEED, None);
        let m = ix.find_matches(&h, ANY_TIER);
        assert_eq!(m.depths, vec![2, 2]);
        // An embeddings digest (bin) and an unknown entry shape key their block the same way.
        let ix = KvIndex::new(None);
        let ev = stored_map_id(
            &[1, 2, 3, 4],
            None,
            &t,
            BS as u64,
            None,
            V::A(vec![V::Nil, V::A(vec![V::B(vec![9; 32])]), V::Nil, V::M(vec![("k", V::U(1))])]),
        );
        ix.apply_event_batch(0, &batch(vec![ev], 0), BS, DEFAULT_SEED).unwrap();
        assert_eq!(depth(&ix, &t, None), 1);
    }

    /// The deprecated `lora_id` alone: a root no request reproduces (never credited to the base
    /// model nor to an adapter by name).
    #[test]
    fn a_bare_lora_id_is_credited_to_nobody() {
        let t = toks(0, 2 * BS);
        let V::M(mut fields) = stored_map(&[1, 2], None, &t, BS as u64, None) else { unreachable!() };
        for (k, v) in fields.iter_mut() {
            if *k == "lora_id" {
                *v = V::U(3);
            }
        }
        let ix = KvIndex::new(None);
        ix.apply_event_batch(0, &batch(vec![V::M(fields)], 0), BS, DEFAULT_SEED).unwrap();
        assert_eq!(ix.num_blocks(0), 2);
        for r in [None, identity_root(Some(b"3"), None)] {
            assert_eq!(depth(&ix, &t, r), 0);
        }
    }

    #[test]
    fn more_extra_keys_than_blocks_is_an_error() {
        let t = toks(0, BS);
        let ev = stored_map_id(&[1], None, &t, BS as u64, None, keys(vec![vec![], vec![]]));
        let e = KvIndex::new(None).apply_event_batch(0, &batch(vec![ev], 0), BS, DEFAULT_SEED).unwrap_err();
        assert!(matches!(e, EventError::OutOfRange { ref at, .. } if at == "events[0].extra_keys"), "{e}");
        let e = KvIndex::new(None)
            .apply_event_batch(
                0,
                &batch(vec![stored_map_id(&[1], None, &t, BS as u64, Some("a"), V::A(vec![V::A(vec![V::U(1)]), V::S("x")]))], 0),
                BS,
                DEFAULT_SEED,
            )
            .unwrap_err();
        assert!(matches!(e, EventError::OutOfRange { .. }), "{e}");
    }
}
