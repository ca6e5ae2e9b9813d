//! `Staged`: a lease a peer staged for a delayed pull (`Engine.stage`), resolved by
//! `Engine.resolve` before it expires.

use pyo3::prelude::*;

/// A staged lease on a peer (delayed pull), from `Engine.stage`.
#[pyclass(name = "Staged", module = "kvferry._kvferry", frozen)]
pub struct PyStaged {
    pub(super) handle: kvferry::engine::StagedHandle,
}

#[pymethods]
impl PyStaged {
    /// The peer holding the lease.
    #[getter]
    fn peer(&self) -> String {
        self.handle.peer.clone()
    }

    /// The peer's incarnation that granted it.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.handle.incarnation
    }

    /// Chunks staged (a prefix of the keys asked for; with a selection, every key).
    #[getter]
    fn chunks(&self) -> usize {
        match &self.handle.selection {
            Some(s) => s.keys,
            None => self.handle.chunks.len(),
        }
    }

    /// Bytes staged for a selection (what a resolve moves), else None.
    #[getter]
    fn selected_bytes(&self) -> Option<u64> {
        self.handle.selection.as_ref().map(|s| s.shape.total())
    }

    /// Seconds left on the lease (by this side's conservative clock).
    #[getter]
    fn ttl_left(&self) -> f64 {
        self.handle
            .expires
            .saturating_duration_since(tokio::time::Instant::now())
            .as_secs_f64()
    }

    fn __repr__(&self) -> String {
        format!(
            "Staged(peer={:?}, chunks={}, incarnation={:#x})",
            self.handle.peer,
            self.handle.chunks.len(),
            self.handle.incarnation
        )
    }
}
