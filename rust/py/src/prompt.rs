//! `kvroute._core.ExactPrompter`: exact mode's prompter (the engines' tokenizer.json and chat
//! template, kvroute-dataplane's `ExactPrompter`) for `kvroute.prompt`, so the gateway and the
//! integrations derive a request's hashes with one implementation.

use std::path::PathBuf;

use std::sync::Arc;
use std::time::Duration;

use kvroute_dataplane::{ApproxCache, ExactError, ExactPrompter};
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::convert::{check_block_size, extract_hashes, extract_u64};
use crate::dataplane::{bad_request, parse};
use crate::index::PyKvIndex;

/// Exact mode: a tokenizer.json (or a directory holding one) and the chat template of the
/// tokenizer_config.json beside it, as the data plane loads them.
#[pyclass(name = "ExactPrompter", module = "kvroute._core", frozen)]
pub struct PyExactPrompter {
    inner: ExactPrompter,
}

#[pymethods]
impl PyExactPrompter {
    #[new]
    #[pyo3(signature = (path, block_size = 64, *, seed = 1337))]
    fn new(py: Python<'_>, path: PathBuf, block_size: i64, seed: u64) -> PyResult<Self> {
        let bs = check_block_size(block_size)?;
        let inner = py.detach(|| ExactPrompter::load(&path, bs, seed)).map_err(|e| match e {
            ExactError::NotFound(_) => PyFileNotFoundError::new_err(e.to_string()),
            _ => PyValueError::new_err(e.to_string()),
        })?;
        Ok(PyExactPrompter { inner })
    }

    /// The routed prompt of a raw request body: (sequence hashes, num_tokens, output_tokens,
    /// exact). `exact` is False when the body is valid but its tokens cannot be derived exactly here
    /// (the hashes are then the approximate ones, as the data plane routes it); ValueError with the
    /// client's 400 message for an invalid body.
    /// `lora`: the LoRA adapter serving the request; with the body's `cache_salt` it keys the blocks.
    #[pyo3(signature = (body, chat, *, lora = None))]
    fn prompt<'py>(&self, py: Python<'py>, body: &[u8], chat: bool, lora: Option<&str>) -> PyResult<Bound<'py, PyTuple>> {
        let value = parse(body)?;
        let (p, exact) = py.detach(|| self.inner.routed_prompt(&value, chat, lora)).map_err(bad_request)?;
        let hashes: Bound<'_, PyArray1<u64>> = p.hashes.into_pyarray(py);
        PyTuple::new(
            py,
            [
                hashes.into_any(),
                p.num_tokens.into_pyobject(py)?.into_any(),
                p.output_tokens.into_pyobject(py)?.into_any(),
                pyo3::types::PyBool::new(py, exact).to_owned().into_any(),
            ],
        )
    }

    /// The token ids the engine sees for a raw request body, or None when they cannot be derived
    /// exactly here; ValueError when the body is invalid.
    fn token_ids<'py>(&self, py: Python<'py>, body: &[u8], chat: bool) -> PyResult<Option<Bound<'py, PyArray1<u32>>>> {
        let value = parse(body)?;
        Ok(py.detach(|| self.inner.token_ids(&value, chat)).map_err(bad_request)?.map(|ids| ids.into_pyarray(py)))
    }

    /// The chat template applied to a raw chat request body, or None when it cannot be rendered
    /// exactly here; ValueError when the body is invalid.
    fn render_chat(&self, py: Python<'_>, body: &[u8]) -> PyResult<Option<String>> {
        let value = parse(body)?;
        py.detach(|| self.inner.render_chat(&value)).map_err(bad_request)
    }

    /// Why chat requests route on approximate hashes (minijinja cannot compile the template), else None.
    #[getter]
    fn template_unsupported(&self) -> Option<String> {
        self.inner.template_unsupported().map(str::to_string)
    }

    /// The prefix store's counters (hits, misses, entries, tokens: prompts' encoded prefixes
    /// reused, rust/dataplane/src/exact/reuse.rs), or None when this tokenizer has none.
    #[getter]
    fn prefix_reuse<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.inner.prefix_reuse().map(|s| crate::dataplane::reuse_dict(py, s)).transpose()
    }

    /// Why this tokenizer's prompts are always encoded whole (no prefix store), else None.
    #[getter]
    fn prefix_reuse_unavailable(&self) -> Option<String> {
        self.inner.prefix_reuse_unavailable().map(str::to_string)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }
}

/// The router's own decisions as cache state, for when no KV events arrive: each routed prompt's
/// blocks are stored in `index` for its worker and removed `ttl` seconds after their last use.
/// The data plane's own implementation (`rust/dataplane/src/approx.rs`), thread-safe.
///
/// >>> idx = KvIndex(); c = ApproxCache(idx, ttl=10.0)
/// >>> c.insert(0, [1, 2], now=0.0); c.expire(10.0), idx.num_blocks(0)
/// (2, 0)
#[pyclass(frozen, module = "kvroute._core", name = "ApproxCache")]
pub struct PyApproxCache {
    inner: Arc<ApproxCache>,
}

#[pymethods]
impl PyApproxCache {
    #[new]
    fn new(index: &Bound<'_, PyKvIndex>, ttl: f64) -> PyResult<Self> {
        if !(ttl.is_finite() && ttl > 0.0) {
            return Err(PyValueError::new_err(format!("ttl must be a finite number > 0 seconds, got {ttl}")));
        }
        Ok(PyApproxCache { inner: Arc::new(ApproxCache::new(index.get().inner.clone(), Duration::from_secs_f64(ttl))) })
    }

    /// Records that `worker` was sent a prompt with these sequence hashes at `now` (seconds).
    fn insert(&self, py: Python<'_>, worker: &Bound<'_, PyAny>, hashes: &Bound<'_, PyAny>, now: f64) -> PyResult<()> {
        let w = extract_u64(worker, "worker")?;
        let hs = extract_hashes(hashes)?;
        let s = hs.as_slice();
        py.detach(|| self.inner.insert(w, s, now));
        Ok(())
    }

    /// Removes blocks untouched for `ttl` as of `now`; returns how many.
    fn expire(&self, py: Python<'_>, now: f64) -> usize {
        py.detach(|| self.inner.expire(now))
    }

    /// Forgets a worker's blocks (it failed: its cache is presumed gone), in the index too.
    fn drop_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let w = extract_u64(worker, "worker")?;
        py.detach(|| self.inner.drop_worker(w));
        Ok(())
    }

    /// Index stores that failed (the index refused the blocks); counted, never raised.
    #[getter]
    fn store_errors(&self) -> u64 {
        self.inner.store_errors()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyApproxCache>()?;
    m.add_class::<PyExactPrompter>()
}
