//! `kvroute.KvIndex` and its compact match result.

use std::sync::Arc;

use kvroute_core::{index::Matches, KvIndex, Tier, TierMask, ANY_TIER};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::convert::{extract_hashes, extract_u64};
use crate::errors::index_err;

fn parse_tier(tier: &str) -> PyResult<Tier> {
    Tier::from_name(tier).ok_or_else(|| PyValueError::new_err(format!("tier must be 'device', 'host' or 'disk', got {tier:?}")))
}

fn parse_tiers(tier: Option<&str>) -> PyResult<TierMask> {
    Ok(match tier {
        None => ANY_TIER,
        Some(t) => parse_tier(t)?.bit(),
    })
}

/// Longest match (in blocks) run without releasing the GIL.
const SHORT_MATCH: usize = 256;
/// Longest store (in blocks) run without releasing the GIL, on an index without `max_nodes`
/// (whose stores may evict, a scan of the whole index).
const SHORT_STORE: usize = 64;

/// A concurrent radix index over chained block hashes with per-worker membership.
///
/// >>> idx = KvIndex()
/// >>> idx.store(0, block_hashes(list(range(128)), 64))
/// 2
#[pyclass(frozen, module = "kvroute._core", name = "KvIndex")]
pub struct PyKvIndex {
    pub inner: Arc<KvIndex>,
}

#[pymethods]
impl PyKvIndex {
    #[new]
    #[pyo3(signature = (max_nodes = None))]
    fn new(max_nodes: Option<i64>) -> PyResult<Self> {
        let cap = match max_nodes {
            None => None,
            Some(n) if n >= 1 => Some(n as usize),
            Some(n) => return Err(PyValueError::new_err(format!("max_nodes must be >= 1 or None, got {n}"))),
        };
        Ok(PyKvIndex { inner: Arc::new(KvIndex::new(cap)) })
    }

    /// Records that `worker` holds the consecutive blocks `hashes` on `tier`; `parent` is the
    /// sequence hash of the block before `hashes[0]` (None: they start at block 0).
    /// Returns the number of new (block, worker) entries.
    #[pyo3(signature = (worker, hashes, *, parent = None, tier = "device"))]
    fn store(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        tier: &str,
    ) -> PyResult<usize> {
        let w = extract_u64(worker, "worker")?;
        let parent = parent.map(|p| extract_u64(p, "parent")).transpose()?;
        let tier = parse_tier(tier)?;
        let hs = extract_hashes(hashes)?;
        let s = hs.as_slice();
        let idx = &self.inner;
        // Engines publish a few blocks per event: such a store takes well under a microsecond,
        // of which releasing and retaking the GIL would be a tenth. Like a short match it never
        // waits on Python: no thread holding a shard lock needs the GIL.
        if s.len() <= SHORT_STORE && idx.max_nodes().is_none() {
            return idx.store(w, s, parent, tier).map_err(index_err);
        }
        py.detach(|| idx.store(w, s, parent, tier)).map_err(index_err)
    }

    /// Records that `worker` dropped `hashes` (from `tier`, or from every tier when None).
    /// Unknown blocks and workers are counted in `stats()`, not raised. Returns entries removed.
    #[pyo3(signature = (worker, hashes, *, tier = None))]
    fn remove(&self, py: Python<'_>, worker: &Bound<'_, PyAny>, hashes: &Bound<'_, PyAny>, tier: Option<&str>) -> PyResult<usize> {
        let w = extract_u64(worker, "worker")?;
        let mask = parse_tiers(tier)?;
        let hs = extract_hashes(hashes)?;
        let s = hs.as_slice();
        let idx = &self.inner;
        Ok(py.detach(|| idx.remove(w, s, mask)))
    }

