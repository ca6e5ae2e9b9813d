//! The CUDA backend (cargo feature `cuda`): the CUDA driver API through `cudarc`'s raw
//! bindings with dynamic loading — building needs no CUDA, and on a machine without a
//! driver library or GPU [`CudaDevice::open`] returns [`DeviceError::NoDevice`] and never
//! panics (every driver symbol used is looked up before the first call).
//!
//! - Each device uses its primary context; streams are created non-blocking (no implicit
//!   synchronisation with the legacy default stream).
//! - Every operation creates a fresh `CUevent` (timing disabled), recorded after the
//!   operation's work.
//! - Waiting polls `cuEventQuery` with exponential backoff, 20 µs doubling to 1 ms
//!   (`tokio::time::sleep` in async waits, `std::thread::sleep` in blocking ones), so a
//!   waiter costs a driver call per backoff step — well under 1% of a core — and
//!   resumes within about a millisecond of completion.
//! - A copy's lease pages and device buffers are held by its event until a query sees it
//!   complete; that first query also runs the settle callbacks (releasing quarantined
//!   pages) before it returns. An abandoned copy (timed out, dropped) is watched by a
//!   per-device reaper thread, which exists only while there is something to watch,
//!   polls with backoff up to 100 ms, and so releases the quarantined pages soon after
//!   the event completes. Device memory is freed on that thread too, so dropping a
//!   buffer never blocks the caller on a busy device.
//! - A stream can wait on a CUDA event (`cuStreamWaitEvent`) or on a host-side event
//!   such as [`Event::manual`]: then a host function enqueued with `cuLaunchHostFunc`
//!   holds the stream until the event settles. It occupies the driver's callback thread
//!   meanwhile, so gate only on conditions that do not need other host functions of the
//!   same context to run first.
//! - Events of other libraries (torch's `CUevent`s) can be queried
//!   ([`query_raw_event`]) or watched without polling ([`on_raw_event_complete`]: a
//!   private stream waits on the event and runs a host function that calls back; a
//!   stream is reused only after its host function ran).
//! - An error from `cuEventQuery` (a sticky context error) settles the event as
//!   [`EventStatus::Faulted`]: its memory stays quarantined.
//! - Device memory is ours (`Device::alloc`: `cuMemAlloc`, freed on the reaper thread
//!   when the last holder drops it) or **external** ([`CudaDevice::wrap_external`]:
//!   memory another library allocated, e.g. a torch tensor). External memory is never
//!   freed here: the buffer holds an `owner` that keeps it alive, and dropping the
//!   buffer (after every operation that targets it has settled) drops the owner.
//!   Wrapping checks with the driver that every byte of the range is device memory of
//!   this device (`cuPointerGetAttribute`, `cuMemGetAddressRange`) and refuses anything
//!   else (host memory, another GPU, another context) with
//!   [`DeviceError::InvalidArgument`].
//! - Pinned host memory for an arena comes from `cuMemHostAlloc` with
//!   `CU_MEMHOSTALLOC_PORTABLE` and **without** write-combining (the CPU reads these
//!   pages back for checksums and socket writes): [`cuda_pinned_backing`],
//!   [`cuda_pinned_arena`].
//!
//! # Cancellation
//!
//! Dropping an async wait stops polling at once; the operation continues on the GPU.

use std::any::Any;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use parking_lot::{Condvar, Mutex};

use crate::mem::{Arena, Backing, BackingKind, HostMemory};

use super::buffer::{BufferBackend, DeviceBuffer};
use super::event::{BoxFuture, Event, EventMeta, EventSignal, EventStatus, PushSignal, SettleCallback};
use super::stream::{CopyDirection, CopyOp, Stream, StreamBackend};
use super::{next_device_id, Device, DeviceError, DeviceKind};

