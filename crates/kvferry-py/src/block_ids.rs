//! Block-id lists from Python, checked at native speed: a region's block ids are
//! `u32`, and a get into a large landing region names thousands of them (LMCache's
//! 32 MiB chunks in 4 KiB blocks: 8,192 a chunk), which a per-element Python check
//! cost about 0.1 ms per thousand on the development VM.

use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList};

use crate::errors::ErrInfo;

/// Checks that `ids` is a non-empty list of integers in `0..2**32` (Python ints, or
/// any object with `__index__`, such as NumPy's integer scalars; floats and strings
/// are refused). Raises `InvalidArgumentError` naming `what` and the first bad
/// element.
#[pyfunction]
pub fn check_block_ids(ids: &Bound<'_, PyList>, what: &str) -> PyResult<()> {
    if ids.is_empty() {
        return Err(ErrInfo::invalid(format!("{what} is empty")).into());
    }
    for (at, item) in ids.iter().enumerate() {
        if item.extract::<u32>().is_ok() {
            continue;
        }
        let integral = item.is_instance_of::<PyInt>() || item.hasattr("__index__").unwrap_or(false);
        let message = if integral {
            format!("{what}: block ids must be in 0..2**32, got {item} at position {at}")
        } else {
            let repr = item.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
            format!("{what} must be a sequence of ints, got {repr} at position {at}")
        };
        return Err(ErrInfo::invalid(message).into());
    }
    Ok(())
}
