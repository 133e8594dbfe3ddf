//! The response body: the first chunk, then the upstream's frames, with the SSE stream's end
//! checked (a stream cut short is reported), and what the request holds released at its end.

use super::*;

/// What a response body keeps alive until it is fully written (or the client goes away).
#[derive(Default)]
pub(super) struct Hold {
    // Held for their Drop: the lease releases the Router's load, the dispatch the worker's count.
    pub(super) _lease: Option<Lease>,
    pub(super) _dispatch: Option<Dispatch>,
    /// A PD request's prefill side.
    pub(super) _pd: Option<PdHold>,
    pub(super) adm: Option<Admission>,
}

/// A hot-path stream's upstream, for when it breaks after bytes reached the client.
pub(super) struct Break {
    pub(super) sh: Arc<Shared>,
    pub(super) worker: Arc<Worker>,
}

/// Whether a response is an SSE stream.
pub(super) fn is_sse(content_type: &HeaderValue) -> bool {
    content_type.as_bytes().starts_with(b"text/event-stream")
}

/// Where an OpenAI SSE stream stands. Its last event is `data: [DONE]`, and before it the last
/// chunk of each choice carries a `finish_reason`: a stream that ends before `[DONE]`, or reaches
/// `[DONE]` with no `finish_reason` (a SIGTERMed vLLM ends its open streams so), was cut short.
/// Both markers are found even when split across frames.
#[derive(Default)]
pub(super) struct SseEnd {
    /// The last bytes of the stream's last frame holding more than whitespace.
    pub(super) tail: Vec<u8>,
    /// A chunk with a `finish_reason` has passed.
    pub(super) finished: bool,
    /// `data: [DONE]` has passed.
    pub(super) done: bool,
}

impl SseEnd {
    /// Bytes kept between frames: more than either marker and the whitespace around `[DONE]`.
    const KEEP: usize = 32;

    /// Takes the next frame; when it completes `data: [DONE]`, where in the frame that event starts
    /// (0 when it began in an earlier frame).
    pub(super) fn push(&mut self, d: &[u8]) -> Option<usize> {
        if !d.iter().any(|b| !b.is_ascii_whitespace()) {
            return None;
        }
        if !self.finished {
            // A JSON key, so its quotes are never escaped: content text cannot fake it. Searched in
            // the frame, then across the seam with the previous one (on the stack: a frame per token).
            let has =
                |h: &[u8]| [&b"\"finish_reason\":\""[..], b"\"finish_reason\": \""].iter().any(|k| memchr::memmem::find(h, k).is_some());
            let head = &d[..d.len().min(Self::KEEP)];
            let mut seam = [0u8; 2 * Self::KEEP];
            let n = self.tail.len() + head.len();
            seam[..self.tail.len()].copy_from_slice(&self.tail);
            seam[self.tail.len()..n].copy_from_slice(head);
            self.finished = has(d) || has(&seam[..n]);
        }
        self.tail.extend_from_slice(&d[d.len().saturating_sub(Self::KEEP)..]);
        let cut = self.tail.len().saturating_sub(Self::KEEP);
        self.tail.drain(..cut);
        if self.done || !sse_done(&self.tail) {
            return None;
        }
        self.done = true;
        Some(memchr::memmem::rfind(d, b"data: [DONE]").unwrap_or(0))
    }
}

/// The response body: a first chunk, then the upstream's frames as they come; ends (and releases
/// what it holds) at the upstream's end, and releases on drop when the client went away first.
pub struct PlaneBody {
    pub(super) first: Option<Bytes>,
    pub(super) upstream: Option<Incoming>,
    pub(super) read_timeout: Option<Duration>,
    pub(super) timer: Option<Pin<Box<Sleep>>>,
    pub(super) on_break: Option<Break>,
    /// An SSE stream's progress towards its `data: [DONE]`.
    pub(super) sse: Option<SseEnd>,
    /// The relayed worker was marked unhealthy: end the stream now, not at the read timeout.
    pub(super) down: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    pub(super) hold: Option<Hold>,
}

impl PlaneBody {
    pub(super) fn full(data: Bytes) -> PlaneBody {
        PlaneBody { first: Some(data), upstream: None, read_timeout: None, timer: None, on_break: None, sse: None, down: None, hold: None }
    }

    /// Shows the bytes on their way to the client to the self-check's usage tap, if any.
    fn tap(&mut self, d: &[u8]) {
        if let Some(tap) = self.hold.as_mut().and_then(|h| h._lease.as_mut()).and_then(|l| l.tap.as_mut()) {
            tap.push(d);
        }
    }

    /// The body reached its end: a hold's admission counts as completed, its lease as finished.
    pub(super) fn finish(&mut self) {
        self.answered();
        self.hold = None;
    }

