//! A routed request's load on the Router and on its worker, each released exactly once.

use super::*;

/// One routed request's load on the Router, released exactly once: `finished` once its first byte
/// (prefill done) was seen, `cancel` otherwise.
pub(super) struct Lease {
    pub(super) router: Arc<Router>,
    pub(super) rid: u64,
    pub(super) prefilled: bool,
    /// Reads the engine's usage from the response this lease's body relays (the self-check).
    pub(super) tap: Option<UsageTap>,
}

impl Lease {
    pub(super) fn prefill_done(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            let _ = self.router.prefill_done(self.rid, None);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // The output the response reported (its usage): what decode KV is reserved for, and one
        // sample of the worker's decode step. An unknown request here would be a data plane bug;
        // nothing useful to do on the drop path.
        if let Some(out) = self.tap.as_ref().filter(|_| self.prefilled).and_then(|t| last_int(&t.tail, "completion_tokens")) {
            let _ = self.router.output_done(self.rid, out, None);
        }
        let _ = if self.prefilled { self.router.finished(self.rid, None) } else { self.router.cancel(self.rid, None) };
    }
}

/// Counts one request dispatched to a worker, in flight until dropped.
pub(super) struct Dispatch(pub(super) Arc<Worker>);

impl Dispatch {
    pub(super) fn new(w: Arc<Worker>) -> Dispatch {
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        w.served.fetch_add(1, Ordering::SeqCst);
        Dispatch(w)
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The self-check's view of one response: the prediction, and the response's tail, where the
/// engine's `usage` is (the JSON answer's end, or a stream's last chunk before `data: [DONE]` when
/// the client asked for `stream_options.include_usage`). Checked when the response ends.
pub(super) struct UsageTap {
    pub(super) sh: Arc<Shared>,
    pub(super) worker: WorkerId,
    pub(super) predicted_blocks: u64,
    /// The router's prompt length, when exact (checked against the engine's `prompt_tokens`).
    pub(super) routed_tokens: Option<u64>,
    pub(super) tail: Vec<u8>,
}

impl UsageTap {
    /// The tap of a routed decision whose prompt was the engine's `routed_tokens` tokens.
    pub(super) fn of(sh: &Arc<Shared>, d: &kvroute_core::router::decision::Decision, routed_tokens: u64) -> UsageTap {
        UsageTap {
            sh: sh.clone(),
            worker: d.worker,
            predicted_blocks: d.overlap_blocks as u64,
            routed_tokens: Some(routed_tokens),
            tail: Vec::new(),
        }
    }

    /// Bytes kept from the response's end: the usage object and what an engine writes after it.
    const KEEP: usize = 2048;

    pub(super) fn push(&mut self, d: &[u8]) {
        if d.len() >= Self::KEEP {
            self.tail.clear();
            self.tail.extend_from_slice(&d[d.len() - Self::KEEP..]);
        } else {
            let over = (self.tail.len() + d.len()).saturating_sub(Self::KEEP);
            self.tail.drain(..over);
            self.tail.extend_from_slice(d);
        }
    }
}

/// The last integer value of JSON key `key` in `s` (a key's quotes are never escaped, so text
/// inside strings cannot fake it).
pub(super) fn last_int(s: &[u8], key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let at = memchr::memmem::rfind(s, pat.as_bytes())? + pat.len();
    let rest = &s[at..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits: &[u8] = &rest[start..];
    let end = digits.iter().position(|b| !b.is_ascii_digit()).unwrap_or(digits.len());
    std::str::from_utf8(&digits[..end]).ok()?.parse().ok()
}

impl Drop for UsageTap {
    fn drop(&mut self) {
        // Only a complete usage object counts: both figures, cached tokens within the prompt.
        let (Some(prompt), Some(cached)) = (last_int(&self.tail, "prompt_tokens"), last_int(&self.tail, "cached_tokens")) else {
            return;
        };
        if cached > prompt {
            return;
        }
        let sh = &self.sh;
        let o = kvroute_core::check::Observation {
            worker: self.worker,
            predicted_blocks: self.predicted_blocks,
            block_size: sh.block_size,
            routed_tokens: self.routed_tokens,
            prompt_tokens: prompt,
            cached_tokens: cached,
            indexed_blocks: sh.router.index().num_blocks(self.worker),
        };
        if let (_, Some(alarm)) = sh.check.observe(&o) {
            eprintln!("WARNING {alarm}");
        }
    }
}
