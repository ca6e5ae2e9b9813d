//! Host memory registered as KV caches, for [`PyEngine`]'s Python methods (which keep
//! the signatures and documentation and call these): Python buffers laid out by spans
//! (`register_spans`), and the registration every host region goes through (raw memory
//! another engine handed out included). The region holds what keeps the memory alive —
//! the buffer (and so its exporter), or the owner object — until every transfer and
//! publication using it has dropped it.

use std::ptr::NonNull;
use std::sync::Arc;

use kvferry::engine::{KvCache, Region, Span};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use super::{byte_buffer, PyEngine};
use crate::errors::{py_err, ErrInfo};
use crate::region::PyRegion;

/// Registered Python memory: the buffer (holding its exporter) keeps it alive.
pub(crate) struct HeldBuffer(#[allow(dead_code)] pub(crate) PyBuffer<u8>);

impl PyEngine {
    /// `register_spans`: `parts` — `[(buffer, [(offset, stride, length), ...]), ...]` —
    /// as one KV cache of `blocks` blocks; block *i* is every part's spans at `i`.
    pub(super) fn register_buffers(
        &self,
        py: Python<'_>,
        name: String,
        parts: Vec<(Bound<'_, PyAny>, Vec<(usize, usize, usize)>)>,
        blocks: u32,
    ) -> PyResult<PyRegion> {
        if parts.is_empty() {
            return Err(ErrInfo::invalid("nothing to register").into());
        }
        let mut regions = Vec::with_capacity(parts.len());
        let mut readonly = false;
        for (i, (obj, spans)) in parts.iter().enumerate() {
            let buf = byte_buffer(obj, &name)?;
            readonly |= buf.readonly();
            let len = buf.len_bytes();
            let ptr = NonNull::new(buf.buf_ptr() as *mut u8)
                .ok_or_else(|| ErrInfo::invalid(format!("{name}: buffer {i} is empty")))?;
            // SAFETY: `ptr` is the buffer's memory, valid for `len` bytes while the
            // `PyBuffer` is held; the region holds it (and so the exporting object) until
            // every copy and socket operation referencing the region has dropped it.
            // Writes happen only into regions that are not read-only (checked per
            // transfer) and only into blocks a transfer owns.
            let region = unsafe { Region::from_raw(format!("{name}[{i}]"), ptr, len, Box::new(HeldBuffer(buf))) };
            let spans = spans
                .iter()
                .map(|&(offset, stride, len)| Span { offset, stride, len })
                .collect();
            regions.push((Arc::new(region), spans));
        }
        let _ = py;
        let cache = KvCache::new(name, regions, blocks).map_err(|e| ErrInfo::invalid(e.to_string()))?;
        self.register_cache(cache, readonly)
    }

    /// Registers `cache` with the engine as a region of this engine.
    pub(super) fn register_cache(&self, cache: KvCache, readonly: bool) -> PyResult<PyRegion> {
        let reg = self.engine.register(cache).map_err(py_err)?;
        Ok(PyRegion::new(reg, readonly, self.id, self.engine.clone()))
    }
}