    /// The worker dropped its whole cache. Returns entries removed (0 for an unknown worker).
    fn clear(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<usize> {
        let w = extract_u64(worker, "worker")?;
        let idx = &self.inner;
        Ok(py.detach(|| idx.clear(w)))
    }

    /// Forgets the worker entirely. Returns entries removed (0 for an unknown worker).
    fn remove_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<usize> {
        let w = extract_u64(worker, "worker")?;
        let idx = &self.inner;
        Ok(py.detach(|| idx.remove_worker(w)))
    }

    /// For each worker holding `hashes[0]`: how many leading blocks of `hashes` it holds.
    /// `hashes` are chained sequence hashes (`block_hashes`, engines' KV events): each stands for
    /// the whole prefix up to it.
    #[pyo3(name = "match", signature = (hashes, *, tier = None))]
    fn match_(&self, py: Python<'_>, hashes: &Bound<'_, PyAny>, tier: Option<&str>) -> PyResult<MatchResult> {
        let mask = parse_tiers(tier)?;
        let hs = extract_hashes(hashes)?;
        let s = hs.as_slice();
        let idx = &self.inner;
        // A short match takes about a microsecond, of which releasing and retaking the GIL would
        // be a tenth; it never waits on Python (no thread holding a shard lock needs the GIL).
        let m = if s.len() <= SHORT_MATCH { idx.find_matches(s, mask) } else { py.detach(|| idx.find_matches(s, mask)) };
        Ok(MatchResult { m })
    }

    /// `match` per tier: {"device": ..., "host": ..., "disk": ...}.
    fn match_tiers<'py>(&self, py: Python<'py>, hashes: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let hs = extract_hashes(hashes)?;
        let s = hs.as_slice();
        let idx = &self.inner;
        let per: Vec<Matches> = py.detach(|| Tier::ALL.iter().map(|t| idx.find_matches(s, t.bit())).collect());
        let d = PyDict::new(py);
        for (t, m) in Tier::ALL.iter().zip(per) {
            d.set_item(t.name(), MatchResult { m })?;
        }
        Ok(d)
    }

    /// Decodes one vLLM/SGLang KV-event batch payload (the msgpack frame after topic and seq)
    /// and applies it to worker `worker + data_parallel_rank`. `block_size`/`seed` are the
    /// router's. The whole batch is validated first: on `EventError` nothing was applied.
    /// Returns the number of events applied.
    #[pyo3(signature = (worker, payload, *, block_size, seed = 1337))]
    fn apply_event_batch(&self, py: Python<'_>, worker: &Bound<'_, PyAny>, payload: &[u8], block_size: i64, seed: u64) -> PyResult<usize> {
        crate::events::apply(self, py, worker, payload, block_size, seed).map(|s| s.events)
    }

    /// `apply_event_batch` returning (worker, events, skipped, blocks_stored, blocks_removed,
    /// orphan_blocks, unknown_removals); used by `kvroute.events`.
    #[pyo3(signature = (worker, payload, *, block_size, seed = 1337))]
    fn _apply_event_batch_stats(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        payload: &[u8],
        block_size: i64,
        seed: u64,
    ) -> PyResult<(u64, usize, usize, usize, usize, usize, usize)> {
        let s = crate::events::apply(self, py, worker, payload, block_size, seed)?;
        Ok((s.worker, s.events, s.skipped, s.blocks_stored, s.blocks_removed, s.orphan_blocks, s.unknown_removals))
    }

    /// Registered worker ids.
    fn workers(&self) -> Vec<u64> {
        self.inner.workers()
    }

