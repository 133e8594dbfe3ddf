//! The hot path: route a request, open it on the chosen worker, relay the answer, and retry on
//! the next-best worker while no byte reached the client.

use super::*;

/// One hot-path request as every attempt at it sends it upstream.
pub(super) struct Call<'a> {
    pub(super) sh: &'a Arc<Shared>,
    pub(super) endpoint: &'static str,
    pub(super) headers: &'a HeaderMap,
    pub(super) raw: &'a Bytes,
    pub(super) stream: bool,
    /// The workers serving the request's model (`None`: any).
    pub(super) pool: Option<&'a [WorkerId]>,
    /// The prompt is the engine's tokens (exact mode): the self-check compares its predictions.
    pub(super) exact: bool,
}

/// An attempt that failed before any byte reached the client, so it may be retried elsewhere.
pub(super) struct Failure {
    /// The worker to blame (marked unhealthy); `None`: routed to a worker this plane does not know.
    pub(super) worker: Option<Arc<Worker>>,
    pub(super) reason: String,
}

impl Failure {
    pub(super) fn of(w: &Arc<Worker>, reason: String) -> Failure {
        Failure { worker: Some(w.clone()), reason }
    }

    pub(super) fn unknown(id: WorkerId) -> Failure {
        Failure { worker: None, reason: format!("worker {id} is routed to but unknown to the data plane") }
    }
}

/// An attempt's outcome: the response, or the admission back with what failed.
pub(super) type Attempted = Result<Response<PlaneBody>, (Admission, Failure)>;

/// What `open` returns: status, content type, the first chunk (the whole body when buffered) and the
/// rest of the stream.
pub(super) type Opened = (StatusCode, HeaderValue, Bytes, Option<Incoming>);

/// Routes and relays one hot-path request, retrying on the next-best worker while no byte reached
/// the client: unified workers, a PD pair (pd.rs), or a PD decision the decode worker serves alone.
pub(super) async fn serve_hot(call: &Call<'_>, prompt: &ApproxPrompt, t0: Instant, mut adm: Admission) -> Response<PlaneBody> {
    let sh = call.sh;
    let mut last_failure = String::from("no attempt made");
    let attempts = sh.cfg.max_retries + 1;
    for attempt in 0..attempts {
        let rid = REQUEST_ID_BASE | sh.next_rid.fetch_add(1, Ordering::Relaxed);
        let req = RouteRequest {
            hashes: Some(&prompt.hashes),
            num_tokens: Some(prompt.num_tokens),
            request_id: Some(rid),
            output_tokens: prompt.output_tokens,
            workers: call.pool,
            ..Default::default()
        };
        let d = match sh.router.route(&req) {
            Ok(d) => d,
            Err(RouterError::NoWorkers(_)) => {
                let mut msg = format!("no healthy worker to route to: {}", sh.no_worker_detail());
                if attempt > 0 {
                    msg.push_str(&format!("; this request's last failure: {last_failure}"));
                }
                return adm.respond(error(503, &msg, "service_unavailable", Some(1)));
            }
            Err(e @ RouterError::InvalidArgument(_)) => {
                return adm.respond(error(400, &format!("cannot route this prompt: {e}"), "invalid_request_error", None));
            }
            Err(e) => return adm.respond(error(500, &format!("routing failed: {e}"), "internal_error", None)),
        };
        if attempt == 0 {
            sh.metrics.routing_time(t0.elapsed().as_secs_f64());
        }
        if !d.admitted {
            sh.metrics.rejection(d.reason.name());
            let retry_after = d.queue_delay.ceil().max(1.0) as u64;
            let msg = format!("request rejected: {} (predicted TTFT {:.3} s); retry later", d.reason.name(), d.predicted_ttft);
            return adm.respond(error(429, &msg, "rate_limit_exceeded", Some(retry_after)));
        }
        // The self-check applies where predictions are meant to be the engine's (exact prompts).
        // A PD pair's answer comes from the decode side, whose reuse is not the predicted prefill hit.
        let tap = (call.exact && d.path != RoutePath::Disaggregated).then(|| UsageTap::of(sh, &d, prompt.num_tokens));
        let lease = Lease { router: sh.router.clone(), rid, prefilled: false, tap };
        sh.metrics.tokens(prompt.num_tokens, prompt.num_tokens - d.uncached_tokens.min(prompt.num_tokens));
        if let Some(a) = &sh.approx {
            let now = a.now();
            a.insert(d.worker, &prompt.hashes, now);
            if let Some(dw) = d.decode_worker.filter(|&dw| dw != d.worker) {
                a.insert(dw, &prompt.hashes, now);
            }
        }
        let outcome = match (d.path, d.decode_worker) {
            (RoutePath::Disaggregated, Some(dw)) => pd::serve(call, d.worker, dw, lease, adm).await,
            _ => unified(call, d.worker, lease, adm).await,
        };
        match outcome {
            Ok(resp) => return resp,
            Err((back, failure)) => {
                adm = back;
                let Some(w) = failure.worker else {
                    last_failure = failure.reason;
                    continue;
                };
                last_failure = format!("{}: {}", w.url, failure.reason);
                sh.mark_unhealthy(&w, &failure.reason);
                if attempt + 1 < attempts {
                    sh.metrics.retry();
                }
            }
        }
    }
    let msg = format!("all {attempts} attempts failed; last: {last_failure}");
    adm.respond(error(502, &msg, "upstream_error", None))
}