/// Driver entry points this backend calls; all are checked before the first call.
const SYMBOLS: &[&str] = &[
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

const POLL_MIN: Duration = Duration::from_micros(20);
const POLL_MAX: Duration = Duration::from_millis(1);
const REAP_MIN: Duration = Duration::from_millis(1);
const REAP_MAX: Duration = Duration::from_millis(100);

fn ok(r: sys::CUresult) -> bool {
    r == sys::CUresult::CUDA_SUCCESS
}

fn driver(r: sys::CUresult, what: &str) -> DeviceError {
    DeviceError::Driver(format!("{what}: {r:?}"))
}

fn check(r: sys::CUresult, what: &str) -> Result<(), DeviceError> {
    if ok(r) {
        Ok(())
    } else {
        Err(driver(r, what))
    }
}

/// Loads the driver library, checks every symbol, and initialises the driver.
fn load_driver() -> Result<(), DeviceError> {
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
struct Ctx {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
}

// SAFETY: a CUDA context handle may be used from any thread (made current with
// cuCtxSetCurrent); the driver API is thread-safe.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Makes the context current on this thread.
    fn bind(&self) -> Result<(), DeviceError> {
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

/// An event in flight, and what its operation keeps alive until it completes.
struct CudaEv {
    ctx: Arc<Ctx>,
    event: sys::CUevent,
    /// Report this failure instead of success once the event completes (an enqueue
    /// failed after earlier parts of the copy were queued).
    fail_on_complete: Option<String>,
    state: Mutex<EvState>,
}

struct EvState {
    /// Set once, by the first query that sees the event settled.
    settled: Option<EventStatus>,
    /// The operation's memory (host pages, buffers), dropped at settlement.
    keep: Option<Box<dyn Any + Send>>,
    /// Settle callbacks, run by whoever first sees the event settled.
    callbacks: Vec<SettleCallback>,
}

// SAFETY: event handles may be queried and destroyed from any thread with the context
// current; everything else is `Send` and behind a mutex.
unsafe impl Send for CudaEv {}
// SAFETY: as above; all mutation is behind the mutex or in the (thread-safe) driver.
unsafe impl Sync for CudaEv {}

impl CudaEv {
    /// Queries the driver until the event settles; the first caller that sees it settle
    /// releases the operation's memory and runs the settle callbacks before returning.
    fn query(&self) -> EventStatus {
        if let Some(s) = &self.state.lock().settled {
            return s.clone();
        }
        let status = match self.ctx.bind() {
            Err(e) => EventStatus::Faulted(e.to_string()),
            Ok(()) => {
                // SAFETY: `event` was created in this context and is destroyed only on drop.
                let r = unsafe { sys::cuEventQuery(self.event) };
                match r {
                    sys::CUresult::CUDA_SUCCESS => match &self.fail_on_complete {
                        None => EventStatus::Complete,
                        Some(m) => EventStatus::Failed(m.clone()),
                    },
                    sys::CUresult::CUDA_ERROR_NOT_READY => return EventStatus::Pending,
                    other => EventStatus::Faulted(format!("cuEventQuery: {other:?}")),
                }
            }
        };
        let (keep, callbacks) = {
            let mut st = self.state.lock();
            if let Some(first) = &st.settled {
                return first.clone();
            }
            st.settled = Some(status.clone());
            (st.keep.take(), std::mem::take(&mut st.callbacks))
        };
        // The operation's memory is quiet (or, if faulted, quarantined by its owner).
        drop(keep);
        for cb in callbacks {
            cb(&status);
        }
        status
    }

    /// Runs `f` at settlement (now if settled). True if it was queued.
    fn on_settled(&self, f: SettleCallback) -> bool {
        let status = {
            let mut st = self.state.lock();
            match &st.settled {
                Some(s) => s.clone(),
                None => {
                    st.callbacks.push(f);
                    return true;
                }
            }
        };
        f(&status);
        false
    }
}

impl Drop for CudaEv {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the event belongs to this context; destroying a pending event is
            // allowed (its resources are freed when it completes).
            unsafe {
                sys::cuEventDestroy_v2(self.event);
            }
        }
    }
}

/// The [`EventSignal`] of a CUDA event.
struct CudaSignal {
    ev: Arc<CudaEv>,
    reaper: Reaper,
}

impl EventSignal for CudaSignal {
    fn status(&self) -> EventStatus {
        self.ev.query()
    }

    fn settled(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let mut backoff = POLL_MIN;
            while !self.ev.query().is_settled() {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(POLL_MAX);
            }
        })
    }

    fn settled_blocking(&self, deadline: std::time::Instant) {
        let mut backoff = POLL_MIN;
        while !self.ev.query().is_settled() {
            let now = std::time::Instant::now();
            if now >= deadline {
                return;
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(POLL_MAX);
        }
    }

    fn on_settled(&self, f: SettleCallback) {
        // Runs `f` now if settled, else queues it on the event.
        self.ev.query();
        if !self.ev.on_settled(f) {
            return;
        }
        // Waiters may be gone: the reaper polls the event until it settles.
        self.reaper.watch(self.ev.clone());
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct ReaperState {
    watches: Vec<Arc<CudaEv>>,
    frees: Vec<(Arc<Ctx>, sys::CUdeviceptr)>,
    running: bool,
    kicked: bool,
}

struct ReaperInner {
    state: Mutex<ReaperState>,
    cv: Condvar,
}

/// Watches abandoned events and frees device memory, on a thread that exists only while
/// there is work.
#[derive(Clone)]
struct Reaper {
    inner: Arc<ReaperInner>,
}

impl Reaper {
    fn new() -> Reaper {
        Reaper {
            inner: Arc::new(ReaperInner {
                state: Mutex::new(ReaperState {
                    watches: Vec::new(),
                    frees: Vec::new(),
                    running: false,
                    kicked: false,
                }),
                cv: Condvar::new(),
            }),
        }
    }

    fn watch(&self, ev: Arc<CudaEv>) {
        self.kick(|st| st.watches.push(ev));
    }

    fn free(&self, ctx: Arc<Ctx>, ptr: sys::CUdeviceptr) {
        self.kick(|st| st.frees.push((ctx, ptr)));
    }

    fn kick(&self, add: impl FnOnce(&mut ReaperState)) {
        let mut st = self.inner.state.lock();
        add(&mut st);
        st.kicked = true;
        if st.running {
            self.inner.cv.notify_one();
            return;
        }
        st.running = true;
        let inner = self.inner.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-cuda-reaper".into())
            .spawn(move || reap(inner));
        if let Err(e) = spawned {
            // Nothing is released without the thread: watched pages stay quarantined and
            // queued frees leak. Both are safe; report it.
            st.running = false;
            tracing::warn!(target: "kvferry::device", "cannot start the CUDA reaper thread: {e}");
        }
    }
}

fn reap(inner: Arc<ReaperInner>) {
    let mut backoff = REAP_MIN;
    loop {
        let (frees, watches) = {
            let mut st = inner.state.lock();
            if st.watches.is_empty() && st.frees.is_empty() {
                st.running = false;
                return;
            }
            if std::mem::take(&mut st.kicked) {
                backoff = REAP_MIN;
            }
            (std::mem::take(&mut st.frees), std::mem::take(&mut st.watches))
        };
        for (ctx, ptr) in frees {
            if ctx.bind().is_ok() {
                // SAFETY: `ptr` was allocated with cuMemAlloc in `ctx`, and every
                // operation that used it held the buffer until it completed.
                unsafe {
                    sys::cuMemFree_v2(ptr);
                }
            }
        }
        // A query that sees an event settle runs its callbacks (releasing quarantine).
        let pending: Vec<_> = watches.into_iter().filter(|ev| !ev.query().is_settled()).collect();
        let mut st = inner.state.lock();
        st.watches.extend(pending);
        if !st.kicked && !st.watches.is_empty() && st.frees.is_empty() {
            inner.cv.wait_for(&mut st, backoff);
            backoff = (backoff * 2).min(REAP_MAX);
        }
    }
}

/// What a device's streams and buffers share.
struct DevShared {
    id: u64,
    rank: u32,
    ctx: Arc<Ctx>,
    reaper: Reaper,
}

/// A CUDA GPU, through its primary context. See the module docs.
pub struct CudaDevice {
    shared: Arc<DevShared>,
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
        })))
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

