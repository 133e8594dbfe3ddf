//! Exact mode's prefix store: the token ids of rendered prompts' prefixes, so a conversation's
//! next turn encodes only what it adds (as llm-d's tokenizer cache does), with the token ids of a
//! whole encode.
//!
//! Hugging Face tokenizers split a text at its added tokens before anything else: the pieces between
//! them are normalized, pre-tokenized and encoded on their own. So where an added token starts, the
//! text splits without changing its tokens: `ids(a + b) == ids(a) ++ ids(b)` when `b` starts with
//! one. The split points used are the starts of added tokens that are matched as they are written
//! (not normalized) and absorb nothing around them (no `lstrip`, `rstrip`, `single_word`): ChatML's
//! `<|im_start|>`, Llama's `[INST]` when added, and the like. Each is checked once, when the tokenizer
//! loads, on probe texts against a whole encode; a tokenizer that fails any probe (a pre-tokenizer
//! that treats the first piece of a text apart, say) gets no store, and every encode is whole.
//!
//! Only encodes without the post-processor's special tokens (chat prompts: their template writes them)
//! use the store. An entry is keyed by its text's length and 128-bit hash; the longer prefix of a
//! conversation's next turn replaces the entry it extends (one entry per conversation); the store
//! holds at most `capacity` tokens and forgets the least recently used entries first.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::Xxh3;

/// Tokens the store holds by default (16 MiB of ids).
pub const DEFAULT_CAPACITY_TOKENS: usize = 1 << 22;
/// Shorter texts are encoded whole: looking them up would cost about as much as encoding them.
pub const MIN_TEXT_BYTES: usize = 2048;

/// Texts around the split tokens in the load-time probes: words, spaces, newlines, punctuation,
/// non-ASCII, nothing.
const PROBE_PIECES: [&str; 8] = ["hello world", " leading space", "\n\nnew lines\n", "", "  ", "x", "naïve café, 東京!", "end.\n"];

pub struct PrefixStore {
    /// Every added token matched as written, leftmost-longest as the tokenizer matches them.
    matcher: AhoCorasick,
    /// Per pattern of `matcher`, whether a text splits where it starts.
    splits: Vec<bool>,
    inner: Mutex<Lru>,
}

/// A stored prefix: its text's 128-bit hash and length.
type Key = (u128, usize);

#[derive(Default)]
struct Lru {
    /// Key -> (the prefix's token ids, its last use).
    map: HashMap<Key, (Arc<[u32]>, u64)>,
    /// (key, stamp) in use order; entries whose stamp moved on are stale.
    order: VecDeque<(Key, u64)>,
    tokens: usize,
    capacity: usize,
    clock: u64,
    hits: u64,
    misses: u64,
}

/// The store's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReuseStats {
    /// Encodes that reused a stored prefix.
    pub hits: u64,
    /// Encodes long enough to look one up that found none.
    pub misses: u64,
    pub entries: usize,
    pub tokens: usize,
}

