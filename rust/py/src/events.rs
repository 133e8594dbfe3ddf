//! Live KV events: `KvIndex.apply_event_batch` and the `kvroute.EventError` it raises.
//! Decoding and applying run in the core with the GIL released.

use kvroute_core::events::{ApplyStats, EventError as CoreEventError};
use pyo3::prelude::*;

use crate::convert::{check_block_size, extract_u64};
use crate::errors::{IndexCapacityError, KvrouteError};
use crate::index::PyKvIndex;

pyo3::create_exception!(
    kvroute,
    EventError,
    KvrouteError,
    "A KV-event batch payload was malformed (the message names the field and the problem); nothing of it was applied."
);

/// Decodes and applies one batch payload to `worker + data_parallel_rank`.
pub fn apply(
    idx: &PyKvIndex,
    py: Python<'_>,
    worker: &Bound<'_, PyAny>,
    payload: &[u8],
    block_size: i64,
    seed: u64,
) -> PyResult<ApplyStats> {
    let w = extract_u64(worker, "worker")?;
    let bs = check_block_size(block_size)?;
    let inner = &idx.inner;
    py.detach(|| inner.apply_event_batch(w, payload, bs, seed)).map_err(|e| match e {
        CoreEventError::Capacity { .. } => IndexCapacityError::new_err(e.to_string()),
        e => EventError::new_err(e.to_string()),
    })
}