/// Device memory: from `cuMemAlloc` (ours, freed on drop) or external (kept alive by
/// its owner, never freed here).
struct CudaBuffer {
    dev: Arc<DevShared>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// What keeps external memory alive (dropped with the buffer); `None`: ours.
    owner: Option<Box<dyn Any + Send + Sync>>,
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
        super::buffer::check_range(offset, data.len(), self.len, "device buffer")?;
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
        super::buffer::check_range(offset, out.len(), self.len, "device buffer")?;
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
}

struct CudaStream {
    name: String,
    dev: Arc<DevShared>,
    stream: sys::CUstream,
}

// SAFETY: stream handles may be used from any thread with the context current.
unsafe impl Send for CudaStream {}
// SAFETY: as above; the driver serialises use of a stream.
unsafe impl Sync for CudaStream {}

impl std::fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStream").field("name", &self.name).finish()
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.dev.ctx.bind().is_ok() {
            // SAFETY: our stream; destroying it with work pending is allowed (resources
            // are released once the work completes).
            unsafe {
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

impl CudaStream {
    /// Creates a fresh event and records it on the stream.
    fn new_event(&self) -> Result<sys::CUevent, DeviceError> {
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the context is current (callers bind); `ev` is a valid out pointer.
        check(unsafe { sys::cuEventCreate(&mut ev, flags) }, "cuEventCreate")?;
        // SAFETY: both handles belong to the current context.
        let r = unsafe { sys::cuEventRecord(ev, self.stream) };
        if !ok(r) {
            // SAFETY: the event was created above and is not used elsewhere.
            unsafe {
                sys::cuEventDestroy_v2(ev);
            }
            return Err(driver(r, "cuEventRecord"));
        }
        Ok(ev)
    }

    fn event(
        &self,
        meta: EventMeta,
        ev: sys::CUevent,
        fail: Option<String>,
        keep: Option<Box<dyn Any + Send>>,
    ) -> Event {
        let ev = Arc::new(CudaEv {
            ctx: self.dev.ctx.clone(),
            event: ev,
            fail_on_complete: fail,
            state: Mutex::new(EvState {
                settled: None,
                keep,
                callbacks: Vec::new(),
            }),
        });
        Event::new(
            meta,
            Arc::new(CudaSignal {
                ev,
                reaper: self.dev.reaper.clone(),
            }),
        )
    }
}

impl StreamBackend for CudaStream {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_id(&self) -> u64 {
        self.dev.id
    }

    fn rank(&self) -> u32 {
        self.dev.rank
    }

    fn copy(&self, op: CopyOp) -> Result<Event, DeviceError> {
        let mut bufs = Vec::with_capacity(op.parts.len());
        for p in &op.parts {
            let b = p
                .buffer
                .backend()
                .as_any()
                .downcast_ref::<CudaBuffer>()
                .ok_or_else(|| {
                    DeviceError::InvalidArgument("CUDA stream given a buffer that is not CUDA memory".into())
                })?;
            bufs.push(b.ptr);
        }
        self.dev.ctx.bind()?;
        let mut issued = 0usize;
        let mut error: Option<String> = None;
        for (part, base) in op.parts.iter().zip(bufs) {
            for seg in &part.segments {
                let (host_off, mut dev_off) = match op.direction {
                    CopyDirection::DeviceToHost => (seg.dst, seg.src),
                    CopyDirection::HostToDevice => (seg.src, seg.dst),
                };
                let walked = op.host.for_each_run(host_off, seg.len, &mut |p, n| {
                    if error.is_some() {
                        return;
                    }
                    let d = base + dev_off as u64;
                    // SAFETY: both ranges were validated against their memories; the
                    // host pages and the buffer are kept alive by the event until the
                    // copy completes.
                    let r = unsafe {
                        match op.direction {
                            CopyDirection::DeviceToHost => {
                                sys::cuMemcpyDtoHAsync_v2(p as *mut c_void, d, n, self.stream)
                            }
                            CopyDirection::HostToDevice => {
                                sys::cuMemcpyHtoDAsync_v2(d, p as *const c_void, n, self.stream)
                            }
                        }
                    };
                    if ok(r) {
                        issued += 1;
                    } else {
                        error = Some(format!("cuMemcpyAsync: {r:?}"));
                    }
                    dev_off += n;
                });
                if let Err(e) = walked {
                    error.get_or_insert_with(|| e.to_string());
                }
            }
        }
        if let (Some(e), 0) = (&error, issued) {
            return Err(DeviceError::Driver(e.clone()));
        }
        let meta = op.meta.clone();
        match self.new_event() {
            Ok(ev) => Ok(self.event(meta, ev, error, Some(Box::new(op)))),
            Err(e) => {
                // Copies are queued but cannot be tracked: keep their memory forever and
                // report a fault (the lease stays quarantined).
                std::mem::forget(op);
                let signal = PushSignal::new();
                signal.settle(EventStatus::Faulted(e.to_string()));
                Ok(Event::new(meta, signal))
            }
        }
    }

    fn record(&self, meta: EventMeta) -> Result<Event, DeviceError> {
        self.dev.ctx.bind()?;
        let ev = self.new_event()?;
        Ok(self.event(meta, ev, None, None))
    }

    fn wait_event(&self, event: &Event) -> Result<(), DeviceError> {
        match event.signal().as_any().downcast_ref::<CudaSignal>() {
            Some(s) => {
                self.dev.ctx.bind()?;
                // SAFETY: both handles are live; waiting on an event of another context
                // is allowed.
                check(
                    unsafe { sys::cuStreamWaitEvent(self.stream, s.ev.event, 0) },
                    "cuStreamWaitEvent",
                )
            }
            None if event.query().is_settled() => Ok(()),
            None => {
                self.dev.ctx.bind()?;
                let data = Box::into_raw(Box::new(event.clone())) as *mut c_void;
                // SAFETY: `host_wait` matches CUhostFn and takes ownership of `data`, a
                // leaked `Box<Event>`, when the driver calls it (once).
                let r = unsafe { sys::cuLaunchHostFunc(self.stream, Some(host_wait), data) };
                if !ok(r) {
                    // SAFETY: the driver refused the call, so it will never use `data`.
                    drop(unsafe { Box::from_raw(data as *mut Event) });
                    return Err(driver(r, "cuLaunchHostFunc"));
                }
                Ok(())
            }
        }
    }
}

/// A host function that holds its stream until a host-side event settles.
///
/// # Safety
///
/// `data` must be a `Box<Event>` leaked with `Box::into_raw`, passed to exactly one call.
unsafe extern "C" fn host_wait(data: *mut c_void) {
    // SAFETY: guaranteed by the caller (`wait_event`).
    let event = unsafe { Box::from_raw(data as *mut Event) };
    // Never unwind into the driver.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while !event.query().is_settled() {
            event
                .signal()
                .settled_blocking(std::time::Instant::now() + Duration::from_secs(3600));
        }
    }));
}

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

