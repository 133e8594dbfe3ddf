//! The seed's multi-turn chat workload, generated with CPython's `random.Random` in the
//! seed's exact call order, so a seed gives the very requests the seed's Python script gives.

use crate::random::PyRandom;

/// Shape of the seed's chat workload (defaults: the seed's constants).
#[derive(Clone, Debug, PartialEq)]
pub struct ChatShape {
    pub systems: usize,
    pub system_tokens: usize,
    pub conversations: usize,
    pub turn_tokens: usize,
    /// Token ids are drawn from `0..vocab` (`rng.randrange(vocab)`).
    pub vocab: u64,
}

impl Default for ChatShape {
    fn default() -> Self {
        ChatShape { systems: 20, system_tokens: 2048, conversations: 400, turn_tokens: 300, vocab: 1_000_000 }
    }
}

/// Requests as (arrival, conversation, prompt length): request `i`'s prompt is the first
/// `num_tokens[i]` tokens of `conversation_tokens[conversation[i]]` (conversations only grow).
#[derive(Clone, Debug, Default)]
pub struct ChatWorkload {
    pub arrival: Vec<f64>,
    pub conversation: Vec<u32>,
    pub num_tokens: Vec<u32>,
    pub conversation_tokens: Vec<Vec<u32>>,
}

/// The seed's `workload(rate, seconds, seed)`:
/// ```text
/// systems = [[rng.randrange(V) for _ in range(S_TOK)] for _ in range(S)]
/// convs = [list(rng.choice(systems)) for _ in range(C)]
/// while t < seconds: t += rng.expovariate(rate); c = rng.randrange(C); convs[c] += [rng.randrange(V)]*T
/// ```
pub fn seed_chat(rate: f64, seconds: f64, seed: u64, shape: &ChatShape) -> ChatWorkload {
    assert!(shape.systems >= 1 && shape.conversations >= 1, "need at least one system prompt and one conversation");
    assert!(shape.vocab >= 1 && shape.vocab <= 1 << 32, "vocab must be in 1..=2**32");
    let mut rng = PyRandom::new(seed);
    let systems: Vec<Vec<u32>> =
        (0..shape.systems).map(|_| (0..shape.system_tokens).map(|_| rng.randbelow(shape.vocab) as u32).collect()).collect();
    let mut convs: Vec<Vec<u32>> =
        (0..shape.conversations).map(|_| systems[rng.randbelow(shape.systems as u64) as usize].clone()).collect();
    let mut w = ChatWorkload::default();
    let mut t = 0.0f64;
    while t < seconds {
        t += rng.expovariate(rate);
        let c = rng.randbelow(shape.conversations as u64) as usize;
        let conv = &mut convs[c];
        conv.reserve(shape.turn_tokens);
        for _ in 0..shape.turn_tokens {
            conv.push(rng.randbelow(shape.vocab) as u32);
        }
        w.arrival.push(t);
        w.conversation.push(c as u32);
        w.num_tokens.push(conv.len() as u32);
    }
    w.conversation_tokens = convs;
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_request_counts() {
        // The seed prints 4814 requests at 40 req/s and 8456 at 70 req/s over 120 s.
        let shape = ChatShape::default();
        assert_eq!(seed_chat(40.0, 120.0, 0, &shape).arrival.len(), 4814);
        assert_eq!(seed_chat(70.0, 120.0, 0, &shape).arrival.len(), 8456);
    }

    #[test]
    fn prompts_are_prefixes_of_their_conversation() {
        let w = seed_chat(10.0, 5.0, 3, &ChatShape::default());
        for (i, &c) in w.conversation.iter().enumerate() {
            assert!(w.num_tokens[i] as usize <= w.conversation_tokens[c as usize].len());
            assert_eq!((w.num_tokens[i] - 2048) % 300, 0);
        }
    }
}
