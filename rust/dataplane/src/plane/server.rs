//! The HTTP/1.1 server: connections, admission of a request (limits, body), the plane's own
//! endpoints (`/v1/models`, `/health`, `/metrics`) and the admin API passed to the owner.

use super::*;

pub(super) async fn serve(sh: Arc<Shared>, listener: std::net::TcpListener, mut stop: oneshot::Receiver<()>) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kvroute data plane: cannot register the listener: {e}");
            return;
        }
    };
    if let Some(approx) = &sh.approx {
        let sh2 = sh.clone();
        let period = (approx.ttl() / 4).min(Duration::from_secs(5));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tick.tick().await;
                if let Some(a) = &sh2.approx {
                    a.expire(a.now());
                }
            }
        });
    }
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    tokio::spawn(connection(sh.clone(), stream, peer));
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }
}

pub(super) async fn connection(sh: Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let ip: Arc<str> = peer.ip().to_string().into();
    let sh_timeout = sh.cfg.client_timeout;
    let svc = service_fn(move |req| {
        let sh = sh.clone();
        let ip = ip.clone();
        async move { Ok::<_, Infallible>(handle(sh, ip, req).await) }
    });
    let _ = http1::Builder::new()
        .title_case_headers(true)
        .timer(TokioTimer::new())
        .header_read_timeout(sh_timeout)
        .serve_connection(TokioIo::new(stream), svc)
        .await;
}

pub(super) fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    }
}

/// An error answer decided before any upstream work (limits, unreadable body).
pub(super) struct Reject {
    pub(super) status: u16,
    pub(super) message: String,
    pub(super) kind: &'static str,
    pub(super) retry_after: Option<u64>,
}

impl Reject {
    pub(super) fn response(self) -> Response<PlaneBody> {
        error(self.status, &self.message, self.kind, self.retry_after)
    }
}

