//! Device buffers: memory owned by one device, shared (`Arc`) by its handles and by
//! every operation that targets it, so dropping a handle never frees memory under a
//! copy in flight.
//!
//! [`DeviceBuffer::write`] and [`DeviceBuffer::read`] are synchronous and outside stream
//! order: like [`Region`](crate::mem::Region), the caller coordinates them with the
//! copies that target the same bytes (e.g. by waiting for the copy's event first).

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::mem::{HostMemory, Region};

use super::DeviceError;

/// A backend's device memory.
pub trait BufferBackend: Send + Sync + std::fmt::Debug + 'static {
    /// Size in bytes.
    fn len(&self) -> usize;

    /// True for a zero-length buffer.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id of the device that owns this memory.
    fn device_id(&self) -> u64;

    /// The memory as host-addressable runs, when the device memory is host memory
    /// (host and sim backends); `None` for real device memory.
    fn host_memory(&self) -> Option<Arc<dyn HostMemory>>;

    /// Copies `data` into the buffer at `offset`, synchronously.
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError>;

    /// Copies bytes at `offset` into `out`, synchronously.
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError>;

    /// The concrete buffer, for backends that need their own handle (CUDA).
    fn as_any(&self) -> &dyn Any;

    /// A handle another process of this host can open this memory by (device IPC:
    /// a sim allocation's shared-memory handle, a CUDA IPC memory handle), or why
    /// there is none.
    fn export_handle(&self) -> Result<Vec<u8>, DeviceError> {
        Err(DeviceError::InvalidArgument(
            "this device memory cannot be exported to another process".into(),
        ))
    }

    /// True for memory imported from another process: only ever a copy's source.
    fn read_only(&self) -> bool {
        false
    }
}

/// Device memory. Cheap to clone; the memory is freed when the last clone and the last
/// operation targeting it are gone.
#[derive(Clone, Debug)]
pub struct DeviceBuffer {
    inner: Arc<dyn BufferBackend>,
}

impl DeviceBuffer {
    /// Wraps a backend's buffer.
    pub fn new(inner: Arc<dyn BufferBackend>) -> DeviceBuffer {
        DeviceBuffer { inner }
    }

    /// The backend's buffer.
    pub fn backend(&self) -> &Arc<dyn BufferBackend> {
        &self.inner
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }

    /// The id of the device that owns the buffer.
    pub fn device_id(&self) -> u64 {
        self.inner.device_id()
    }

    /// Copies `data` into the buffer at `offset`, synchronously (outside stream order).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.write(offset, data)
    }

    /// Copies bytes at `offset` into `out`, synchronously (outside stream order).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read(offset, out)
    }

    /// The bytes at `offset..offset+len` as a new vector.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, DeviceError> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// The byte range `offset..offset+len` of this buffer.
    pub fn slice(&self, offset: usize, len: usize) -> DeviceSlice {
        DeviceSlice {
            buffer: self.clone(),
            offset,
            len,
        }
    }

    /// The whole buffer.
    pub fn whole(&self) -> DeviceSlice {
        self.slice(0, self.len())
    }

    /// A handle another process of this host can open this memory by (see
    /// [`Device::open_ipc`](super::Device::open_ipc)), or why there is none.
    pub fn export_handle(&self) -> Result<Vec<u8>, DeviceError> {
        self.inner.export_handle()
    }

    /// True for memory imported from another process (never a copy's destination).
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only()
    }

    /// True when both handles are the same memory.
    pub fn same_buffer(&self, other: &DeviceBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// A byte range of a device buffer.
#[derive(Clone, Debug)]
pub struct DeviceSlice {
    /// The buffer.
    pub buffer: DeviceBuffer,
    /// Start of the range.
    pub offset: usize,
    /// Length of the range.
    pub len: usize,
}

impl DeviceSlice {
    /// Fails with [`DeviceError::InvalidArgument`] unless the range fits the buffer.
    pub(crate) fn check(&self) -> Result<(), DeviceError> {
        check_range(self.offset, self.len, self.buffer.len(), "device buffer")
    }
}

pub(crate) fn check_range(offset: usize, len: usize, size: usize, what: &str) -> Result<(), DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(DeviceError::InvalidArgument(format!(
            "range {offset}+{len} is out of bounds for a {what} of {size} bytes"
        ))),
    }
}

/// Device memory that is host memory (host and sim backends): a [`Region`], optionally
/// counted against a device memory budget.
#[derive(Debug)]
pub(crate) struct HostBuffer {
    device: u64,
    region: Arc<Region>,
    budget: Option<Arc<AtomicUsize>>,
    /// Shared memory another process may open (sim allocations).
    export: Option<super::shm::ShmHandle>,
    /// Imported from another process: never written.
    read_only: bool,
}

impl HostBuffer {
    /// Wraps `region` as memory of device `device`; `budget` is decremented by the
    /// region's size when the buffer is dropped.
    pub(crate) fn new(device: u64, region: Arc<Region>, budget: Option<Arc<AtomicUsize>>) -> HostBuffer {
        HostBuffer {
            device,
            region,
            budget,
            export: None,
            read_only: false,
        }
    }

    /// Marks the buffer exportable as `handle`.
    pub(crate) fn exported(mut self, handle: super::shm::ShmHandle) -> HostBuffer {
        self.export = Some(handle);
        self
    }

    /// Marks the buffer imported (read-only).
    pub(crate) fn imported(mut self) -> HostBuffer {
        self.read_only = true;
        self
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.fetch_sub(self.region.len(), Ordering::AcqRel);
        }
    }
}

impl BufferBackend for HostBuffer {
    fn len(&self) -> usize {
        self.region.len()
    }

    fn device_id(&self) -> u64 {
        self.device
    }

    fn host_memory(&self) -> Option<Arc<dyn HostMemory>> {
        Some(self.region.clone())
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::InvalidArgument(
                "device memory imported from another process is read-only".into(),
            ));
        }
        check_range(offset, data.len(), self.region.len(), "device buffer")?;
        Ok(self.region.write(offset, data)?)
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, out.len(), self.region.len(), "device buffer")?;
        Ok(self.region.read(offset, out)?)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn export_handle(&self) -> Result<Vec<u8>, DeviceError> {
        match &self.export {
            Some(h) => Ok(h.to_bytes()),
            None => Err(DeviceError::InvalidArgument(
                "this memory is not shared (adopted host memory, host-device memory, or a sim allocation made without shared memory)".into(),
            )),
        }
    }

    fn read_only(&self) -> bool {
        self.read_only
    }
}
