//! `kvroute._core.DataPlane`: the gateway's request path (kvroute-dataplane) on a Router object, driven
//! by the Python control plane (`kvroute.gateway`), plus `approx_prompt` (the plane's approximate prompt).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use kvroute_core::router::Role;
use kvroute_dataplane::{
    approx_prompt as rust_approx_prompt, ApproxPrompt, BadRequest, DataPlane, ExactError, PdConvention, PlaneConfig, PlaneError,
    ROUTING_BUCKETS,
};
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::{check_block_size, extract_hashes, extract_u64};
use crate::router::PyRouter;

fn to_py(e: PlaneError) -> PyErr {
    match e {
        PlaneError::Bind { .. } | PlaneError::Runtime(_) => PyOSError::new_err(e.to_string()),
        PlaneError::Exact(ExactError::NotFound(_)) => PyFileNotFoundError::new_err(e.to_string()),
        PlaneError::Config(_) | PlaneError::WorkerUrl(_) | PlaneError::DuplicateWorker(_) | PlaneError::Exact(_) | PlaneError::Tls(_) => {
            PyValueError::new_err(e.to_string())
        }
    }
}

fn addr(host: &str, port: u16, what: &str) -> PyResult<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("{what}: cannot resolve {host}:{port}: {e}")))?
        .next()
        .ok_or_else(|| PyValueError::new_err(format!("{what}: {host}:{port} resolves to no address")))
}

fn seconds(v: f64, what: &str) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(v) {
        Ok(d) if v > 0.0 => Ok(d),
        _ => Err(PyValueError::new_err(format!("{what} must be a finite number of seconds > 0 (and < 2**64), got {v}"))),
    }
}

/// The gateway's data plane: an HTTP/1.1 server in Rust that serves every client request (completions:
/// tokenize or hash, route on `router`, relay with load accounting and retries; unified workers and PD
/// pairs in `pd_convention`; exact mode with `tokenizer`, a tokenizer.json or its directory, else
/// approximate mode; `/v1/models`, `/health`, `/metrics`) and passes `/admin` requests to the
/// admin API given to `start`.
///
/// Register the workers (same ids as in `router`); `on_unhealthy(worker_id, reason)` is called (from
/// the data plane's thread, or the caller's for `mark_unhealthy`) when a worker is taken out of routing.
#[pyclass(frozen, module = "kvroute._core", name = "DataPlane")]
pub struct PyDataPlane {
    inner: DataPlane,
}

