//! Decodes one vLLM/SGLang KV-event batch payload (msgpack) into flat buffers, validating all of it.
//! Nothing is applied here: a batch that fails anywhere yields an error and no partial result.

use std::ops::Range;

use super::msgpack::{Int, RawError, Reader};
use super::EventError;
use crate::index::Tier;

/// One decoded event; hashes and token ids live in the batch's shared buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodedEvent {
    Stored {
        hashes: Range<usize>,
        parent: Option<u64>,
        tokens: Range<usize>,
        tier: Tier,
        /// The identity the engine mixed into the chain (`crate::hash::identity_root`: LoRA name,
        /// cache salt); used only where the chain starts (`parent` None).
        root: Option<u64>,
        /// Blocks carrying other extra keys (multimodal, prompt embeddings): `batch.mixes[mixes]`.
        mixes: Range<usize>,
    },
    Removed {
        hashes: Range<usize>,
        tier: Tier,
    },
    Cleared,
    /// An event for a KV-cache group other than the first (hybrid models), or a `BlockStored` of
    /// blocks of another size than the router's; see the module docs.
    Skipped,
}

/// A fully validated batch.
#[derive(Debug, Default, Clone)]
pub struct DecodedBatch {
    pub ts: f64,
    pub dp_rank: u32,
    pub events: Vec<DecodedEvent>,
    /// Engine block hashes of every event, concatenated.
    pub hashes: Vec<u64>,
    /// Token ids of every `Stored` event, concatenated.
    pub tokens: Vec<u32>,
    /// `(block index within its event, digest)` of blocks with extra keys, per event ascending.
    pub mixes: Vec<(u32, u64)>,
}

impl DecodedBatch {
    pub fn clear(&mut self) {
        self.ts = 0.0;
        self.dp_rank = 0;
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
        self.mixes.clear();
    }
}

