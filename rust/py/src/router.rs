//! `kvroute.Router` and `kvroute.Decision`: thin wrappers over `kvroute_core::Router`, plus the
//! router's exceptions (subclasses of `KvrouteError`) that router errors map onto.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kvroute_core::router::params::{self, Value};
use kvroute_core::router::{Decision, Observed, Preset, Role, RouteRequest, Router, RouterConfig, RouterError, WorkerSpec};
use pyo3::create_exception;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString};

use crate::convert::{extract_hashes, extract_tokens, extract_u64};
use crate::errors::KvrouteError;
use crate::index::PyKvIndex;

create_exception!(
    kvroute,
    NoWorkersError,
    KvrouteError,
    "Routing found no worker to route to (none registered, or none of the needed role)."
);
create_exception!(kvroute, UnknownWorkerError, KvrouteError, "A worker id that was never registered with add_worker (or was removed).");
create_exception!(
    kvroute,
    UnknownRequestError,
    KvrouteError,
    "A request id that is not in flight (never routed with it, or already finished)."
);

fn to_py(e: RouterError) -> PyErr {
    let msg = e.to_string();
    match e {
        RouterError::NoWorkers(_) => NoWorkersError::new_err(msg),
        RouterError::UnknownWorker(_) => UnknownWorkerError::new_err(msg),
        RouterError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
        RouterError::DuplicateWorker(_)
        | RouterError::DuplicateRequest(_)
        | RouterError::InvalidArgument(_)
        | RouterError::InvalidConfig(_) => PyValueError::new_err(msg),
    }
}

/// Request ids may be ints (0..2**64) or strings (hashed to a 64-bit key).
fn request_key(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(s) = obj.cast::<PyString>() {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        s.to_str()?.hash(&mut h);
        return Ok(h.finish());
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("request_id must be an int or a str, got bool"));
    }
    extract_u64(obj, "request_id").map_err(|e| {
        if e.is_instance_of::<PyTypeError>(obj.py()) {
            PyTypeError::new_err(format!(
                "request_id must be an int or a str, got {}",
                obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        } else {
            e
        }
    })
}

fn preset_named(name: &str) -> PyResult<Preset> {
    Preset::from_name(name)
        .ok_or_else(|| PyValueError::new_err(format!("preset must be one of {}, got {name:?}", Preset::NAMES.join(", "))))
}

/// A Python value as a parameter value (its kind is checked by the parameter).
fn value_from_py(v: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(if v.is_none() {
        Value::None
    } else if let Ok(b) = v.cast::<PyBool>() {
        Value::Bool(b.is_true())
    } else if let Ok(i) = v.cast::<PyInt>() {
        Value::Int(i.extract::<i128>().map_err(|_| PyValueError::new_err(format!("{i} is out of range")))?)
    } else if let Ok(f) = v.cast::<PyFloat>() {
        Value::Float(f.value())
    } else if let Ok(s) = v.cast::<PyString>() {
        Value::Str(s.to_str()?.to_string())
    } else {
        let t = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!("expected None, a bool, a number or a str, got {t}")));
    })
}

