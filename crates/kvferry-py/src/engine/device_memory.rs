//! The engine's device memory and remote releases, for [`PyEngine`]'s Python methods
//! (which keep the signatures and documentation and call these): wrapping CUDA
//! tensors and raw device pointers, adopting host memory as sim device memory,
//! registering device KV caches, and `release_remote`'s background release.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::{DeviceKvCache, Region, Span};
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::{byte_buffer, required, HeldBuffer, PyEngine};
use crate::device::{dev_err, PyDeviceMemory};
use crate::errors::{py_err, ErrInfo};
use crate::region::PyRegion;
use crate::transfer::PyTransfer;

impl PyEngine {
    pub(crate) fn wrap_dlpack_memory(&self, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<PyDeviceMemory> {
        let dev = self.dev()?;
        let Some(ordinal) = dev.cuda_ordinal() else {
            return Err(ErrInfo::invalid(format!(
                "{name}: wrapping a device tensor needs a CUDA engine (Engine(device='cuda:N')), not {:?}",
                dev.spec()
            ))
            .into());
        };
        let t = crate::dlpack::read(obj, name)?;
        if t.device_type != crate::dlpack::KDL_CUDA {
            return Err(ErrInfo::invalid(format!(
                "{name}: the tensor is on DLPack device type {}, not CUDA device memory (type {})",
                t.device_type,
                crate::dlpack::KDL_CUDA
            ))
            .into());
        }
        if usize::try_from(t.device_id).ok() != Some(ordinal) {
            return Err(ErrInfo::invalid(format!(
                "{name}: the tensor is on cuda:{}, this engine uses cuda:{ordinal}",
                t.device_id
            ))
            .into());
        }
        // SAFETY: the DLPack exporter keeps the tensor's memory alive until the capsule's
        // deleter runs, which happens only when the capsule (held by `owner`) is
        // collected; the buffer holds `owner` until no operation targets it.
        let buf = unsafe { dev.wrap(t.ptr, t.nbytes, t.owner) }?;
        Ok(self.device_memory(buf, Some(t.shape)))
    }

    pub(crate) fn wrap_device_memory(
        &self,
        py: Python<'_>,
        name: &str,
        ptr: u64,
        nbytes: usize,
        device: &str,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<PyDeviceMemory> {
        let dev = self.dev()?;
        let ordinal = crate::device::cuda_ordinal(device)?;
        if dev.cuda_ordinal() != Some(ordinal) {
            return Err(ErrInfo::invalid(format!(
                "{name}: memory on {device:?}, but this engine's device is {:?}",
                dev.spec()
            ))
            .into());
        }
        if ptr == 0 || nbytes == 0 {
            return Err(ErrInfo::invalid(format!("{name}: ptr and nbytes must be non-zero")).into());
        }
        let owner = owner.unwrap_or_else(|| py.None());
        // SAFETY: the caller of this documented entry point promises the memory stays
        // allocated while `owner` lives; the buffer holds `owner`.
        let buf = unsafe { dev.wrap(ptr, nbytes, owner) }?;
        Ok(self.device_memory(buf, None))
    }

    pub(crate) fn adopt_host(
        &self,
        name: &str,
        obj: &Bound<'_, PyAny>,
        shape: Option<Vec<usize>>,
    ) -> PyResult<PyDeviceMemory> {
        let sim = self.dev()?.sim()?;
        let buf = byte_buffer(obj, name)?;
        if buf.readonly() {
            return Err(ErrInfo::invalid(format!("{name}: read-only memory cannot be device memory")).into());
        }
        let len = buf.len_bytes();
        let ptr =
            NonNull::new(buf.buf_ptr() as *mut u8).ok_or_else(|| ErrInfo::invalid(format!("{name}: empty buffer")))?;
        // SAFETY: `ptr` is the buffer's memory, valid for `len` bytes while the
        // `PyBuffer` is held; the region holds it (and so the exporting object) until the
        // device buffer and every copy targeting it have dropped the region.
        let region = unsafe { Region::from_raw(name.to_string(), ptr, len, Box::new(HeldBuffer(buf))) };
        Ok(self.device_memory(sim.adopt_host(Arc::new(region)), shape))
    }

    pub(crate) fn register_device_parts(
        &self,
        name: String,
        parts: Vec<(Bound<'_, PyDeviceMemory>, Vec<(usize, usize, usize)>)>,
        blocks: u32,
    ) -> PyResult<PyRegion> {
        let dev = self.dev()?;
        if parts.is_empty() {
            return Err(ErrInfo::invalid("nothing to register").into());
        }
        let mut bufs = Vec::with_capacity(parts.len());
        for (mem, spans) in &parts {
            let mem = mem.get();
            if mem.engine_id != self.id {
                return Err(ErrInfo::invalid(format!("{name}: device memory of another engine")).into());
            }
            let spans = spans
                .iter()
                .map(|&(offset, stride, len)| Span { offset, stride, len })
                .collect();
            bufs.push((mem.buf.clone(), spans));
        }
        let cache = DeviceKvCache::new(name, dev.device.clone(), bufs, blocks, dev.op_timeout)
            .map_err(|e| PyErr::from(dev_err(&e)))?;
        let reg = self.engine.register(cache).map_err(py_err)?;
        Ok(PyRegion::new(reg, false, self.id, self.engine.clone()))
    }

    pub(crate) fn spawn_release_remote(
        &self,
        keys: &Bound<'_, PyList>,
        peer: String,
        timeout: f64,
        retry_miss: f64,
        incarnation: Option<u64>,
    ) -> PyResult<PyTransfer> {
        let keys = Self::keys(keys)?;
        let t = required(timeout, "timeout")?;
        if !(retry_miss.is_finite() && retry_miss >= 0.0) {
            return Err(ErrInfo::invalid(format!("retry_miss must be >= 0 seconds, got {retry_miss}")).into());
        }
        let retry = Duration::from_secs_f64(retry_miss.min(t.as_secs_f64()));
        let (e, p2) = (self.engine.clone(), peer.clone());
        // The call's instant, not the first poll's: the deadline, and a timeout's
        // `waited` (the library's), run from when the caller asked.
        let start = tokio::time::Instant::now();
        let fut = async move {
            e.release_remote(&p2, keys, incarnation, start, start + t, start + retry)
                .await
                .map(|released| kvferry::engine::Landed {
                    chunks: released,
                    bytes: 0,
                    checksum: 0,
                })
                .map_err(|error| kvferry::engine::GetFailure {
                    error,
                    fence: kvferry::engine::DrainFence::ready(),
                    dirty: false,
                })
        };
        let _guard = self.handle().enter();
        Ok(PyTransfer::spawn_op(
            &self.waiting,
            peer,
            kvferry::engine::DrainFence::ready(),
            fut,
            "release_remote",
        ))
    }
}
