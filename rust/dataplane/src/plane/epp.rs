//! The Gateway API Inference Extension endpoint picker (EPP): Envoy's external processor
//! (`envoy.service.ext_proc.v3.ExternalProcessor`, tonic with `envoy-types`' generated messages)
//! picking the endpoint of each request on the same Router, prompts, admission, leases and metrics
//! as the HTTP hot path; plus gRPC health (`liveness`, `readiness`, the ext_proc service name).
//!
//! One ext_proc stream is one HTTP request. With `FULL_DUPLEX_STREAMED` request bodies the picker
//! holds the request headers' answer until the body's end, routes on its prompt, then answers the
//! headers with `x-gateway-destination-endpoint` (the pick, then fallbacks: `ip:port,ip:port`, the
//! same value as the `envoy.lb` dynamic metadata) and sends the body back unchanged. Response bodies
//! stream through it (echoed chunk by chunk), so it sees the first token (prefill done) and the end
//! (load released). A request's load also ends when the stream breaks and when the gateway is silent
//! on it for `read_timeout` (the lease TTL). The endpoint the gateway reports as served
//! (`envoy.lb`/`x-gateway-destination-endpoint-served`) moves the load there when a fallback served.
//! Protocol: docs/proposals/004-endpoint-picker-protocol in kubernetes-sigs/gateway-api-inference-extension.

use std::collections::HashSet;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue as PbHeader, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value as PbValue};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic_health::ServingStatus;

use super::*;

/// The header and `envoy.lb` metadata key carrying the pick.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The key under which the gateway reports the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the pick and of the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace and key of the gateway's candidate subset.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// gRPC health service names (besides the ext_proc service's own).
const LIVENESS: &str = "liveness";
const READINESS: &str = "readiness";
const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// Body chunks sent back to the gateway are at most this large (gRPC messages stay small).
const CHUNK: usize = 64 * 1024;

/// `host:port` of a worker URL (`[v6]:port`), the port defaulting to the scheme's.
pub(super) fn endpoint_of(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?.to_ascii_lowercase();
    let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
    Some(format!("{host}:{port}"))
}

