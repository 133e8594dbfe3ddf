//! Bindings for the simulator's Rust parts: the seed's chat workload generator and the
//! simulated prefill engines (LRU caches + FIFO queues publishing events into a `KvIndex`).

use kvroute_core::sim::{seed_chat, ChatShape, PrefillEngines, SimError};
use numpy::{IntoPyArray, PyArray1};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{check_block_size, extract_hashes};
use crate::index::PyKvIndex;

fn sim_err(e: SimError) -> PyErr {
    match e {
        SimError::UnknownWorker(..) => PyIndexError::new_err(e.to_string()),
        SimError::Index(ie) => crate::errors::index_err(ie),
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn positive(x: f64, what: &str) -> PyResult<f64> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(PyValueError::new_err(format!("{what} must be a finite number > 0, got {x}")))
    }
}

fn count(x: i64, what: &str, min: i64) -> PyResult<usize> {
    if x < min {
        return Err(PyValueError::new_err(format!("{what} must be >= {min}, got {x}")));
    }
    Ok(x as usize)
}

/// The seed's chat workload (`workload(rate, seconds, seed)`), generated with CPython's
/// MT19937 in the seed's call order, plus each request's chained block hashes.
///
/// Returns a dict of numpy arrays: `arrival` (s), `conversation`, `num_tokens`, `hash_offsets`
/// (request i's hashes are `hashes[hash_offsets[i]:hash_offsets[i+1]]`) and `hashes`; with
/// `with_tokens=True` also `conversation_tokens`, a list of uint32 arrays (each conversation's
/// final tokens; request i's prompt is the first `num_tokens[i]` of its conversation's).
#[pyfunction]
#[pyo3(signature = (rate, seconds, seed = 0, *, systems = 20, system_tokens = 2048, conversations = 400,
                    turn_tokens = 300, vocab = 1_000_000, block_size = 64, hash_seed = 1337, with_tokens = false))]
#[allow(clippy::too_many_arguments)]
pub fn seed_chat_workload<'py>(
    py: Python<'py>,
    rate: f64,
    seconds: f64,
    seed: u64,
    systems: i64,
    system_tokens: i64,
    conversations: i64,
    turn_tokens: i64,
    vocab: u64,
    block_size: i64,
    hash_seed: u64,
    with_tokens: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let rate = positive(rate, "rate")?;
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!("seconds must be a finite number >= 0, got {seconds}")));
    }
    if !(1..=1u64 << 32).contains(&vocab) {
        return Err(PyValueError::new_err(format!("vocab must be in 1..=2**32, got {vocab}")));
    }
    let bs = check_block_size(block_size)?;
    let shape = ChatShape {
        systems: count(systems, "systems", 1)?,
        system_tokens: count(system_tokens, "system_tokens", 0)?,
        conversations: count(conversations, "conversations", 1)?,
        turn_tokens: count(turn_tokens, "turn_tokens", 0)?,
        vocab,
    };
    let (w, offsets, hashes) = py.detach(|| {
        let w = seed_chat(rate, seconds, seed, &shape);
        let conv_hashes: Vec<Vec<u64>> =
            w.conversation_tokens.iter().map(|t| kvroute_core::hash::sequence_hashes(t, bs, hash_seed, None)).collect();
        let mut offsets = Vec::with_capacity(w.arrival.len() + 1);
        let mut hashes = Vec::new();
        offsets.push(0i64);
        for (i, &c) in w.conversation.iter().enumerate() {
            let nb = w.num_tokens[i] as usize / bs;
            hashes.extend_from_slice(&conv_hashes[c as usize][..nb]);
            offsets.push(hashes.len() as i64);
        }
        (w, offsets, hashes)
    });
    let d = PyDict::new(py);
    let num_tokens: Vec<i64> = w.num_tokens.iter().map(|&n| n as i64).collect();
    d.set_item("arrival", w.arrival.into_pyarray(py))?;
    d.set_item("conversation", w.conversation.into_pyarray(py))?;
    d.set_item("num_tokens", num_tokens.into_pyarray(py))?;
    d.set_item("hash_offsets", offsets.into_pyarray(py))?;
    d.set_item("hashes", hashes.into_pyarray(py))?;
    if with_tokens {
        let toks: Vec<Bound<'py, PyArray1<u32>>> = w.conversation_tokens.into_iter().map(|t| t.into_pyarray(py)).collect();
        d.set_item("conversation_tokens", toks)?;
    }
    Ok(d)
}

/// Simulated prefill engines, the seed's cluster: engine `i` (published as worker `worker_ids[i]`)
/// has an LRU prefix cache of `capacity_blocks` blocks and a FIFO queue prefilling
/// `tokens_per_s` uncached tokens per second. With `index`, engines publish block stored/removed
/// events into it, `event_lag` seconds after they happen (0: immediately). With `shared_cache`,
/// one LRU of `capacity_blocks` x engines blocks serves every engine (the global-cache bound).
#[pyclass(module = "kvroute._core", name = "PrefillEngines")]
pub struct PyPrefillEngines {
    inner: PrefillEngines,
}

