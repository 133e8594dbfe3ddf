//! kvroute's Python exception hierarchy; every error kvroute raises on purpose derives from
//! `KvrouteError` (argument errors stay TypeError/ValueError, as Python code expects).

use kvroute_core::IndexError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(kvroute, KvrouteError, PyException, "Base class of kvroute's own errors.");
create_exception!(kvroute, IndexCapacityError, KvrouteError, "The index cannot hold more blocks or workers.");

/// Index errors: corrupt dumps are bad input (ValueError); capacity limits are kvroute errors.
pub fn index_err(e: IndexError) -> PyErr {
    match e {
        IndexError::Corrupt(_) => PyValueError::new_err(e.to_string()),
        IndexError::Full(_) | IndexError::TooManyWorkers(_) => IndexCapacityError::new_err(e.to_string()),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("KvrouteError", m.py().get_type::<KvrouteError>())?;
    m.add("IndexCapacityError", m.py().get_type::<IndexCapacityError>())?;
    Ok(())
}
