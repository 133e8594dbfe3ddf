//! `kvroute._core.ExactPrompter`: exact mode's prompter (the engines' tokenizer.json and chat
//! template, kvroute-gateway's `ExactPrompter`) for `kvroute.prompt`, so the gateway and the
//! integrations derive a request's hashes with one implementation.

use std::path::PathBuf;

use kvroute_gateway::{ExactError, ExactPrompter};
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyFileNotFoundError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::check_block_size;
use crate::dataplane::{bad_request, parse};

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
    fn prompt<'py>(&self, py: Python<'py>, body: &[u8], chat: bool) -> PyResult<Bound<'py, PyTuple>> {
        let value = parse(body)?;
        let (p, exact) = py.detach(|| self.inner.routed_prompt(&value, chat)).map_err(bad_request)?;
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

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyExactPrompter>()
}