fn value_to_py(py: Python<'_>, v: Value) -> PyResult<Bound<'_, PyAny>> {
    Ok(match v {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => f.into_pyobject(py)?.into_any(),
        Value::Str(s) => PyString::new(py, &s).into_any(),
    })
}

/// The config `Router(preset=..., **params)` builds: unknown names and values of the wrong type
/// are TypeErrors, values out of range (or a parameter of another policy) ValueErrors.
fn config_from(preset: &str, params: Option<&Bound<'_, PyDict>>) -> PyResult<RouterConfig> {
    let preset = preset_named(preset)?;
    let mut given = Vec::new();
    for (k, v) in params.into_iter().flat_map(|d| d.iter()) {
        let name = k.cast::<PyString>()?.to_str()?.to_string();
        let param =
            params::param(&name).ok_or_else(|| PyTypeError::new_err(format!("Router() got an unexpected keyword argument {name:?}")))?;
        let value = value_from_py(&v).map_err(|e| PyTypeError::new_err(format!("{name}: {}", e.value(v.py()))))?;
        let value = param.check_kind(value).map_err(|e| PyTypeError::new_err(e.to_string()))?;
        given.push((param.name, value));
    }
    params::build(preset, given).map_err(to_py)
}

/// The Router's parameters, as `(name, type, default, policies, help)` under `preset`: the one
/// definition the constructor, `Router.config`, the stub and the CLIs' flags follow.
#[pyfunction]
#[pyo3(signature = (preset = "simulator"))]
fn router_parameters<'py>(py: Python<'py>, preset: &str) -> PyResult<Bound<'py, PyList>> {
    let preset = preset_named(preset)?;
    let out = PyList::empty(py);
    for p in params::PARAMS {
        let t = (p.name, p.kind.python_type(), value_to_py(py, p.default_value(preset))?, p.policies.to_vec(), p.help);
        out.append(t)?;
    }
    Ok(out)
}

fn check_time(v: Option<f64>, what: &str) -> PyResult<Option<f64>> {
    match v {
        Some(t) if !(t.is_finite() && t >= 0.0) => {
            Err(PyValueError::new_err(format!("{what} must be a finite number of seconds >= 0, got {t}")))
        }
        _ => Ok(v),
    }
}

/// A cache- and load-aware router: picks the prefill (and in PD mode the decode) worker for each
/// request from prefix overlap in a `KvIndex` and its own per-worker load model.
///
/// >>> r = Router(policy="ttft")
/// >>> r.add_worker(0); r.add_worker(1)
/// >>> r.route(list(range(256)), now=0.0).worker in (0, 1)
/// True
#[pyclass(frozen, module = "kvroute._core", name = "Router")]
pub struct PyRouter {
    pub(crate) inner: Arc<Router>,
}

#[pymethods]
impl PyRouter {
    /// Every keyword but `preset` and `index` is a parameter of `kvroute._core.router_parameters()`;
    /// `preset` picks the defaults of an entry point ("simulator", the default; "gateway",
    /// "gateway_approx", "host_router"; docs/router.md, "Configuration").
    #[new]
    #[pyo3(signature = (*, preset = "simulator", index = None, **params))]
    fn new(preset: &str, index: Option<&Bound<'_, PyKvIndex>>, params: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let cfg = config_from(preset, params)?;
        let index = index.map(|i| i.get().inner.clone());
        Ok(PyRouter { inner: Arc::new(Router::new(cfg, index).map_err(to_py)?) })
    }