/// Serves the picker on `listener` until the runtime shuts down.
pub(super) async fn serve(sh: Arc<Shared>, listener: std::net::TcpListener) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kvroute endpoint picker: cannot register the listener: {e}");
            return;
        }
    };
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status(LIVENESS, ServingStatus::Serving).await;
    reporter.set_service_status("", ServingStatus::Serving).await;
    // Readiness follows the workers (serving while one healthy worker can take a request) and
    // draining (not serving, so the gateway's health check moves it off before the picker stops).
    let sh2 = sh.clone();
    tokio::spawn(async move {
        let mut last = None;
        loop {
            let ready = !sh2.draining.load(Ordering::SeqCst) && sh2.workers.read().values().any(|w| w.healthy.load(Ordering::SeqCst));
            if last != Some(ready) {
                let st = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
                reporter.set_service_status(READINESS, st).await;
                reporter.set_service_status(EXT_PROC_SERVICE, st).await;
                last = Some(ready);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let limit = sh.cfg.max_body_bytes.saturating_add(1 << 20);
    let picker = ExternalProcessorServer::new(Picker { sh }).max_decoding_message_size(limit).max_encoding_message_size(limit);
    let server = tonic::transport::Server::builder().add_service(health).add_service(picker);
    // Without TCP_NODELAY on the accepted connections, each small answer waits out the gateway's
    // delayed ACK (~40 ms a request).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    if let Err(e) = server.serve_with_incoming(incoming).await {
        eprintln!("kvroute endpoint picker stopped: {e}");
    }
}

struct Picker {
    sh: Arc<Shared>,
}

type Out = Result<ProcessingResponse, tonic::Status>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Out>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let st = Stream::new(self.sh.clone(), tx);
        tokio::spawn(st.run(inbound));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// What the picker chose for a request, held until its response ends.
struct Picked {
    worker: Arc<Worker>,
    /// The prompt, kept to move the load when a fallback served.
    prompt: Option<ApproxPrompt>,
    pool: Option<Vec<WorkerId>>,
    lease: Option<Lease>,
    dispatch: Option<Dispatch>,
}

/// One ext_proc stream: one HTTP request through the gateway.
struct Stream {
    sh: Arc<Shared>,
    tx: mpsc::Sender<Out>,
    /// Request headers (lower-case names) once received.
    headers: Option<HeaderMap>,
    subset: Option<Vec<String>>,
    body: BytesMut,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    adm: Option<Admission>,
    picked: Option<Picked>,
    /// The pick was answered (or an immediate response sent): later request messages pass.
    decided: bool,
    /// The request has a body the picker holds and sends back (FULL_DUPLEX_STREAMED).
    has_body: bool,
    exact: bool,
}

impl Stream {
    fn new(sh: Arc<Shared>, tx: mpsc::Sender<Out>) -> Stream {
        Stream {
            sh,
            tx,
            headers: None,
            subset: None,
            body: BytesMut::new(),
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            adm: None,
            picked: None,
            decided: false,
            has_body: false,
            exact: false,
        }
    }

    async fn run(mut self, mut inbound: tonic::Streaming<ProcessingRequest>) {
        let ttl = self.sh.cfg.read_timeout;
        loop {
            let holding = self.picked.as_ref().is_some_and(|p| p.lease.is_some());
            let msg = tokio::select! {
                m = inbound.message() => m,
                () = tokio::time::sleep(ttl), if holding => {
                    // The gateway went silent on a routed request: release its load (TTL).
                    if let Some(p) = &mut self.picked {
                        p.lease = None;
                        p.dispatch = None;
                    }
                    self.sh.metrics.lease_expired();
                    continue;
                }
            };
            match msg {
                Ok(Some(m)) => {
                    if !self.on_message(m).await {
                        break;
                    }
                }
                // The gateway closed the stream (the request ended, or it gave up on it): the load
                // is released below, as finished once prefilled, else cancelled.
                Ok(None) | Err(_) => break,
            }
        }
    }

    /// Handles one message; false ends the stream (the gateway stopped listening).
    async fn on_message(&mut self, m: ProcessingRequest) -> bool {
        if let Some(pc) = &m.protocol_config {
            self.request_mode = BodySendMode::try_from(pc.request_body_mode).unwrap_or(BodySendMode::None);
            self.response_mode = BodySendMode::try_from(pc.response_body_mode).unwrap_or(BodySendMode::None);
        }
        let Some(req) = m.request else { return true };
        use processing_request::Request as R;
        match req {
            R::RequestHeaders(h) => {
                self.subset = subset_hint(m.metadata_context.as_ref());
                self.headers = Some(header_map(&h));
                self.has_body = !h.end_of_stream && self.request_mode != BodySendMode::None;
                if !self.has_body {
                    return self.decide().await;
                }
                if self.request_mode != BodySendMode::FullDuplexStreamed {
                    let msg = "the endpoint picker needs the request body in FULL_DUPLEX_STREAMED mode \
                               (processing_mode.request_body_mode), or NONE to pick without the prompt";
                    return self.immediate(500, msg, "internal_error", None).await;
                }
                true
            }
            R::RequestBody(b) => {
                if self.decided {
                    // A body after an answer (an immediate response raced it): nothing to pick.
                    return true;
                }
                if self.body.len() + b.body.len() > self.sh.cfg.max_body_bytes {
                    let endpoint = self.headers.as_ref().map_or("other", |h| endpoint_of_request(h).0);
                    self.sh.metrics.request(endpoint, "4xx");
                    let msg = format!("request body larger than {} bytes", self.sh.cfg.max_body_bytes);
                    return self.immediate(413, &msg, "invalid_request_error", None).await;
                }
                self.body.extend_from_slice(&b.body);
                if b.end_of_stream {
                    return self.decide().await;
                }
                true
            }
            R::RequestTrailers(_) => {
                if !self.decided && !self.decide().await {
                    return false;
                }
                self.send(processing_response::Response::RequestTrailers(TrailersResponse::default()), None).await
            }
            R::ResponseHeaders(h) => self.on_response_headers(&m.metadata_context, &h).await,
            R::ResponseBody(b) => {
                if !b.body.is_empty() {
                    if let Some(l) = self.picked.as_mut().and_then(|p| p.lease.as_mut()) {
                        l.prefill_done();
                        if let Some(tap) = &mut l.tap {
                            tap.push(&b.body);
                        }
                    }
                }
                let eos = b.end_of_stream;
                let common = match self.response_mode {
                    BodySendMode::FullDuplexStreamed => Some(streamed(b.body, eos)),
                    _ => None,
                };
                let ok = self.send(processing_response::Response::ResponseBody(BodyResponse { response: common }), None).await;
                if eos {
                    self.finish();
                }
                ok
            }
            R::ResponseTrailers(_) => {
                let ok = self.send(processing_response::Response::ResponseTrailers(TrailersResponse::default()), None).await;
                self.finish();
                ok
            }
        }
    }

    /// The response's end: its load released as finished, the request counted as answered.
    fn finish(&mut self) {
        if let Some(mut p) = self.picked.take() {
            if let Some(l) = &mut p.lease {
                l.prefill_done();
            }
        }
        if let Some(a) = &mut self.adm {
            a.completed = true;
        }
        self.adm = None;
    }

    async fn on_response_headers(&mut self, meta: &Option<Metadata>, h: &HttpHeaders) -> bool {
        let headers = header_map(h);
        let status = headers.get("x-pseudo-status").and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<u16>().ok());
        if let (Some(s), Some(a)) = (status, self.adm.take()) {
            self.adm = Some(a.with_outcome(status_class(StatusCode::from_u16(s).unwrap_or(StatusCode::BAD_GATEWAY))));
        }
        let served = served_endpoint(meta.as_ref()).or_else(|| headers.get(SERVED).and_then(|v| v.to_str().ok()).map(str::to_string));
        if let Some(served) = served {
            self.moved_to(served.trim());
        }
        let ok = self.send(processing_response::Response::ResponseHeaders(HeadersResponse::default()), None).await;
        if h.end_of_stream {
            self.finish();
        }
        ok
    }

    /// The gateway served the request from `served`: when that is not the pick (a fallback after
    /// the pick failed), the load moves there and the pick is taken out of routing until its
    /// health probe passes, as a failed dispatch of the HTTP path is.
    fn moved_to(&mut self, served: &str) {
        let Some(p) = &mut self.picked else { return };
        if p.worker.endpoint == served {
            return;
        }
        let Some(w) = self.sh.workers.read().values().find(|w| w.endpoint == served).cloned() else { return };
        self.sh.metrics.fallback_served();
        let failed = p.worker.clone();
        p.lease = None;
        p.dispatch = Some(Dispatch::new(w.clone()));
        p.worker = w.clone();
        if let Some(prompt) = &p.prompt {
            let rid = REQUEST_ID_BASE | self.sh.next_rid.fetch_add(1, Ordering::Relaxed);
            let req = RouteRequest {
                hashes: Some(&prompt.hashes),
                num_tokens: Some(prompt.num_tokens),
                request_id: Some(rid),
                output_tokens: prompt.output_tokens,
                pin: Some(w.id),
                workers: p.pool.as_deref(),
                ..Default::default()
            };
            // Tracked only when admitted there: a rejection leaves the request untracked.
            if let Ok(d) = self.sh.router.route(&req) {
                if d.admitted {
                    let tap = self.exact.then(|| UsageTap::of(&self.sh, &d, prompt.num_tokens));
                    p.lease = Some(Lease { router: self.sh.router.clone(), rid, prefilled: false, tap });
                }
            }
            if let Some(a) = &self.sh.approx {
                a.insert(w.id, &prompt.hashes, a.now());
            }
        }
        let reason = format!("the gateway served its request from the fallback {served}");
        self.sh.mark_unhealthy(&failed, &reason);
    }

    /// Picks the endpoint (the body, if any, is complete) and answers the request headers, then
    /// sends the body back; or answers with an immediate response.
    async fn decide(&mut self) -> bool {
        self.decided = true;
        let sh = self.sh.clone();
        let headers = self.headers.take().unwrap_or_default();
        let (endpoint, chat) = endpoint_of_request(&headers);
        let key = match (&sh.cfg.client_key_header, headers.get("x-forwarded-for")) {
            (Some(h), _) if headers.get(h.to_ascii_lowercase().as_str()).is_some_and(|v| !v.is_empty()) => client_key(&sh, &headers, ""),
            (_, Some(xff)) => format!("ip:{}", String::from_utf8_lossy(xff.as_bytes()).split(',').next().unwrap_or("").trim()),
            // No client identity: only the total in-flight limit applies.
            _ => format!("stream:{}", sh.next_rid.fetch_add(1, Ordering::Relaxed)),
        };
        let adm = match Admission::take(&sh, key, endpoint) {
            Ok(a) => a,
            Err(r) => {
                sh.metrics.request(endpoint, "4xx");
                return self.immediate(r.status, &r.message, r.kind, r.retry_after).await;
            }
        };
        self.adm = Some(adm);
        let t0 = Instant::now();
        let raw = std::mem::take(&mut self.body).freeze();
        let (prompt, pool) = match chat {
            Some(chat) if !raw.is_empty() => {
                let value = match serde_json::from_slice::<Value>(&raw) {
                    Ok(v) => v,
                    Err(e) => return self.fail(400, &format!("request body is not valid JSON: {e}"), "invalid_request_error", None).await,
                };
                match sh.routed_prompt(&value, chat).await {
                    Ok(r) => {
                        self.exact = r.exact;
                        (Some(r.prompt), r.pool)
                    }
                    Err(Unroutable::UnknownModel(model)) => {
                        let msg = format!("The model `{model}` does not exist.");
                        return self.fail(404, &msg, "NotFoundError", None).await;
                    }
                    Err(Unroutable::Bad(BadRequest(msg))) => return self.fail(400, &msg, "invalid_request_error", None).await,
                }
            }
            // Not a completion (or no body): picked on load alone.
            _ => (None, None),
        };
        // The gateway's subset narrows the candidates; an empty or wholly ineligible subset is a 503.
        let pool = match &self.subset {
            None => pool,
            Some(subset) => {
                let allowed: HashSet<&str> = subset.iter().map(|s| s.trim()).collect();
                let in_subset: Vec<WorkerId> = {
                    let ws = sh.workers.read();
                    ws.values()
                        .filter(|w| allowed.contains(w.endpoint.as_str()) && w.healthy.load(Ordering::SeqCst))
                        .filter(|w| pool.as_ref().is_none_or(|p| p.contains(&w.id)))
                        .map(|w| w.id)
                        .collect()
                };
                if in_subset.is_empty() {
                    let msg = format!("no eligible endpoint in the gateway's subset {subset:?}");
                    return self.fail(503, &msg, "service_unavailable", Some(1)).await;
                }
                Some(in_subset)
            }
        };
        let rid = REQUEST_ID_BASE | sh.next_rid.fetch_add(1, Ordering::Relaxed);
        let empty: [u64; 0] = [];
        let fallbacks = sh.cfg.max_retries as usize;
        let req = RouteRequest {
            hashes: Some(prompt.as_ref().map_or(&empty[..], |p| &p.hashes)),
            num_tokens: Some(prompt.as_ref().map_or(1, |p| p.num_tokens)), // no prompt: one token, picked on load
            request_id: Some(rid),
            output_tokens: prompt.as_ref().and_then(|p| p.output_tokens),
            workers: pool.as_deref(),
            explain: fallbacks > 0,
            ..Default::default()
        };
        let d = match sh.router.route(&req) {
            Ok(d) => d,
            Err(RouterError::NoWorkers(_)) => {
                let msg = format!("no healthy worker to route to: {}", sh.no_worker_detail());
                return self.fail(503, &msg, "service_unavailable", Some(1)).await;
            }
            Err(e @ RouterError::InvalidArgument(_)) => {
                return self.fail(400, &format!("cannot route this prompt: {e}"), "invalid_request_error", None).await;
            }
            Err(e) => return self.fail(500, &format!("routing failed: {e}"), "internal_error", None).await,
        };
        sh.metrics.routing_time(t0.elapsed().as_secs_f64());
        if !d.admitted {
            sh.metrics.rejection(d.reason.name());
            let retry_after = d.queue_delay.ceil().max(1.0) as u64;
            let msg = format!("request rejected: {} (predicted TTFT {:.3} s); retry later", d.reason.name(), d.predicted_ttft);
            return self.fail(429, &msg, "rate_limit_exceeded", Some(retry_after)).await;
        }
        let Some(worker) = sh.worker(d.worker) else {
            let _ = sh.router.cancel(rid, None);
            return self.fail(503, "routed to a worker the data plane no longer knows", "service_unavailable", Some(1)).await;
        };
        // Fallbacks: the next-best healthy candidates, best first.
        let mut list = vec![worker.endpoint.clone()];
        if let Some(mut cands) = d.explain.clone() {
            cands.sort_by(|a, b| a.score.total_cmp(&b.score).then(a.predicted_ttft.total_cmp(&b.predicted_ttft)));
            let ws = sh.workers.read();
            for c in cands.iter().filter(|c| c.worker != d.worker) {
                if list.len() > fallbacks {
                    break;
                }
                if let Some(w) = ws.get(&c.worker).filter(|w| w.healthy.load(Ordering::SeqCst)) {
                    list.push(w.endpoint.clone());
                }
            }
        }
        let pick = list.join(",");
        let tap = prompt.as_ref().filter(|_| self.exact).map(|p| UsageTap::of(&sh, &d, p.num_tokens));
        if let Some(p) = &prompt {
            sh.metrics.tokens(p.num_tokens, p.num_tokens - d.uncached_tokens.min(p.num_tokens));
            if let Some(a) = &sh.approx {
                a.insert(d.worker, &p.hashes, a.now());
            }
        }
        self.picked = Some(Picked {
            worker: worker.clone(),
            prompt,
            pool,
            lease: Some(Lease { router: sh.router.clone(), rid, prefilled: false, tap }),
            dispatch: Some(Dispatch::new(worker)),
        });
        let common = CommonResponse {
            header_mutation: Some(HeaderMutation { set_headers: vec![overwrite(DESTINATION, pick.as_bytes())], remove_headers: vec![] }),
            clear_route_cache: true,
            ..Default::default()
        };
        let meta = Struct {
            fields: [(LB_NAMESPACE.to_string(), struct_value([(DESTINATION.to_string(), string_value(&pick))]))].into_iter().collect(),
        };
        if !self.send(processing_response::Response::RequestHeaders(HeadersResponse { response: Some(common) }), Some(meta)).await {
            return false;
        }
        if !self.has_body {
            return true;
        }
        // The body goes back unchanged, in chunks, the last one ending the stream.
        let mut rest = raw;
        loop {
            let n = rest.len().min(CHUNK);
            let chunk = rest.split_to(n);
            let eos = rest.is_empty();
            let body = processing_response::Response::RequestBody(BodyResponse { response: Some(streamed(chunk.to_vec(), eos)) });
            if !self.send(body, None).await {
                return false;
            }
            if eos {
                return true;
            }
        }
    }

    /// An immediate response after admission: counted under its status.
    async fn fail(&mut self, status: u16, message: &str, kind: &str, retry_after: Option<u64>) -> bool {
        if let Some(mut a) = self.adm.take() {
            a = a.with_outcome(status_class(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)));
            a.completed = true;
            drop(a);
        }
        self.immediate(status, message, kind, retry_after).await
    }

    /// Answers the request itself (the gateway sends it to the client; no endpoint is contacted).
    async fn immediate(&mut self, status: u16, message: &str, kind: &str, retry_after: Option<u64>) -> bool {
        self.decided = true;
        let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}});
        let mut set = vec![overwrite("content-type", b"application/json")];
        if let Some(s) = retry_after {
            set.push(overwrite("retry-after", s.to_string().as_bytes()));
        }
        let resp = ImmediateResponse {
            status: Some(HttpStatus { code: status as i32 }),
            headers: Some(HeaderMutation { set_headers: set, remove_headers: vec![] }),
            body: body.to_string().into_bytes(),
            details: format!("kvroute_epp_{status}"),
            ..Default::default()
        };
        // The gateway ends the stream after an immediate response.
        self.send(processing_response::Response::ImmediateResponse(resp), None).await;
        false
    }

    async fn send(&self, r: processing_response::Response, meta: Option<Struct>) -> bool {
        let msg = ProcessingResponse { response: Some(r), dynamic_metadata: meta, ..Default::default() };
        self.tx.send(Ok(msg)).await.is_ok()
    }
}