    /// The client has the whole answer (the body's end, or an SSE stream's final `data: [DONE]`): a
    /// client that closes now completed its request. The `openai` client closes as soon as it reads
    /// `[DONE]`, often before the engine's end of stream reaches the plane.
    pub(super) fn answered(&mut self) {
        if let Some(adm) = self.hold.as_mut().and_then(|h| h.adm.as_mut()) {
            adm.completed = true;
        }
    }

    /// Relays `d`, first noting whether it ends an SSE stream: with its answer complete, or cut short
    /// (no `finish_reason` before `data: [DONE]`), which the client is told in place of the `[DONE]`.
    pub(super) fn data(&mut self, d: Bytes) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let Some(s) = self.sse.as_mut() else { return Poll::Ready(Some(Ok(Frame::data(d)))) };
        match s.push(&d) {
            Some(_) if s.finished => self.answered(),
            Some(at) => {
                s.done = false; // not a complete answer: broken, as if it had ended here
                let mut out = BytesMut::from(&d[..at]);
                if let Some(ev) = self.broke("the stream reached `data: [DONE]` without a finish_reason") {
                    out.extend_from_slice(&ev);
                }
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
            None => {}
        }
        Poll::Ready(Some(Ok(Frame::data(d))))
    }

    /// The upstream broke mid-stream: mark the worker, and for SSE tell the client in-band. After an
    /// SSE stream's `data: [DONE]` the client has the whole answer: the stream just ends.
    pub(super) fn broke(&mut self, reason: &str) -> Option<Bytes> {
        self.upstream = None;
        if self.sse.as_ref().is_some_and(|s| s.done) {
            self.on_break = None;
            return None;
        }
        let b = self.on_break.take()?;
        b.sh.mark_unhealthy(&b.worker, &format!("stream broke: {reason}"));
        self.sse.as_ref()?;
        let msg = format!("upstream worker failed mid-stream: {reason}");
        let ev = serde_json::json!({"error": {"message": msg, "type": "upstream_error", "code": 502}});
        Some(Bytes::from(format!("data: {ev}\n\n")))
    }
}

/// Whether an SSE chunk ends with the OpenAI stream's final event, `data: [DONE]`.
pub(super) fn sse_done(chunk: &[u8]) -> bool {
    let end = chunk.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    chunk[..end].ends_with(b"data: [DONE]")
}

impl Body for PlaneBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            this.tap(&first);
            if this.upstream.is_none() {
                // The whole body: hyper may not poll again once the announced length is written.
                this.finish();
            }
            if !first.is_empty() {
                return this.data(first);
            }
        }
        loop {
            let Some(up) = this.upstream.as_mut() else {
                this.finish();
                return Poll::Ready(None);
            };
            match Pin::new(up).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let (Some(t), Some(rt)) = (this.timer.as_mut(), this.read_timeout) {
                        t.as_mut().reset(tokio::time::Instant::now() + rt);
                    }
                    match frame.into_data() {
                        Ok(d) if !d.is_empty() => {
                            this.tap(&d);
                            return this.data(d);
                        }
                        _ => continue,
                    }
                }
                Poll::Ready(None) => {
                    this.upstream = None;
                    // An OpenAI stream ends with `data: [DONE]`; one that ends before it is cut
                    // short (a SIGTERMed vLLM closes its open streams cleanly): say so in-band.
                    if this.sse.as_ref().is_some_and(|s| !s.done) {
                        if let Some(chunk) = this.broke("the stream ended before its final `data: [DONE]`") {
                            return Poll::Ready(Some(Ok(Frame::data(chunk))));
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    if this.on_break.is_none() {
                        // A forwarded response: abort the client's connection rather than end it cleanly.
                        this.upstream = None;
                        return Poll::Ready(Some(Err(io::Error::other(e))));
                    }
                    if let Some(chunk) = this.broke(&e.to_string()) {
                        return Poll::Ready(Some(Ok(Frame::data(chunk))));
                    }
                }
                Poll::Pending => {
                    if this.down.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready()) {
                        this.down = None;
                        if let Some(chunk) = this.broke("the worker was marked unhealthy") {
                            return Poll::Ready(Some(Ok(Frame::data(chunk))));
                        }
                        continue;
                    }
                    let Some(rt) = this.read_timeout else { return Poll::Pending };
                    let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(rt)));
                    if timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    if let Some(chunk) = this.broke(&format!("no data for {rt:?}")) {
                        return Poll::Ready(Some(Ok(Frame::data(chunk))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.upstream.is_none() && !matches!(&self.first, Some(f) if !f.is_empty())
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.first, &self.upstream) {
            (first, None) => SizeHint::with_exact(first.as_ref().map_or(0, |f| f.len() as u64)),
            _ => SizeHint::default(),
        }
    }
}
