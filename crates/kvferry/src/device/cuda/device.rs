//! [`CudaDevice`]: one GPU through its primary context — opening it (never panicking
//! without a driver or GPU), allocating device memory, creating non-blocking streams,
//! and wrapping memory another library allocated after the driver confirmed that every
//! byte of the range is device memory of this GPU.

use std::any::Any;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::device::buffer::DeviceBuffer;
use crate::device::stream::Stream;
use crate::device::{next_device_id, Device, DeviceError, DeviceKind};

use super::buffer::CudaBuffer;
use super::driver::{check, cuda_device_count, ok, Ctx};
use super::reaper::Reaper;
use super::stream::CudaStream;

/// What a device's streams and buffers share.
pub(super) struct DevShared {
    pub(super) id: u64,
    pub(super) rank: u32,
    pub(super) ctx: Arc<Ctx>,
    pub(super) reaper: Reaper,
}

/// A CUDA GPU, through its primary context. See the module docs.
pub struct CudaDevice {
    pub(super) shared: Arc<DevShared>,
    ordinal: usize,
    name: String,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("rank", &self.shared.rank)
            .finish()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` for `rank`. [`DeviceError::NoDevice`] when there is no
    /// driver, no GPU, or no such ordinal; never panics.
    pub fn open(ordinal: usize, rank: u32) -> Result<Arc<CudaDevice>, DeviceError> {
        let count = cuda_device_count()?;
        if count == 0 {
            return Err(DeviceError::NoDevice("the CUDA driver reports no device".into()));
        }
        if ordinal >= count {
            return Err(DeviceError::NoDevice(format!(
                "CUDA device {ordinal} does not exist ({count} present)"
            )));
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: the driver is initialised and `ordinal < count`.
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal as c_int) }, "cuDeviceGet")?;
        let mut name = [0 as c_char; 256];
        // SAFETY: `name` has room for 256 bytes including the terminator.
        let named = ok(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev) });
        let name = if named {
            // SAFETY: the driver wrote a NUL-terminated string into `name`.
            unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned()
        } else {
            format!("CUDA device {ordinal}")
        };
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: `dev` is a valid device (from `cuDeviceGet`); `ctx` is a valid out
            // pointer; the retained context is released once, by `Ctx`'s `Drop`.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let ctx = Arc::new(Ctx { ctx, dev });
        ctx.bind()?;
        Ok(Arc::new(CudaDevice {
            shared: Arc::new(DevShared {
                id: next_device_id(),
                rank,
                ctx,
                reaper: Reaper::new(),
            }),
            ordinal,
            name,
        }))
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Wraps `len` bytes of device memory at `ptr` that someone else allocated (a
    /// torch tensor, another engine's pool) as a buffer of this device. `owner` keeps
    /// the memory alive: it is dropped when the buffer and every operation that
    /// targets it are gone; the memory itself is never freed here.
    ///
    /// The driver must confirm that every byte of `ptr..ptr+len` is device memory
    /// (not host, pinned or array memory) of this GPU, allocated in its primary context
    /// (or context-free, as virtual-memory-management and pool allocations are);
    /// otherwise [`DeviceError::InvalidArgument`] names what is wrong. Zero length or a
    /// null pointer is refused the same way.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated (not freed, not unmapped) for as long as `owner`
    /// lives, and nobody else may free it while operations of this device target it.
    /// The driver check proves the range is mapped device memory now, not who owns it.
    pub unsafe fn wrap_external(
        &self,
        ptr: u64,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.check_device_range(ptr, len)?;
        Ok(DeviceBuffer::new(Arc::new(CudaBuffer {
            dev: self.shared.clone(),
            ptr,
            len,
            owner: Some(owner),
            read_only: false,
        })))
    }

    /// The device address of `buf`, if it is CUDA memory of this device.
    pub fn device_ptr(&self, buf: &DeviceBuffer) -> Option<u64> {
        let b = buf.backend().as_any().downcast_ref::<CudaBuffer>()?;
        (b.dev.id == self.shared.id).then_some(b.ptr)
    }

    /// Checks that every byte of `ptr..ptr+len` is device memory of this device: walks
    /// the allocations covering the range (one, or several adjacent mappings).
    fn check_device_range(&self, ptr: u64, len: usize) -> Result<(), DeviceError> {
        if ptr == 0 || len == 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "external CUDA memory needs a non-null pointer and a non-zero length (got {ptr:#x}, {len} bytes)"
            )));
        }
        let end = ptr
            .checked_add(len as u64)
            .ok_or_else(|| DeviceError::InvalidArgument(format!("range {ptr:#x}+{len} overflows")))?;
        self.shared.ctx.bind()?;
        let mut at = ptr;
        while at < end {
            self.check_pointer(at)?;
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: the context is current; both out pointers are valid.
            let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, at) };
            if !ok(r) {
                return Err(DeviceError::InvalidArgument(format!(
                    "{at:#x} (in {ptr:#x}+{len}) is not inside a CUDA allocation: {r:?}"
                )));
            }
            let next = base.saturating_add(size as u64);
            if base > at || next <= at {
                return Err(DeviceError::InvalidArgument(format!(
                    "the driver reports allocation {base:#x}+{size} for {at:#x}, which does not contain it"
                )));
            }
            at = next;
        }
        Ok(())
    }

    /// Checks that `at` is device memory of this device, in its context or in none.
    /// The context must be current.
    fn check_pointer(&self, at: u64) -> Result<(), DeviceError> {
        use sys::CUpointer_attribute as A;
        let not_ours = |why: String| {
            DeviceError::InvalidArgument(format!(
                "{at:#x} is not device memory of CUDA device {}: {why}",
                self.ordinal
            ))
        };
        let mut mem_type: u32 = 0;
        // SAFETY: MEMORY_TYPE writes one `unsigned int` (a CUmemorytype) to `data`.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut mem_type as *mut u32 as *mut c_void,
                A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                at,
            )
        };
        if !ok(r) {
            return Err(not_ours(format!("the driver does not know it ({r:?}); host memory?")));
        }
        if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            use sys::CUmemorytype as M;
            let kind = match mem_type {
                t if t == M::CU_MEMORYTYPE_HOST as u32 => "host (pinned or registered) memory".to_string(),
                t if t == M::CU_MEMORYTYPE_ARRAY as u32 => "a CUDA array".to_string(),
                t if t == M::CU_MEMORYTYPE_UNIFIED as u32 => "unified memory".to_string(),
                n => format!("memory of type {n}"),
            };
            return Err(not_ours(format!("it is {kind}")));
        }
        let mut ordinal: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one `int` to `data`.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut c_int as *mut c_void,
                A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                at,
            )
        };
        check(r, "cuPointerGetAttribute(DEVICE_ORDINAL)")?;
        if ordinal < 0 || ordinal as usize != self.ordinal {
            return Err(not_ours(format!("it belongs to CUDA device {ordinal}")));
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: CONTEXT writes one `CUcontext` to `data`.
        let r = unsafe {
            sys::cuPointerGetAttribute(
                &mut ctx as *mut sys::CUcontext as *mut c_void,
                A::CU_POINTER_ATTRIBUTE_CONTEXT,
                at,
            )
        };
        if ok(r) && !ctx.is_null() && ctx != self.shared.ctx.ctx {
            return Err(not_ours(
                "it was allocated in another context than the device's primary context".into(),
            ));
        }
        Ok(())
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn rank(&self) -> u32 {
        self.shared.rank
    }

    fn id(&self) -> u64 {
        self.shared.id
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer, DeviceError> {
        let mut ptr: sys::CUdeviceptr = 0;
        if len > 0 {
            self.shared.ctx.bind()?;
            // SAFETY: the context is current; `ptr` is a valid out pointer.
            let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, len) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(DeviceError::OutOfMemory {
                    requested: len,
                    detail: format!("cuMemAlloc: {r:?}"),
                });
            }
            check(r, "cuMemAlloc")?;
        }
        Ok(DeviceBuffer::new(Arc::new(CudaBuffer {
            dev: self.shared.clone(),
            ptr,
            len,
            owner: None,
            read_only: false,
        })))
    }

    fn ipc_kind(&self) -> Option<&'static str> {
        Some(super::ipc::CUDA_IPC)
    }

    fn open_ipc(&self, handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        Ok(DeviceBuffer::new(Arc::new(super::ipc::open(&self.shared, handle)?)))
    }

    fn create_stream(&self, name: &str) -> Result<Stream, DeviceError> {
        self.shared.ctx.bind()?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the context is current; `stream` is a valid out pointer.
        check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate")?;
        Ok(Stream::new(Arc::new(CudaStream {
            name: name.to_string(),
            dev: self.shared.clone(),
            stream,
        })))
    }
}
