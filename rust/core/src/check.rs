//! The router checks itself: each request's predicted prefix-cache hit against what its engine
//! reports it reused (`usage.prompt_tokens_details.cached_tokens`), and, in exact mode, the
//! prompt length the router counted against the engine's `prompt_tokens`. A window of recent
//! requests with too many mismatches raises one alarm that names the likely cause.
//!
//! One implementation for the gateway (which reads the usage from the responses it relays) and
//! the integrations (which get it from their hosts), exposed to Python as `kvroute._core.PrefixCheck`.

use std::collections::VecDeque;

use parking_lot::Mutex;

use crate::index::WorkerId;

/// One checked request: what the router predicted and what the engine reported.
#[derive(Clone, Copy, Debug, Default)]
pub struct Observation {
    pub worker: WorkerId,
    /// The decision's overlap in the router's blocks.
    pub predicted_blocks: u64,
    /// The router's block size.
    pub block_size: usize,
    /// The prompt length the router counted, when its prompt is meant to be the engine's tokens
    /// (exact mode); `None` skips the length check.
    pub routed_tokens: Option<u64>,
    /// The engine's `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// The engine's `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Blocks the index holds for the worker now (an empty index points at missing KV events).
    pub indexed_blocks: u64,
}

/// How one request compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Predicted cached tokens equal the engine's.
    Match,
    /// The router credited more than the engine reused.
    Over,
    /// The engine reused more than the router credited.
    Under,
    /// The router's prompt length is not the engine's (its tokens are not the engine's).
    Length,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [Outcome::Match, Outcome::Over, Outcome::Under, Outcome::Length];

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Match => "match",
            Outcome::Over => "over",
            Outcome::Under => "under",
            Outcome::Length => "prompt_length",
        }
    }
}

/// The cached tokens the engine should report for a predicted overlap: vLLM always computes a
/// prompt's last token, so a fully cached prompt reports one block short.
pub fn predicted_cached(predicted_blocks: u64, block_size: usize, prompt_tokens: u64) -> u64 {
    let bs = block_size.max(1) as u64;
    (predicted_blocks * bs).min(prompt_tokens.saturating_sub(1) / bs * bs)
}

/// Counters of a `PrefixCheck` (the `/metrics` view).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckSnapshot {
    /// Requests per outcome, in `Outcome::ALL` order.
    pub outcomes: [u64; 4],
    /// Tokens credited but not reused, summed over requests.
    pub over_tokens: u64,
    /// Tokens reused but not credited, summed over requests.
    pub under_tokens: u64,
    /// Alarms raised so far.
    pub alarms: u64,
    /// The alarm is up (the window has not cleared since).
    pub alarmed: bool,
}

#[derive(Clone, Copy)]
struct Seen {
    outcome: Outcome,
    /// A mismatch on a worker for which the index held no block (no KV events applied).
    empty_index: bool,
}

struct Inner {
    recent: VecDeque<Seen>,
    snap: CheckSnapshot,
    /// An example of the last mismatch, for the alarm's message.
    example: Option<(Observation, u64)>,
    /// The last alarm's message.
    last_alarm: Option<String>,
}

/// The window the gateway and `kvroute.PrefixCheck` use by default: requests with usage.
pub const DEFAULT_WINDOW: usize = 20;
/// Mismatches in the window that raise the alarm by default.
pub const DEFAULT_THRESHOLD: usize = 8;

/// The self-check: feed it every checked request; it says when to raise the alarm.
pub struct PrefixCheck {
    window: usize,
    threshold: usize,
    inner: Mutex<Inner>,
}

impl PrefixCheck {
    /// Over the last `window` requests, `threshold` mismatches raise the alarm (once, until the
    /// window holds fewer than half as many again).
    pub fn new(window: usize, threshold: usize) -> Result<Self, String> {
        if window == 0 || threshold == 0 || threshold > window {
            return Err(format!("the self-check needs 1 <= threshold <= window, got threshold {threshold}, window {window}"));
        }
        let inner = Inner { recent: VecDeque::with_capacity(window), snap: CheckSnapshot::default(), example: None, last_alarm: None };
        Ok(PrefixCheck { window, threshold, inner: Mutex::new(inner) })
    }

