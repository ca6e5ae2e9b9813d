//! `Region`: a registered KV cache as Python sees it. It holds the engine's
//! registration (and through it the Python objects whose memory it uses): Python's
//! garbage collector cannot free that memory while any transfer still touches it.

use std::sync::Arc;

use kvferry::engine::Registered;
use kvferry::layout::KvCache;
use pyo3::prelude::*;

/// A registered KV cache (from `Engine.register_kv_cache` and friends).
#[pyclass(name = "Region", module = "kvferry._kvferry", frozen)]
pub struct PyRegion {
    pub(crate) reg: Registered,
    pub(crate) readonly: bool,
    /// The engine it was registered with (its registration id space).
    pub(crate) engine_id: usize,
}

impl PyRegion {
    pub(crate) fn cache(&self) -> &Arc<KvCache> {
        &self.reg.cache
    }
}

#[pymethods]
impl PyRegion {
    /// The region's name.
    #[getter]
    fn name(&self) -> String {
        self.reg.cache.name().to_string()
    }

    /// Blocks in the region.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.reg.cache.map().blocks()
    }

    /// Bytes of one block (across every buffer of the region).
    #[getter]
    fn block_bytes(&self) -> usize {
        self.reg.cache.map().block_bytes()
    }

    /// True when the memory is read-only (it can be published, not written into).
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// Transfers and publications holding the region right now.
    #[getter]
    fn users(&self) -> usize {
        Arc::strong_count(&self.reg.cache).saturating_sub(2)
    }

    fn __repr__(&self) -> String {
        format!(
            "Region({:?}, {} blocks of {} bytes{})",
            self.reg.cache.name(),
            self.reg.cache.map().blocks(),
            self.reg.cache.map().block_bytes(),
            if self.readonly { ", read-only" } else { "" }
        )
    }
}