    /// Registers a worker. `role`: "both" (unified), "prefill" or "decode"; registering any
    /// "decode" worker turns on PD mode.
    /// `max_running`: the most requests the engine runs at once (vLLM `max_num_seqs`); a unified
    /// worker with that many in flight is chosen only when none has a seat.
    #[pyo3(signature = (worker, *, role = "both", prefill_tokens_per_s = 20000.0, kv_capacity_blocks = None, decode_tokens_per_s = None, prefix_cache_blocks = None, max_running = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_worker(
        &self,
        worker: &Bound<'_, PyAny>,
        role: &str,
        prefill_tokens_per_s: f64,
        kv_capacity_blocks: Option<u64>,
        decode_tokens_per_s: Option<f64>,
        prefix_cache_blocks: Option<i64>,
        max_running: Option<i64>,
    ) -> PyResult<()> {
        let max_running = max_running
            .map(|m| {
                u32::try_from(m)
                    .ok()
                    .filter(|&m| m >= 1)
                    .ok_or_else(|| PyValueError::new_err(format!("max_running must be an int >= 1 (requests) or None, got {m}")))
            })
            .transpose()?;
        let prefix_cache_blocks = prefix_cache_blocks
            .map(|b| {
                u64::try_from(b)
                    .map_err(|_| PyValueError::new_err(format!("prefix_cache_blocks must be an int >= 0 (blocks) or None, got {b}")))
            })
            .transpose()?;
        let id = extract_u64(worker, "worker")?;
        let role = Role::from_name(role)
            .ok_or_else(|| PyValueError::new_err(format!("role must be 'both', 'prefill' or 'decode', got {role:?}")))?;
        let spec = WorkerSpec { role, prefill_tokens_per_s, kv_capacity_blocks, decode_tokens_per_s, prefix_cache_blocks, max_running };
        self.inner.add_worker(id, spec).map_err(to_py)
    }

    /// Stops routing to `worker` (the index is left alone).
    fn remove_worker(&self, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.remove_worker(extract_u64(worker, "worker")?).map_err(to_py)
    }

    /// Routes one request: `tokens` (list or 1-D integer array), or precomputed sequence `hashes`
    /// with `num_tokens`. `worker` pins the request to that worker. `identity` (`identity_root`)
    /// keys `tokens` under a LoRA adapter or cache salt; `workers` restricts the choice to those
    /// workers (the pool serving the request's model). Rejections leave state untouched.
    #[pyo3(signature = (tokens = None, *, hashes = None, num_tokens = None, now = None, request_id = None, output_tokens = None, explain = false, worker = None, identity = None, workers = None))]
    #[allow(clippy::too_many_arguments)]
    fn route(
        &self,
        py: Python<'_>,
        tokens: Option<&Bound<'_, PyAny>>,
        hashes: Option<&Bound<'_, PyAny>>,
        num_tokens: Option<i64>,
        now: Option<f64>,
        request_id: Option<&Bound<'_, PyAny>>,
        output_tokens: Option<i64>,
        explain: bool,
        worker: Option<&Bound<'_, PyAny>>,
        identity: Option<&Bound<'_, PyAny>>,
        workers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyDecision> {
        let now = check_time(now, "now")?;
        let num_tokens = match num_tokens {
            Some(n) if n < 0 => return Err(PyValueError::new_err(format!("num_tokens must be >= 1, got {n}"))),
            n => n.map(|n| n as u64),
        };
        let output_tokens = match output_tokens {
            Some(n) if n < 0 => return Err(PyValueError::new_err(format!("output_tokens must be >= 0, got {n}"))),
            n => n.map(|n| n as u64),
        };
        let key = request_id.map(request_key).transpose()?;
        let pin = worker.map(|w| extract_u64(w, "worker")).transpose()?;
        let toks = tokens.map(extract_tokens).transpose()?;
        let hs = hashes.map(extract_hashes).transpose()?;
        let identity = identity.map(|i| extract_u64(i, "identity")).transpose()?;
        let pool = workers
            .map(|ws| extract_hashes(ws))
            .transpose()
            .map_err(|_| PyValueError::new_err("workers must be a sequence of worker ids (ints >= 0)"))?;
        let req = RouteRequest {
            tokens: toks.as_ref().map(|t| t.as_slice()),
            hashes: hs.as_ref().map(|h| h.as_slice()),
            num_tokens,
            now,
            request_id: key,
            output_tokens,
            explain,
            pin,
            identity,
            workers: pool.as_ref().map(|w| w.as_slice()),
        };
        let router = &self.inner;
        let d = py.detach(|| router.route(&req)).map_err(to_py)?;
        Ok(PyDecision { d, request_id: request_id.map(|r| r.clone().unbind()) })
    }

    /// The request's prefill finished (corrects the worker's virtual queue by the prediction error).
    #[pyo3(signature = (request_id, now = None))]
    fn prefill_done(&self, request_id: &Bound<'_, PyAny>, now: Option<f64>) -> PyResult<()> {
        self.inner.prefill_done(request_key(request_id)?, check_time(now, "now")?).map_err(to_py)
    }

    /// The request completed; its decode KV is released.
    #[pyo3(signature = (request_id, now = None))]
    fn finished(&self, request_id: &Bound<'_, PyAny>, now: Option<f64>) -> PyResult<()> {
        self.inner.finished(request_key(request_id)?, check_time(now, "now")?).map_err(to_py)
    }

    /// The request, still in flight, produced `tokens` output tokens (its response's usage):
    /// decode KV is then reserved for what requests produce (mean + 2 SD), capped by each one's
    /// max_tokens; with the learned model, one sample of its decode worker's step.
    #[pyo3(signature = (request_id, tokens, now = None))]
    fn output_done(&self, request_id: &Bound<'_, PyAny>, tokens: u64, now: Option<f64>) -> PyResult<()> {
        self.inner.output_done(request_key(request_id)?, tokens, check_time(now, "now")?).map_err(to_py)
    }

    /// The request was abandoned; a queued prefill is taken out of the virtual queue.
    #[pyo3(signature = (request_id, now = None))]
    fn cancel(&self, request_id: &Bound<'_, PyAny>, now: Option<f64>) -> PyResult<()> {
        self.inner.cancel(request_key(request_id)?, check_time(now, "now")?).map_err(to_py)
    }

    /// Folds in engine-reported metrics: `waiting`/`running` request counts, `kv_usage` (0..1),
    /// `queue_delay` (seconds of queued prefill; resets the virtual queue to now + queue_delay).
    #[pyo3(signature = (worker, *, waiting = None, running = None, kv_usage = None, queue_delay = None, now = None))]
    fn observe(
        &self,
        worker: &Bound<'_, PyAny>,
        waiting: Option<u32>,
        running: Option<u32>,
        kv_usage: Option<f64>,
        queue_delay: Option<f64>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let id = extract_u64(worker, "worker")?;
        self.inner.observe(id, Observed { waiting, running, kv_usage }, queue_delay, check_time(now, "now")?).map_err(to_py)
    }

    /// Sets a registered worker's prefix-cache size in KV blocks (None: unknown), e.g. once its
    /// engine reports it; the worker's load and in-flight requests are kept.
    fn set_prefix_cache_blocks(&self, worker: &Bound<'_, PyAny>, blocks: Option<i64>) -> PyResult<()> {
        let id = extract_u64(worker, "worker")?;
        let blocks = match blocks {
            Some(b) if b < 0 => return Err(PyValueError::new_err(format!("blocks must be >= 0 or None, got {b}"))),
            b => b.map(|b| b as u64),
        };
        self.inner.set_prefix_cache_blocks(id, blocks).map_err(to_py)
    }

    /// Registered worker ids, ascending.
    fn workers(&self) -> Vec<u64> {
        self.inner.workers()
    }

    /// One worker's load as the router sees it, as a dict.
    #[pyo3(signature = (worker, *, now = None))]
    fn load<'py>(&self, py: Python<'py>, worker: &Bound<'py, PyAny>, now: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let w = self.inner.load(extract_u64(worker, "worker")?).map_err(to_py)?;
        let now = check_time(now, "now")?.unwrap_or_else(|| self.inner.clock());
        let d = PyDict::new(py);
        d.set_item("role", w.spec.role.name())?;
        d.set_item("busy_until", w.busy_until)?;
        d.set_item("queue_delay", w.queue_delay(now))?;
        d.set_item("in_flight", w.in_flight())?;
        d.set_item("prefilling", w.prefilling)?;
        d.set_item("prefill_tokens", w.prefill_tokens)?;
        d.set_item("decoding", w.decoding)?;
        d.set_item("decode_blocks", w.decode_blocks)?;
        d.set_item("kv_capacity_blocks", w.spec.kv_capacity_blocks)?;
        d.set_item("prefix_cache_blocks", w.spec.prefix_cache_blocks)?;
        d.set_item("max_running", w.spec.max_running)?;
        d.set_item("prefill_tokens_per_s", w.spec.prefill_tokens_per_s)?;
        d.set_item("decode_tokens_per_s", w.spec.decode_tokens_per_s)?;
        d.set_item("observed_waiting", w.observed.waiting)?;
        d.set_item("observed_running", w.observed.running)?;
        d.set_item("observed_kv_usage", w.observed.kv_usage)?;
        d.set_item("prefill_samples", w.prefill_fit.samples())?;
        d.set_item("learned_lateness_s", w.lateness)?;
        d.set_item("learned_overhead_s", w.prefill_model().map(|(a, _)| a))?;
        d.set_item("learned_prefill_tokens_per_s", w.prefill_model().map(|(_, b)| if b > 0.0 { 1.0 / b } else { f64::INFINITY }))?;
        Ok(d)
    }

    /// Number of tracked in-flight requests.
    #[getter]
    fn num_in_flight(&self) -> usize {
        self.inner.num_in_flight()
    }

    /// Distinct (block, worker) pairs counted as cached because this router sent a request
    /// there whose KV events cannot have arrived yet (`pending_prefixes`), at `now`.
    #[pyo3(signature = (now = None))]
    fn num_pending_blocks(&self, now: Option<f64>) -> PyResult<usize> {
        self.inner.num_pending_blocks(now).map_err(to_py)
    }

    /// The KvIndex the router matches against (shared, not a copy).
    #[getter]
    fn index(&self) -> PyKvIndex {
        PyKvIndex { inner: self.inner.index().clone() }
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy_name()
    }

    /// The configuration, as a dict of the constructor's keyword arguments (the parameters of
    /// every policy and of this router's policy; values left to a rule, such as the admission work
    /// factor and the load window, resolved): `Router(**r.config)` builds an equal router.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, v) in params::values(&self.inner.config().resolved()) {
            d.set_item(name, value_to_py(py, v)?)?;
        }
        Ok(d)
    }

    /// Offered prefill load as a fraction of the prefill pool's capacity, decayed to `now`: the
    /// signal that switches size-aware admission on (see `shed_load_threshold`).
    #[pyo3(signature = (now = None))]
    fn offered_load(&self, now: Option<f64>) -> PyResult<f64> {
        self.inner.offered_load(now).map_err(to_py)
    }

    /// "capacity": the fraction of recent evictions (the engines' removals) that a later prompt
    /// asked for again, the reuse an eviction is charged with; 0 for other policies.
    #[pyo3(signature = (now = None))]
    fn evicted_reuse(&self, now: Option<f64>) -> PyResult<f64> {
        self.inner.evicted_reuse(now).map_err(to_py)
    }

    /// Seconds on the router's default clock (since it was created).
    fn clock(&self) -> f64 {
        self.inner.clock()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!("Router(policy={:?}, workers={}, tie_break={:?})", c.policy, self.inner.workers().len(), c.tie_break.name())
    }
}

