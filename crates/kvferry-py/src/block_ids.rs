//! Block-id lists from Python, checked and converted at native speed, once: a
//! region's block ids are `u32`, and a get into a large landing region names thousands
//! of them (LMCache's 32 MiB chunks in 4 KiB blocks: 8,192 a chunk), which a
//! per-element Python check cost about 0.1 ms per thousand on the development VM.
//!
//! [`check_block_ids`] walks a list once and returns a [`PyBlockIds`] holding the
//! converted ids; the engine's methods take that as it is ([`BlockIdsArg`]), so a
//! checked list is not walked a second time when a transfer starts.

use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList};

use crate::errors::ErrInfo;

/// A block-id list that [`check_block_ids`] checked (Python: `kvferry._kvferry.BlockIds`):
/// non-empty, every id a `u32`. Immutable.
#[pyclass(frozen, name = "BlockIds", module = "kvferry._kvferry")]
pub struct PyBlockIds {
    ids: Vec<u32>,
}

#[pymethods]
impl PyBlockIds {
    fn __len__(&self) -> usize {
        self.ids.len()
    }

    /// The ids as a Python list.
    fn tolist(&self) -> Vec<u32> {
        self.ids.clone()
    }

    fn __repr__(&self) -> String {
        match (self.ids.first(), self.ids.last()) {
            (Some(first), Some(last)) => format!("BlockIds({} ids, {first}..{last})", self.ids.len()),
            _ => "BlockIds(0 ids)".to_string(),
        }
    }
}

/// Checks that `ids` is a non-empty list of integers in `0..2**32` (Python ints, or
/// any object with `__index__`, such as NumPy's integer scalars; floats and strings
/// are refused) and returns them converted. Raises `InvalidArgumentError` naming
/// `what` and the first bad element.
#[pyfunction]
pub fn check_block_ids(ids: &Bound<'_, PyList>, what: &str) -> PyResult<PyBlockIds> {
    if ids.is_empty() {
        return Err(ErrInfo::invalid(format!("{what} is empty")).into());
    }
    let mut out = Vec::with_capacity(ids.len());
    for (at, item) in ids.iter().enumerate() {
        if let Ok(id) = item.extract::<u32>() {
            out.push(id);
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
    Ok(PyBlockIds { ids: out })
}

/// A block-id argument of the engine's methods: a [`PyBlockIds`] (already checked and
/// converted: its ids are copied, not walked as Python objects again) or any sequence
/// of ints (converted as `Vec<u32>` is).
pub struct BlockIdsArg(pub Vec<u32>);

impl<'a, 'py> FromPyObject<'a, 'py> for BlockIdsArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(checked) = obj.cast::<PyBlockIds>() {
            return Ok(BlockIdsArg(checked.get().ids.clone()));
        }
        Ok(BlockIdsArg(obj.extract::<Vec<u32>>()?))
    }
}

/// The ids of every row.
pub fn rows(rows: Vec<BlockIdsArg>) -> Vec<Vec<u32>> {
    rows.into_iter().map(|r| r.0).collect()
}