/// Field path for error messages, built only when an error happens.
#[derive(Clone, Copy)]
enum Path {
    Batch(&'static str),
    Event(usize, &'static str),
    Item(usize, &'static str, usize),
}

impl Path {
    fn render(self) -> String {
        match self {
            Path::Batch(f) => f.to_string(),
            Path::Event(i, "") => format!("events[{i}]"),
            Path::Event(i, f) => format!("events[{i}].{f}"),
            Path::Item(i, f, j) => format!("events[{i}].{f}[{j}]"),
        }
    }
}

fn raw(e: RawError, at: Path, offset: usize) -> EventError {
    let at = at.render();
    match e {
        RawError::Truncated => EventError::Truncated { at, offset },
        RawError::Type { expected, found } => EventError::WrongType { at, offset, expected, found },
        RawError::TooDeep => EventError::TooDeep { at, offset },
        RawError::Reserved => EventError::WrongType { at, offset, expected: "a msgpack value", found: "reserved byte 0xc1" },
    }
}

/// Decodes `payload` into `out` (cleared first). Every `BlockStored` must carry exactly
/// `len(block_hashes) * block_size` token ids (its own `block_size`); those whose `block_size` is not
/// the router's `block_size` decode as `Skipped`.
pub fn decode_batch(payload: &[u8], block_size: usize, out: &mut DecodedBatch) -> Result<(), EventError> {
    out.clear();
    let mut r = Reader::new(payload);
    let start = r.pos;
    let m = r.peek().map_err(|e| raw(e, Path::Batch("batch"), start))?;
    if (0x80..=0x8f).contains(&m) || m == 0xde || m == 0xdf {
        decode_map_batch(&mut r, block_size, out)?;
    } else {
        let n = r.array_len().map_err(|e| match e {
            RawError::Type { found, .. } => EventError::WrongType { at: "batch".into(), offset: start, expected: "array or map", found },
            e => raw(e, Path::Batch("batch"), start),
        })?;
        if n < 2 {
            return Err(EventError::MissingField { at: "batch".into(), field: "events" });
        }
        let p = r.pos;
        out.ts = r.number().map_err(|e| raw(e, Path::Batch("ts"), p))?;
        decode_events(&mut r, block_size, out)?;
        if n >= 3 {
            out.dp_rank = decode_dp_rank(&mut r, "data_parallel_rank")?;
        }
        for _ in 3..n {
            let p = r.pos;
            r.skip().map_err(|e| raw(e, Path::Batch("batch"), p))?;
        }
    }
    if !r.is_empty() {
        return Err(EventError::TrailingBytes { offset: r.pos, len: payload.len() });
    }
    Ok(())
}

fn decode_dp_rank(r: &mut Reader<'_>, field: &'static str) -> Result<u32, EventError> {
    let p = r.pos;
    if r.nil().map_err(|e| raw(e, Path::Batch(field), p))? {
        return Ok(0);
    }
    match r.int().map_err(|e| raw(e, Path::Batch(field), p))? {
        Int::U(v) if v <= u32::MAX as u64 => Ok(v as u32),
        Int::I(v) if (0..=u32::MAX as i64).contains(&v) => Ok(v as u32),
        _ => Err(EventError::OutOfRange { at: field.into(), what: "a data-parallel rank in 0..=4294967295" }),
    }
}

fn decode_map_batch(r: &mut Reader<'_>, block_size: usize, out: &mut DecodedBatch) -> Result<(), EventError> {
    let p = r.pos;
    let n = r.map_len().map_err(|e| raw(e, Path::Batch("batch"), p))?;
    let mut saw_events = false;
    for _ in 0..n {
        let p = r.pos;
        let key = r.str().map_err(|e| raw(e, Path::Batch("batch key"), p))?;
        match key {
            b"ts" => {
                let p = r.pos;
                out.ts = r.number().map_err(|e| raw(e, Path::Batch("ts"), p))?;
            }
            b"events" => {
                if saw_events {
                    return Err(EventError::Duplicate { at: "batch".into(), field: "events" });
                }
                saw_events = true;
                decode_events(r, block_size, out)?;
            }
            b"data_parallel_rank" => out.dp_rank = decode_dp_rank(r, "data_parallel_rank")?,
            b"attn_dp_rank" => out.dp_rank = decode_dp_rank(r, "attn_dp_rank")?,
            _ => {
                let p = r.pos;
                r.skip().map_err(|e| raw(e, Path::Batch("batch"), p))?;
            }
        }
    }
    if !saw_events {
        return Err(EventError::MissingField { at: "batch".into(), field: "events" });
    }
    Ok(())
}

fn decode_events(r: &mut Reader<'_>, block_size: usize, out: &mut DecodedBatch) -> Result<(), EventError> {
    let p = r.pos;
    let n = r.array_len().map_err(|e| raw(e, Path::Batch("events"), p))?;
    for i in 0..n {
        let p = r.pos;
        let m = r.peek().map_err(|e| raw(e, Path::Event(i, ""), p))?;
        let ev = if (0x90..=0x9f).contains(&m) || m == 0xdc || m == 0xdd {
            decode_array_event(r, i, block_size, out)?
        } else if (0x80..=0x8f).contains(&m) || m == 0xde || m == 0xdf {
            decode_map_event(r, i, block_size, out)?
        } else {
            return Err(EventError::WrongType {
                at: Path::Event(i, "").render(),
                offset: p,
                expected: "array or map",
                found: super::msgpack::kind_name(m),
            });
        };
        out.events.push(ev);
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

fn kind_of(tag: &[u8], i: usize) -> Result<Kind, EventError> {
    match tag {
        b"BlockStored" => Ok(Kind::Stored),
        b"BlockRemoved" => Ok(Kind::Removed),
        b"AllBlocksCleared" => Ok(Kind::Cleared),
        other => Err(EventError::UnknownEventType { at: Path::Event(i, "").render(), name: String::from_utf8_lossy(other).into_owned() }),
    }
}

/// Raw fields of one event, gathered in any order.
#[derive(Default)]
struct Fields<'p> {
    hashes: Option<Range<usize>>,
    parent: Option<Option<u64>>,
    tokens: Option<Range<usize>>,
    block_size: Option<u64>,
    tier: Option<Tier>,
    group: Option<u64>,
    lora_id: Option<u64>,
    lora_name: Option<&'p [u8]>,
    extra: Option<ExtraKeys<'p>>,
}

/// A `BlockStored`'s `extra_keys`, as vLLM publishes them: one entry per block (nil or an array)
/// holding, untagged and in order, the LoRA name (when `lora_name` is set), `(mm_identifier,
/// offset)` pairs, the cache salt (the request's first block only) and prompt-embedding digests.
#[derive(Default)]
struct ExtraKeys<'p> {
    /// Entries (blocks) in the list.
    blocks: usize,
    /// The first block's leading strings (a LoRA name, a salt), in order.
    first_strs: Vec<&'p [u8]>,
    /// `(block, digest)` of every block's keys that are not strings (multimodal pairs, digests).
    mixes: Vec<(u32, u64)>,
    /// Strings past block 0 (a salt only ever keys block 0; a LoRA name repeats in every block).
    later_strs: Vec<(u32, &'p [u8])>,
}

fn read_extra_keys<'p>(r: &mut Reader<'p>, i: usize) -> Result<Option<ExtraKeys<'p>>, EventError> {
    let at = Path::Event(i, "extra_keys");
    let p = r.pos;
    if r.nil().map_err(|e| raw(e, at, p))? {
        return Ok(None);
    }
    let n = r.array_len().map_err(|e| raw(e, at, p))?;
    let mut x = ExtraKeys { blocks: n, ..Default::default() };
    for j in 0..n {
        let at = Path::Item(i, "extra_keys", j);
        let p = r.pos;
        if r.nil().map_err(|e| raw(e, at, p))? {
            continue;
        }
        let m = r.peek().map_err(|e| raw(e, at, p))?;
        if !((0x90..=0x9f).contains(&m) || m == 0xdc || m == 0xdd) {
            // Not a shape vLLM publishes (a future tagged form?): the entry keys its block, so the
            // block is never credited to a request that does not carry it.
            r.skip().map_err(|e| raw(e, at, p))?;
            x.mixes.push((j as u32, crate::hash::extra_digest(r.since(p))));
            continue;
        }
        let k = r.array_len().map_err(|e| raw(e, at, p))?;
        let mut others = false;
        let block_start = r.pos;
        for _ in 0..k {
            let p = r.pos;
            let m = r.peek().map_err(|e| raw(e, at, p))?;
            let is_str = (0xa0..=0xbf).contains(&m) || (0xd9..=0xdb).contains(&m);
            if is_str {
                let s = r.str().map_err(|e| raw(e, at, p))?;
                if j == 0 {
                    x.first_strs.push(s);
                } else {
                    x.later_strs.push((j as u32, s));
                }
            } else {
                others = true;
                r.skip().map_err(|e| raw(e, at, p))?;
            }
        }
        if others {
            // The block's whole entry (strings included) keys it: what matters is that it differs
            // from a plain block's and from any other media's.
            x.mixes.push((j as u32, crate::hash::extra_digest(r.since(block_start))));
        }
    }
    Ok(Some(x))
}

fn read_hash(r: &mut Reader<'_>, at: Path) -> Result<u64, EventError> {
    let p = r.pos;
    let m = r.peek().map_err(|e| raw(e, at, p))?;
    if (0xc4..=0xc6).contains(&m) {
        let b = r.bin().map_err(|e| raw(e, at, p))?;
        // vLLM's int form of a block hash is the digest's last 8 bytes, big-endian
        // (`maybe_convert_block_hash`); folding bytes the same way keeps both forms equal.
        if !(8..=64).contains(&b.len()) {
            return Err(EventError::BadHash { at: at.render(), len: b.len() });
        }
        return Ok(b[b.len() - 8..].iter().fold(0u64, |acc, &x| (acc << 8) | x as u64));
    }
    match r.int() {
        Ok(Int::U(v)) => Ok(v),
        // SGLang hashes are signed 64-bit: keep the bit pattern.
        Ok(Int::I(v)) => Ok(v as u64),
        Err(RawError::Type { found, .. }) => {
            Err(EventError::WrongType { at: at.render(), offset: p, expected: "int or bin block hash", found })
        }
        Err(e) => Err(raw(e, at, p)),
    }
}

fn read_hashes(r: &mut Reader<'_>, i: usize, field: &'static str, out: &mut DecodedBatch) -> Result<Range<usize>, EventError> {
    let p = r.pos;
    let n = r.array_len().map_err(|e| raw(e, Path::Event(i, field), p))?;
    let start = out.hashes.len();
    out.hashes.reserve(n.min(r_remaining(r)));
    for j in 0..n {
        let h = read_hash(r, Path::Item(i, field, j))?;
        out.hashes.push(h);
    }
    Ok(start..out.hashes.len())
}

fn r_remaining(r: &Reader<'_>) -> usize {
    // Every element takes at least one byte, so this caps any reservation by the input size.
    r.remaining()
}

fn read_tokens(r: &mut Reader<'_>, i: usize, out: &mut DecodedBatch) -> Result<Range<usize>, EventError> {
    let p = r.pos;
    let n = r.array_len().map_err(|e| raw(e, Path::Event(i, "token_ids"), p))?;
    let start = out.tokens.len();
    out.tokens.reserve(n.min(r_remaining(r)));
    loop {
        let done = out.tokens.len() - start;
        let Err(j) = r.u32s(n - done, &mut out.tokens) else { break };
        // Off the fast path: an unusual encoding of a valid id, or a bad value to name.
        let j = done + j;
        let p = r.pos;
        match r.int() {
            Ok(Int::U(v)) if v <= u32::MAX as u64 => out.tokens.push(v as u32),
            Ok(Int::I(v)) if (0..=u32::MAX as i64).contains(&v) => out.tokens.push(v as u32),
            Ok(_) => {
                return Err(EventError::OutOfRange { at: Path::Item(i, "token_ids", j).render(), what: "a token id in 0..=4294967295" })
            }
            Err(e) => return Err(raw(e, Path::Item(i, "token_ids", j), p)),
        }
    }
    Ok(start..out.tokens.len())
}

fn read_opt_uint(r: &mut Reader<'_>, at: Path) -> Result<Option<u64>, EventError> {
    let p = r.pos;
    if r.nil().map_err(|e| raw(e, at, p))? {
        return Ok(None);
    }
    match r.int() {
        Ok(Int::U(v)) => Ok(Some(v)),
        Ok(Int::I(_)) => Err(EventError::OutOfRange { at: at.render(), what: "a non-negative integer" }),
        Err(e) => Err(raw(e, at, p)),
    }
}

fn read_opt_str<'p>(r: &mut Reader<'p>, at: Path) -> Result<Option<&'p [u8]>, EventError> {
    let p = r.pos;
    if r.nil().map_err(|e| raw(e, at, p))? {
        return Ok(None);
    }
    r.str().map(Some).map_err(|e| raw(e, at, p))
}