#[pymethods]
impl PyDataPlane {
    #[new]
    #[pyo3(signature = (
        router, *, pd_convention = "vllm",
        max_body_bytes = 33554432, max_client_concurrency = 256, max_in_flight = 10000, client_key_header = None,
        max_retries = 2, connect_timeout = 5.0, read_timeout = 600.0, client_timeout = 30.0, approx_ttl = Some(120.0), threads = 1, on_unhealthy = None,
        tokenizer = None, models = Vec::new(), health_timeout = 2.0, ca_file = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        router: &Bound<'_, PyRouter>,
        pd_convention: &str,
        max_body_bytes: usize,
        max_client_concurrency: usize,
        max_in_flight: usize,
        client_key_header: Option<String>,
        max_retries: u32,
        connect_timeout: f64,
        read_timeout: f64,
        client_timeout: f64,
        approx_ttl: Option<f64>,
        threads: usize,
        on_unhealthy: Option<Py<PyAny>>,
        tokenizer: Option<std::path::PathBuf>,
        models: Vec<String>,
        health_timeout: f64,
        ca_file: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        if threads == 0 || threads > 64 {
            return Err(PyValueError::new_err(format!("threads must be in 1..=64, got {threads}")));
        }
        let pd_convention = PdConvention::from_name(pd_convention)
            .ok_or_else(|| PyValueError::new_err(format!("pd_convention must be 'vllm' or 'sglang', got {pd_convention:?}")))?;
        let cfg = PlaneConfig {
            pd_convention,
            tokenizer,
            max_body_bytes,
            max_client_concurrency,
            max_in_flight,
            client_key_header: client_key_header.map(|h| h.to_ascii_lowercase()),
            max_retries,
            connect_timeout: seconds(connect_timeout, "connect_timeout")?,
            read_timeout: seconds(read_timeout, "read_timeout")?,
            client_timeout: seconds(client_timeout, "client_timeout")?,
            approx_ttl: approx_ttl.map(|t| seconds(t, "approx_ttl")).transpose()?,
            threads,
            models,
            health_timeout: seconds(health_timeout, "health_timeout")?,
            ca_file,
        };
        let hook = on_unhealthy.map(|cb| {
            Box::new(move |worker: u64, reason: &str| {
                Python::attach(|py| {
                    if let Err(e) = cb.call1(py, (worker, reason)) {
                        e.write_unraisable(py, None);
                    }
                })
            }) as kvroute_dataplane::UnhealthyHook
        });
        let router = router.get().inner.clone();
        // Loading a tokenizer reads and parses files: without the GIL.
        let inner = py.detach(|| DataPlane::new(router, cfg, hook)).map_err(to_py)?;
        Ok(PyDataPlane { inner })
    }

    /// Binds host:port and starts serving; returns the bound (host, port). OSError when the address
    /// is taken. `/admin` requests go to 127.0.0.1:`admin_port` (the admin API), else get 403.
    /// `epp_port`: also serve the Gateway API Inference Extension endpoint picker (Envoy ext_proc and
    /// gRPC health) on host:`epp_port` (0: any free port; `epp_address` tells which).
    #[pyo3(signature = (host = "127.0.0.1", port = 0, *, admin_port = None, epp_port = None))]
    fn start<'py>(
        &self,
        py: Python<'py>,
        host: &str,
        port: u16,
        admin_port: Option<u16>,
        epp_port: Option<u16>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let listen = addr(host, port, "host")?;
        let admin = admin_port.map(|p| addr("127.0.0.1", p, "admin_port")).transpose()?;
        let a = match epp_port {
            None => py.detach(|| self.inner.start(listen, admin)).map_err(to_py)?,
            Some(ep) => {
                let epp = addr(host, ep, "host")?;
                py.detach(|| self.inner.start_picker(listen, admin, epp)).map_err(to_py)?.0
            }
        };
        PyTuple::new(py, [a.ip().to_string().into_pyobject(py)?.into_any(), a.port().into_pyobject(py)?.into_any()])
    }

    /// Draining: the endpoint picker's gRPC readiness reports NOT_SERVING while it still serves the
    /// requests it has (a gateway health-checking it stops sending new ones); False: ready again.
    fn set_draining(&self, draining: bool) {
        self.inner.set_draining(draining);
    }

    /// The endpoint picker's bound "host:port" (started with `epp_port`), else None.
    #[getter]
    fn epp_address(&self) -> Option<String> {
        self.inner.epp_addr().map(|a| a.to_string())
    }

    /// Stops serving and joins the data plane's thread; requests in flight are dropped and their
    /// load released. Idempotent.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.inner.stop());
    }

    #[getter]
    fn running(&self) -> bool {
        self.inner.is_running()
    }

    /// "http://host:port" while running (after start), else None.
    #[getter]
    fn url(&self) -> Option<String> {
        self.inner.local_addr().map(|a| format!("http://{a}"))
    }

    /// Registers a worker by the id and role the Router knows it under; `bootstrap_port`: an SGLang
    /// PD prefill server's (sent to both servers of a pair as `bootstrap_port`).
    #[pyo3(signature = (worker, url, *, role = "both", bootstrap_port = None))]
    fn add_worker(&self, worker: &Bound<'_, PyAny>, url: &str, role: &str, bootstrap_port: Option<i64>) -> PyResult<()> {
        let role = Role::from_name(role)
            .ok_or_else(|| PyValueError::new_err(format!("role must be 'both', 'prefill' or 'decode', got {role:?}")))?;
        let port = match bootstrap_port {
            None => None,
            Some(p) if (1..=65535).contains(&p) => Some(p as u16),
            Some(p) => return Err(PyValueError::new_err(format!("bootstrap_port must be a TCP port (1..65535), got {p}"))),
        };
        self.inner.add_worker(extract_u64(worker, "worker")?, url, role, port).map_err(to_py)
    }

    /// The models a worker serves: its `/v1/models` answer (JSON bytes), or None when not known
    /// (it may then serve any). Requests naming a model go only to workers serving it; a model no
    /// worker serves gets a 404. Returns whether the worker is registered; ValueError for a bad answer.
    fn set_worker_models(&self, worker: &Bound<'_, PyAny>, models: Option<&[u8]>) -> PyResult<bool> {
        let id = extract_u64(worker, "worker")?;
        let list = match models {
            None => None,
            Some(raw) => {
                let v = parse(raw).map_err(|_| PyValueError::new_err("a /v1/models answer must be JSON"))?;
                Some(kvroute_dataplane::ServedModel::parse_list(&v).map_err(PyValueError::new_err)?)
            }
        };
        Ok(self.inner.set_worker_models(id, list))
    }

    /// Forgets a worker; returns whether it was registered.
    fn remove_worker(&self, worker: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.remove_worker(extract_u64(worker, "worker")?))
    }

    /// Routes to a worker again (its health probe answered) or stops routing to it; the Router's
    /// worker table is the caller's (re-register it there when it is healthy again).
    fn set_healthy(&self, worker: &Bound<'_, PyAny>, healthy: bool) -> PyResult<bool> {
        Ok(self.inner.set_healthy(extract_u64(worker, "worker")?, healthy))
    }

    /// Takes a worker out of routing as a failed dispatch does (removed from the Router, its
    /// approximate blocks dropped, its streams ended, `on_unhealthy` called); returns whether it
    /// was healthy.
    fn mark_unhealthy(&self, py: Python<'_>, worker: &Bound<'_, PyAny>, reason: &str) -> PyResult<bool> {
        let w = extract_u64(worker, "worker")?;
        Ok(py.detach(|| self.inner.mark_unhealthy(w, reason)))
    }

    /// The Prometheus text `/metrics` serves.
    fn metrics_text(&self, py: Python<'_>) -> String {
        py.detach(|| self.inner.metrics_text())
    }

    /// Per worker: id, url, role, bootstrap_port, healthy, in_flight, requests (dispatched).
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for r in self.inner.workers() {
            let d = PyDict::new(py);
            d.set_item("id", r.id)?;
            d.set_item("url", r.url)?;
            d.set_item("role", r.role.name())?;
            d.set_item("bootstrap_port", r.bootstrap_port)?;
            d.set_item("healthy", r.healthy)?;
            d.set_item("in_flight", r.in_flight)?;
            d.set_item("requests", r.served)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Completions requests holding an admission slot.
    #[getter]
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    /// Clients with requests in flight.
    #[getter]
    fn active_clients(&self) -> usize {
        self.inner.active_clients()
    }

    /// The counters `/metrics` renders, as a dict.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.inner.metrics();
        let d = PyDict::new(py);
        let requests = PyDict::new(py);
        for ((endpoint, class), n) in &m.requests {
            requests.set_item((endpoint, class), n)?;
        }
        d.set_item("requests", requests)?;
        d.set_item("rejections", m.rejections.into_pyobject(py)?)?;
        d.set_item("retries", m.retries)?;
        d.set_item("upstream_errors", m.upstream_errors.into_pyobject(py)?)?;
        d.set_item("client_disconnects", m.client_disconnects)?;
        d.set_item("fallbacks_served", m.fallbacks_served)?;
        d.set_item("leases_expired", m.leases_expired)?;
        d.set_item("prompt_tokens", m.prompt_tokens)?;
        d.set_item("cached_tokens", m.cached_tokens)?;
        d.set_item("routing_bounds", ROUTING_BUCKETS.to_vec())?;
        d.set_item("routing_counts", m.routing_counts)?;
        d.set_item("routing_sum", m.routing_sum)?;
        d.set_item("routing_count", m.routing_count)?;
        d.set_item("prefix_check", crate::check::snapshot_dict(py, &self.inner.check(), self.inner.check_last_alarm())?)?;
        Ok(d)
    }

    /// Approximate mode's cache: stores `hashes` for `worker` now, under the data plane's TTL.
    fn approx_insert(&self, py: Python<'_>, worker: &Bound<'_, PyAny>, hashes: &Bound<'_, PyAny>) -> PyResult<()> {
        let w = extract_u64(worker, "worker")?;
        let hs = extract_hashes(hashes)?;
        let s = hs.as_slice();
        let approx = self.approx()?;
        py.detach(|| approx.insert(w, s, approx.now()));
        Ok(())
    }

    /// Forgets a worker's approximate-mode blocks (and clears them from the index).
    fn approx_drop_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let w = extract_u64(worker, "worker")?;
        let approx = self.approx()?;
        py.detach(|| approx.drop_worker(w));
        Ok(())
    }

    /// Expires blocks untouched for the TTL as of `now` (seconds on `approx_clock()`; default: now).
    /// The data plane also does this by itself every min(5 s, ttl / 4). Returns blocks removed.
    #[pyo3(signature = (now = None))]
    fn approx_expire(&self, py: Python<'_>, now: Option<f64>) -> PyResult<usize> {
        let approx = self.approx()?;
        Ok(py.detach(|| approx.expire(now.unwrap_or_else(|| approx.now()))))
    }

    /// Seconds on the approximate cache's clock.
    fn approx_clock(&self) -> PyResult<f64> {
        Ok(self.approx()?.now())
    }

    /// (worker, block) entries the approximate cache tracks.
    fn approx_len(&self) -> PyResult<usize> {
        Ok(self.approx()?.len())
    }

    #[getter]
    fn has_approx(&self) -> bool {
        self.inner.approx().is_some()
    }

    /// Whether the plane runs in exact mode (configured with a tokenizer).
    #[getter]
    fn exact(&self) -> bool {
        self.inner.exact().is_some()
    }

    /// Exact mode: why chat requests route on approximate hashes (minijinja cannot compile the chat
    /// template), else None.
    #[getter]
    fn template_unsupported(&self) -> Option<String> {
        self.inner.exact().and_then(|e| e.template_unsupported()).map(str::to_string)
    }

    /// Exact mode: the prefix store's counters (hits, misses, entries, tokens), or None (approximate
    /// mode, or a tokenizer with no store).
    #[getter]
    fn prefix_reuse<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.inner.exact().and_then(|e| e.prefix_reuse()).map(|s| reuse_dict(py, s)).transpose()
    }

    /// The prompt the plane routes a raw request body on: (sequence hashes, num_tokens,
    /// output_tokens); ValueError with the client's 400 message for an invalid body.
    fn prompt<'py>(&self, py: Python<'py>, body: &[u8], chat: bool) -> PyResult<Bound<'py, PyTuple>> {
        let value = parse(body)?;
        let p = py.detach(|| self.inner.prompt(&value, chat)).map_err(bad_request)?;
        prompt_tuple(py, p)
    }

    /// Exact mode: the token ids of a raw request body (the rendered chat template encoded, the
    /// completions text encoded with special tokens, or the prompt's own ids), or None when they
    /// cannot be derived exactly (the plane then routes on approximate hashes); ValueError when invalid.
    fn exact_tokens<'py>(&self, py: Python<'py>, body: &[u8], chat: bool) -> PyResult<Option<Bound<'py, PyArray1<u32>>>> {
        let exact = self.inner.exact().ok_or_else(|| PyRuntimeError::new_err("this data plane is not in exact mode (tokenizer=None)"))?;
        let value = parse(body)?;
        Ok(py.detach(|| exact.token_ids(&value, chat)).map_err(bad_request)?.map(|ids| ids.into_pyarray(py)))
    }

    /// Exact mode: the chat template rendered for a raw request body, or None when it cannot be
    /// rendered exactly; ValueError when invalid.
    fn render_chat(&self, py: Python<'_>, body: &[u8]) -> PyResult<Option<String>> {
        let exact = self.inner.exact().ok_or_else(|| PyRuntimeError::new_err("this data plane is not in exact mode (tokenizer=None)"))?;
        let value = parse(body)?;
        py.detach(|| exact.render_chat(&value)).map_err(bad_request)
    }

    fn __repr__(&self) -> String {
        let url = self.url().unwrap_or_else(|| "not started".into());
        format!("DataPlane({url}, workers={}, running={})", self.inner.workers().len(), self.inner.is_running())
    }
}