// -- Notification when a raw CUevent completes (no polling) ------------------------------

/// Driver entry points [`on_raw_event_complete`] needs beyond [`SYMBOLS`].
const WATCH_SYMBOLS: &[&str] = &["cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"];

/// At most this many watch streams may be held at once behind events that have not
/// completed (timed-out waits on stuck events); beyond it [`on_raw_event_complete`]
/// returns [`DeviceError::Busy`] and callers poll instead.
pub const MAX_BUSY_WATCH_STREAMS: usize = 64;

/// The private streams of [`on_raw_event_complete`], per device ordinal.
#[derive(Default)]
struct WatchPool {
    /// Each device's retained primary context (kept for the life of the process).
    ctx: std::collections::HashMap<usize, usize>,
    /// Streams whose last watch has fired: free for the next one.
    idle: std::collections::HashMap<usize, Vec<usize>>,
    /// Streams with a watch enqueued that has not fired yet.
    busy: usize,
    /// Watches that have fired.
    fired: u64,
}

fn watch_pool() -> &'static Mutex<WatchPool> {
    static POOL: std::sync::OnceLock<Mutex<WatchPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| Mutex::new(WatchPool::default()))
}

/// Where the watch streams stand: `(idle, busy, fired)` — streams free for the next
/// watch, streams held behind an event that has not completed yet, and watches that
/// have fired since the process started.
pub fn raw_event_watch_stats() -> (usize, usize, u64) {
    let p = watch_pool().lock();
    (p.idle.values().map(Vec::len).sum(), p.busy, p.fired)
}