    /// Records one request; returns the alarm's message when this request raises it.
    pub fn observe(&self, o: &Observation) -> (Outcome, Option<String>) {
        let want = predicted_cached(o.predicted_blocks, o.block_size, o.prompt_tokens);
        let outcome = if o.routed_tokens.is_some_and(|n| n != o.prompt_tokens) {
            Outcome::Length
        } else if want > o.cached_tokens {
            Outcome::Over
        } else if want < o.cached_tokens {
            Outcome::Under
        } else {
            Outcome::Match
        };
        let mut g = self.inner.lock();
        let s = &mut g.snap;
        s.outcomes[outcome as usize] += 1;
        s.over_tokens += want.saturating_sub(o.cached_tokens);
        s.under_tokens += o.cached_tokens.saturating_sub(want);
        if outcome != Outcome::Match {
            g.example = Some((*o, want));
        }
        if g.recent.len() == self.window {
            g.recent.pop_front();
        }
        g.recent.push_back(Seen { outcome, empty_index: outcome != Outcome::Match && o.indexed_blocks == 0 });
        let bad = g.recent.iter().filter(|s| s.outcome != Outcome::Match).count();
        if g.snap.alarmed {
            if bad * 2 < self.threshold {
                g.snap.alarmed = false;
            }
            return (outcome, None);
        }
        if bad < self.threshold {
            return (outcome, None);
        }
        g.snap.alarmed = true;
        g.snap.alarms += 1;
        let msg = self.message(&g, bad);
        g.last_alarm = Some(msg.clone());
        (outcome, Some(msg))
    }

    pub fn snapshot(&self) -> CheckSnapshot {
        self.inner.lock().snap
    }

    /// The last alarm's message (None before the first).
    pub fn last_alarm(&self) -> Option<String> {
        self.inner.lock().last_alarm.clone()
    }

