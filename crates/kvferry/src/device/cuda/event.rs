//! A CUDA event in flight ([`CudaEv`]) and its [`EventSignal`] ([`CudaSignal`]).
//!
//! - Every operation creates a fresh `CUevent` (timing disabled), recorded after the
//!   operation's work; the event holds the operation's memory (lease pages, device
//!   buffers) until a query sees it settle. That first query releases the memory and
//!   runs the settle callbacks (releasing quarantined pages) before it returns.
//! - Waiting polls `cuEventQuery` with exponential backoff, 20 µs doubling to 1 ms
//!   (`tokio::time::sleep` in async waits, `std::thread::sleep` in blocking ones).
//! - A settle callback queued with no waiter left hands the event to the device's
//!   [`Reaper`], which polls it until it settles.
//! - An error from `cuEventQuery` (a sticky context error) settles the event as
//!   [`EventStatus::Faulted`]: its memory stays quarantined.
//!
//! # Cancellation
//!
//! Dropping an async wait ([`EventSignal::settled`]) stops polling at once; the
//! operation continues on the GPU and its memory stays held until the event settles.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::device::event::{BoxFuture, EventSignal, EventStatus, SettleCallback};

use super::driver::Ctx;
use super::reaper::Reaper;

const POLL_MIN: Duration = Duration::from_micros(20);
const POLL_MAX: Duration = Duration::from_millis(1);

/// An event in flight, and what its operation keeps alive until it completes.
pub(super) struct CudaEv {
    pub(super) ctx: Arc<Ctx>,
    pub(super) event: sys::CUevent,
    /// Report this failure instead of success once the event completes (an enqueue
    /// failed after earlier parts of the copy were queued).
    pub(super) fail_on_complete: Option<String>,
    pub(super) state: Mutex<EvState>,
}

pub(super) struct EvState {
    /// Set once, by the first query that sees the event settled.
    pub(super) settled: Option<EventStatus>,
    /// The operation's memory (host pages, buffers), dropped at settlement.
    pub(super) keep: Option<Box<dyn Any + Send>>,
    /// Settle callbacks, run by whoever first sees the event settled.
    pub(super) callbacks: Vec<SettleCallback>,
}

// SAFETY: event handles may be queried and destroyed from any thread with the context
// current; everything else is `Send` and behind a mutex.
unsafe impl Send for CudaEv {}
// SAFETY: as above; all mutation is behind the mutex or in the (thread-safe) driver.
unsafe impl Sync for CudaEv {}

impl CudaEv {
    /// Queries the driver until the event settles; the first caller that sees it settle
    /// releases the operation's memory and runs the settle callbacks before returning.
    pub(super) fn query(&self) -> EventStatus {
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
pub(super) struct CudaSignal {
    pub(super) ev: Arc<CudaEv>,
    pub(super) reaper: Reaper,
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
