//! The `kvferry._kvferry` extension module: a thin layer over [`kvferry::engine`].
//! The typed Python package `kvferry` (in `python/`) wraps it.

#![warn(clippy::undocumented_unsafe_blocks)]
// Python signatures dictate the arity of methods and the shapes of their arguments, and
// `ErrInfo` travels only on the (cold) error path.
#![allow(clippy::too_many_arguments, clippy::type_complexity, clippy::result_large_err)]

mod device;
mod engine;
mod errors;
mod region;
mod transfer;

use pyo3::prelude::*;

/// Chunk keys as the engine sees them: `str` names are hashed, 32 bytes are used as is.
#[pyfunction]
fn key_bytes<'py>(py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    Ok(pyo3::types::PyBytes::new(py, &engine::key_of(key)?.0))
}

#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<region::PyRegion>()?;
    m.add_class::<transfer::PyTransfer>()?;
    m.add_class::<engine::PyStaged>()?;
    m.add_class::<device::PyDeviceMemory>()?;
    m.add_function(wrap_pyfunction!(key_bytes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