fn read_medium(r: &mut Reader<'_>, i: usize) -> Result<Tier, EventError> {
    let at = Path::Event(i, "medium");
    let p = r.pos;
    if r.nil().map_err(|e| raw(e, at, p))? {
        return Ok(Tier::Device);
    }
    let s = r.str().map_err(|e| raw(e, at, p))?;
    medium_tier(s).ok_or_else(|| EventError::UnknownMedium { at: at.render(), medium: String::from_utf8_lossy(s).into_owned() })
}

/// vLLM: GPU / CPU / STORAGE; SGLang: GPU / CPU_PINNED / DISK / EXTERNAL.
pub fn medium_tier(s: &[u8]) -> Option<Tier> {
    let up = |x: &[u8]| s.eq_ignore_ascii_case(x);
    if up(b"GPU") {
        Some(Tier::Device)
    } else if up(b"CPU") || up(b"CPU_PINNED") {
        Some(Tier::Host)
    } else if up(b"DISK") || up(b"STORAGE") || up(b"EXTERNAL") {
        Some(Tier::Disk)
    } else {
        None
    }
}

fn read_parent(r: &mut Reader<'_>, i: usize) -> Result<Option<u64>, EventError> {
    let at = Path::Event(i, "parent_block_hash");
    let p = r.pos;
    if r.nil().map_err(|e| raw(e, at, p))? {
        return Ok(None);
    }
    read_hash(r, at).map(Some)
}

