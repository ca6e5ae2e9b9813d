//! CUDA events in `bounded_wait`: a torch CUDA event's raw `CUevent` is queried once
//! from Rust (`cuEventQuery`); if pending, a notification is armed (a private stream of
//! the event's device waits on it and runs a host function that sets a notifier) and
//! the thread sleeps on it, also querying every 250 ms and at the deadline, because the
//! driver's callback thread can be held up by someone else's host function. Where the
//! notification cannot be armed, the wait polls `cuEventQuery` on the schedule. Builds
//! without the `cuda` feature never see a CUDA handle.
//!
//! # Cancellation
//!
//! A notification armed by a wait that ended early (a timeout, an interrupt) stays
//! armed: its host function owns the notifier it sets (an `Arc`), so it touches nothing
//! freed, and its stream is reused only after it ran.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "cuda")]
use kvferry::ErrorCode;
use pyo3::prelude::*;

use crate::completion::Notifier;
#[cfg(feature = "cuda")]
use crate::errors::ErrInfo;

use super::poll::{poll_loop, sleep_on, sleep_until, Outcome};
use super::schedule::Plan;
use super::{bump, STATS};

/// How often a notified CUDA wait also queries the event (a held-up callback thread).
const CUDA_CHECK_EVERY: Duration = Duration::from_millis(250);

#[cfg(feature = "cuda")]
fn query_cuda(handle: usize, what: &str, device: &str) -> PyResult<bool> {
    if handle == 0 {
        return Ok(true);
    }
    // SAFETY: `handle` is the CUevent of a torch event object that the caller's
    // arguments keep alive for this whole call (torch destroys it only when the
    // object is freed).
    unsafe { kvferry::engine::query_raw_event(handle) }.map_err(|e| {
        ErrInfo::new(
            ErrorCode::Device,
            format!("bounded_wait: querying {what} on {device}: {e}"),
        )
        .op(what)
        .into()
    })
}

#[cfg(not(feature = "cuda"))]
fn query_cuda(_handle: usize, _what: &str, _device: &str) -> PyResult<bool> {
    unreachable!("CUDA handles are used only in builds with the cuda feature")
}

/// Arms a notification for the raw CUDA event (see the module docs); `None` when it
/// cannot be armed (the caller polls).
#[cfg(feature = "cuda")]
fn arm_cuda(handle: usize, ordinal: Option<usize>) -> Option<Arc<Notifier>> {
    let ordinal = ordinal?;
    let n = Arc::new(Notifier::new());
    let signal = n.clone();
    // SAFETY: `handle` is a live CUevent of GPU `ordinal` for this call, as in
    // `query_cuda`. The callback owns its `Arc` of the notifier.
    match unsafe {
        kvferry::engine::on_raw_event_complete(
            handle,
            ordinal,
            Box::new(move || {
                signal.set();
            }),
        )
    } {
        Ok(true) => Some(n),
        Ok(false) | Err(_) => None,
    }
}

#[cfg(not(feature = "cuda"))]
fn arm_cuda(_handle: usize, _ordinal: Option<usize>) -> Option<Arc<Notifier>> {
    None
}

/// A CUDA event's wait, with the GIL released: notified where possible, else polled.
pub(super) fn wait_cuda(
    handle: usize,
    ordinal: Option<usize>,
    start: Instant,
    timeout: Duration,
    plan: Plan,
    what: &str,
    device: &str,
) -> PyResult<Outcome> {
    let deadline = start + timeout;
    if query_cuda(handle, what, device)? {
        return Ok(Outcome::at_once(start));
    }
    let Some(n) = (if timeout.is_zero() {
        None
    } else {
        arm_cuda(handle, ordinal)
    }) else {
        bump(&STATS.cuda_poll_waits);
        return poll_loop(
            start,
            timeout,
            plan,
            || query_cuda(handle, what, device),
            |until| {
                if sleep_until(until) {
                    Python::attach(|py| py.check_signals())?;
                }
                Ok(())
            },
        );
    };
    bump(&STATS.cuda_notify_waits);
    let mut check = start + CUDA_CHECK_EVERY;
    loop {
        if sleep_on(&n, check.min(deadline))? || query_cuda(handle, what, device)? {
            return Ok(Outcome {
                completed: true,
                waited: start.elapsed(),
                // Notified: nothing to learn for the polling schedule.
                pending_at_start: false,
                last_pending: Duration::ZERO,
                overshot: false,
            });
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(Outcome {
                completed: false,
                waited: now - start,
                pending_at_start: true,
                last_pending: Duration::ZERO,
                overshot: false,
            });
        }
        check += CUDA_CHECK_EVERY;
    }
}