impl PrefixStore {
    /// The store for `tokenizer`, or why it has none (no eligible added token, or a probe whose
    /// split encode differs from the whole one).
    pub fn new(tokenizer: &Tokenizer, capacity: usize) -> Result<PrefixStore, String> {
        let mut added: Vec<_> =
            tokenizer.get_added_tokens_decoder().into_values().filter(|t| !t.normalized && !t.content.is_empty()).collect();
        added.sort_by(|a, b| a.content.cmp(&b.content));
        let splits: Vec<bool> = added.iter().map(|t| !t.lstrip && !t.rstrip && !t.single_word).collect();
        if !splits.iter().any(|&s| s) {
            return Err("the tokenizer has no added token a text splits at".into());
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|t| t.content.as_str()))
            .map_err(|e| format!("cannot match the added tokens: {e}"))?;
        let store = PrefixStore { matcher, splits, inner: Mutex::new(Lru { capacity, ..Lru::default() }) };
        for (tok, _) in added.iter().zip(&store.splits).filter(|(_, &s)| s) {
            store.probe(tokenizer, &tok.content)?;
        }
        Ok(store)
    }

    /// Every probe text encodes split at its boundaries as it does whole.
    fn probe(&self, tokenizer: &Tokenizer, token: &str) -> Result<(), String> {
        let encode = |t: &str| tokenizer.encode_fast(t, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string());
        for a in PROBE_PIECES {
            for b in PROBE_PIECES {
                let text = format!("{a}{token}{b}{token}{a}");
                let whole = encode(&text)?;
                let mut split = Vec::new();
                let mut last = 0;
                for at in self.boundaries(&text).into_iter().chain([text.len()]) {
                    split.extend(encode(&text[last..at])?);
                    last = at;
                }
                if split != whole {
                    return Err(format!("{text:?} does not encode split at {token:?} as it does whole"));
                }
            }
        }
        Ok(())
    }

    /// Where `text` splits without changing its tokens: the starts of its split tokens (> 0), ascending.
    pub fn boundaries(&self, text: &str) -> Vec<usize> {
        self.matcher.find_iter(text).filter(|m| self.splits[m.pattern().as_usize()] && m.start() > 0).map(|m| m.start()).collect()
    }

    /// `text`'s token ids (no post-processor tokens) with `encode` on what the store does not hold;
    /// `None` when `encode` fails.
    pub fn encode(&self, text: &str, encode: impl Fn(&str) -> Option<Vec<u32>>) -> Option<Vec<u32>> {
        if text.len() < MIN_TEXT_BYTES {
            return encode(text);
        }
        let bounds = self.boundaries(text);
        let Some(&last) = bounds.last() else { return encode(text) };
        // Each boundary's key, from one pass over the text.
        let mut h = Xxh3::new();
        let mut from = 0;
        let keys: Vec<Key> = bounds
            .iter()
            .map(|&b| {
                h.update(&text.as_bytes()[from..b]);
                from = b;
                (h.digest128(), b)
            })
            .collect();
        let hit = keys.iter().rev().find_map(|k| self.get(k).map(|ids| (*k, ids)));
        self.count(hit.is_some());
        let (start, mut ids) = match &hit {
            Some((k, ids)) => (k.1, ids.to_vec()),
            None => (0, Vec::new()),
        };
        if last > start {
            ids.extend(encode(&text[start..last])?);
            // The prefix up to the last split: what the conversation's next turn starts with. It
            // replaces the shorter prefix it extends (one entry per conversation, not per turn).
            self.put(keys[keys.len() - 1], &ids, hit.map(|(k, _)| k));
        }
        ids.extend(encode(&text[last..])?);
        Some(ids)
    }

    fn get(&self, key: &Key) -> Option<Arc<[u32]>> {
        let mut g = self.inner.lock();
        g.clock += 1;
        let now = g.clock;
        let (ids, stamp) = g.map.get_mut(key)?;
        *stamp = now;
        let ids = ids.clone();
        g.order.push_back((*key, now));
        g.compact();
        Some(ids)
    }

    fn put(&self, key: Key, ids: &[u32], replaces: Option<Key>) {
        let mut g = self.inner.lock();
        if let Some((old, _)) = replaces.and_then(|k| g.map.remove(&k)) {
            g.tokens -= old.len();
        }
        if ids.len() > g.capacity || g.map.contains_key(&key) {
            return;
        }
        g.clock += 1;
        let now = g.clock;
        g.tokens += ids.len();
        g.map.insert(key, (Arc::from(ids), now));
        g.order.push_back((key, now));
        while g.tokens > g.capacity {
            let Some((k, stamp)) = g.order.pop_front() else { break };
            if g.map.get(&k).is_some_and(|(_, s)| *s == stamp) {
                let (old, _) = g.map.remove(&k).expect("present");
                g.tokens -= old.len();
            }
        }
        g.compact();
    }

    fn count(&self, hit: bool) {
        let mut g = self.inner.lock();
        if hit {
            g.hits += 1;
        } else {
            g.misses += 1;
        }
    }

    pub fn stats(&self) -> ReuseStats {
        let g = self.inner.lock();
        ReuseStats { hits: g.hits, misses: g.misses, entries: g.map.len(), tokens: g.tokens }
    }
}

impl Lru {
    /// Drops stale order entries once they outnumber the live ones (bounded memory under many hits).
    fn compact(&mut self) {
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order.retain(|(k, s)| map.get(k).is_some_and(|(_, stamp)| stamp == s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_keeps_the_capacity_and_the_recently_used() {
        let store = PrefixStore {
            matcher: AhoCorasick::new(["<s>"]).unwrap(),
            splits: vec![true],
            inner: Mutex::new(Lru { capacity: 10, ..Lru::default() }),
        };
        store.put((1, 1), &[1, 2, 3, 4], None);
        store.put((2, 2), &[5, 6, 7, 8], None);
        assert!(store.get(&(1, 1)).is_some()); // 1 is now the most recent
        store.put((3, 3), &[9, 10, 11], None); // 11 tokens > 10: the least recent (2) goes
        assert!(store.get(&(2, 2)).is_none());
        assert_eq!(store.get(&(1, 1)).as_deref(), Some(&[1, 2, 3, 4][..]));
        assert_eq!(store.stats().tokens, 7);
        store.put((4, 4), &[0; 11], None); // larger than the whole store: not kept
        assert_eq!(store.stats().entries, 2);
        for _ in 0..1000 {
            store.get(&(1, 1));
        }
        assert!(store.inner.lock().order.len() <= 2 * 2 + 64 + 1);
        // An extension replaces the prefix it extends.
        store.put((5, 5), &[1, 2, 3, 4, 5], Some((1, 1)));
        assert!(store.get(&(1, 1)).is_none());
        assert_eq!(store.stats().tokens, 3 + 5);
    }
}