fn finish(i: usize, kind: Kind, f: Fields<'_>, block_size: usize, out: &mut DecodedBatch) -> Result<DecodedEvent, EventError> {
    if f.group.is_some_and(|g| g != 0) {
        return Ok(DecodedEvent::Skipped);
    }
    let tier = f.tier.unwrap_or(Tier::Device);
    match kind {
        Kind::Cleared => Ok(DecodedEvent::Cleared),
        Kind::Removed => {
            let hashes = f.hashes.ok_or(EventError::MissingField { at: Path::Event(i, "").render(), field: "block_hashes" })?;
            Ok(DecodedEvent::Removed { hashes, tier })
        }
        Kind::Stored => {
            let missing = |field| EventError::MissingField { at: Path::Event(i, "").render(), field };
            let hashes = f.hashes.clone().ok_or(missing("block_hashes"))?;
            let tokens = f.tokens.clone().ok_or(missing("token_ids"))?;
            let bs = f.block_size.ok_or(missing("block_size"))?;
            if bs == 0 {
                return Err(EventError::OutOfRange { at: Path::Event(i, "block_size").render(), what: "a block size >= 1" });
            }
            let blocks = hashes.len();
            if tokens.len() as u128 != blocks as u128 * bs as u128 {
                let block_size = bs as usize;
                return Err(EventError::TokenCount { at: Path::Event(i, "token_ids").render(), tokens: tokens.len(), blocks, block_size });
            }
            if bs != block_size as u64 {
                // Blocks of another size (e.g. a KV connector's chunks sharing the batch) cannot
                // be keyed in a tree of `block_size` blocks: skipped and counted.
                return Ok(DecodedEvent::Skipped);
            }
            let (root, mixes) = identity(i, &f, blocks, out)?;
            Ok(DecodedEvent::Stored { hashes, parent: f.parent.flatten(), tokens, tier, root, mixes })
        }
    }
}

