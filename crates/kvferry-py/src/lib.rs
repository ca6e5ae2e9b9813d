//! The `kvferry._kvferry` extension module: a thin layer over [`kvferry::engine`].
//! The typed Python package `kvferry` (in `python/`) wraps it.

#![warn(clippy::undocumented_unsafe_blocks)]
// Python signatures dictate the arity of methods and the shapes of their arguments, and
// `ErrInfo` travels only on the (cold) error path.
#![allow(clippy::too_many_arguments, clippy::type_complexity, clippy::result_large_err)]

mod block_ids;
mod bounded_wait;
mod completion;
mod device;
mod directory;
mod dlpack;
mod engine;
mod errors;
mod linger;
mod options;
mod region;
mod runtime;
mod selection;
mod spin;
mod transfer;

use pyo3::prelude::*;

/// Chunk keys as the engine sees them: `str` names are hashed, 32 bytes are used as is.
#[pyfunction]
fn key_bytes<'py>(py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    Ok(pyo3::types::PyBytes::new(py, &engine::key_of(key)?.0))
}

/// crc32c (Castagnoli) of a C-contiguous buffer — the checksum kvferry puts on the
/// wire — computed with the GIL released (hardware-accelerated where available).
#[pyfunction]
fn crc32c(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u32> {
    let buf = engine::byte_buffer(data, "crc32c")?;
    let len = buf.len_bytes();
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: the buffer is held (and C-contiguous) for this call; it is only read.
    let bytes = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) };
    Ok(py.detach(|| kvferry::engine::checksum(bytes)))
}

#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<options::PyEngineOptions>()?;
    m.add_class::<region::PyRegion>()?;
    m.add_class::<transfer::PyTransfer>()?;
    m.add_class::<engine::PyStaged>()?;
    m.add_class::<device::PyDeviceMemory>()?;
    m.add_function(wrap_pyfunction!(key_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack::dlpack_info, m)?)?;
    m.add_function(wrap_pyfunction!(bounded_wait::bounded_wait, m)?)?;
    errors::add_classes(m)?;
    m.add_function(wrap_pyfunction!(bounded_wait::_bounded_wait_stats, m)?)?;
    m.add_class::<completion::PyCompletionEvent>()?;
    m.add_function(wrap_pyfunction!(selection::check_selection, m)?)?;
    m.add_class::<block_ids::PyBlockIds>()?;
    m.add_function(wrap_pyfunction!(block_ids::check_block_ids, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("HAS_ETCD", directory::HAS_ETCD)?;
    m.add("HAS_CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
