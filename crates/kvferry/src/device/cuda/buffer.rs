//! [`CudaBuffer`]: device memory, ours (`cuMemAlloc`, freed on the reaper thread when
//! the last holder drops it) or external (memory another library allocated, kept alive
//! by its `owner` and never freed here). Synchronous reads and writes for small
//! transfers; copies of KV data go through streams.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::device::buffer::{check_range, BufferBackend};
use crate::device::DeviceError;
use crate::mem::HostMemory;

use super::device::DevShared;
use super::driver::check;

/// Device memory: from `cuMemAlloc` (ours, freed on drop) or external (kept alive by
/// its owner, never freed here).
pub(super) struct CudaBuffer {
    pub(super) dev: Arc<DevShared>,
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) len: usize,
    /// What keeps external memory alive (dropped with the buffer); `None`: ours.
    pub(super) owner: Option<Box<dyn Any + Send + Sync>>,
    /// Imported from another process (CUDA IPC): never written.
    pub(super) read_only: bool,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("external", &self.owner.is_some())
            .finish()
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // External memory: dropping `owner` (with the buffer) is its owner's business.
        if self.len > 0 && self.owner.is_none() {
            // Freed on the reaper thread: cuMemFree may synchronise with a busy device.
            self.dev.reaper.free(self.dev.ctx.clone(), self.ptr);
        }
    }
}

impl BufferBackend for CudaBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn device_id(&self) -> u64 {
        self.dev.id
    }

    fn host_memory(&self) -> Option<Arc<dyn HostMemory>> {
        None
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::InvalidArgument(
                "device memory imported from another process is read-only".into(),
            ));
        }
        check_range(offset, data.len(), self.len, "device buffer")?;
        if data.is_empty() {
            return Ok(());
        }
        self.dev.ctx.bind()?;
        // SAFETY: the range is inside the buffer's memory (ours, or external memory its
        // owner keeps alive); `data` is valid for its length.
        let r = unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, data.as_ptr() as *const c_void, data.len()) };
        check(r, "cuMemcpyHtoD")?;
        // From pageable memory the call may return before the DMA into the device has
        // finished, and our copy streams do not synchronise with the legacy stream it
        // ran on: wait for it, so the bytes are there for whatever is submitted next.
        // SAFETY: the context is current; the null handle is its legacy default stream.
        let r = unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) };
        check(r, "cuStreamSynchronize")
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, out.len(), self.len, "device buffer")?;
        if out.is_empty() {
            return Ok(());
        }
        self.dev.ctx.bind()?;
        // SAFETY: the range is inside the buffer's memory (ours, or external memory its
        // owner keeps alive); `out` is valid for writes.
        let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, self.ptr + offset as u64, out.len()) };
        check(r, "cuMemcpyDtoH")
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn export_handle(&self) -> Result<Vec<u8>, DeviceError> {
        super::ipc::export(self)
    }

    fn read_only(&self) -> bool {
        self.read_only
    }
}
