//! Partial gets from Python: the `kvferry.Selection` wrapper hands its three lists to
//! the engine's methods as a tuple, turned here into a [`Selection`]; a selection that
//! does not fit raises `kvferry.SelectionError` naming the mismatch.

use kvferry::engine::{Selection, SelectionError};
use pyo3::prelude::*;

use crate::errors::ErrInfo;

/// A selection as the Python wrapper passes it: `(blocks, src_ranges, dst_ranges)`.
pub type PySelection = (
    Option<Vec<u32>>,
    Option<Vec<(usize, usize)>>,
    Option<Vec<(usize, usize)>>,
);

/// The selection error as the Python exception.
pub fn selection_error(e: &SelectionError) -> ErrInfo {
    ErrInfo::new("SelectionError", format!("selection does not fit: {e}"))
}

/// The [`Selection`] of a Python tuple (`None`: no selection).
pub fn selection(s: Option<PySelection>) -> PyResult<Option<Selection>> {
    s.map(|(b, src, dst)| Selection::new(b, src, dst).map_err(|e| selection_error(&e).into()))
        .transpose()
}

/// Checks a selection's lists as `kvferry.Selection` is built: bounds, ranges that
/// are non-empty and do not overflow, destination ranges that do not overlap, equal
/// totals when both range lists are given. Raises `SelectionError`.
#[pyfunction]
#[pyo3(signature = (blocks, src_ranges, dst_ranges))]
pub fn check_selection(
    blocks: Option<Vec<u32>>,
    src_ranges: Option<Vec<(usize, usize)>>,
    dst_ranges: Option<Vec<(usize, usize)>>,
) -> PyResult<()> {
    selection(Some((blocks, src_ranges, dst_ranges))).map(drop)
}