    /// Blocks held by `worker` (0 for an unknown worker).
    fn num_blocks(&self, worker: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.num_blocks(extract_u64(worker, "worker")?))
    }

    /// Counters: nodes, entries, workers, estimated_bytes, orphan_stores, duplicate_stores,
    /// parent_mismatches, unknown_removals, evictions.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("nodes", s.nodes)?;
        d.set_item("entries", s.entries)?;
        d.set_item("workers", s.workers)?;
        d.set_item("estimated_bytes", s.estimated_bytes)?;
        d.set_item("orphan_stores", s.orphan_stores)?;
        d.set_item("duplicate_stores", s.duplicate_stores)?;
        d.set_item("parent_mismatches", s.parent_mismatches)?;
        d.set_item("unknown_removals", s.unknown_removals)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("max_nodes", self.inner.max_nodes())?;
        Ok(d)
    }

    /// Serializes the index for a warm restart (see `KvIndex.load`).
    fn dump<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let idx = &self.inner;
        let data = py.detach(|| idx.dump());
        PyBytes::new(py, &data)
    }

    /// Rebuilds an index from `dump()` output; corrupt data raises ValueError.
    #[staticmethod]
    #[pyo3(signature = (data, *, max_nodes = None))]
    fn load(py: Python<'_>, data: &[u8], max_nodes: Option<usize>) -> PyResult<Self> {
        let idx = py.detach(|| KvIndex::load(data, max_nodes)).map_err(index_err)?;
        Ok(PyKvIndex { inner: Arc::new(idx) })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!("KvIndex(nodes={}, entries={}, workers={})", s.nodes, s.entries, s.workers)
    }
}

/// Read-only mapping worker -> matched blocks, built without Python objects until read.
#[pyclass(frozen, module = "kvroute._core", mapping)]
pub struct MatchResult {
    pub m: Matches,
}

#[pymethods]
impl MatchResult {
    fn __len__(&self) -> usize {
        self.m.len()
    }

    fn __getitem__(&self, worker: &Bound<'_, PyAny>) -> PyResult<u32> {
        let w = worker.extract::<u64>().map_err(|_| PyKeyError::new_err(worker.clone().unbind()))?;
        self.m.get(w).ok_or_else(|| PyKeyError::new_err(w))
    }

    fn __contains__(&self, worker: &Bound<'_, PyAny>) -> bool {
        worker.extract::<u64>().map(|w| self.m.get(w).is_some()).unwrap_or(false)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        PyList::new(py, &self.m.workers)?.into_any().try_iter().map(|i| i.into_any())
    }

    #[pyo3(signature = (worker, default = None))]
    fn get<'py>(&self, py: Python<'py>, worker: &Bound<'py, PyAny>, default: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        match worker.extract::<u64>().ok().and_then(|w| self.m.get(w)) {
            Some(d) => Ok(d.into_pyobject(py)?.into_any()),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.m.workers)
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.m.depths)
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<Bound<'py, PyTuple>> = self
            .m
            .workers
            .iter()
            .zip(&self.m.depths)
            .map(|(w, d)| PyTuple::new(py, [w.into_pyobject(py)?.into_any(), d.into_pyobject(py)?.into_any()]))
            .collect::<PyResult<_>>()?;
        PyList::new(py, items)
    }

    /// Worker ids as a numpy uint64 array.
    #[getter]
    fn workers<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        let a = PyArray1::from_slice(py, &self.m.workers);
        a.readwrite().make_nonwriteable();
        a
    }

    /// Matched block counts as a numpy uint32 array, aligned with `workers`.
    #[getter]
    fn depths<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        let a = PyArray1::from_slice(py, &self.m.depths);
        a.readwrite().make_nonwriteable();
        a
    }

    /// Deepest match as (worker, blocks), or None when no worker matched.
    fn best(&self) -> Option<(u64, u32)> {
        let i = (0..self.m.len()).max_by_key(|&i| (self.m.depths[i], std::cmp::Reverse(self.m.workers[i])))?;
        Some((self.m.workers[i], self.m.depths[i]))
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (w, dep) in self.m.workers.iter().zip(&self.m.depths) {
            d.set_item(w, dep)?;
        }
        Ok(d)
    }

    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Ok(o) = other.cast::<MatchResult>() {
            let o = o.get();
            let mut a: Vec<_> = self.m.workers.iter().zip(&self.m.depths).collect();
            let mut b: Vec<_> = o.m.workers.iter().zip(&o.m.depths).collect();
            a.sort();
            b.sort();
            return Ok(a == b);
        }
        self.to_dict(py)?.eq(other)
    }

    fn __repr__(&self) -> String {
        let items: Vec<String> = self.m.workers.iter().zip(&self.m.depths).map(|(w, d)| format!("{w}: {d}")).collect();
        format!("MatchResult({{{}}})", items.join(", "))
    }
}