/// One attempt on one worker that prefills and decodes (a unified worker, or a PD decode worker
/// prefilling locally): the request body goes upstream unchanged.
pub(super) async fn unified(call: &Call<'_>, worker: WorkerId, mut lease: Lease, adm: Admission) -> Attempted {
    let Some(w) = call.sh.worker(worker) else { return Err((adm, Failure::unknown(worker))) };
    let dispatch = Dispatch::new(w.clone());
    let down = w.went_down();
    let opened = tokio::select! {
        r = open(call.sh, &w, call.endpoint, call.headers, call.raw, call.stream) => r,
        () = down => Err("the worker was marked unhealthy before it answered".to_string()),
    };
    match opened {
        Ok(opened) => {
            lease.prefill_done();
            Ok(relay(call.sh, &w, opened, Hold { _lease: Some(lease), _dispatch: Some(dispatch), ..Hold::default() }, adm))
        }
        Err(reason) => Err((adm, Failure::of(&w, reason))),
    }
}

/// The client's response relaying worker `w`'s answer; `hold` (with the admission) lives until its end.
pub(super) fn relay(sh: &Arc<Shared>, w: &Arc<Worker>, opened: Opened, mut hold: Hold, adm: Admission) -> Response<PlaneBody> {
    let (status, content_type, first, rest) = opened;
    let sse = is_sse(&content_type);
    hold.adm = Some(adm.with_outcome(status_class(status)));
    let mut body = PlaneBody::full(first);
    body.upstream = rest;
    body.read_timeout = Some(sh.cfg.read_timeout);
    body.on_break = Some(Break { sh: sh.clone(), worker: w.clone() });
    // An error answer (4xx) is relayed as the engine wrote it, whatever its content type.
    body.sse = (sse && status.is_success()).then(SseEnd::default);
    body.down = Some(w.went_down());
    body.hold = Some(hold);
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, content_type);
    if let Ok(v) = HeaderValue::from_str(&w.url) {
        h.insert(HeaderName::from_static("x-kvroute-worker"), v);
    }
    resp
}

/// Sends one request to a worker; returns status, content type and the first chunk (the whole body
/// when not streaming) plus the rest of the stream. `Err` (refusal, 5xx, a break before the first
/// byte) may be retried elsewhere.
pub(super) async fn open(sh: &Shared, w: &Worker, path: &str, headers: &HeaderMap, raw: &Bytes, stream: bool) -> Result<Opened, String> {
    let mut b = Request::post(format!("{}{}", w.url, path))
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .header(ACCEPT, HeaderValue::from_static("*/*"));
    for name in FORWARD {
        if let Some(v) = headers.get(name) {
            b = b.header(name, v.clone());
        }
    }
    let req = b.body(Full::new(raw.clone())).map_err(|e| format!("cannot build the upstream request: {e}"))?;
    let rt = sh.cfg.read_timeout;
    let resp = match tokio::time::timeout(rt, sh.client.request(req)).await {
        Err(_) => return Err(format!("no response head within {rt:?}")),
        Ok(Err(e)) => return Err(format!("connection failed: {}", chain(&e))),
        Ok(Ok(r)) => r,
    };
    let (parts, mut body) = resp.into_parts();
    if parts.status.as_u16() >= 500 {
        let mut detail = BytesMut::new();
        while detail.len() < 300 {
            match tokio::time::timeout(rt, body.frame()).await {
                Ok(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        detail.extend_from_slice(&d);
                    }
                }
                _ => break,
            }
        }
        detail.truncate(300);
        return Err(format!("HTTP {}: {}", parts.status.as_u16(), String::from_utf8_lossy(&detail)));
    }
    let content_type = parts.headers.get(CONTENT_TYPE).cloned().unwrap_or_else(|| HeaderValue::from_static("application/json"));
    if !stream {
        let mut all = BytesMut::new();
        loop {
            match tokio::time::timeout(rt, body.frame()).await {
                Err(_) => return Err(format!("response broke before it was complete: no data for {rt:?}")),
                Ok(None) => return Ok((parts.status, content_type, all.freeze(), None)),
                Ok(Some(Err(e))) => return Err(format!("response broke before it was complete: {e}")),
                Ok(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        all.extend_from_slice(&d);
                    }
                }
            }
        }
    }
    loop {
        match tokio::time::timeout(rt, body.frame()).await {
            Err(_) => return Err(format!("response broke before the first byte: no data for {rt:?}")),
            Ok(None) if parts.status.is_success() && is_sse(&content_type) => {
                return Err("the event stream ended before its first byte".to_string());
            }
            Ok(None) => return Ok((parts.status, content_type, Bytes::new(), None)),
            Ok(Some(Err(e))) => return Err(format!("response broke before the first byte: {e}")),
            Ok(Some(Ok(f))) => match f.into_data() {
                Ok(d) if !d.is_empty() => return Ok((parts.status, content_type, d, Some(body))),
                _ => continue,
            },
        }
    }
}

/// An error and its causes on one line (hyper's errors say little at the top level).
pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}
