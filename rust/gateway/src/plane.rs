//! The data plane's server: admission limits, the hot path (hash, route, relay with load accounting
//! and retries), `/v1/models`, `/health`, `/metrics`, and the admin API passed to its owner.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use kvroute_core::router::decision::Path as RoutePath;
use kvroute_core::router::Role;
use kvroute_core::{RouteRequest, Router, RouterError, WorkerId};
use parking_lot::{Mutex, RwLock};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Sleep;

use crate::approx::ApproxCache;
use crate::exact::{ExactError, ExactPrompter};
use crate::metrics::{render_metrics, Metrics, MetricsSnapshot};
use crate::prompt::{approx_prompt, py_truthy, ApproxPrompt, BadRequest};

#[path = "pd.rs"]
pub mod pd;
use pd::{PdConvention, PdHold};

/// Request ids of the data plane's routes have the top bit set, so they never collide with ids a
/// library user routes by hand on the same Router (a counter from 1, as in the examples).
pub const REQUEST_ID_BASE: u64 = 1 << 63;

/// Client headers the engines may need (API key, request id, trace context): Python's `_FORWARD`.
const FORWARD: [&str; 3] = ["authorization", "x-request-id", "traceparent"];
/// Connection-level headers a proxy must not pass on.
const HOP_BY_HOP: [&str; 8] =
    ["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate"];

/// How the data plane behaves; the Python side fills it from its GatewayConfig.
#[derive(Clone, Debug)]
pub struct PlaneConfig {
    /// How prefill and decode workers are paired (`GatewayConfig.pd_convention`).
    pub pd_convention: PdConvention,
    /// Exact mode: the engines' tokenizer.json (or its directory); `None`: approximate prompts.
    pub tokenizer: Option<std::path::PathBuf>,
    pub max_body_bytes: usize,
    pub max_client_concurrency: usize,
    pub max_in_flight: usize,
    /// Trust this header as the client's identity (else its IP address).
    pub client_key_header: Option<String>,
    pub max_retries: u32,
    pub connect_timeout: Duration,
    /// Longest upstream silence (response head, then between two chunks).
    pub read_timeout: Duration,
    /// Longest a client may take to send a request's head, and again its body: a client that
    /// opens connections and trickles bytes is cut off instead of holding them forever.
    pub client_timeout: Duration,
    /// Insert routed prompts into the index for this long (approximate mode); `None`: never.
    pub approx_ttl: Option<Duration>,
    /// Runtime threads: 1 runs a current-thread runtime on one dedicated thread.
    pub threads: usize,
    /// `/v1/models` answers with these when no worker answers it.
    pub models: Vec<String>,
    /// Longest wait for a worker's `/v1/models`.
    pub health_timeout: Duration,
    /// Extra PEM certificates trusted for `https://` workers (beside the system's roots).
    pub ca_file: Option<std::path::PathBuf>,
}

/// Called (off the hot path) when the data plane marks a worker unhealthy, so its owner probes it back.
pub type UnhealthyHook = Box<dyn Fn(WorkerId, &str) + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum PlaneError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("cannot start the data plane's runtime: {0}")]
    Runtime(io::Error),
    #[error("invalid data plane config: {0}")]
    Config(String),
    #[error("worker url {0:?} is not supported: expected http(s)://host[:port][/prefix]")]
    WorkerUrl(String),
    #[error("worker {0} is already registered with the data plane")]
    DuplicateWorker(WorkerId),
    #[error(transparent)]
    Exact(#[from] ExactError),
    #[error("cannot set up TLS for https workers: {0}")]
    Tls(String),
}

/// One worker as the data plane sees it.
#[derive(Clone, Debug)]
pub struct WorkerRow {
    pub id: WorkerId,
    pub url: String,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    pub healthy: bool,
    pub in_flight: i64,
    pub served: u64,
}

