//! The CUDA driver library: loading it (dynamically, through `cudarc`'s raw bindings)
//! and checking every entry point this backend calls before the first call, the
//! helpers that turn a `CUresult` into a [`DeviceError`], a retained primary context
//! ([`Ctx`]), and the two calls that need no device of ours: [`cuda_device_count`] and
//! [`query_raw_event`].
//!
//! Without a driver library, or with one lacking an entry point, loading fails with
//! [`DeviceError::NoDevice`]; nothing here panics.

use std::ffi::c_int;

use cudarc::driver::sys;

use crate::device::DeviceError;

/// Driver entry points this backend calls; all are checked before the first call.
pub(super) const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuLaunchHostFunc",
    "cuPointerGetAttribute",
    "cuMemGetAddressRange_v2",
];

/// Entry points of device IPC (exports, imports, device-to-device copies): checked at
/// load, but a driver without them still serves the device path; device IPC is then
/// refused ([`require_ipc`]) and transfers take the other movers.
const IPC_SYMBOLS: &[&str] = &[
    "cuMemcpyDtoDAsync_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
];

/// Set at load when the driver has every [`IPC_SYMBOLS`] entry point.
static IPC_PRESENT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `Ok` when the loaded driver has the device-IPC entry points; else a
/// [`DeviceError::Driver`] naming the call, before anything is called.
pub(super) fn require_ipc(what: &str) -> Result<(), DeviceError> {
    if IPC_PRESENT.load(std::sync::atomic::Ordering::Acquire) {
        Ok(())
    } else {
        Err(DeviceError::Driver(format!(
            "{what}: the CUDA driver lacks the device-IPC entry points ({})",
            IPC_SYMBOLS.join(", ")
        )))
    }
}

pub(super) fn ok(r: sys::CUresult) -> bool {
    r == sys::CUresult::CUDA_SUCCESS
}

pub(super) fn driver(r: sys::CUresult, what: &str) -> DeviceError {
    DeviceError::Driver(format!("{what}: {r:?}"))
}

pub(super) fn check(r: sys::CUresult, what: &str) -> Result<(), DeviceError> {
    if ok(r) {
        Ok(())
    } else {
        Err(driver(r, what))
    }
}

/// Loads the driver library, checks every symbol, and initialises the driver.
pub(super) fn load_driver() -> Result<(), DeviceError> {
    // SAFETY: `is_culib_present` only tries to dlopen candidate library names.
    let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err(DeviceError::NoDevice(
            "CUDA driver library (libcuda.so) not found".into(),
        ));
    }
    // SAFETY: the library is present, so `culib` loads it instead of panicking (and a
    // panic would be caught here anyway).
    let lib = std::panic::catch_unwind(|| unsafe { sys::culib() })
        .map_err(|_| DeviceError::NoDevice("CUDA driver library could not be loaded".into()))?;
    for name in SYMBOLS {
        // SAFETY: looking a symbol up does not call it; the type is irrelevant here.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
        if !found {
            return Err(DeviceError::NoDevice(format!(
                "the CUDA driver lacks {name}; it is too old"
            )));
        }
    }
    // SAFETY: as above, lookups only.
    let ipc = IPC_SYMBOLS
        .iter()
        .all(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok());
    IPC_PRESENT.store(ipc, std::sync::atomic::Ordering::Release);
    // SAFETY: every symbol is present; cuInit(0) has no other preconditions.
    let r = unsafe { sys::cuInit(0) };
    if !ok(r) {
        return Err(DeviceError::NoDevice(format!("cuInit failed: {r:?}")));
    }
    Ok(())
}

/// The number of CUDA devices; [`DeviceError::NoDevice`] without a driver.
pub fn cuda_device_count() -> Result<usize, DeviceError> {
    load_driver()?;
    let mut n: c_int = 0;
    // SAFETY: the driver is loaded and initialised; `n` is a valid out pointer.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

/// Whether a `CUevent` created by another library (torch's `torch.cuda.Event.cuda_event`,
/// CuPy's, ...) has completed: one `cuEventQuery` on the raw handle, through this
/// backend's dynamic loading of the driver (loaded and checked once per process, with
/// [`DeviceError::NoDevice`] when there is no driver). `Ok(true)`: every piece of work
/// captured by the event's last record has completed (or the event was never
/// recorded); `Ok(false)`: still pending (`CUDA_ERROR_NOT_READY`); any other result is
/// [`DeviceError::Driver`] naming it (a sticky context error after a device fault, an
/// invalid handle). Needs no context current on the calling thread and takes no lock of
/// ours, so it may run on any thread, e.g. one that released the Python GIL.
///
/// # Safety
///
/// `handle` must be a live `CUevent` (not destroyed) for the duration of the call: the
/// caller keeps the object that owns it alive.
pub unsafe fn query_raw_event(handle: usize) -> Result<bool, DeviceError> {
    static LOADED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    if let Err(why) = LOADED.get_or_init(|| {
        load_driver().map_err(|e| match e {
            DeviceError::NoDevice(m) => m,
            other => other.to_string(),
        })
    }) {
        return Err(DeviceError::NoDevice(why.clone()));
    }
    if handle == 0 {
        return Err(DeviceError::InvalidArgument("a null CUevent handle".into()));
    }
    // SAFETY: the driver is loaded and initialised; the caller guarantees `handle` is a
    // live event.
    let r = unsafe { sys::cuEventQuery(handle as sys::CUevent) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(driver(other, "cuEventQuery")),
    }
}

/// A retained primary context; released when the last holder drops it.
pub(super) struct Ctx {
    pub(super) ctx: sys::CUcontext,
    pub(super) dev: sys::CUdevice,
}

// SAFETY: a CUDA context handle may be used from any thread (made current with
// cuCtxSetCurrent); the driver API is thread-safe.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Makes the context current on this thread.
    pub(super) fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is a retained primary context, valid until `Drop`.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: we retained the primary context of `dev` once in `CudaDevice::open`;
        // every object created in it holds this `Ctx`, so none outlives the release.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}
