//! Block hashing: the chained sequence hashes that key the prefix index.
//! The scheme is NVIDIA Dynamo's published one, so hashes agree byte for byte with its router.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Dynamo's default seed for block hashes.
pub const DEFAULT_SEED: u64 = 1337;

/// Hash of one block's token ids: xxh3-64 over the ids as little-endian u32, with `seed`.
#[inline]
pub fn local_block_hash(block: &[u32], seed: u64) -> u64 {
    if cfg!(target_endian = "little") {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8; on a little-endian
        // target the in-memory bytes are exactly the little-endian encoding we hash.
        let bytes = unsafe { std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), block.len() * 4) };
        xxh3_64_with_seed(bytes, seed)
    } else {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// Sequence hash of a block from its parent's sequence hash and its own local hash.
#[inline]
pub fn chain_hash(parent: u64, local: u64, seed: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, seed)
}

/// Local hashes of every full block of `tokens` (a trailing partial block is not hashed).
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be >= 1");
    tokens.chunks_exact(block_size).map(|b| local_block_hash(b, seed)).collect()
}

/// Chained sequence hashes: `seq[0] = local[0]`, `seq[i] = chain(seq[i-1], local[i])`.
/// `parent` continues an existing chain (the sequence hash of the block before `tokens[0]`).
pub fn sequence_hashes(tokens: &[u32], block_size: usize, seed: u64, parent: Option<u64>) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_sequence_hashes(&mut out, tokens, block_size, seed, parent);
    out
}

/// Appends the sequence hashes of `tokens`' full blocks to `out` (no allocation if it has room).
pub fn extend_sequence_hashes(out: &mut Vec<u64>, tokens: &[u32], block_size: usize, seed: u64, parent: Option<u64>) {
    assert!(block_size > 0, "block_size must be >= 1");
    let mut prev = parent;
    for block in tokens.chunks_exact(block_size) {
        let local = local_block_hash(block, seed);
        let seq = match prev {
            None => local,
            Some(p) => chain_hash(p, local, seed),
        };
        out.push(seq);
        prev = Some(seq);
    }
}

/// Key of the identity digests (`identity_root`, `extra_digest`): a fixed value, so the event side
/// and the request side agree whatever the router's hash seed.
const IDENTITY_KEY: u64 = 0x6b76_726f_7574_6549;

/// The root a request's chain hangs from when the engine mixes more than tokens into its block keys:
/// the LoRA adapter serving it and its `cache_salt` (vLLM's `("lora", name, ..)` and
/// `("cache_salt", salt)` extra keys). `None` for the base model without a salt, whose chain starts
/// at block 0 as before, so the common case hashes exactly as it always did. An empty salt is no
/// salt (vLLM tests the salt's truth). Block 0's sequence hash is `chain_hash(root, local0, seed)`:
/// the root seeds the chain but is never stored or matched itself.
pub fn identity_root(lora: Option<&[u8]>, cache_salt: Option<&[u8]>) -> Option<u64> {
    let salt = cache_salt.filter(|s| !s.is_empty());
    if lora.is_none() && salt.is_none() {
        return None;
    }
    let mut buf = Vec::with_capacity(32 + lora.map_or(0, <[u8]>::len) + salt.map_or(0, <[u8]>::len));
    for (tag, v) in [(b"lora", lora), (b"salt", salt)] {
        if let Some(v) = v {
            buf.extend_from_slice(tag);
            buf.extend_from_slice(&(v.len() as u64).to_le_bytes());
            buf.extend_from_slice(v);
        }
    }
    Some(xxh3_64_with_seed(&buf, IDENTITY_KEY))
}

/// Digest of a block's keys that are not the request's identity (multimodal `(identifier, offset)`
/// pairs, prompt-embedding digests), from their encoded bytes. Mixed into that block's local hash
/// (`extend_sequence_hashes_mixed`); a request never reproduces it, so its match stops before the
/// first such block.
pub fn extra_digest(encoded: &[u8]) -> u64 {
    xxh3_64_with_seed(encoded, IDENTITY_KEY ^ 0x6d6d)
}

