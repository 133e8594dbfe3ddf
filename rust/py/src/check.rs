//! `kvroute._core.PrefixCheck`: the router's self-check (kvroute_core::check) for the integrations.

use kvroute_core::check::{CheckSnapshot, Observation, Outcome, PrefixCheck, DEFAULT_THRESHOLD, DEFAULT_WINDOW};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::extract_u64;

/// Compares each request's predicted prefix hit with what its engine reported reusing
/// (`usage.prompt_tokens_details.cached_tokens`); over the last `window` requests, `threshold`
/// mismatches raise one alarm naming the likely cause (docs/events.md, "The self-check").
const _: () = assert!(DEFAULT_WINDOW == 20 && DEFAULT_THRESHOLD == 8, "PrefixCheck's Python defaults must be the core's");

#[pyclass(frozen, module = "kvroute._core", name = "PrefixCheck")]
pub struct PyPrefixCheck {
    inner: PrefixCheck,
}

#[pymethods]
impl PyPrefixCheck {
    #[new]
    // Literals, so Python's signature shows them; the assertion below keeps them the core's defaults.
    #[pyo3(signature = (window = 20, threshold = 8))]
    fn new(window: usize, threshold: usize) -> PyResult<Self> {
        Ok(PyPrefixCheck { inner: PrefixCheck::new(window, threshold).map_err(PyValueError::new_err)? })
    }

    /// Records one request: the decision's `overlap_blocks` and the router's `block_size`, the
    /// engine's `prompt_tokens` and `cached_tokens`; `routed_tokens`: the prompt length the router
    /// counted, when its tokens are meant to be the engine's; `indexed_blocks`: what the index holds
    /// for the worker. Returns (outcome, alarm message or None).
    #[pyo3(signature = (worker, predicted_blocks, block_size, prompt_tokens, cached_tokens, *, routed_tokens = None, indexed_blocks = 0))]
    #[allow(clippy::too_many_arguments)]
    fn observe(
        &self,
        worker: &Bound<'_, PyAny>,
        predicted_blocks: u64,
        block_size: usize,
        prompt_tokens: u64,
        cached_tokens: u64,
        routed_tokens: Option<u64>,
        indexed_blocks: u64,
    ) -> PyResult<(&'static str, Option<String>)> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be >= 1"));
        }
        if cached_tokens > prompt_tokens {
            return Err(PyValueError::new_err(format!("cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")));
        }
        let o = Observation {
            worker: extract_u64(worker, "worker")?,
            predicted_blocks,
            block_size,
            routed_tokens,
            prompt_tokens,
            cached_tokens,
            indexed_blocks,
        };
        let (outcome, alarm) = self.inner.observe(&o);
        Ok((outcome.name(), alarm))
    }

    /// The counters: requests per outcome, error tokens, alarms, whether the alarm is up.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        snapshot_dict(py, &self.inner.snapshot(), self.inner.last_alarm())
    }
}

pub(crate) fn snapshot_dict<'py>(py: Python<'py>, s: &CheckSnapshot, last_alarm: Option<String>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let outcomes = PyDict::new(py);
    for o in Outcome::ALL {
        outcomes.set_item(o.name(), s.outcomes[o as usize])?;
    }
    d.set_item("outcomes", outcomes)?;
    d.set_item("over_tokens", s.over_tokens)?;
    d.set_item("under_tokens", s.under_tokens)?;
    d.set_item("alarms", s.alarms)?;
    d.set_item("alarmed", s.alarmed)?;
    d.set_item("last_alarm", last_alarm)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixCheck>()
}