/// What a watch's host function owns: the callback and the stream it returns.
struct Watch {
    done: Box<dyn FnOnce() + Send>,
    ordinal: usize,
    stream: usize,
}

/// Loads and checks the driver once per process (the result is remembered).
fn ensure_loaded() -> Result<(), DeviceError> {
    fn load() -> Result<(), DeviceError> {
        load_driver()?;
        // SAFETY: load_driver succeeded, so the library is loaded; looking symbols up
        // does not call them.
        let lib = unsafe { sys::culib() };
        for name in WATCH_SYMBOLS {
            // SAFETY: as above.
            if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                return Err(DeviceError::NoDevice(format!("the CUDA driver lacks {name}")));
            }
        }
        Ok(())
    }
    static LOADED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        load().map_err(|e| match e {
            DeviceError::NoDevice(m) => m,
            other => other.to_string(),
        })
    });
    match loaded {
        Ok(()) => Ok(()),
        Err(why) => Err(DeviceError::NoDevice(why.clone())),
    }
}

/// Pops the context pushed by [`on_raw_event_complete`] when dropped.
struct PopCtx;

impl Drop for PopCtx {
    fn drop(&mut self) {
        let mut old: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a context was pushed on this thread by the code that made this guard.
        unsafe {
            sys::cuCtxPopCurrent_v2(&mut old);
        }
    }
}