#[pymethods]
impl PyPrefillEngines {
    #[new]
    #[pyo3(signature = (worker_ids, *, capacity_blocks, tokens_per_s, block_size = 64, index = None, event_lag = 0.0, shared_cache = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        worker_ids: Vec<u64>,
        capacity_blocks: i64,
        tokens_per_s: f64,
        block_size: i64,
        index: Option<PyRef<'_, PyKvIndex>>,
        event_lag: f64,
        shared_cache: bool,
    ) -> PyResult<Self> {
        let cap = count(capacity_blocks, "capacity_blocks", 0)?;
        let bs = check_block_size(block_size)?;
        let mut seen = std::collections::HashSet::new();
        if let Some(w) = worker_ids.iter().find(|w| !seen.insert(**w)) {
            return Err(PyValueError::new_err(format!("worker_ids must be distinct; {w} appears twice")));
        }
        let idx = index.map(|i| i.inner.clone());
        let make = if shared_cache { PrefillEngines::shared } else { PrefillEngines::new };
        let inner = make(worker_ids, cap, tokens_per_s, bs, idx, event_lag).map_err(sim_err)?;
        Ok(PyPrefillEngines { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Worker ids, by engine index.
    #[getter]
    fn worker_ids(&self) -> Vec<u64> {
        self.inner.ids().to_vec()
    }

    /// When each engine's queue drains (virtual seconds), by engine index.
    #[getter]
    fn busy_until(&self) -> Vec<f64> {
        self.inner.busy_until().to_vec()
    }

    /// Events published into the index so far, and events still waiting out their lag.
    #[getter]
    fn events_published(&self) -> u64 {
        self.inner.events_published()
    }

    #[getter]
    fn pending_events(&self) -> usize {
        self.inner.pending_events()
    }

    /// Enqueues a prefill on engine `engine` at virtual time `now`; returns
    /// `(hit_blocks, hit_tokens, start, finish)`. `now` must not decrease between calls.
    fn prefill(
        &mut self,
        py: Python<'_>,
        engine: usize,
        hashes: &Bound<'_, PyAny>,
        num_tokens: i64,
        now: f64,
    ) -> PyResult<(usize, usize, f64, f64)> {
        let hs = extract_hashes(hashes)?;
        let n = count(num_tokens, "num_tokens", 1)?;
        let s = hs.as_slice();
        let inner = &mut self.inner;
        let p = py.detach(|| inner.prefill(engine, s, n, now)).map_err(sim_err)?;
        Ok((p.hit_blocks, p.hit_tokens, p.start, p.finish))
    }

    /// Leading blocks of `hashes` cached on engine `engine` (the truth, not the index's view).
    fn hit_blocks(&self, engine: usize, hashes: &Bound<'_, PyAny>) -> PyResult<usize> {
        let hs = extract_hashes(hashes)?;
        self.inner.hit_blocks(engine, hs.as_slice()).map_err(sim_err)
    }

    /// Publishes the events due by `now`.
    fn advance(&mut self, now: f64) -> PyResult<()> {
        self.inner.advance(now).map_err(sim_err)
    }

    /// Publishes every pending event.
    fn flush(&mut self) -> PyResult<()> {
        self.inner.flush().map_err(sim_err)
    }

    /// Engine `engine`'s cached block hashes, least recently used first.
    fn cached_blocks<'py>(&self, py: Python<'py>, engine: usize) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let c = self.inner.cache(engine).map_err(sim_err)?;
        Ok(c.iter_lru().collect::<Vec<u64>>().into_pyarray(py))
    }

    /// Drops engine `engine`'s cache at time `now` (publishing removals); returns blocks dropped.
    fn clear(&mut self, engine: usize, now: f64) -> PyResult<usize> {
        self.inner.clear(engine, now).map_err(sim_err)
    }

    fn __repr__(&self) -> String {
        format!("PrefillEngines({} workers, {} events published)", self.inner.len(), self.inner.events_published())
    }
}

/// Chains per-request block ids (e.g. a Mooncake trace's `hash_ids`) into sequence hashes:
/// request i's ids are `ids[offsets[i]:offsets[i+1]]`; each request's chain starts fresh, so
/// equal hashes mean equal ids at every position up to that block.
#[pyfunction]
#[pyo3(signature = (ids, offsets, *, seed = 1337))]
pub fn chain_block_ids<'py>(
    py: Python<'py>,
    ids: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    seed: u64,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let ids = extract_hashes(ids)?;
    let offs = extract_hashes(offsets)?;
    let (ids, offs) = (ids.as_slice(), offs.as_slice());
    if offs.first().copied().unwrap_or(0) != 0
        || offs.last().copied().unwrap_or(0) != ids.len() as u64
        || offs.windows(2).any(|w| w[0] > w[1])
    {
        return Err(PyValueError::new_err(format!(
            "offsets must start at 0, never decrease and end at len(ids) = {}; got {} offsets",
            ids.len(),
            offs.len()
        )));
    }
    let out = py.detach(|| {
        let mut out = Vec::with_capacity(ids.len());
        for w in offs.windows(2) {
            out.extend(kvroute_core::hash::chain_local_hashes(&ids[w[0] as usize..w[1] as usize], seed, None));
        }
        out
    });
    Ok(out.into_pyarray(py))
}
