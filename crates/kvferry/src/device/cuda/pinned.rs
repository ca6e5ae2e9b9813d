//! Pinned host memory for an arena: `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE`
//! and **without** write-combining (the CPU reads these pages back for checksums and
//! socket writes), freed with `cuMemFreeHost` when the backing drops.

use std::ffi::c_void;
use std::ptr::NonNull;

use cudarc::driver::sys;

use crate::device::DeviceError;
use crate::mem::{Arena, Backing, BackingKind};

use super::device::CudaDevice;
use super::driver::check;

/// Pinned host memory for an arena: `len` bytes from `cuMemHostAlloc` with
/// `CU_MEMHOSTALLOC_PORTABLE` (no write-combining), freed with `cuMemFreeHost` when the
/// backing drops.
pub fn cuda_pinned_backing(device: &CudaDevice, len: usize) -> Result<Backing, DeviceError> {
    if len == 0 {
        return Err(DeviceError::InvalidArgument(
            "pinned backing size must be non-zero".into(),
        ));
    }
    let ctx = device.shared.ctx.clone();
    ctx.bind()?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: the context is current; `p` is a valid out pointer.
    let r = unsafe { sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE) };
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(DeviceError::OutOfMemory {
            requested: len,
            detail: format!("cuMemHostAlloc: {r:?}"),
        });
    }
    check(r, "cuMemHostAlloc")?;
    let ptr = NonNull::new(p as *mut u8).ok_or_else(|| DeviceError::Driver("cuMemHostAlloc returned null".into()))?;
    let free = Box::new(move |ptr: *mut u8, _len: usize| {
        let _ = ctx.bind();
        // SAFETY: `ptr` came from cuMemHostAlloc above and is freed exactly once (the
        // backing calls this once, on drop).
        unsafe {
            sys::cuMemFreeHost(ptr as *mut c_void);
        }
    });
    // SAFETY: `ptr` is valid for `len` bytes of reads and writes, owned by nobody else,
    // and `free` releases it correctly once.
    Ok(unsafe { Backing::from_external(ptr, len, BackingKind::CudaHost, free) })
}

/// An arena of `page_count` pages of `page_size` bytes (a non-zero multiple of 4 KiB) in
/// CUDA pinned host memory.
pub fn cuda_pinned_arena(device: &CudaDevice, page_size: usize, page_count: usize) -> Result<Arena, DeviceError> {
    if page_size == 0 || page_size & 4095 != 0 || page_count == 0 || page_count > u32::MAX as usize {
        return Err(DeviceError::InvalidArgument(format!(
            "pinned arena needs a page size that is a non-zero multiple of 4 KiB and 1..=2^32-1 pages (got {page_size} x {page_count})"
        )));
    }
    let bytes = page_size
        .checked_mul(page_count)
        .filter(|b| *b <= isize::MAX as usize)
        .ok_or_else(|| DeviceError::InvalidArgument("pinned arena size overflows".into()))?;
    Ok(Arena::with_backing(cuda_pinned_backing(device, bytes)?, page_size))
}