struct Worker {
    id: WorkerId,
    url: String,
    role: Role,
    /// The URL's host, SGLang's `bootstrap_host` when this worker prefills.
    host: String,
    /// SGLang PD prefill servers' `--disaggregation-bootstrap-port`.
    bootstrap_port: Option<u16>,
    healthy: AtomicBool,
    in_flight: AtomicI64,
    served: AtomicU64,
    /// Bumped each time the worker is marked unhealthy: its requests in flight end at once (a
    /// SIGTERMed vLLM aborts its engine but holds its open streams silent until it exits).
    down: watch::Sender<u64>,
}

impl Worker {
    /// What the control plane and `/health` see of this worker now.
    fn row(&self) -> WorkerRow {
        WorkerRow {
            id: self.id,
            url: self.url.clone(),
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            healthy: self.healthy.load(Ordering::SeqCst),
            in_flight: self.in_flight.load(Ordering::SeqCst),
            served: self.served.load(Ordering::SeqCst),
        }
    }

    fn mark_down(&self) {
        self.down.send_modify(|n| *n += 1);
    }

    /// Resolves when the worker is next marked unhealthy.
    fn went_down(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut rx = self.down.subscribe();
        Box::pin(async move {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

type UpstreamClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

struct Shared {
    router: Arc<Router>,
    cfg: PlaneConfig,
    block_size: usize,
    seed: u64,
    workers: RwLock<HashMap<WorkerId, Arc<Worker>>>,
    approx: Option<ApproxCache>,
    exact: Option<Arc<ExactPrompter>>,
    metrics: Metrics,
    clients: Mutex<HashMap<String, usize>>,
    in_flight: AtomicUsize,
    next_rid: AtomicU64,
    client: UpstreamClient,
    /// Where `/admin` requests go (the owner's admin API on loopback); `None`: the admin API is off.
    admin_base: RwLock<Option<String>>,
    on_unhealthy: Option<UnhealthyHook>,
}

/// The data plane: configure and register workers, then `start` serves on a runtime thread of its
/// own until `stop` (or drop). Every method takes `&self`; none blocks on the serving thread but `stop`.
pub struct DataPlane {
    shared: Arc<Shared>,
    control: Mutex<Control>,
}

#[derive(Default)]
struct Control {
    local_addr: Option<SocketAddr>,
    stop_tx: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl DataPlane {
    pub fn new(router: Arc<Router>, cfg: PlaneConfig, on_unhealthy: Option<UnhealthyHook>) -> Result<Self, PlaneError> {
        if cfg.max_body_bytes == 0 || cfg.max_client_concurrency == 0 || cfg.max_in_flight == 0 {
            return Err(PlaneError::Config("max_body_bytes, max_client_concurrency and max_in_flight must be >= 1".into()));
        }
        if cfg.read_timeout.is_zero()
            || cfg.connect_timeout.is_zero()
            || cfg.client_timeout.is_zero()
            || cfg.approx_ttl.is_some_and(|t| t.is_zero())
        {
            return Err(PlaneError::Config("timeouts and approx_ttl must be > 0 seconds".into()));
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        connector.set_connect_timeout(Some(cfg.connect_timeout));
        let tls = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(cfg.ca_file.as_deref())?)
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).build(tls);
        let rc = router.config();
        let exact = match &cfg.tokenizer {
            Some(path) => Some(Arc::new(ExactPrompter::load(path, rc.block_size, rc.hash_seed)?)),
            None => None,
        };
        let shared = Arc::new(Shared {
            block_size: rc.block_size,
            seed: rc.hash_seed,
            approx: cfg.approx_ttl.map(|ttl| ApproxCache::new(router.index().clone(), ttl)),
            exact,
            router: router.clone(),
            admin_base: RwLock::new(None),
            cfg,
            workers: RwLock::new(HashMap::new()),
            metrics: Metrics::default(),
            clients: Mutex::new(HashMap::new()),
            in_flight: AtomicUsize::new(0),
            next_rid: AtomicU64::new(1),
            client,
            on_unhealthy,
        });
        Ok(DataPlane { shared, control: Mutex::new(Control::default()) })
    }

    /// Binds `listen` (errors here, synchronously) and serves on a runtime thread; `/admin`
    /// requests go to `admin` (the owner's admin API, on loopback), or get 403 without one.
    pub fn start(&self, listen: SocketAddr, admin: Option<SocketAddr>) -> Result<SocketAddr, PlaneError> {
        let mut ctl = self.control.lock();
        if ctl.thread.is_some() {
            return Err(PlaneError::Config("the data plane is already running".into()));
        }
        *self.shared.admin_base.write() = admin.map(|a| format!("http://{a}"));
        let listener = std::net::TcpListener::bind(listen).map_err(|source| PlaneError::Bind { addr: listen, source })?;
        listener.set_nonblocking(true).map_err(PlaneError::Runtime)?;
        let local_addr = listener.local_addr().map_err(PlaneError::Runtime)?;
        let mut builder = if self.shared.cfg.threads <= 1 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(self.shared.cfg.threads);
            b
        };
        let rt = builder.enable_all().thread_name("kvroute-dataplane").build().map_err(PlaneError::Runtime)?;
        let (stop_tx, stop_rx) = oneshot::channel();
        let sh = self.shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvroute-dataplane".into())
            .spawn(move || {
                rt.block_on(serve(sh, listener, stop_rx));
                // In-flight requests are dropped here, which releases their load (leases cancel or finish).
                rt.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(PlaneError::Runtime)?;
        *ctl = Control { local_addr: Some(local_addr), stop_tx: Some(stop_tx), thread: Some(thread) };
        Ok(local_addr)
    }

    /// Stops accepting, drops in-flight requests (their load is released) and joins the runtime
    /// thread; a no-op when not running.
    pub fn stop(&self) {
        let (tx, thread) = {
            let mut ctl = self.control.lock();
            (ctl.stop_tx.take(), ctl.thread.take())
        };
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// The bound address while running (or after a stop).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.control.lock().local_addr
    }

    /// Registers a worker its owner registered with the Router (same id and role);
    /// `bootstrap_port`: an SGLang PD prefill server's.
    pub fn add_worker(&self, id: WorkerId, url: &str, role: Role, bootstrap_port: Option<u16>) -> Result<(), PlaneError> {
        let base = url.trim_end_matches('/');
        let rest =
            base.strip_prefix("http://").or_else(|| base.strip_prefix("https://")).ok_or_else(|| PlaneError::WorkerUrl(url.to_string()))?;
        if rest.is_empty() || rest.starts_with('/') || base.parse::<http::Uri>().is_err() {
            return Err(PlaneError::WorkerUrl(url.to_string()));
        }
        let host = pd::url_host(base).ok_or_else(|| PlaneError::WorkerUrl(url.to_string()))?;
        if bootstrap_port == Some(0) {
            return Err(PlaneError::Config(format!("worker {id}: bootstrap_port must be a TCP port (1..65535), got 0")));
        }
        let mut ws = self.shared.workers.write();
        if ws.contains_key(&id) {
            return Err(PlaneError::DuplicateWorker(id));
        }
        let w = Worker {
            id,
            url: base.to_string(),
            role,
            host,
            bootstrap_port,
            healthy: AtomicBool::new(true),
            in_flight: AtomicI64::new(0),
            served: AtomicU64::new(0),
            down: watch::channel(0).0,
        };
        ws.insert(id, Arc::new(w));
        Ok(())
    }

    /// Forgets a worker (requests in flight on it finish normally); false when unknown.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        self.shared.workers.write().remove(&id).is_some()
    }

    /// Takes a worker out of routing as a failed dispatch does (the owner's health probe failed):
    /// removed from the Router, its approximate blocks dropped, its streams in flight ended, the
    /// owner told through the unhealthy hook. False when unknown or already unhealthy.
    pub fn mark_unhealthy(&self, id: WorkerId, reason: &str) -> bool {
        let Some(w) = self.shared.worker(id) else { return false };
        let was = w.healthy.load(Ordering::SeqCst);
        self.shared.mark_unhealthy(&w, reason);
        was
    }

    /// The owner's view of a worker's health (it marked it down, or its probe brought it back).
    pub fn set_healthy(&self, id: WorkerId, healthy: bool) -> bool {
        match self.shared.workers.read().get(&id) {
            Some(w) => {
                if w.healthy.swap(healthy, Ordering::SeqCst) && !healthy {
                    w.mark_down();
                }
                true
            }
            None => false,
        }
    }

    pub fn workers(&self) -> Vec<WorkerRow> {
        let mut rows: Vec<WorkerRow> = self.shared.workers.read().values().map(|w| w.row()).collect();
        rows.sort_by_key(|r| r.id);
        rows
    }

    pub fn approx(&self) -> Option<&ApproxCache> {
        self.shared.approx.as_ref()
    }

    /// Exact mode's prompter, when the plane was configured with a tokenizer.
    pub fn exact(&self) -> Option<&ExactPrompter> {
        self.shared.exact.as_deref()
    }

    /// The prompt the hot path routes this body on (exact, or approximate when not configured or
    /// not reproducible exactly), or the 400 an invalid body gets.
    pub fn prompt(&self, body: &Value, chat: bool) -> Result<ApproxPrompt, BadRequest> {
        let sh = &self.shared;
        match &sh.exact {
            Some(exact) => exact.routed_prompt(body, chat).map(|(p, _)| p),
            None => approx_prompt(body, chat, sh.block_size, sh.seed),
        }
    }

    /// The Prometheus exposition `/metrics` serves.
    pub fn metrics_text(&self) -> String {
        self.shared.metrics_text()
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// Requests this plane holds admission slots for.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Clients with requests in flight.
    pub fn active_clients(&self) -> usize {
        self.shared.clients.lock().len()
    }

    pub fn is_running(&self) -> bool {
        self.control.lock().thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(sh: Arc<Shared>, listener: std::net::TcpListener, mut stop: oneshot::Receiver<()>) {
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

async fn connection(sh: Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
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

fn status_class(status: StatusCode) -> &'static str {
    match status.as_u16() / 100 {
        1 => "1xx",
        2 => "2xx",
        3 => "3xx",
        4 => "4xx",
        _ => "5xx",
    }
}

/// An error answer decided before any upstream work (limits, unreadable body).
struct Reject {
    status: u16,
    message: String,
    kind: &'static str,
    retry_after: Option<u64>,
}

impl Reject {
    fn response(self) -> Response<PlaneBody> {
        error(self.status, &self.message, self.kind, self.retry_after)
    }
}

/// The OpenAI-style JSON error shape.
fn error(status: u16, message: &str, kind: &str, retry_after: Option<u64>) -> Response<PlaneBody> {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}});
    let mut r = Response::new(PlaneBody::full(Bytes::from(body.to_string())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    if let Some(s) = retry_after {
        r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

async fn handle(sh: Arc<Shared>, ip: Arc<str>, req: Request<Incoming>) -> Response<PlaneBody> {
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
    let prompt = match &sh.exact {
        // A valid body the exact prompter cannot reproduce routes on its approximate hashes.
        Some(exact) => exact.prompt_async(&value, chat).await.and_then(|p| exact.or_approx(&value, chat, p)).map(|(p, _)| p),
        None => approx_prompt(&value, chat, sh.block_size, sh.seed),
    };
    match prompt {
        Ok(prompt) => {
            let call = Call { sh: &sh, endpoint, headers: &parts.headers, raw: &raw, stream };
            serve_hot(&call, &prompt, t0, adm).await
        }
        Err(BadRequest(msg)) => adm.respond(error(400, &msg, "invalid_request_error", None)),
    }
}

/// Every request but completions: the plane's own endpoints, and the admin API passed to its owner.
async fn other(sh: &Arc<Shared>, req: Request<Incoming>) -> Response<PlaneBody> {
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

/// `/v1/models`: the first healthy worker's that serves requests (not a PD prefill), else the
/// configured names, else 503.
async fn models(sh: &Shared, headers: &HeaderMap) -> Response<PlaneBody> {
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

fn json_response(status: u16, body: &Value) -> Response<PlaneBody> {
    let mut r = Response::new(PlaneBody::full(Bytes::from(body.to_string())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    r
}

/// The TLS set-up for `https://` workers: the system's roots plus `ca_file`'s certificates.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, PlaneError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    // Unreadable system certificates only matter for https workers, which then fail to connect (and say why).
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| PlaneError::Tls(format!("cannot read {}: {e}", path.display())))?
            .collect::<Result<_, _>>()
            .map_err(|e| PlaneError::Tls(format!("{}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(PlaneError::Tls(format!("{} holds no PEM certificate", path.display())));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| PlaneError::Tls(format!("{}: {e}", path.display())))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PlaneError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(cfg)
}

fn client_key(sh: &Shared, headers: &HeaderMap, ip: &str) -> String {
    if let Some(h) = &sh.cfg.client_key_header {
        if let Some(v) = headers.get(h.as_str()) {
            if !v.is_empty() {
                return format!("h:{}", String::from_utf8_lossy(v.as_bytes()));
            }
        }
    }
    format!("ip:{ip}")
}

async fn read_body(sh: &Shared, headers: &HeaderMap, body: Incoming) -> Result<Bytes, Reject> {
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

/// One client's slot (per-client and total in-flight limits), held until the response ends.
struct Admission {
    sh: Arc<Shared>,
    client: String,
    endpoint: &'static str,
    /// Status class of the response, counted once its body was fully written.
    class: &'static str,
    completed: bool,
}

impl Admission {
    fn take(sh: &Arc<Shared>, client: String, endpoint: &'static str) -> Result<Admission, Reject> {
        let mut clients = sh.clients.lock();
        let active = clients.get(&client).copied().unwrap_or(0);
        if active >= sh.cfg.max_client_concurrency {
            drop(clients);
            sh.metrics.rejection("client_concurrency");
            let msg = format!("too many concurrent requests from this client (limit {})", sh.cfg.max_client_concurrency);
            return Err(Reject { status: 429, message: msg, kind: "rate_limit_exceeded", retry_after: Some(1) });
        }
        if sh.in_flight.load(Ordering::SeqCst) >= sh.cfg.max_in_flight {
            drop(clients);
            sh.metrics.rejection("gateway_full");
            let msg = format!("gateway at its in-flight limit ({})", sh.cfg.max_in_flight);
            return Err(Reject { status: 429, message: msg, kind: "rate_limit_exceeded", retry_after: Some(1) });
        }
        *clients.entry(client.clone()).or_insert(0) += 1;
        sh.in_flight.fetch_add(1, Ordering::SeqCst);
        drop(clients);
        Ok(Admission { sh: sh.clone(), client, endpoint, class: "5xx", completed: false })
    }

    /// A response produced here: the slot is held until its body is written.
    fn respond(self, mut resp: Response<PlaneBody>) -> Response<PlaneBody> {
        let class = status_class(resp.status());
        resp.body_mut().hold = Some(Hold { adm: Some(self.with_outcome(class)), ..Hold::default() });
        resp
    }

    fn with_outcome(mut self, class: &'static str) -> Admission {
        self.class = class;
        self
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        {
            let mut clients = self.sh.clients.lock();
            if let Some(n) = clients.get_mut(&self.client) {
                *n -= 1;
                if *n == 0 {
                    clients.remove(&self.client);
                }
            }
        }
        self.sh.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.completed {
            self.sh.metrics.request(self.endpoint, self.class);
        } else {
            self.sh.metrics.disconnect(self.endpoint);
        }
    }
}

/// One routed request's load on the Router, released exactly once: `finished` once its first byte
/// (prefill done) was seen, `cancel` otherwise.
struct Lease {
    router: Arc<Router>,
    rid: u64,
    prefilled: bool,
}

impl Lease {
    fn prefill_done(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            let _ = self.router.prefill_done(self.rid, None);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // An unknown request here would be a data plane bug; nothing useful to do on the drop path.
        let _ = if self.prefilled { self.router.finished(self.rid, None) } else { self.router.cancel(self.rid, None) };
    }
}

/// Counts one request dispatched to a worker, in flight until dropped.
struct Dispatch(Arc<Worker>);

impl Dispatch {
    fn new(w: Arc<Worker>) -> Dispatch {
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

impl Shared {
    fn worker(&self, id: WorkerId) -> Option<Arc<Worker>> {
        self.workers.read().get(&id).cloned()
    }

    /// Every worker's row with what its engine last reported into `Router.observe` (none while
    /// it is out of routing).
    fn rows(&self) -> Vec<(WorkerRow, Option<kvroute_core::router::load::Observed>)> {
        let mut ws: Vec<Arc<Worker>> = self.workers.read().values().cloned().collect();
        ws.sort_by_key(|w| w.id);
        ws.iter().map(|w| (w.row(), self.router.load(w.id).ok().map(|l| l.observed))).collect()
    }

    fn metrics_text(&self) -> String {
        render_metrics(&self.metrics.snapshot(), &self.rows())
    }

    /// `/health`: 200 while a complete serving path is healthy (a unified worker, or a prefill and
    /// a decode worker), else 503; the body lists every worker's state.
    fn health(&self) -> Response<PlaneBody> {
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

    /// Takes a failed worker out of routing (once) and tells the owner, who probes it back.
    fn mark_unhealthy(&self, w: &Worker, reason: &str) {
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

/// One hot-path request as every attempt at it sends it upstream.
struct Call<'a> {
    sh: &'a Arc<Shared>,
    endpoint: &'static str,
    headers: &'a HeaderMap,
    raw: &'a Bytes,
    stream: bool,
}

/// An attempt that failed before any byte reached the client, so it may be retried elsewhere.
struct Failure {
    /// The worker to blame (marked unhealthy); `None`: routed to a worker this plane does not know.
    worker: Option<Arc<Worker>>,
    reason: String,
}

impl Failure {
    fn of(w: &Arc<Worker>, reason: String) -> Failure {
        Failure { worker: Some(w.clone()), reason }
    }

    fn unknown(id: WorkerId) -> Failure {
        Failure { worker: None, reason: format!("worker {id} is routed to but unknown to the data plane") }
    }
}

/// An attempt's outcome: the response, or the admission back with what failed.
type Attempted = Result<Response<PlaneBody>, (Admission, Failure)>;

/// What `open` returns: status, content type, the first chunk (the whole body when buffered) and the
/// rest of the stream.
type Opened = (StatusCode, HeaderValue, Bytes, Option<Incoming>);

/// Routes and relays one hot-path request, retrying on the next-best worker while no byte reached
/// the client: unified workers, a PD pair (pd.rs), or a PD decision the decode worker serves alone.
async fn serve_hot(call: &Call<'_>, prompt: &ApproxPrompt, t0: Instant, mut adm: Admission) -> Response<PlaneBody> {
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
            ..Default::default()
        };
        let d = match sh.router.route(&req) {
            Ok(d) => d,
            Err(e @ RouterError::NoWorkers(_)) => {
                let msg = format!("no healthy worker to route to ({e}); last failure: {last_failure}");
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
        let lease = Lease { router: sh.router.clone(), rid, prefilled: false };
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
async fn unified(call: &Call<'_>, worker: WorkerId, mut lease: Lease, adm: Admission) -> Attempted {
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
fn relay(sh: &Arc<Shared>, w: &Arc<Worker>, opened: Opened, mut hold: Hold, adm: Admission) -> Response<PlaneBody> {
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
async fn open(sh: &Shared, w: &Worker, path: &str, headers: &HeaderMap, raw: &Bytes, stream: bool) -> Result<Opened, String> {
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
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Passes an admin request to the owner's admin API and its answer back.
async fn forward(sh: &Arc<Shared>, base: &str, parts: http::request::Parts, raw: Bytes) -> Response<PlaneBody> {
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

/// What a response body keeps alive until it is fully written (or the client goes away).
#[derive(Default)]
struct Hold {
    // Held for their Drop: the lease releases the Router's load, the dispatch the worker's count.
    _lease: Option<Lease>,
    _dispatch: Option<Dispatch>,
    /// A PD request's prefill side.
    _pd: Option<PdHold>,
    adm: Option<Admission>,
}

/// A hot-path stream's upstream, for when it breaks after bytes reached the client.
struct Break {
    sh: Arc<Shared>,
    worker: Arc<Worker>,
}

/// Whether a response is an SSE stream.
fn is_sse(content_type: &HeaderValue) -> bool {
    content_type.as_bytes().starts_with(b"text/event-stream")
}

/// Where an OpenAI SSE stream stands. Its last event is `data: [DONE]`, and before it the last
/// chunk of each choice carries a `finish_reason`: a stream that ends before `[DONE]`, or reaches
/// `[DONE]` with no `finish_reason` (a SIGTERMed vLLM ends its open streams so), was cut short.
/// Both markers are found even when split across frames.
#[derive(Default)]
struct SseEnd {
    /// The last bytes of the stream's last frame holding more than whitespace.
    tail: Vec<u8>,
    /// A chunk with a `finish_reason` has passed.
    finished: bool,
    /// `data: [DONE]` has passed.
    done: bool,
}

impl SseEnd {
    /// Bytes kept between frames: more than either marker and the whitespace around `[DONE]`.
    const KEEP: usize = 32;

    /// Takes the next frame; when it completes `data: [DONE]`, where in the frame that event starts
    /// (0 when it began in an earlier frame).
    fn push(&mut self, d: &[u8]) -> Option<usize> {
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
    first: Option<Bytes>,
    upstream: Option<Incoming>,
    read_timeout: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    on_break: Option<Break>,
    /// An SSE stream's progress towards its `data: [DONE]`.
    sse: Option<SseEnd>,
    /// The relayed worker was marked unhealthy: end the stream now, not at the read timeout.
    down: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    hold: Option<Hold>,
}

impl PlaneBody {
    fn full(data: Bytes) -> PlaneBody {
        PlaneBody { first: Some(data), upstream: None, read_timeout: None, timer: None, on_break: None, sse: None, down: None, hold: None }
    }

    /// The body reached its end: a hold's admission counts as completed, its lease as finished.
    fn finish(&mut self) {
        self.answered();
        self.hold = None;
    }

    /// The client has the whole answer (the body's end, or an SSE stream's final `data: [DONE]`): a
    /// client that closes now completed its request. The `openai` client closes as soon as it reads
    /// `[DONE]`, often before the engine's end of stream reaches the plane.
    fn answered(&mut self) {
        if let Some(adm) = self.hold.as_mut().and_then(|h| h.adm.as_mut()) {
            adm.completed = true;
        }
    }

    /// Relays `d`, first noting whether it ends an SSE stream: with its answer complete, or cut short
    /// (no `finish_reason` before `data: [DONE]`), which the client is told in place of the `[DONE]`.
    fn data(&mut self, d: Bytes) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
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
    fn broke(&mut self, reason: &str) -> Option<Bytes> {
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
fn sse_done(chunk: &[u8]) -> bool {
    let end = chunk.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(0, |i| i + 1);
    chunk[..end].ends_with(b"data: [DONE]")
}

impl Body for PlaneBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
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
                        Ok(d) if !d.is_empty() => return this.data(d),
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