    fn message(&self, g: &Inner, bad: usize) -> String {
        let count = |o: Outcome| g.recent.iter().filter(|s| s.outcome == o).count();
        let (over, under, length) = (count(Outcome::Over), count(Outcome::Under), count(Outcome::Length));
        let empty = g.recent.iter().filter(|s| s.empty_index).count();
        let cause = if length * 2 >= bad {
            "the router's prompt tokens are not the engines': the tokenizer or the chat template differs. Check that \
             --tokenizer names the engines' own tokenizer.json (with its tokenizer_config.json and chat template beside it); \
             compare the engine's POST /tokenize with kvroute.prompt.ExactPrompter(...).token_ids(body, chat)"
        } else if empty * 2 >= over + under {
            "the index holds no KV-event block for the workers these requests went to: KV events are missing, or the router's block \
             size is not the engines' (events of another block size are skipped). Check --block-size against the \
             engines' --block-size and the --kv-events endpoints (the event subscriber's stats count skipped events)"
        } else if under > over {
            "the engines reuse more than the index credits: the router hashes other tokens or blocks than the engines \
             (block size, hash seed, tokenizer or chat template), or KV events arrive late"
        } else {
            "the index credits KV the engines do not reuse: requests differ in what the engines key blocks by \
             (LoRA adapter, cache_salt, multimodal inputs: is the request's model or salt reaching the router?), \
             or BlockRemoved events are missing (evictions not seen)"
        };
        let example = match g.example {
            Some((o, want)) => format!(
                "; last mismatch: worker {}, predicted {} cached tokens, engine reused {} of {} prompt tokens{}",
                o.worker,
                want,
                o.cached_tokens,
                o.prompt_tokens,
                o.routed_tokens.filter(|&n| n != o.prompt_tokens).map_or(String::new(), |n| format!(" (router counted {n})"))
            ),
            None => String::new(),
        };
        format!(
            "kvroute self-check: {bad} of the last {} requests were not cached as predicted ({over} over, {under} under, \
             {length} prompt length); likely cause: {cause}{example}. docs/events.md, \"The self-check\", shows how to read it.",
            g.recent.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(pred: u64, cached: u64) -> Observation {
        Observation {
            worker: 1,
            predicted_blocks: pred,
            block_size: 32,
            routed_tokens: Some(100),
            prompt_tokens: 100,
            cached_tokens: cached,
            indexed_blocks: 5,
        }
    }

    #[test]
    fn outcomes_follow_vllms_last_token_cap() {
        assert_eq!(predicted_cached(4, 32, 128), 96);
        assert_eq!(predicted_cached(4, 32, 129), 128);
        assert_eq!(predicted_cached(0, 32, 1), 0);
        let c = PrefixCheck::new(20, 8).unwrap();
        assert_eq!(c.observe(&obs(3, 96)).0, Outcome::Match);
        assert_eq!(c.observe(&obs(3, 64)).0, Outcome::Over);
        assert_eq!(c.observe(&obs(1, 64)).0, Outcome::Under);
        assert_eq!(c.observe(&Observation { routed_tokens: Some(99), ..obs(3, 96) }).0, Outcome::Length);
        assert_eq!(c.observe(&Observation { routed_tokens: None, ..obs(3, 96) }).0, Outcome::Match);
        let s = c.snapshot();
        assert_eq!((s.outcomes, s.over_tokens, s.under_tokens, s.alarmed), ([2, 1, 1, 1], 32, 32, false));
        assert!(PrefixCheck::new(5, 6).is_err());
        assert!(PrefixCheck::new(0, 0).is_err());
    }

    #[test]
    fn one_alarm_per_episode_naming_the_cause() {
        let c = PrefixCheck::new(20, 8).unwrap();
        for _ in 0..12 {
            assert!(c.observe(&obs(3, 96)).1.is_none());
        }
        let mut raised = Vec::new();
        for i in 0..30 {
            let o = Observation { routed_tokens: Some(101), ..obs(0, 0) };
            if let (_, Some(m)) = c.observe(&o) {
                raised.push((i, m));
            }
        }
        assert_eq!(raised.len(), 1);
        assert_eq!(raised[0].0, 7, "the 8th mismatch raises it");
        assert!(raised[0].1.contains("tokenizer or the chat template"), "{}", raised[0].1);
        assert!(raised[0].1.contains("router counted 101"), "{}", raised[0].1);
        // A clean window re-arms it; the next episode names its own cause.
        for _ in 0..20 {
            assert!(c.observe(&obs(3, 96)).1.is_none());
        }
        assert!(!c.snapshot().alarmed);
        let msgs: Vec<String> = (0..8).filter_map(|_| c.observe(&Observation { indexed_blocks: 0, ..obs(0, 96) }).1).collect();
        assert_eq!(msgs.len(), 1);
        assert!(msgs[0].contains("KV events are missing"), "{}", msgs[0]);
        // Predictions from routed prefixes alone (pending, never confirmed by events): the events.
        let c = PrefixCheck::new(20, 8).unwrap();
        let msgs: Vec<String> = (0..8).filter_map(|_| c.observe(&Observation { indexed_blocks: 0, ..obs(3, 64) }).1).collect();
        assert!(msgs[0].contains("KV events are missing"), "{}", msgs[0]);
        assert_eq!(c.last_alarm().as_deref(), Some(msgs[0].as_str()));
        let c = PrefixCheck::new(20, 8).unwrap();
        let msgs: Vec<String> = (0..8).filter_map(|_| c.observe(&obs(3, 0)).1).collect();
        assert!(msgs[0].contains("LoRA adapter, cache_salt"), "{}", msgs[0]);
        let c = PrefixCheck::new(20, 8).unwrap();
        let msgs: Vec<String> = (0..8).filter_map(|_| c.observe(&obs(0, 96)).1).collect();
        assert!(msgs[0].contains("other tokens or blocks"), "{}", msgs[0]);
        assert_eq!(c.snapshot().alarms, 1);
    }
}
