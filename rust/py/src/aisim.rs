//! The realistic engine model (kvroute-aisim, NVIDIA AISimulate's engines) for `kvroute.sim.aisim`:
//! one replay per call, configured and reported as JSON so the typed Rust structs
//! (`RunSpec`, `RunResult`) stay the one definition of both.

use std::path::PathBuf;

use kvroute_aisim::{load_trace, run, trace_from_rows_in_blocks, Placer, RunSpec, TRACE_BLOCK_SIZE};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::KvrouteError;
use crate::router::PyRouter;

/// Replays a Mooncake-format trace (`trace_path`, or the same rows as JSON lines in
/// `trace_jsonl`) on an AISimulate cluster described by `spec_json` (a `RunSpec`: engine,
/// topology, slo), placed by `router` (a fresh `Router` with no workers) or, when None, by round
/// robin. Returns the `RunResult` as JSON (summary and per-request records). `trace_block_size`:
/// tokens per `hash_ids` entry of `trace_jsonl` rows (Mooncake's 512 by default).
#[pyfunction]
#[pyo3(signature = (spec_json, *, router = None, trace_path = None, trace_jsonl = None, speedup = 1.0, trace_block_size = TRACE_BLOCK_SIZE))]
pub fn aisim_replay(
    py: Python<'_>,
    spec_json: &str,
    router: Option<&Bound<'_, PyRouter>>,
    trace_path: Option<PathBuf>,
    trace_jsonl: Option<String>,
    speedup: f64,
    trace_block_size: usize,
) -> PyResult<String> {
    let spec: RunSpec = serde_json::from_str(spec_json).map_err(|e| PyValueError::new_err(format!("invalid aisim spec: {e}")))?;
    spec.engine.validate().map_err(|e| PyValueError::new_err(format!("{e:#}")))?;
    let placer = match router {
        Some(r) => Placer::Kvroute(r.get().inner.clone()),
        None => Placer::RoundRobin,
    };
    let result = py.detach(move || -> Result<String, (bool, String)> {
        let trace = match (trace_path, trace_jsonl) {
            (Some(p), None) => load_trace(&p, speedup).map_err(|e| (true, format!("{e:#}")))?,
            (None, Some(text)) => {
                let mut rows = Vec::new();
                for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                    rows.push(serde_json::from_str(line).map_err(|e| (true, format!("trace line {}: {e}", i + 1)))?);
                }
                trace_from_rows_in_blocks(rows, trace_block_size, speedup).map_err(|e| (true, format!("{e:#}")))?
            }
            _ => return Err((true, "give the trace as trace_path or trace_jsonl (one of them)".into())),
        };
        let r = run(&spec, placer, trace).map_err(|e| (false, format!("{e:#}")))?;
        serde_json::to_string(&r).map_err(|e| (false, e.to_string()))
    });
    result.map_err(|(bad_input, msg)| if bad_input { PyValueError::new_err(msg) } else { KvrouteError::new_err(msg) })
}
