//! `kvferry.bounded_wait(event, timeout, *, what=...)`: waits for an accelerator event
//! (anything with `query()`) until it completes or the deadline passes, never longer,
//! and without spinning.
//!
//! This is the bounded replacement for `event.synchronize()`, which waits without a
//! limit: if the device never completes the event, the waiting thread blocks for good
//! (the hang of `../shared/background/async-output-bounded-wait.txt`).
//!
//! Semantics:
//! - Returns the seconds waited once the event has completed. A `timeout` of `0`
//!   queries once. A negative, NaN or infinite timeout is an `InvalidArgumentError`.
//! - When the deadline passes first, raises `kvferry.TimeoutError` naming `what`, the
//!   event's device and the time waited (attributes `op` = what, `waited`, `device`).
//!   The event itself is untouched: the device may still complete it later.
//! - The GIL is released while the thread sleeps. How it learns of the completion
//!   depends on the event; the first query is always immediate, so a completed event
//!   costs one query:
//!   - **Events that notify** — `kvferry.CompletionEvent` (`completion.rs`): the thread
//!     sleeps on the event's notifier until it is set or the deadline passes. No
//!     polling: one wake-up, when it completes or at the deadline.
//!   - **CUDA events** (`torch.cuda.Event`, whose `cuda_event` is the raw `CUevent`,
//!     and a `torch.Event` on a CUDA device, whose `event_id` is), in builds with the
//!     `cuda` feature: one `cuEventQuery` from Rust; if pending, a private stream of the
//!     event's device waits on it and then runs a host function that sets a notifier
//!     (`kvferry::engine::on_raw_event_complete`), and the thread sleeps on that
//!     notifier, with the GIL released for the whole wait. The driver's callback thread
//!     can be held up by someone else's host function, so the wait also queries the
//!     event every 250 ms and at the deadline (four driver calls per second of a stuck
//!     event, never a continuous poll). Where the notification cannot be armed (a
//!     driver without the entry points, 64 watch streams already held behind stuck
//!     events, an unknown device ordinal) the wait polls `cuEventQuery` on the
//!     schedule below. A driver error (a sticky fault, a bad handle) is a
//!     `kvferry.DeviceError`. An event never recorded (handle 0) counts as complete, as
//!     torch's `query()` says. Builds without the `cuda` feature use `query()`.
//!   - **Any other event** is polled with its `query()` (truthy: complete), holding the
//!     GIL only for that call; an exception raised by `query()` propagates unchanged.
//! - The polling schedule (no busy spin). Each `what` remembers, for its last 16 waits
//!   that found the event pending at first, when the event completed: after the last
//!   query that saw it pending and by the one that saw it complete (taken at the middle
//!   of that bracket; a bracket that holds one at most half as wide is left out, so a
//!   cold wait's rough bracket or a sleep a busy host stalled does not pull the
//!   horizon early; when the sleep to the horizon overshot — its first poll saw the
//!   event complete — the completion is taken an eighth before that poll, so the next
//!   horizon steps back a little instead of to the middle of the sleep). A wait
//!   sleeps in one stretch until shortly before the earliest recent completion, polls
//!   finely across to the latest its bracket allows (6 queries, at least 40 µs
//!   apart; the most extreme completion on each side is left out once there are 6, so
//!   one step delayed by a busy host does not coarsen the next 16), polls once more a
//!   window later, and then, as without history, backs off geometrically: the next
//!   query at 4 times the time waited so far (the first at 20 µs), at most 400 ms
//!   later. A second on an event that never completes so costs about ten queries (a
//!   dozen after a history), and a wait that ends when its history says resumes
//!   within tens of microseconds. Completion times that vary widely give coarser fine
//!   polls (the same six queries across the spread). While polling the thread's timer
//!   slack is 1 µs (Linux), so short sleeps are as short as asked; it is restored
//!   afterwards.
//! - Ctrl-C: a signal interrupts the sleep (Linux: `nanosleep`/`futex` return
//!   `EINTR`), the wait runs Python's signal handlers, and a raised `KeyboardInterrupt`
//!   ends it; otherwise it sleeps on. (As with Python's own lock waits, a signal
//!   delivered to another thread is seen at the next wake-up.)
//!
//! # Cancellation
//!
//! There is no future to drop: the call is synchronous. An interrupt (a signal
//! handler raising) ends the wait like a timeout does — the event is left as it is. A
//! CUDA notification armed by a wait that ended early stays armed: its host function
//! owns the notifier it sets (an `Arc`), so it touches nothing freed, and its stream is
//! reused only after it ran.
//!
//! # Files
//!
//! - `schedule`: the polling schedule — each `what`'s recent completions and the plan
//!   of the next wait.
//! - `poll`: sleeping and the polling loop that follows a plan.
//! - `cuda`: CUDA events — one `cuEventQuery`, then a notification where it can be
//!   armed (checked every 250 ms), else the polling loop.