/// The metrics label of a request, and whether it is a chat (`None`: not a completion).
fn endpoint_of_request(headers: &HeaderMap) -> (&'static str, Option<bool>) {
    let path = headers.get("x-pseudo-path").and_then(|v| v.to_str().ok()).unwrap_or("");
    match path.split('?').next().unwrap_or("") {
        "/v1/completions" => ("/v1/completions", Some(false)),
        "/v1/chat/completions" => ("/v1/chat/completions", Some(true)),
        _ => ("other", None),
    }
}

/// A header the gateway sets, replacing any value it had.
fn overwrite(key: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(PbHeader { key: key.into(), raw_value: value.to_vec(), ..Default::default() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse { body, end_of_stream, ..Default::default() })),
        }),
        ..Default::default()
    }
}

/// An ext_proc header list as an `http::HeaderMap` (values from `raw_value`, or `value`); the
/// pseudo-headers HTTP/1 has no names for are kept as `x-pseudo-path`, `x-pseudo-status`, ...
fn header_map(h: &HttpHeaders) -> HeaderMap {
    let mut out = HeaderMap::new();
    for hv in h.headers.iter().flat_map(|m| m.headers.iter()) {
        let value = if hv.raw_value.is_empty() { hv.value.as_bytes() } else { &hv.raw_value };
        let key = hv.key.to_ascii_lowercase();
        let key = match key.strip_prefix(':') {
            Some(pseudo) => format!("x-pseudo-{pseudo}"),
            None => key,
        };
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_bytes(value)) {
            out.append(k, v);
        }
    }
    out
}

