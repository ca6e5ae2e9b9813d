//! [`CudaStream`]: a non-blocking stream of a device's primary context. A copy enqueues
//! one `cuMemcpy*Async` per contiguous run of host pages and records a fresh event that
//! holds the copy's memory until it settles (an enqueue failing after earlier parts were
//! queued is reported when the event completes). A stream waits on a CUDA event with
//! `cuStreamWaitEvent`, and on a host-side event (such as [`Event::manual`]) with a host
//! function (`cuLaunchHostFunc`) that holds the stream until the event settles; that
//! function occupies the driver's callback thread meanwhile, so gate only on conditions
//! that do not need other host functions of the same context to run first.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::device::event::{Event, EventMeta, EventStatus, PushSignal};
use crate::device::stream::{CopyDirection, CopyOp, D2dOp, StreamBackend};
use crate::device::DeviceError;
use crate::mem::HostMemory;

use super::buffer::CudaBuffer;
use super::device::DevShared;
use super::driver::{check, driver, ok};
use super::event::{CudaEv, CudaSignal, EvState};

pub(super) struct CudaStream {
    pub(super) name: String,
    pub(super) dev: Arc<DevShared>,
    pub(super) stream: sys::CUstream,
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

    /// The event of an operation whose copies were queued: `issued` of them were, the
    /// first failure to queue one is `error` (none queued: the error itself). The
    /// operation `op` — the memory its copies touch — is kept by the event until it
    /// settles. When no event can be recorded the queued copies cannot be tracked:
    /// their memory is kept forever (a host lease stays quarantined, an import is never
    /// closed under a copy) and the event reports a fault.
    fn track<O: Send + 'static>(
        &self,
        meta: EventMeta,
        issued: usize,
        error: Option<String>,
        op: O,
    ) -> Result<Event, DeviceError> {
        if let (Some(e), 0) = (&error, issued) {
            return Err(DeviceError::Driver(e.clone()));
        }
        match self.new_event() {
            Ok(ev) => Ok(self.event(meta, ev, error, Some(Box::new(op)))),
            Err(e) => {
                std::mem::forget(op);
                let signal = PushSignal::new();
                signal.settle(EventStatus::Faulted(e.to_string()));
                Ok(Event::new(meta, signal))
            }
        }
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
        let meta = op.meta.clone();
        self.track(meta, issued, error, op)
    }

    fn copy_d2d(&self, op: D2dOp) -> Result<Event, DeviceError> {
        let cuda = |b: &crate::device::DeviceBuffer| -> Result<u64, DeviceError> {
            b.backend()
                .as_any()
                .downcast_ref::<CudaBuffer>()
                .map(|c| c.ptr)
                .ok_or_else(|| {
                    DeviceError::InvalidArgument("CUDA stream given a buffer that is not CUDA memory".into())
                })
        };
        let mut pairs = Vec::with_capacity(op.segments.len());
        for s in &op.segments {
            pairs.push((
                cuda(&s.src.buffer)? + s.src.offset as u64,
                cuda(&s.dst.buffer)? + s.dst.offset as u64,
                s.dst.len,
            ));
        }
        super::driver::require_ipc("cuMemcpyDtoDAsync")?;
        self.dev.ctx.bind()?;
        let (mut issued, mut error) = (0usize, None::<String>);
        for (src, dst, len) in pairs {
            // SAFETY: both ranges were validated against buffers the operation keeps
            // alive until its event settles (the event's `keep`); the destination is
            // this device's memory, never an import; the stream is ours.
            let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream) };
            if ok(r) {
                issued += 1;
            } else {
                error = Some(format!("cuMemcpyDtoDAsync: {r:?}"));
                break;
            }
        }
        let meta = op.meta.clone();
        self.track(meta, issued, error, op)
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
