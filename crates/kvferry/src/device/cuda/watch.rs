//! Notification when a raw `CUevent` of another library (torch's `CUevent`s) completes,
//! without polling: [`on_raw_event_complete`] makes a private stream of the device's
//! primary context wait on the event and run a host function that calls back. A stream
//! is reused only after its host function ran, and at most [`MAX_BUSY_WATCH_STREAMS`]
//! are held at once behind events that have not completed; [`raw_event_watch_stats`]
//! says where the pool stands.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::device::DeviceError;

use super::driver::{check, driver, load_driver, ok};

/// Driver entry points [`on_raw_event_complete`] needs beyond [`SYMBOLS`](super::driver::SYMBOLS).
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
///   someone else's that blocks (see [`Stream::wait_event`](crate::device::Stream::wait_event) on host events) delays
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