pub(crate) fn bad_request(e: BadRequest) -> PyErr {
    PyValueError::new_err(e.0)
}

pub(crate) fn parse(body: &[u8]) -> PyResult<serde_json::Value> {
    serde_json::from_slice(body).map_err(|e| PyValueError::new_err(format!("request body is not valid JSON: {e}")))
}

impl PyDataPlane {
    fn approx(&self) -> PyResult<&kvroute_dataplane::ApproxCache> {
        self.inner.approx().ok_or_else(|| PyRuntimeError::new_err("this data plane has no approximate cache (approx_ttl=None)"))
    }
}

/// The data plane's approximate prompt of a raw request body: (sequence hashes, num_tokens,
/// output_tokens); ValueError with the client's 400 message for an invalid body.
#[pyfunction]
/// `lora`: the LoRA adapter serving the request; with the body's `cache_salt` it keys the blocks.
#[pyo3(signature = (body, chat, block_size = 64, *, seed = 1337, lora = None))]
fn approx_prompt<'py>(
    py: Python<'py>,
    body: &[u8],
    chat: bool,
    block_size: i64,
    seed: u64,
    lora: Option<&str>,
) -> PyResult<Bound<'py, PyTuple>> {
    let bs = check_block_size(block_size)?;
    let value = parse(body)?;
    let p = py.detach(|| rust_approx_prompt(&value, chat, bs, seed, lora)).map_err(bad_request)?;
    prompt_tuple(py, p)
}

fn prompt_tuple(py: Python<'_>, p: ApproxPrompt) -> PyResult<Bound<'_, PyTuple>> {
    let hashes: Bound<'_, PyArray1<u64>> = p.hashes.into_pyarray(py);
    PyTuple::new(py, [hashes.into_any(), p.num_tokens.into_pyobject(py)?.into_any(), p.output_tokens.into_pyobject(py)?.into_any()])
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDataPlane>()?;
    m.add_function(wrap_pyfunction!(approx_prompt, m)?)?;
    Ok(())
}

/// A prefix store's counters as a dict.
pub(crate) fn reuse_dict(py: Python<'_>, s: kvroute_dataplane::exact::ReuseStats) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("hits", s.hits)?;
    d.set_item("misses", s.misses)?;
    d.set_item("entries", s.entries)?;
    d.set_item("tokens", s.tokens)?;
    Ok(d)
}
