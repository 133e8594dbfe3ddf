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

mod admission;
mod body;
mod epp;
mod lease;
pub mod pd;
mod relay;
mod server;
mod tls;

use admission::*;
pub use body::PlaneBody;
use body::*;
use lease::*;
use pd::{PdConvention, PdHold};
use relay::*;
pub use server::ServedModel;
use server::*;
use tls::*;

/// Request ids of the data plane's routes have the top bit set, so they never collide with ids a
/// library user routes by hand on the same Router (a counter from 1, as in the examples).
pub const REQUEST_ID_BASE: u64 = 1 << 63;

/// Client headers passed on to the engines (API key, request id, trace context).
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
    /// `host:port` (`[v6]:port`), how the endpoint picker names it to the gateway.
    endpoint: String,
    /// SGLang PD prefill servers' `--disaggregation-bootstrap-port`.
    bootstrap_port: Option<u16>,
    healthy: AtomicBool,
    /// Why it was last taken out of routing (a failed dispatch, a failed probe).
    down_reason: Mutex<Option<String>>,
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
    /// Per worker, the models it serves, once known (`set_worker_models`).
    models: RwLock<HashMap<WorkerId, Vec<ServedModel>>>,
    /// Predicted prefix hits against the engines' reported `cached_tokens`.
    check: kvroute_core::check::PrefixCheck,
    /// The endpoint picker reports not ready (its gateway stops sending it requests) while it drains.
    draining: AtomicBool,
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
    epp_addr: Option<SocketAddr>,
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
            models: RwLock::new(HashMap::new()),
            draining: AtomicBool::new(false),
            check: kvroute_core::check::PrefixCheck::new(kvroute_core::check::DEFAULT_WINDOW, kvroute_core::check::DEFAULT_THRESHOLD)
                .map_err(PlaneError::Config)?,
        });
        Ok(DataPlane { shared, control: Mutex::new(Control::default()) })
    }

    /// Binds `listen` (errors here, synchronously) and serves on a runtime thread; `/admin`
    /// requests go to `admin` (the owner's admin API, on loopback), or get 403 without one.
    pub fn start(&self, listen: SocketAddr, admin: Option<SocketAddr>) -> Result<SocketAddr, PlaneError> {
        self.launch(listen, admin, None).map(|(a, _)| a)
    }

    /// `start`, plus the Gateway API Inference Extension endpoint picker (Envoy's external
    /// processor and gRPC health, src/plane/epp.rs) on `epp`: the HTTP listener then serves
    /// `/metrics`, `/health` and the admin API beside it. Returns both bound addresses.
    pub fn start_picker(
        &self,
        listen: SocketAddr,
        admin: Option<SocketAddr>,
        epp: SocketAddr,
    ) -> Result<(SocketAddr, SocketAddr), PlaneError> {
        if self.shared.workers.read().values().any(|w| w.role != Role::Both) {
            return Err(PlaneError::Config(
                "the endpoint picker routes unified workers; PD (prefill/decode) workers need `kvroute serve`".into(),
            ));
        }
        self.launch(listen, admin, Some(epp)).map(|(a, e)| (a, e.expect("the picker was bound")))
    }

    fn launch(
        &self,
        listen: SocketAddr,
        admin: Option<SocketAddr>,
        epp: Option<SocketAddr>,
    ) -> Result<(SocketAddr, Option<SocketAddr>), PlaneError> {
        let mut ctl = self.control.lock();
        if ctl.thread.is_some() {
            return Err(PlaneError::Config("the data plane is already running".into()));
        }
        *self.shared.admin_base.write() = admin.map(|a| format!("http://{a}"));
        let bind = |addr: SocketAddr| -> Result<(std::net::TcpListener, SocketAddr), PlaneError> {
            let l = std::net::TcpListener::bind(addr).map_err(|source| PlaneError::Bind { addr, source })?;
            l.set_nonblocking(true).map_err(PlaneError::Runtime)?;
            let local = l.local_addr().map_err(PlaneError::Runtime)?;
            Ok((l, local))
        };
        let (listener, local_addr) = bind(listen)?;
        let picker = epp.map(bind).transpose()?;
        let epp_addr = picker.as_ref().map(|(_, a)| *a);
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
                rt.block_on(async move {
                    if let Some((l, _)) = picker {
                        tokio::spawn(epp::serve(sh.clone(), l));
                    }
                    serve(sh, listener, stop_rx).await
                });
                // In-flight requests are dropped here, which releases their load (leases cancel or finish).
                rt.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(PlaneError::Runtime)?;
        *ctl = Control { local_addr: Some(local_addr), epp_addr, stop_tx: Some(stop_tx), thread: Some(thread) };
        Ok((local_addr, epp_addr))
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

    /// Draining: the endpoint picker's readiness turns NOT_SERVING (so health-checking gateways
    /// send it no new request) while it still serves the requests it has; false: ready again.
    pub fn set_draining(&self, draining: bool) {
        self.shared.draining.store(draining, Ordering::SeqCst);
    }

    /// The endpoint picker's bound address (`start_picker`).
    pub fn epp_addr(&self) -> Option<SocketAddr> {
        self.control.lock().epp_addr
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
        let endpoint = epp::endpoint_of(base).ok_or_else(|| PlaneError::WorkerUrl(url.to_string()))?;
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
            endpoint,
            bootstrap_port,
            healthy: AtomicBool::new(true),
            down_reason: Mutex::new(None),
            in_flight: AtomicI64::new(0),
            served: AtomicU64::new(0),
            down: watch::channel(0).0,
        };
        ws.insert(id, Arc::new(w));
        Ok(())
    }

    /// Forgets a worker (requests in flight on it finish normally); false when unknown.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        self.shared.models.write().remove(&id);
        self.shared.workers.write().remove(&id).is_some()
    }

    /// The models a worker serves (its `/v1/models` entries; `None`: not known, so it may serve
    /// any). Requests naming a model go only to workers serving it; false when the worker is unknown.
    pub fn set_worker_models(&self, id: WorkerId, models: Option<Vec<ServedModel>>) -> bool {
        if !self.shared.workers.read().contains_key(&id) {
            return false;
        }
        let mut m = self.shared.models.write();
        match models {
            Some(list) => m.insert(id, list),
            None => m.remove(&id),
        };
        true
    }

    /// The self-check's counters.
    pub fn check(&self) -> kvroute_core::check::CheckSnapshot {
        self.shared.check.snapshot()
    }

    /// The self-check's last alarm message.
    pub fn check_last_alarm(&self) -> Option<String> {
        self.shared.check.last_alarm()
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
                if healthy {
                    *w.down_reason.lock() = None;
                } else {
                    w.down_reason.lock().get_or_insert_with(|| "taken out of routing by its owner".into());
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
        // Keyed as the hot path keys it: by the adapter its model names in the workers' lists.
        let lora = match sh.pool(body.get("model")) {
            server::Pool::Of(_, lora) => lora,
            _ => None,
        };
        match &sh.exact {
            Some(exact) => exact.routed_prompt(body, chat, lora.as_deref()).map(|(p, _)| p),
            None => approx_prompt(body, chat, sh.block_size, sh.seed, lora.as_deref()),
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