fn string_value(s: &str) -> PbValue {
    PbValue { kind: Some(Kind::StringValue(s.to_string())) }
}

fn struct_value<I: IntoIterator<Item = (String, PbValue)>>(fields: I) -> PbValue {
    PbValue { kind: Some(Kind::StructValue(Struct { fields: fields.into_iter().collect() })) }
}

/// A metadata value as endpoint strings: a list of strings, or one comma-separated string.
fn endpoints(v: &PbValue) -> Vec<String> {
    match &v.kind {
        Some(Kind::StringValue(s)) => s.split(',').map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect(),
        Some(Kind::ListValue(ListValue { values })) => values.iter().flat_map(endpoints).collect(),
        _ => Vec::new(),
    }
}

/// The gateway's subset hint: `filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`.
fn subset_hint(meta: Option<&Metadata>) -> Option<Vec<String>> {
    let v = meta?.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET)?;
    Some(endpoints(v))
}

/// The endpoint the gateway reports as served: `filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]`.
fn served_endpoint(meta: Option<&Metadata>) -> Option<String> {
    let v = meta?.filter_metadata.get(LB_NAMESPACE)?.fields.get(SERVED)?;
    endpoints(v).into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_of_urls() {
        assert_eq!(endpoint_of("http://10.0.0.1:8000").as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(endpoint_of("http://Engine.local").as_deref(), Some("engine.local:80"));
        assert_eq!(endpoint_of("https://10.0.0.2").as_deref(), Some("10.0.0.2:443"));
        assert_eq!(endpoint_of("http://[::1]:8001").as_deref(), Some("[::1]:8001"));
    }

    #[test]
    fn subset_hint_reads_lists_and_comma_strings() {
        let mut m = Metadata::default();
        let list = PbValue { kind: Some(Kind::ListValue(ListValue { values: vec![string_value("a:1"), string_value("b:2")] })) };
        m.filter_metadata.insert(SUBSET_NAMESPACE.into(), Struct { fields: [(SUBSET.to_string(), list)].into_iter().collect() });
        assert_eq!(subset_hint(Some(&m)), Some(vec!["a:1".to_string(), "b:2".to_string()]));
        m.filter_metadata
            .insert(SUBSET_NAMESPACE.into(), Struct { fields: [(SUBSET.to_string(), string_value("a:1, c:3"))].into_iter().collect() });
        assert_eq!(subset_hint(Some(&m)), Some(vec!["a:1".to_string(), "c:3".to_string()]));
        // Present but empty: an empty subset (a 503), not "no hint".
        m.filter_metadata
            .insert(SUBSET_NAMESPACE.into(), Struct { fields: [(SUBSET.to_string(), string_value(""))].into_iter().collect() });
        assert_eq!(subset_hint(Some(&m)), Some(vec![]));
        assert_eq!(subset_hint(None), None);
        m.filter_metadata.insert(LB_NAMESPACE.into(), Struct { fields: [(SERVED.to_string(), string_value("b:2"))].into_iter().collect() });
        assert_eq!(served_endpoint(Some(&m)).as_deref(), Some("b:2"));
    }
}
