//! CUDA IPC: exporting this process's device allocations to another process of the
//! host (`cuIpcGetMemHandle`), opening another's (`cuIpcOpenMemHandle`, closed with
//! `cuIpcCloseMemHandle` when the last holder of the import is gone), the device side
//! of the device-IPC mover (see `peer::movers`).
//!
//! **Never run on a GPU**: this is compiled and checked by `cargo clippy --features
//! cuda`, and `scripts/gpu-check.sh` has the two-process case that exercises it; the
//! consumer offers the `cuda-ipc` kind only with `KVFERRY_CUDA_IPC=1` until that case
//! has passed on real hardware.
//!
//! A handle is 80 bytes: the 64-byte `CUipcMemHandle` of the allocation that contains
//! the buffer, the buffer's offset in that allocation, and its length. Memory the
//! driver cannot export (virtual-memory-management or pool allocations, memory of
//! another library's allocator that uses them) is refused with the driver's reason,
//! and the consumer then reads it through staging.
//!
//! # Errors
//!
//! [`DeviceError::Driver`] naming the call, or [`DeviceError::InvalidArgument`] for a
//! malformed handle or an import too short for the length it names.

use std::sync::Arc;

use cudarc::driver::sys;

use crate::device::DeviceError;

use super::buffer::CudaBuffer;
use super::device::DevShared;
use super::driver::{check, require_ipc, Ctx};

/// The device-IPC kind of CUDA devices.
pub const CUDA_IPC: &str = "cuda-ipc";

const HANDLE: usize = 64;
/// Encoded size of an exported CUDA buffer.
const ENCODED: usize = HANDLE + 16;

/// The export of `buf`: its allocation's IPC handle, its offset there, its length.
pub(super) fn export(buf: &CudaBuffer) -> Result<Vec<u8>, DeviceError> {
    if buf.read_only {
        return Err(DeviceError::InvalidArgument(
            "memory imported from another process is not exported again".into(),
        ));
    }
    if buf.len == 0 {
        return Err(DeviceError::InvalidArgument(
            "an empty buffer has nothing to export".into(),
        ));
    }
    buf.dev.ctx.bind()?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: the context is current; out pointers are valid; `ptr` is device memory
    // the buffer keeps alive.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, buf.ptr) };
    check(r, "cuMemGetAddressRange")?;
    // SAFETY: a zeroed handle is a valid out value for the driver to fill.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    require_ipc("cuIpcGetMemHandle")?;
    // SAFETY: the context is current; `base` is the start of a live allocation; the
    // driver has the entry point (checked just above).
    let r = unsafe { sys::cuIpcGetMemHandle(&mut handle, base) };
    check(r, "cuIpcGetMemHandle")?;
    let mut out = Vec::with_capacity(ENCODED);
    out.extend(handle.reserved.iter().map(|b| *b as u8));
    out.extend_from_slice(&(buf.ptr - base).to_le_bytes());
    out.extend_from_slice(&(buf.len as u64).to_le_bytes());
    Ok(out)
}

/// An opened IPC mapping; closed when the last buffer over it is gone (every copy
/// reading it holds the buffer until its event settles).
struct Mapping {
    ctx: Arc<Ctx>,
    base: sys::CUdeviceptr,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: `base` came from cuIpcOpenMemHandle in this context and is closed
            // once, after every operation reading it settled (see the type's docs).
            unsafe {
                sys::cuIpcCloseMemHandle(self.base);
            }
        }
    }
}

/// Opens `bytes` (from [`export`] in another process) on `dev` as a read-only buffer.
pub(super) fn open(dev: &Arc<DevShared>, bytes: &[u8]) -> Result<CudaBuffer, DeviceError> {
    if bytes.len() != ENCODED {
        return Err(DeviceError::InvalidArgument(format!(
            "a CUDA IPC handle is {ENCODED} bytes, got {}",
            bytes.len()
        )));
    }
    // SAFETY: a zeroed handle is plain data, filled below.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    for (d, s) in handle.reserved.iter_mut().zip(&bytes[..HANDLE]) {
        *d = *s as _;
    }
    let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    let (offset, len) = (u64_at(HANDLE), u64_at(HANDLE + 8));
    dev.ctx.bind()?;
    let mut base: sys::CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    require_ipc("cuIpcOpenMemHandle")?;
    // SAFETY: the context is current; `base` is a valid out pointer; the handle bytes
    // are whatever the peer sent, which the driver validates.
    let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags) };
    check(r, "cuIpcOpenMemHandle")?;
    let mapping = Mapping {
        ctx: dev.ctx.clone(),
        base,
    };
    let (mut start, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: the context is current; `base` is a live mapping.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) };
    check(r, "cuMemGetAddressRange")?;
    let end = offset.checked_add(len).filter(|e| *e <= size as u64);
    let (Some(_), Ok(len)) = (end, usize::try_from(len)) else {
        return Err(DeviceError::InvalidArgument(format!(
            "an imported allocation of {size} bytes cannot hold {len} bytes at {offset}"
        )));
    };
    Ok(CudaBuffer {
        dev: dev.clone(),
        ptr: base + offset,
        len,
        owner: Some(Box::new(mapping)),
        read_only: true,
    })
}
