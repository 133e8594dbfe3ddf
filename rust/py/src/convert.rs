//! Python -> Rust argument conversion: token ids and hashes from lists or numpy arrays,
//! borrowed without copying when the array already has the right dtype and is contiguous.

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyString};

/// A slice that is either borrowed from a numpy array or owned.
pub enum Ids<'py, T: numpy::Element> {
    /// A contiguous array of the right dtype, read in place.
    Borrowed(Bound<'py, PyArray1<T>>),
    Owned(Vec<T>),
}

impl<T: numpy::Element> Ids<'_, T> {
    pub fn as_slice(&self) -> &[T] {
        match self {
            // SAFETY: the array is contiguous (checked when built) and kept alive by the Bound.
            // We skip rust-numpy's borrow registry (it costs more than a short match) and only
            // read. As with any C extension reading a numpy buffer without the GIL, the caller
            // must not mutate the array from another thread during the call.
            Ids::Borrowed(a) => unsafe { a.as_slice().expect("checked contiguous") },
            Ids::Owned(v) => v,
        }
    }
}

pub fn check_block_size(block_size: i64) -> PyResult<usize> {
    if block_size < 1 {
        return Err(PyValueError::new_err(format!("block_size must be >= 1, got {block_size}")));
    }
    Ok(block_size as usize)
}

/// Converts a 1-D integer array or a sequence of ints, checking each value fits `T`.
fn extract_ids<'py, T>(obj: &Bound<'py, PyAny>, what: &str, max: u64) -> PyResult<Ids<'py, T>>
where
    T: numpy::Element + Copy + TryFrom<u64>,
{
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(PyValueError::new_err(format!("{what} must be a 1-D array, got {} dimensions", arr.ndim())));
        }
        let dtype = arr.dtype();
        if dtype.is_equiv_to(&numpy::dtype::<T>(obj.py())) {
            let a = obj.cast::<PyArray1<T>>()?;
            if a.is_contiguous() {
                return Ok(Ids::Borrowed(a.clone()));
            }
            return Ok(Ids::Owned(a.readonly().as_array().iter().copied().collect()));
        }
        let kind = dtype.kind();
        if kind != b'i' && kind != b'u' {
            return Err(PyTypeError::new_err(format!("{what} must be integers, got an array of dtype {}", dtype.str()?)));
        }
        // Any other integer dtype: widen through int64/uint64 with range checks.
        let vals: Vec<u64> = if kind == b'u' {
            let a = obj.call_method1("astype", ("uint64",))?;
            a.cast::<PyArray1<u64>>()?.readonly().as_array().to_vec()
        } else {
            let a = obj.call_method1("astype", ("int64",))?;
            let a = a.cast::<PyArray1<i64>>()?.readonly();
            let mut out = Vec::with_capacity(a.len());
            for (i, &v) in a.as_array().iter().enumerate() {
                if v < 0 {
                    return Err(PyValueError::new_err(format!("{what}[{i}] = {v} is negative; expected 0..={max}")));
                }
                out.push(v as u64);
            }
            out
        };
        return to_t(vals, what, max).map(Ids::Owned);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!("{what} must be a sequence of ints or a 1-D integer numpy array, not str/bytes")));
    }
    let mut out: Vec<T> = Vec::with_capacity(obj.len().unwrap_or(0));
    let mut push = |i: usize, item: Bound<'py, PyAny>| -> PyResult<()> {
        if item.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!("{what}[{i}] is a bool, expected an int")));
        }
        match item.extract::<u64>() {
            Ok(v) => match T::try_from(v) {
                Ok(t) => {
                    out.push(t);
                    Ok(())
                }
                Err(_) => Err(PyValueError::new_err(format!("{what}[{i}] = {v} is out of range; expected 0..={max}"))),
            },
            Err(_) if item.extract::<i128>().is_ok() || item.call_method0("__index__").is_ok() => {
                Err(PyValueError::new_err(format!("{what}[{i}] = {} is out of range; expected 0..={max}", item.repr()?)))
            }
            Err(_) => Err(PyTypeError::new_err(format!("{what}[{i}] must be an int, got {}", item.get_type().name()?))),
        }
    };
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a sequence of ints or a 1-D integer numpy array, got {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    for (i, item) in iter.enumerate() {
        push(i, item?)?;
    }
    Ok(Ids::Owned(out))
}

fn to_t<T: TryFrom<u64>>(vals: Vec<u64>, what: &str, max: u64) -> PyResult<Vec<T>> {
    let mut out = Vec::with_capacity(vals.len());
    for (i, v) in vals.into_iter().enumerate() {
        match T::try_from(v) {
            Ok(t) => out.push(t),
            Err(_) => return Err(PyValueError::new_err(format!("{what}[{i}] = {v} is out of range; expected 0..={max}"))),
        }
    }
    Ok(out)
}

/// Token ids: a list or 1-D integer array of values in 0..2^32 (uint32 arrays borrowed).
pub fn extract_tokens<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Ids<'py, u32>> {
    extract_ids::<u32>(obj, "tokens", u32::MAX as u64)
}

/// Sequence hashes: a list or 1-D integer array of values in 0..2^64 (uint64 arrays borrowed).
pub fn extract_hashes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Ids<'py, u64>> {
    extract_ids::<u64>(obj, "hashes", u64::MAX)
}

/// A worker id or a hash given as a Python int in 0..2^64.
pub fn extract_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!("{what} must be an int, got bool")));
    }
    match obj.extract::<u64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.extract::<i128>().is_ok() => {
            Err(PyValueError::new_err(format!("{what} = {} is out of range; expected 0..2**64", obj.repr()?)))
        }
        Err(_) => Err(PyTypeError::new_err(format!("{what} must be an int, got {}", obj.get_type().name()?))),
    }
}