/// A `BlockStored`'s identity root and its mixed blocks (appended to `out.mixes`). The LoRA name
/// comes from `lora_name` (an engine naming only the deprecated `lora_id` gets a root no request
/// reproduces, so its blocks are never credited to another adapter or the base model); the salt is
/// the first block's string after the LoRA name.
fn identity(i: usize, f: &Fields<'_>, blocks: usize, out: &mut DecodedBatch) -> Result<(Option<u64>, Range<usize>), EventError> {
    let start = out.mixes.len();
    let lora_id_name;
    let lora = match (f.lora_name, f.lora_id) {
        (Some(name), _) => Some(name),
        (None, Some(id)) => {
            lora_id_name = format!("\0lora_id:{id}");
            Some(lora_id_name.as_bytes())
        }
        (None, None) => None,
    };
    let Some(x) = &f.extra else {
        return Ok((crate::hash::identity_root(lora, None), start..start));
    };
    if x.blocks > blocks {
        return Err(EventError::OutOfRange { at: Path::Event(i, "extra_keys").render(), what: "at most one entry per block" });
    }
    let mut strs = x.first_strs.as_slice();
    if let (Some(name), Some((first, rest))) = (f.lora_name, strs.split_first()) {
        if *first == name {
            strs = rest;
        }
    }
    // A second string on block 0, or a string on a later block that is not the LoRA name, is not
    // a shape vLLM publishes: keyed as extra keys of its block, so it is never credited as plain.
    let salt = strs.first().copied();
    out.mixes.extend(x.mixes.iter().copied());
    if strs.len() > 1 {
        out.mixes.push((0, crate::hash::extra_digest(&strs[1..].concat())));
    }
    for &(j, s) in &x.later_strs {
        if f.lora_name != Some(s) {
            out.mixes.push((j, crate::hash::extra_digest(s)));
        }
    }
    out.mixes[start..].sort_unstable_by_key(|m| m.0);
    Ok((crate::hash::identity_root(lora, salt), start..out.mixes.len()))
}