/// The outcome of `Router.route`.
#[pyclass(frozen, module = "kvroute._core", name = "Decision")]
pub struct PyDecision {
    d: Decision,
    request_id: Option<Py<PyAny>>,
}

#[pymethods]
impl PyDecision {
    /// Prefill (or unified) worker; for a rejection, the worker that was judged.
    #[getter]
    fn worker(&self) -> u64 {
        self.d.worker
    }
    /// PD mode: the decode worker; else None.
    #[getter]
    fn decode_worker(&self) -> Option<u64> {
        self.d.decode_worker
    }
    #[getter]
    fn overlap_blocks(&self) -> u32 {
        self.d.overlap_blocks
    }
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.d.num_tokens
    }
    #[getter]
    fn uncached_tokens(&self) -> u64 {
        self.d.uncached_tokens
    }
    #[getter]
    fn queue_delay(&self) -> f64 {
        self.d.queue_delay
    }
    /// Seconds: queueing delay + uncached prefill (+ KV transfer in PD mode).
    #[getter]
    fn predicted_ttft(&self) -> f64 {
        self.d.predicted_ttft
    }
    #[getter]
    fn predicted_tpot(&self) -> Option<f64> {
        self.d.predicted_tpot
    }
    /// The prefill worker's virtual-time queue end after admission (the seed's `busy[i]`).
    #[getter]
    fn busy_until(&self) -> f64 {
        self.d.busy_until
    }
    #[getter]
    fn admitted(&self) -> bool {
        self.d.admitted
    }
    #[getter]
    fn reason(&self) -> &'static str {
        self.d.reason.name()
    }
    /// "unified", "disaggregated" or "local" (PD mode, prefilled on the decode worker).
    #[getter]
    fn path(&self) -> &'static str {
        self.d.path.name()
    }
    #[getter]
    fn fetch_from(&self) -> Option<u64> {
        self.d.fetch_from
    }
    #[getter]
    fn request_id(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.request_id.as_ref().map(|r| r.clone_ref(py))
    }
    /// With `explain=True`: per candidate worker, a dict of overlap, queue delay, prefill and
    /// transfer time, predicted TTFT, in-flight requests and the policy's score; else None.
    #[getter]
    fn explain<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(rows) = &self.d.explain else { return Ok(None) };
        let list = PyList::empty(py);
        for r in rows {
            let d = PyDict::new(py);
            d.set_item("worker", r.worker)?;
            d.set_item("overlap_blocks", r.overlap_blocks)?;
            d.set_item("queue_delay", r.queue_delay)?;
            d.set_item("prefill_time", r.prefill_time)?;
            d.set_item("transfer_time", r.transfer_time)?;
            d.set_item("step_time", r.step_time)?;
            d.set_item("predicted_ttft", r.predicted_ttft)?;
            d.set_item("in_flight", r.in_flight)?;
            d.set_item("score", r.score)?;
            list.append(d)?;
        }
        Ok(Some(list))
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("worker", self.d.worker)?;
        d.set_item("decode_worker", self.d.decode_worker)?;
        d.set_item("overlap_blocks", self.d.overlap_blocks)?;
        d.set_item("num_tokens", self.d.num_tokens)?;
        d.set_item("uncached_tokens", self.d.uncached_tokens)?;
        d.set_item("queue_delay", self.d.queue_delay)?;
        d.set_item("predicted_ttft", self.d.predicted_ttft)?;
        d.set_item("predicted_tpot", self.d.predicted_tpot)?;
        d.set_item("busy_until", self.d.busy_until)?;
        d.set_item("admitted", self.d.admitted)?;
        d.set_item("reason", self.d.reason.name())?;
        d.set_item("path", self.d.path.name())?;
        d.set_item("fetch_from", self.d.fetch_from)?;
        d.set_item("request_id", self.request_id(py))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let d = &self.d;
        let dw = d.decode_worker.map(|w| format!(", decode_worker={w}")).unwrap_or_default();
        format!(
            "Decision(worker={}{dw}, admitted={}, reason={:?}, overlap_blocks={}, predicted_ttft={:.6})",
            d.worker,
            if d.admitted { "True" } else { "False" },
            d.reason.name(),
            d.overlap_blocks,
            d.predicted_ttft
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyRouter>()?;
    m.add_class::<PyDecision>()?;
    m.add("NoWorkersError", py.get_type::<NoWorkersError>())?;
    m.add("UnknownWorkerError", py.get_type::<UnknownWorkerError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("POLICIES", kvroute_core::router::PolicyConfig::NAMES.to_vec())?;
    m.add("ROUTER_PRESETS", Preset::NAMES.to_vec())?;
    m.add_function(wrap_pyfunction!(router_parameters, m)?)?;
    Ok(())
}