/// Arranges for `done` to run once every piece of work captured by the last record of
/// the raw `CUevent` `handle` (of GPU `ordinal`; torch's `torch.cuda.Event.cuda_event`)
/// has completed — without polling: a private non-blocking stream of the device's
/// primary context waits on the event (`cuStreamWaitEvent`) and then runs a host
/// function (`cuLaunchHostFunc`) that calls `done` on the driver's callback thread.
///
/// - `done` is owned by the host function: if the event never completes, it is never
///   called and never freed (nothing the caller frees is touched; the caller keeps what
///   `done` signals in an `Arc`). `done` must not call CUDA.
/// - A stream is reused only after its host function ran, so a stream held behind a
///   stuck event never delays a later watch; at most [`MAX_BUSY_WATCH_STREAMS`] are
///   held at once: beyond that nothing is armed and the result is `Ok(false)` (`done`
///   dropped without being called). `Ok(true)`: armed.
/// - The calling thread's current context is left as it was (pushed and popped).
/// - The driver runs host functions of a context one at a time: a host function of
///   someone else's that blocks (see [`Stream::wait_event`] on host events) delays
///   `done` until it returns. Callers that must not depend on that also query.
/// - Errors: [`DeviceError::NoDevice`] without a driver (or one lacking an entry
///   point), [`DeviceError::Driver`] when the driver refuses a call (a sticky context
///   error, an invalid handle); `done` is then dropped without being called.
///
/// # Safety
///
/// `handle` must be a live `CUevent` of GPU `ordinal` for the duration of the call.
pub unsafe fn on_raw_event_complete(
    handle: usize,
    ordinal: usize,
    done: Box<dyn FnOnce() + Send>,
) -> Result<bool, DeviceError> {
    ensure_loaded()?;
    if handle == 0 {
        return Err(DeviceError::InvalidArgument("a null CUevent handle".into()));
    }
    let known = {
        let pool = watch_pool().lock();
        if pool.busy >= MAX_BUSY_WATCH_STREAMS {
            return Ok(false);
        }
        pool.ctx.get(&ordinal).copied()
    };
    // The pool's lock is never held across a driver call (host functions take it).
    let ctx = match known {
        Some(c) => c as sys::CUcontext,
        None => {
            let mut dev: sys::CUdevice = 0;
            let ord =
                c_int::try_from(ordinal).map_err(|_| DeviceError::InvalidArgument(format!("GPU ordinal {ordinal}")))?;
            // SAFETY: the driver is loaded and initialised; `dev` is a valid out pointer.
            check(unsafe { sys::cuDeviceGet(&mut dev, ord) }, "cuDeviceGet")?;
            let mut c: sys::CUcontext = std::ptr::null_mut();
            // The retained context is kept for the life of the process (never released;
            // a second retain by a racing caller only raises its count).
            // SAFETY: `dev` is a device handle; `c` a valid out pointer.
            let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut c, dev) };
            check(r, "cuDevicePrimaryCtxRetain")?;
            *watch_pool().lock().ctx.entry(ordinal).or_insert(c as usize) as sys::CUcontext
        }
    };
    // SAFETY: `ctx` is a retained primary context; it is popped by `_pop`.
    check(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
    let _pop = PopCtx;
    let reused = watch_pool().lock().idle.get_mut(&ordinal).and_then(Vec::pop);
    let stream = match reused {
        Some(s) => s as sys::CUstream,
        None => {
            let mut s: sys::CUstream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: the context is current; `s` is a valid out pointer.
            check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
            s
        }
    };
    // SAFETY: `stream` is ours and live; the caller guarantees `handle` is a live event
    // (waiting on an event of another context is allowed).
    let r = unsafe { sys::cuStreamWaitEvent(stream, handle as sys::CUevent, 0) };
    if !ok(r) {
        // Nothing was enqueued: the stream is free again.
        watch_pool()
            .lock()
            .idle
            .entry(ordinal)
            .or_default()
            .push(stream as usize);
        return Err(driver(r, "cuStreamWaitEvent"));
    }
    let data = Box::into_raw(Box::new(Watch {
        done,
        ordinal,
        stream: stream as usize,
    })) as *mut c_void;
    watch_pool().lock().busy += 1;
    // SAFETY: `watch_done` matches CUhostFn and takes ownership of `data`, a leaked
    // `Box<Watch>`, when the driver calls it (once).
    let r = unsafe { sys::cuLaunchHostFunc(stream, Some(watch_done), data) };
    if !ok(r) {
        // SAFETY: the driver refused the call, so it will never use `data`.
        drop(unsafe { Box::from_raw(data as *mut Watch) });
        // The stream may be held behind the event: never reuse it. Destroying a stream
        // with pending work returns at once and frees it once the work is done.
        // SAFETY: `stream` is ours and no longer referenced anywhere.
        unsafe {
            sys::cuStreamDestroy_v2(stream);
        }
        watch_pool().lock().busy -= 1;
        return Err(driver(r, "cuLaunchHostFunc"));
    }
    Ok(true)
}

/// The host function of [`on_raw_event_complete`]: runs the watch's callback, then
/// returns its stream to the pool. Makes no CUDA call.
///
/// # Safety
///
/// `data` must be a `Box<Watch>` leaked with `Box::into_raw`, passed to exactly one call.
unsafe extern "C" fn watch_done(data: *mut c_void) {
    // SAFETY: guaranteed by the caller (`on_raw_event_complete`).
    let watch = unsafe { Box::from_raw(data as *mut Watch) };
    let Watch { done, ordinal, stream } = *watch;
    // The stream is free first (work enqueued on it now runs after this function), so
    // whoever `done` wakes sees the pool as it is.
    {
        let mut pool = watch_pool().lock();
        pool.busy -= 1;
        pool.fired += 1;
        pool.idle.entry(ordinal).or_default().push(stream);
    }
    // Never unwind into the driver.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(done));
}