/// Legacy positional events: `[tag, field0, field1, ...]`, trailing defaults omitted.
fn decode_array_event(r: &mut Reader<'_>, i: usize, block_size: usize, out: &mut DecodedBatch) -> Result<DecodedEvent, EventError> {
    let p = r.pos;
    let n = r.array_len().map_err(|e| raw(e, Path::Event(i, ""), p))?;
    if n == 0 {
        return Err(EventError::MissingField { at: Path::Event(i, "").render(), field: "type" });
    }
    let p = r.pos;
    let tag = r.str().map_err(|e| raw(e, Path::Event(i, "type"), p))?;
    let kind = kind_of(tag, i)?;
    let mut f = Fields::default();
    // Field order as the engines declare them (vLLM kv_events.py; SGLang kv_events.py).
    for k in 1..n {
        match (kind, k) {
            (Kind::Stored, 1) | (Kind::Removed, 1) => f.hashes = Some(read_hashes(r, i, "block_hashes", out)?),
            (Kind::Stored, 2) => f.parent = Some(read_parent(r, i)?),
            (Kind::Stored, 3) => f.tokens = Some(read_tokens(r, i, out)?),
            (Kind::Stored, 4) => f.block_size = read_opt_uint(r, Path::Event(i, "block_size"))?,
            (Kind::Stored, 5) => f.lora_id = read_opt_uint(r, Path::Event(i, "lora_id"))?,
            (Kind::Stored, 6) | (Kind::Removed, 2) => f.tier = Some(read_medium(r, i)?),
            (Kind::Stored, 7) => f.lora_name = read_opt_str(r, Path::Event(i, "lora_name"))?,
            (Kind::Stored, 8) => f.extra = read_extra_keys(r, i)?,
            (Kind::Stored, 9) | (Kind::Removed, 3) => f.group = read_opt_uint(r, Path::Event(i, "group_idx"))?,
            _ => {
                let p = r.pos;
                r.skip().map_err(|e| raw(e, Path::Event(i, ""), p))?;
            }
        }
    }
    finish(i, kind, f, block_size, out)
}

/// Tagged-map events: `{"type": "BlockStored", "block_hashes": ..., ...}`, any key order.
fn decode_map_event(r: &mut Reader<'_>, i: usize, block_size: usize, out: &mut DecodedBatch) -> Result<DecodedEvent, EventError> {
    let p = r.pos;
    let n = r.map_len().map_err(|e| raw(e, Path::Event(i, ""), p))?;
    let mut kind = None;
    let mut f = Fields::default();
    for _ in 0..n {
        let p = r.pos;
        let key = r.str().map_err(|e| raw(e, Path::Event(i, "key"), p))?;
        let dup = |field| EventError::Duplicate { at: Path::Event(i, "").render(), field };
        match key {
            b"type" => {
                if kind.is_some() {
                    return Err(dup("type"));
                }
                let p = r.pos;
                let tag = r.str().map_err(|e| raw(e, Path::Event(i, "type"), p))?;
                kind = Some(kind_of(tag, i)?);
            }
            b"block_hashes" => {
                if f.hashes.is_some() {
                    return Err(dup("block_hashes"));
                }
                f.hashes = Some(read_hashes(r, i, "block_hashes", out)?);
            }
            b"parent_block_hash" => f.parent = Some(read_parent(r, i)?),
            b"token_ids" => {
                if f.tokens.is_some() {
                    return Err(dup("token_ids"));
                }
                f.tokens = Some(read_tokens(r, i, out)?);
            }
            b"block_size" => f.block_size = read_opt_uint(r, Path::Event(i, "block_size"))?,
            b"medium" => f.tier = Some(read_medium(r, i)?),
            b"lora_id" => f.lora_id = read_opt_uint(r, Path::Event(i, "lora_id"))?,
            b"lora_name" => f.lora_name = read_opt_str(r, Path::Event(i, "lora_name"))?,
            b"extra_keys" => f.extra = read_extra_keys(r, i)?,
            b"group_idx" => f.group = read_opt_uint(r, Path::Event(i, "group_idx"))?,
            _ => {
                let p = r.pos;
                r.skip().map_err(|e| raw(e, Path::Event(i, ""), p))?;
            }
        }
    }
    let kind = kind.ok_or(EventError::MissingField { at: Path::Event(i, "").render(), field: "type" })?;
    finish(i, kind, f, block_size, out)
}