/// `extend_sequence_hashes` where the blocks named in `mixes` (`(block index within tokens, digest)`,
/// ascending) carry extra keys: such a block's local hash is `chain_hash(local, digest, seed)`.
pub fn extend_sequence_hashes_mixed(
    out: &mut Vec<u64>,
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    parent: Option<u64>,
    mixes: &[(u32, u64)],
) {
    assert!(block_size > 0, "block_size must be >= 1");
    let mut prev = parent;
    let mut next = mixes.iter().peekable();
    for (j, block) in tokens.chunks_exact(block_size).enumerate() {
        let mut local = local_block_hash(block, seed);
        while let Some(&&(at, digest)) = next.peek() {
            if at as usize > j {
                break;
            }
            if at as usize == j {
                local = chain_hash(local, digest, seed);
            }
            next.next();
        }
        let seq = match prev {
            None => local,
            Some(p) => chain_hash(p, local, seed),
        };
        out.push(seq);
        prev = Some(seq);
    }
}

/// Chains already-computed local hashes into sequence hashes.
pub fn chain_local_hashes(locals: &[u64], seed: u64, parent: Option<u64>) -> Vec<u64> {
    let mut prev = parent;
    locals
        .iter()
        .map(|&local| {
            let seq = match prev {
                None => local,
                Some(p) => chain_hash(p, local, seed),
            };
            prev = Some(seq);
            seq
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    // Known vectors from Dynamo 1.6.1 (`compute_block_hash_for_seq`).
    #[test]
    fn dynamo_local_vectors() {
        assert_eq!(local_block_hashes(&iota(16), 16, DEFAULT_SEED), vec![15310707395893867146]);
        assert_eq!(
            local_block_hashes(&iota(64), 16, DEFAULT_SEED),
            vec![15310707395893867146, 15292316782987903195, 5532946206955930018, 14928757266181269122]
        );
        assert_eq!(local_block_hashes(&iota(128), 64, DEFAULT_SEED), vec![3480597578098033343, 3318286205056455972]);
    }

    #[test]
    fn dynamo_sequence_vectors() {
        assert_eq!(
            sequence_hashes(&iota(64), 16, DEFAULT_SEED, None),
            vec![15310707395893867146, 13769157705258532664, 11879827756109914528, 3888788807566526800]
        );
    }

    #[test]
    fn partial_block_is_not_hashed_and_parent_continues_chain() {
        let toks = iota(64 + 10);
        let full = sequence_hashes(&toks, 16, DEFAULT_SEED, None);
        assert_eq!(full.len(), 4);
        let tail = sequence_hashes(&toks[32..64], 16, DEFAULT_SEED, Some(full[1]));
        assert_eq!(tail, full[2..].to_vec());
        let locals = local_block_hashes(&toks, 16, DEFAULT_SEED);
        assert_eq!(chain_local_hashes(&locals, DEFAULT_SEED, None), full);
    }
    #[test]
    fn identity_root_is_none_for_the_base_model_and_separates_adapters_and_salts() {
        assert_eq!(identity_root(None, None), None);
        assert_eq!(identity_root(None, Some(b"")), None);
        let a = identity_root(Some(b"a"), None).unwrap();
        let b = identity_root(Some(b"b"), None).unwrap();
        let s = identity_root(None, Some(b"a")).unwrap();
        let as_ = identity_root(Some(b"a"), Some(b"s")).unwrap();
        let ab = identity_root(Some(b"as"), None).unwrap();
        assert_eq!(std::collections::HashSet::from([a, b, s, as_, ab]).len(), 5);
        assert_eq!(identity_root(Some(b"a"), Some(b"")), Some(a));
        // The root seeds block 0's chain: the same tokens hash apart, later blocks too.
        let toks = iota(64);
        let base = sequence_hashes(&toks, 16, DEFAULT_SEED, None);
        let lora = sequence_hashes(&toks, 16, DEFAULT_SEED, Some(a));
        assert!(base.iter().zip(&lora).all(|(x, y)| x != y));
    }

    #[test]
    fn mixed_blocks_change_from_their_block_on() {
        let toks = iota(64);
        let plain = sequence_hashes(&toks, 16, DEFAULT_SEED, None);
        let mut out = Vec::new();
        extend_sequence_hashes_mixed(&mut out, &toks, 16, DEFAULT_SEED, None, &[]);
        assert_eq!(out, plain);
        out.clear();
        extend_sequence_hashes_mixed(&mut out, &toks, 16, DEFAULT_SEED, None, &[(2, extra_digest(b"img"))]);
        assert_eq!(out[..2], plain[..2]);
        assert!(out[2..].iter().zip(&plain[2..]).all(|(x, y)| x != y));
    }
}