/// The OpenAI-style JSON error shape.
pub(super) fn error(status: u16, message: &str, kind: &str, retry_after: Option<u64>) -> Response<PlaneBody> {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}});
    let mut r = Response::new(PlaneBody::full(Bytes::from(body.to_string())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    if let Some(s) = retry_after {
        r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

pub(super) async fn handle(sh: Arc<Shared>, ip: Arc<str>, req: Request<Incoming>) -> Response<PlaneBody> {
    let path = req.uri().path();
    let (endpoint, chat) = match path {
        "/v1/completions" => ("/v1/completions", false),
        "/v1/chat/completions" => ("/v1/chat/completions", true),
        _ => return other(&sh, req).await,
    };
    if req.method() != Method::POST {
        return error(405, &format!("{path} takes POST"), "invalid_request_error", None);
    }
    let key = client_key(&sh, req.headers(), &ip);
    let adm = match Admission::take(&sh, key, endpoint) {
        Ok(a) => a,
        Err(reject) => {
            sh.metrics.request(endpoint, "4xx");
            return reject.response();
        }
    };
    let (parts, body) = req.into_parts();
    let raw = match read_body(&sh, &parts.headers, body).await {
        Ok(raw) => raw,
        Err(reject) => return adm.respond(reject.response()),
    };
    let value = match serde_json::from_slice::<Value>(&raw) {
        Ok(v) => v,
        Err(e) => return adm.respond(error(400, &format!("request body is not valid JSON: {e}"), "invalid_request_error", None)),
    };
    let t0 = Instant::now();
    let stream = value.get("stream").is_some_and(py_truthy);
    match sh.routed_prompt(&value, chat).await {
        Ok(r) => {
            let call = Call { sh: &sh, endpoint, headers: &parts.headers, raw: &raw, stream, pool: r.pool.as_deref(), exact: r.exact };
            serve_hot(&call, &r.prompt, t0, adm).await
        }
        Err(Unroutable::UnknownModel(model)) => adm.respond(model_not_found(&model)),
        Err(Unroutable::Bad(BadRequest(msg))) => adm.respond(error(400, &msg, "invalid_request_error", None)),
    }
}

/// A completion body's prompt as the plane routes it, and the workers it may go to.
pub(super) struct Routed {
    pub(super) prompt: ApproxPrompt,
    /// The prompt is the engine's tokens (exact mode), not approximate hashes.
    pub(super) exact: bool,
    /// The workers serving the body's model (`None`: any).
    pub(super) pool: Option<Vec<WorkerId>>,
}

/// Why a valid JSON body has no prompt to route on.
pub(super) enum Unroutable {
    /// No worker serves its model (the engines' 404).
    UnknownModel(String),
    /// The client's 400.
    Bad(BadRequest),
}

/// Every request but completions: the plane's own endpoints, and the admin API passed to its owner.
pub(super) async fn other(sh: &Arc<Shared>, req: Request<Incoming>) -> Response<PlaneBody> {
    let path = req.uri().path();
    if path == "/admin" || path.starts_with("/admin/") {
        let admin = sh.admin_base.read().clone();
        let Some(base) = admin else {
            return error(403, "the admin API is disabled: start the gateway with --admin-token", "permission_denied", None);
        };
        let (parts, body) = req.into_parts();
        return match read_body(sh, &parts.headers, body).await {
            Ok(raw) => forward(sh, &base, parts, raw).await,
            Err(reject) => reject.response(),
        };
    }
    let get = req.method() == Method::GET;
    match path {
        "/v1/models" if get => models(sh, req.headers()).await,
        "/health" if get => sh.health(),
        "/metrics" if get => {
            let mut r = Response::new(PlaneBody::full(Bytes::from(sh.metrics_text())));
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
            r
        }
        "/v1/models" | "/health" | "/metrics" => error(405, &format!("{path} takes GET"), "invalid_request_error", None),
        _ => error(404, &format!("no such endpoint: {path}"), "not_found", None),
    }
}

/// The engines' own answer to a model no worker serves (vLLM's OpenAI-style 404).
pub(super) fn model_not_found(model: &str) -> Response<PlaneBody> {
    let body = serde_json::json!({"error": {
        "message": format!("The model `{model}` does not exist."), "type": "NotFoundError", "param": "model", "code": 404}});
    json_response(404, &body)
}

/// `/v1/models`: the union of the models the healthy workers serve, once their lists are known
/// (`DataPlane::set_worker_models`); before that, the first healthy worker's own answer (not a PD
/// prefill's), else the configured names, else 503.
pub(super) async fn models(sh: &Shared, headers: &HeaderMap) -> Response<PlaneBody> {
    if let Some(data) = sh.models_union() {
        return json_response(200, &serde_json::json!({"object": "list", "data": data}));
    }
    let mut workers: Vec<Arc<Worker>> =
        sh.workers.read().values().filter(|w| w.role != Role::Prefill && w.healthy.load(Ordering::SeqCst)).cloned().collect();
    workers.sort_by_key(|w| w.id);
    for w in workers {
        let mut b = Request::get(format!("{}/v1/models", w.url));
        for name in FORWARD {
            if let Some(v) = headers.get(name) {
                b = b.header(name, v.clone());
            }
        }
        let Ok(req) = b.body(Full::new(Bytes::new())) else { continue };
        let got = tokio::time::timeout(sh.cfg.health_timeout, async {
            let resp = sh.client.request(req).await.ok()?;
            if resp.status() != StatusCode::OK {
                return None;
            }
            resp.into_body().collect().await.ok().map(|c| c.to_bytes())
        })
        .await;
        if let Ok(Some(body)) = got {
            let mut r = Response::new(PlaneBody::full(body));
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            return r;
        }
    }
    if sh.cfg.models.is_empty() {
        return error(503, "no worker answered /v1/models", "service_unavailable", None);
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let data: Vec<Value> =
        sh.cfg.models.iter().map(|m| serde_json::json!({"id": m, "object": "model", "created": now, "owned_by": "kvroute"})).collect();
    json_response(200, &serde_json::json!({"object": "list", "data": data}))
}

pub(super) fn json_response(status: u16, body: &Value) -> Response<PlaneBody> {
    let mut r = Response::new(PlaneBody::full(Bytes::from(body.to_string())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    r
}

pub(super) fn client_key(sh: &Shared, headers: &HeaderMap, ip: &str) -> String {
    if let Some(h) = &sh.cfg.client_key_header {
        if let Some(v) = headers.get(h.as_str()) {
            if !v.is_empty() {
                return format!("h:{}", String::from_utf8_lossy(v.as_bytes()));
            }
        }
    }
    format!("ip:{ip}")
}

pub(super) async fn read_body(sh: &Shared, headers: &HeaderMap, body: Incoming) -> Result<Bytes, Reject> {
    let limit = sh.cfg.max_body_bytes;
    let too_large = || Reject {
        status: 413,
        message: format!("request body larger than {limit} bytes"),
        kind: "invalid_request_error",
        retry_after: None,
    };
    let declared = headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let timeout = sh.cfg.client_timeout;
    let Ok(collected) = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await else {
        return Err(Reject {
            status: 408,
            message: format!("request body not received within {} s", timeout.as_secs_f64()),
            kind: "invalid_request_error",
            retry_after: None,
        });
    };
    match collected {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(Reject {
            status: 400,
            message: format!("cannot read the request body: {e}"),
            kind: "invalid_request_error",
            retry_after: None,
        }),
    }
}

/// Passes an admin request to the owner's admin API and its answer back.
pub(super) async fn forward(sh: &Arc<Shared>, base: &str, parts: http::request::Parts, raw: Bytes) -> Response<PlaneBody> {
    let target = parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut b = Request::builder().method(parts.method).uri(format!("{base}{target}"));
    for (k, v) in &parts.headers {
        let name = k.as_str();
        if !HOP_BY_HOP.contains(&name) && name != "content-length" {
            b = b.header(k, v);
        }
    }
    let req = match b.body(Full::new(raw)) {
        Ok(r) => r,
        Err(e) => return error(400, &format!("cannot pass on this request: {e}"), "invalid_request_error", None),
    };
    match sh.client.request(req).await {
        Err(e) => error(502, &format!("the gateway's admin API is unavailable: {}", chain(&e)), "upstream_error", None),
        Ok(resp) => {
            let (mut p, body) = resp.into_parts();
            for h in HOP_BY_HOP {
                p.headers.remove(h);
            }
            let mut out = PlaneBody::full(Bytes::new());
            out.upstream = Some(body);
            Response::from_parts(p, out)
        }
    }
}

/// The workers a request may go to, from its `model`.
pub(super) enum Pool {
    /// No model lists are known, or the body names no model: any worker.
    Any,
    /// The workers serving the model (and those whose lists are not known yet), and the LoRA
    /// adapter the model names, when it is one.
    Of(Vec<WorkerId>, Option<String>),
    /// No worker serves it.
    Unknown(String),
}

/// One model a worker serves, as its `/v1/models` lists it.
#[derive(Clone, Debug)]
pub struct ServedModel {
    pub id: String,
    /// A LoRA adapter (vLLM lists one with its base model as `parent`).
    pub adapter: bool,
    /// The engine's own entry, for the gateway's `/v1/models`.
    pub entry: Value,
}

impl ServedModel {
    /// The entries of a `/v1/models` answer (`{"data": [{"id": ..., "parent": ...}, ...]}`).
    pub fn parse_list(body: &Value) -> Result<Vec<ServedModel>, String> {
        let data = body.get("data").and_then(Value::as_array).ok_or("a /v1/models answer needs a 'data' list")?;
        data.iter()
            .map(|e| {
                let id = e.get("id").and_then(Value::as_str).ok_or("each /v1/models entry needs a string 'id'")?;
                let adapter = e.get("parent").is_some_and(|p| p.is_string());
                Ok(ServedModel { id: id.to_string(), adapter, entry: e.clone() })
            })
            .collect()
    }
}

impl Shared {
    /// The pool of a request naming `model`.
    pub(super) fn pool(&self, model: Option<&Value>) -> Pool {
        let models = self.models.read();
        let Some(Value::String(m)) = model else { return Pool::Any };
        if models.is_empty() {
            return Pool::Any;
        }
        let mut ws = Vec::new();
        let mut lora = None;
        for (w, list) in models.iter() {
            if let Some(e) = list.iter().find(|e| e.id == *m) {
                ws.push(*w);
                if e.adapter {
                    lora = Some(m.clone());
                }
            }
        }
        // A worker whose list is not known yet may serve it: only a model no worker may serve is unknown.
        ws.extend(self.workers.read().keys().filter(|w| !models.contains_key(w)));
        if ws.is_empty() {
            return Pool::Unknown(m.clone());
        }
        Pool::Of(ws, lora)
    }

    /// The union of the healthy workers' model lists (first entry per id), `None` when none is known.
    pub(super) fn models_union(&self) -> Option<Vec<Value>> {
        let models = self.models.read();
        let workers = self.workers.read();
        let mut ids: Vec<WorkerId> =
            models.keys().copied().filter(|w| workers.get(w).is_some_and(|w| w.healthy.load(Ordering::SeqCst))).collect();
        if ids.is_empty() {
            return None;
        }
        ids.sort_unstable();
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for w in ids {
            for e in &models[&w] {
                if seen.insert(e.id.clone()) {
                    out.push(e.entry.clone());
                }
            }
        }
        Some(out)
    }

    /// The prompt a completion body routes on (exact, or approximate when not configured or not
    /// reproducible exactly), keyed by the LoRA adapter its model names, and its model's pool: the
    /// HTTP hot path's and the endpoint picker's one derivation.
    pub(super) async fn routed_prompt(&self, value: &Value, chat: bool) -> Result<Routed, Unroutable> {
        let (pool, lora) = match self.pool(value.get("model")) {
            Pool::Any => (None, None),
            Pool::Of(workers, lora) => (Some(workers), lora),
            Pool::Unknown(model) => return Err(Unroutable::UnknownModel(model)),
        };
        let lora = lora.as_deref();
        let prompt = match &self.exact {
            // A valid body the exact prompter cannot reproduce routes on its approximate hashes.
            Some(exact) => exact.prompt_async(value, chat, lora).await.and_then(|p| exact.or_approx(value, chat, p, lora)),
            None => approx_prompt(value, chat, self.block_size, self.seed, lora).map(|p| (p, false)),
        };
        let (prompt, exact) = prompt.map_err(Unroutable::Bad)?;
        Ok(Routed { prompt, exact, pool })
    }

    pub(super) fn worker(&self, id: WorkerId) -> Option<Arc<Worker>> {
        self.workers.read().get(&id).cloned()
    }

    /// Every worker's row with what its engine last reported into `Router.observe` (none while
    /// it is out of routing).
    pub(super) fn rows(&self) -> Vec<(WorkerRow, Option<kvroute_core::router::load::Observed>)> {
        let mut ws: Vec<Arc<Worker>> = self.workers.read().values().cloned().collect();
        ws.sort_by_key(|w| w.id);
        ws.iter().map(|w| (w.row(), self.router.load(w.id).ok().map(|l| l.observed))).collect()
    }

    pub(super) fn metrics_text(&self) -> String {
        let mut out = render_metrics(&self.metrics.snapshot(), &self.rows());
        crate::metrics::render_check(&mut out, &self.check.snapshot());
        if let Some(r) = self.exact.as_ref().and_then(|e| e.prefix_reuse()) {
            crate::metrics::render_reuse(&mut out, &r);
        }
        out
    }

    /// `/health`: 200 while a complete serving path is healthy (a unified worker, or a prefill and
    /// a decode worker), else 503; the body lists every worker's state.
    pub(super) fn health(&self) -> Response<PlaneBody> {
        let rows = self.rows();
        let healthy = |role: Role| rows.iter().any(|(r, _)| r.healthy && r.role == role);
        let ok = healthy(Role::Both) || (healthy(Role::Prefill) && healthy(Role::Decode));
        let workers: Vec<Value> = rows
            .iter()
            .map(|(r, o)| {
                serde_json::json!({
                    "id": r.id, "url": r.url, "role": r.role.name(), "healthy": r.healthy, "in_flight": r.in_flight,
                    "requests": r.served, "bootstrap_port": r.bootstrap_port,
                    "observed_waiting": o.and_then(|o| o.waiting), "observed_running": o.and_then(|o| o.running),
                    "observed_kv_usage": o.and_then(|o| o.kv_usage),
                })
            })
            .collect();
        json_response(if ok { 200 } else { 503 }, &serde_json::json!({"status": if ok { "ok" } else { "unavailable" }, "workers": workers}))
    }

    /// Why no worker could take a request: what is registered, and why each is out of routing.
    pub(super) fn no_worker_detail(&self) -> String {
        let mut ws: Vec<Arc<Worker>> = self.workers.read().values().cloned().collect();
        if ws.is_empty() {
            return "no worker is registered".into();
        }
        ws.sort_by_key(|w| w.id);
        let states: Vec<String> = ws
            .iter()
            .map(|w| match (w.healthy.load(Ordering::SeqCst), w.down_reason.lock().clone()) {
                (true, _) => format!("{} healthy", w.url),
                (false, Some(why)) => format!("{} unhealthy: {why}", w.url),
                (false, None) => format!("{} unhealthy", w.url),
            })
            .collect();
        let healthy = ws.iter().filter(|w| w.healthy.load(Ordering::SeqCst)).count();
        format!("{} registered, {healthy} healthy ({})", ws.len(), states.join("; "))
    }

    /// Takes a failed worker out of routing (once) and tells the owner, who probes it back.
    pub(super) fn mark_unhealthy(&self, w: &Worker, reason: &str) {
        *w.down_reason.lock() = Some(reason.to_string());
        self.metrics.upstream_error(&w.url);
        let known = self.workers.read().contains_key(&w.id);
        if known && w.healthy.swap(false, Ordering::SeqCst) {
            w.mark_down();
            let _ = self.router.remove_worker(w.id);
            if let Some(a) = &self.approx {
                a.drop_worker(w.id);
            }
            if let Some(hook) = &self.on_unhealthy {
                hook(w.id, reason);
            }
        }
    }
}