mod cuda;
mod poll;
mod schedule;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::ErrorCode;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::completion::{Notifier, PyCompletionEvent};
use crate::errors::ErrInfo;
use cuda::wait_cuda;
use poll::{poll_loop, sleep_on, sleep_until, Outcome};
use schedule::{plan, record, Sample};

/// Counters of how waits went (`kvferry._kvferry._bounded_wait_stats()`).
pub(super) struct Stats {
    notify_waits: AtomicU64,
    pub(super) cuda_notify_waits: AtomicU64,
    pub(super) cuda_poll_waits: AtomicU64,
    query_waits: AtomicU64,
    pub(super) polls: AtomicU64,
}

pub(super) static STATS: Stats = Stats {
    notify_waits: AtomicU64::new(0),
    cuda_notify_waits: AtomicU64::new(0),
    cuda_poll_waits: AtomicU64::new(0),
    query_waits: AtomicU64::new(0),
    polls: AtomicU64::new(0),
};

pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// How the event is waited for.
enum Source {
    /// Its notifier (`kvferry.CompletionEvent`).
    Notify(Arc<Notifier>),
    /// A raw `CUevent` (0: never recorded) and its GPU ordinal, if known.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda(usize, Option<usize>),
    /// Its `query()` method.
    Query,
}

/// The event's device as text, if it says (`event.device`).
fn device_of(event: &Bound<'_, PyAny>) -> Option<String> {
    let dev = event.getattr("device").ok()?;
    if dev.is_none() {
        return None;
    }
    dev.str().ok().map(|s| s.to_string())
}

/// The GPU ordinal of a device named `cuda:N`.
fn cuda_ordinal(device: Option<&str>) -> Option<usize> {
    device?.strip_prefix("cuda:")?.parse().ok()
}

/// The raw CUDA handle of a torch CUDA event, if `event` is one.
fn cuda_handle(event: &Bound<'_, PyAny>, device: Option<&str>) -> Option<usize> {
    if !cfg!(feature = "cuda") {
        return None;
    }
    // `torch.cuda.Event` (and CuPy-style events): `cuda_event` is the CUevent.
    if let Ok(h) = event.getattr("cuda_event") {
        return h.extract::<usize>().ok();
    }
    // `torch.Event` on a CUDA device: `event_id` is the cudaEvent_t (a CUevent).
    if device.is_some_and(|d| d.starts_with("cuda")) {
        if let Ok(h) = event.getattr("event_id") {
            return h.extract::<usize>().ok();
        }
    }
    None
}

fn type_name(event: &Bound<'_, PyAny>) -> String {
    let ty = event.get_type();
    let name = ty.qualname().map(|s| s.to_string()).unwrap_or_else(|_| "event".into());
    match ty.module().map(|m| m.to_string()) {
        Ok(m) if m != "builtins" => format!("{m}.{name}"),
        _ => name,
    }
}

