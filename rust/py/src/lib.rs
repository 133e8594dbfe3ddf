//! PyO3 bindings for kvroute-core: argument conversion (numpy zero-copy), errors to Python
//! exceptions, and the GIL released around every call that does real work.

#[cfg(feature = "aisim")]
mod aisim;
mod check;
mod convert;
mod dataplane;
mod errors;
mod events;
mod index;
mod prompt;
mod router;
mod sim;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use convert::{check_block_size, extract_tokens};

/// Per full block, xxh3-64 of the block's token ids as little-endian u32, with `seed`.
#[pyfunction]
#[pyo3(signature = (tokens, block_size = 64, *, seed = 1337))]
fn local_block_hashes<'py>(py: Python<'py>, tokens: &Bound<'py, PyAny>, block_size: i64, seed: u64) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let bs = check_block_size(block_size)?;
    let toks = extract_tokens(tokens)?;
    let slice = toks.as_slice();
    let out = py.detach(|| kvroute_core::hash::local_block_hashes(slice, bs, seed));
    Ok(out.into_pyarray(py))
}

/// Chained sequence hashes of every full block (Dynamo's scheme): `seq[0] = local[0]`,
/// `seq[i] = xxh3_64(le_u64(seq[i-1]) ++ le_u64(local[i]), seed)`.
#[pyfunction]
/// `identity` (from `identity_root`) keys the blocks under a LoRA adapter or a cache salt.
#[pyo3(signature = (tokens, block_size = 64, *, seed = 1337, identity = None))]
fn block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: i64,
    seed: u64,
    identity: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let bs = check_block_size(block_size)?;
    let identity = identity.map(|p| convert::extract_u64(p, "identity")).transpose()?;
    let toks = extract_tokens(tokens)?;
    let slice = toks.as_slice();
    let out = py.detach(|| kvroute_core::hash::sequence_hashes(slice, bs, seed, identity));
    Ok(out.into_pyarray(py))
}

/// Chains already-computed local block hashes into sequence hashes; `parent` continues a chain.
#[pyfunction]
#[pyo3(signature = (local_hashes, *, parent = None, seed = 1337))]
fn chain_hashes<'py>(
    py: Python<'py>,
    local_hashes: &Bound<'py, PyAny>,
    parent: Option<&Bound<'py, PyAny>>,
    seed: u64,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let parent = parent.map(|p| convert::extract_u64(p, "parent")).transpose()?;
    let locals = convert::extract_hashes(local_hashes)?;
    let slice = locals.as_slice();
    let out = py.detach(|| kvroute_core::hash::chain_local_hashes(slice, seed, parent));
    Ok(out.into_pyarray(py))
}

/// The identity a request's KV is keyed under when the engine mixes more than its tokens into
/// block keys: the LoRA adapter serving it (`lora`, its name as the engine serves it) and its
/// `cache_salt`. None for the base model without a salt (blocks hash as plain tokens). Pass it to
/// `block_hashes(..., identity=)` or `Router.route(tokens, identity=)`.
#[pyfunction]
#[pyo3(signature = (*, lora = None, cache_salt = None))]
fn identity_root(lora: Option<&str>, cache_salt: Option<&str>) -> Option<u64> {
    kvroute_core::hash::identity_root(lora.map(str::as_bytes), cache_salt.map(str::as_bytes))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(local_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(chain_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(identity_root, m)?)?;
    errors::register(m)?;
    m.add_class::<index::PyKvIndex>()?;
    m.add_class::<index::MatchResult>()?;
    m.add_function(wrap_pyfunction!(sim::seed_chat_workload, m)?)?;
    m.add_class::<sim::PyPrefillEngines>()?;
    m.add_function(wrap_pyfunction!(sim::chain_block_ids, m)?)?;
    m.add("NUM_SHARDS", kvroute_core::index::NUM_SHARDS)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    router::register(m)?;
    m.add("EventError", m.py().get_type::<events::EventError>())?;
    dataplane::register(m)?;
    prompt::register(m)?;
    check::register(m)?;
    #[cfg(feature = "aisim")]
    m.add_function(wrap_pyfunction!(aisim::aisim_replay, m)?)?;
    m.add("HAS_AISIM", cfg!(feature = "aisim"))?;
    Ok(())
}