/// Waits for `event` to complete, at most `timeout` seconds; returns the seconds
/// waited. See the module docs.
#[pyfunction]
#[pyo3(signature = (event, timeout, *, what = None))]
pub fn bounded_wait(py: Python<'_>, event: &Bound<'_, PyAny>, timeout: f64, what: Option<String>) -> PyResult<f64> {
    if !timeout.is_finite() || timeout < 0.0 {
        return Err(ErrInfo::invalid(format!(
            "bounded_wait: timeout must be a finite number of seconds >= 0, got {timeout}"
        ))
        .into());
    }
    let timeout_d = Duration::from_secs_f64(timeout);
    let what = what.unwrap_or_else(|| type_name(event));
    let device = device_of(event);
    let source = if let Ok(ev) = event.cast::<PyCompletionEvent>() {
        Source::Notify(ev.get().notifier.clone())
    } else {
        match cuda_handle(event, device.as_deref()) {
            Some(h) => Source::Cuda(h, cuda_ordinal(device.as_deref())),
            None => Source::Query,
        }
    };
    let device = device.unwrap_or_else(|| match source {
        Source::Cuda(..) => "cuda".to_string(),
        _ => "an unnamed device".to_string(),
    });
    let start = Instant::now();
    let outcome = match &source {
        Source::Notify(n) => {
            bump(&STATS.notify_waits);
            let deadline = start + timeout_d;
            let completed = n.is_set() || py.detach(|| sleep_on(n, deadline))?;
            Outcome {
                completed,
                waited: start.elapsed(),
                pending_at_start: false,
                last_pending: Duration::ZERO,
                overshot: false,
            }
        }
        Source::Query => {
            bump(&STATS.query_waits);
            let query = event.getattr("query")?;
            poll_loop(
                start,
                timeout_d,
                plan(&what),
                || query.call0()?.is_truthy(),
                |until| {
                    if py.detach(|| sleep_until(until)) {
                        py.check_signals()?;
                    }
                    Ok(())
                },
            )?
        }
        Source::Cuda(handle, ordinal) => {
            let plan = plan(&what);
            let (what_ref, device_ref) = (what.as_str(), device.as_str());
            py.detach(|| wait_cuda(*handle, *ordinal, start, timeout_d, plan, what_ref, device_ref))?
        }
    };
    if outcome.completed {
        if outcome.pending_at_start {
            record(
                &what,
                Sample {
                    lower: outcome.last_pending,
                    upper: outcome.waited,
                    overshot: outcome.overshot,
                },
            );
        }
        return Ok(outcome.waited.as_secs_f64());
    }
    let waited = outcome.waited;
    let mut info = ErrInfo::new(
        ErrorCode::Timeout,
        format!(
            "bounded_wait: {what} on {device} did not complete within {timeout:.3} s (waited {:.3} s); \
             the device may still complete it later",
            waited.as_secs_f64()
        ),
    )
    .op(&what);
    info.waited = Some(waited);
    let err = info.to_py(py);
    let _ = err.value(py).setattr("device", device);
    Err(err)
}

/// How waits have gone in this process: counts of waits by path (`notify`,
/// `cuda_notify`, `cuda_poll`, `query`), `polls` made by polling waits after their
/// first query, and in builds with the `cuda` feature the watch streams
/// (`cuda_watch_idle`, `cuda_watch_busy`: held behind events not yet complete,
/// `cuda_watch_fired`). For tests and benchmarks.
#[pyfunction]
pub fn _bounded_wait_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    d.set_item("notify", get(&STATS.notify_waits))?;
    d.set_item("cuda_notify", get(&STATS.cuda_notify_waits))?;
    d.set_item("cuda_poll", get(&STATS.cuda_poll_waits))?;
    d.set_item("query", get(&STATS.query_waits))?;
    d.set_item("polls", get(&STATS.polls))?;
    #[cfg(feature = "cuda")]
    {
        let (idle, busy, fired) = kvferry::engine::raw_event_watch_stats();
        d.set_item("cuda_watch_idle", idle)?;
        d.set_item("cuda_watch_busy", busy)?;
        d.set_item("cuda_watch_fired", fired)?;
    }
    Ok(d)
}
