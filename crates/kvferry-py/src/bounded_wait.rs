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

use kvferry::ErrorCode;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::completion::{Notifier, PyCompletionEvent, Woke};
use crate::errors::ErrInfo;

/// The first poll of a wait without history (after the immediate query).
const COLD_FIRST: Duration = Duration::from_micros(20);
/// Back-off: the next poll at this multiple of the time waited so far...
const GROWTH: u32 = 4;
/// ...but at most this long after the last one.
const POLL_MAX: Duration = Duration::from_millis(400);
/// Queries spent across the window of recent completions.
const FINE_POLLS: u32 = 6;
/// The shortest interval between fine polls.
const FINE_STEP_MIN: Duration = Duration::from_micros(40);
/// Waits remembered per `what`.
const HISTORY: usize = 16;
/// `what` names remembered (a bound on the table; beyond it the oldest is forgotten).
const MAX_NAMES: usize = 256;
/// How often a notified CUDA wait also queries the event (a held-up callback thread).
const CUDA_CHECK_EVERY: Duration = Duration::from_millis(250);

/// When the event of one past wait completed: after `lower` (the last query that saw it
/// pending) and by `upper` (the query that saw it complete), from the wait's start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Sample {
    lower: Duration,
    upper: Duration,
    /// The first poll, at the plan's horizon, already saw it complete: the sleep
    /// overshot, and all the wait knows is that it completed by `upper`.
    overshot: bool,
}

impl Sample {
    fn width(&self) -> Duration {
        self.upper.saturating_sub(self.lower)
    }

    /// When the event is taken to have completed: the middle of the bracket, or, after
    /// an overshot sleep, an eighth before `upper` (the next horizon steps back by that
    /// much each time it overshoots, so it closes in on the completion from above
    /// instead of jumping to the middle of [0, upper]).
    fn estimate(&self) -> Duration {
        if self.overshot {
            self.upper - self.upper / 8
        } else {
            self.lower + self.width() / 2
        }
    }
}

/// The recent waits of one `what` that were pending when they began.
#[derive(Default)]
struct History {
    recent: [Sample; HISTORY],
    len: usize,
    next: usize,
    /// Use stamp, for forgetting the least recently used name.
    used: u64,
}

impl History {
    fn record(&mut self, sample: Sample) {
        self.recent[self.next] = sample;
        self.next = (self.next + 1) % HISTORY;
        self.len = (self.len + 1).min(HISTORY);
    }

    /// The plan its samples give. Each sample's completion is estimated (the middle of
    /// its bracket, see [`Sample::estimate`]); sleep until shortly before the earliest
    /// estimate and poll [`FINE_POLLS`] times across to the latest (leaving out the
    /// most extreme one on each side once there are 6 samples: a step delayed by a
    /// busy host), and at least to the earliest bracket end (by then one of the recent
    /// events had completed: a lone cold bracket's 20–80 ms is polled across, not
    /// only at its middle).
    fn plan(&self) -> Plan {
        let recent = &self.recent[..self.len];
        if recent.is_empty() {
            return Plan::COLD;
        }
        // A bracket that holds a narrower one tells nothing the narrower one does not
        // (a cold wait's [20 ms, 80 ms], or one sleep stalled by a busy host: pending at
        // 0, complete at 61 ms); its middle would pull the horizon far too early.
        let informative = |s: &&Sample| {
            !recent.iter().any(|n| {
                n.width() * 2 <= s.width() && n.width() < s.width() && s.lower <= n.lower && n.upper <= s.upper
            })
        };
        let kept: Vec<&Sample> = recent.iter().filter(informative).collect();
        let mut estimates: Vec<Duration> = kept.iter().map(|s| s.estimate()).collect();
        estimates.sort();
        let trim = usize::from(kept.len() >= 6);
        let first_end = kept.iter().map(|s| s.upper).min().unwrap_or_default();
        let (lo, hi) = (estimates[trim], estimates[estimates.len() - 1 - trim].max(first_end));
        // A margin of 1/32 of it, between 20 µs and 500 µs, before the earliest.
        let margin = (lo / 32).clamp(Duration::from_micros(20), Duration::from_micros(500));
        let horizon = lo.saturating_sub(margin);
        let window = hi.saturating_sub(horizon);
        let step = (window / FINE_POLLS).max(FINE_STEP_MIN);
        Plan {
            horizon,
            fine_end: horizon + step * FINE_POLLS,
            step,
        }
    }
}

/// The schedule of one wait (times from its start): sleep until `horizon`, poll every
/// `step` until `fine_end`, then back off (see [`Plan::next_poll`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    horizon: Duration,
    fine_end: Duration,
    step: Duration,
}

impl Plan {
    /// Without history: back off from the start.
    const COLD: Plan = Plan {
        horizon: Duration::ZERO,
        fine_end: Duration::ZERO,
        step: FINE_STEP_MIN,
    };

    /// When to poll next, given the time of the last poll.
    fn next_poll(&self, last: Duration) -> Duration {
        if last < self.horizon {
            return self.horizon;
        }
        if last < self.fine_end {
            return last + self.step;
        }
        if self.fine_end > Duration::ZERO && last < self.fine_end * 2 - self.horizon {
            // Just past the window (a step a little later than the recent ones): one
            // more poll a window later before backing off.
            return (self.fine_end * 2 - self.horizon).max(last + self.step);
        }
        (last * GROWTH).max(last + COLD_FIRST).min(last + POLL_MAX)
    }
}

struct Histories {
    by_name: HashMap<String, History>,
    clock: u64,
}

fn histories() -> &'static Mutex<Histories> {
    static H: OnceLock<Mutex<Histories>> = OnceLock::new();
    H.get_or_init(|| {
        Mutex::new(Histories {
            by_name: HashMap::new(),
            clock: 0,
        })
    })
}

/// The plan of a wait for `what` (see [`History::plan`]); without history, cold.
fn plan(what: &str) -> Plan {
    let mut h = histories().lock();
    h.clock += 1;
    let clock = h.clock;
    match h.by_name.get_mut(what) {
        None => Plan::COLD,
        Some(hist) => {
            hist.used = clock;
            hist.plan()
        }
    }
}

fn record(what: &str, sample: Sample) {
    let mut h = histories().lock();
    h.clock += 1;
    let clock = h.clock;
    if !h.by_name.contains_key(what) && h.by_name.len() >= MAX_NAMES {
        if let Some(oldest) = h.by_name.iter().min_by_key(|(_, v)| v.used).map(|(k, _)| k.clone()) {
            h.by_name.remove(&oldest);
        }
    }
    let hist = h.by_name.entry(what.to_string()).or_default();
    hist.used = clock;
    hist.record(sample);
}

/// Counters of how waits went (`kvferry._kvferry._bounded_wait_stats()`).
struct Stats {
    notify_waits: AtomicU64,
    cuda_notify_waits: AtomicU64,
    cuda_poll_waits: AtomicU64,
    query_waits: AtomicU64,
    polls: AtomicU64,
}

static STATS: Stats = Stats {
    notify_waits: AtomicU64::new(0),
    cuda_notify_waits: AtomicU64::new(0),
    cuda_poll_waits: AtomicU64::new(0),
    query_waits: AtomicU64::new(0),
    polls: AtomicU64::new(0),
};

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Sets the calling thread's timer slack to 1 µs, restoring the previous value on drop.
struct TimerSlack {
    #[cfg(target_os = "linux")]
    old: Option<libc::c_ulong>,
}

impl TimerSlack {
    fn tighten() -> TimerSlack {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: PR_GET_TIMERSLACK takes no pointer and only reads this thread's
            // setting.
            let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
            if old > 1000 {
                // SAFETY: PR_SET_TIMERSLACK changes only the calling thread's slack.
                let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong, 0, 0, 0) };
                if r == 0 {
                    return TimerSlack {
                        old: Some(old as libc::c_ulong),
                    };
                }
            }
            TimerSlack { old: None }
        }
        #[cfg(not(target_os = "linux"))]
        TimerSlack {}
    }
}

impl Drop for TimerSlack {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Some(old) = self.old {
            // SAFETY: as in `tighten`: the calling thread's own slack, set back.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, old, 0, 0, 0);
            }
        }
    }
}

/// Sleeps until `until`; returns true if a signal interrupted the sleep (Linux).
fn sleep_until(until: Instant) -> bool {
    let now = Instant::now();
    if now >= until {
        return false;
    }
    let d = until - now;
    #[cfg(target_os = "linux")]
    {
        let ts = libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a valid timespec; the remainder pointer may be null.
        let r = unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
        r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    }
    #[cfg(not(target_os = "linux"))]
    {
        std::thread::sleep(d);
        false
    }
}

/// How one wait ended.
struct Outcome {
    completed: bool,
    waited: Duration,
    /// Whether the first query found the event pending (only such waits teach the
    /// history how long the event takes).
    pending_at_start: bool,
    /// When the last query that found it pending was made.
    last_pending: Duration,
    /// The first poll after the immediate query, made at a plan's horizon, saw it
    /// complete (see [`Sample::overshot`]).
    overshot: bool,
}

impl Outcome {
    fn at_once(start: Instant) -> Outcome {
        Outcome {
            completed: true,
            waited: start.elapsed(),
            pending_at_start: false,
            last_pending: Duration::ZERO,
            overshot: false,
        }
    }
}

/// The polling loop: `poll` says whether the event completed, `pause` sleeps until the
/// given instant (releasing whatever must be released) and may end the wait with an
/// error (a signal).
fn poll_loop(
    start: Instant,
    timeout: Duration,
    plan: Plan,
    mut poll: impl FnMut() -> PyResult<bool>,
    mut pause: impl FnMut(Instant) -> PyResult<()>,
) -> PyResult<Outcome> {
    let deadline = start + timeout;
    if poll()? {
        return Ok(Outcome::at_once(start));
    }
    let mut last_pending = start.elapsed();
    let mut polls = 0u32;
    let _slack = TimerSlack::tighten();
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Ok(Outcome {
                completed: false,
                waited: now - start,
                pending_at_start: true,
                last_pending,
                overshot: false,
            });
        }
        let next = (start + plan.next_poll(last_pending)).min(deadline);
        pause(next)?;
        if Instant::now() < next {
            // Interrupted early (a signal that raised nothing): sleep on.
            continue;
        }
        let before = start.elapsed();
        bump(&STATS.polls);
        polls += 1;
        if poll()? {
            return Ok(Outcome {
                completed: true,
                waited: start.elapsed(),
                pending_at_start: true,
                last_pending,
                overshot: polls == 1 && !plan.horizon.is_zero(),
            });
        }
        last_pending = before;
    }
}

/// Sleeps on `n` until it is set or `deadline` passes, running Python's signal handlers
/// when a signal interrupts the sleep. Call with the GIL released.
fn sleep_on(n: &Notifier, deadline: Instant) -> PyResult<bool> {
    loop {
        match n.wait_until(deadline) {
            Woke::Set => return Ok(true),
            Woke::Deadline => return Ok(false),
            Woke::Interrupted => Python::attach(|py| py.check_signals())?,
        }
    }
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
fn wait_cuda(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sample(lower: Duration, upper: Duration) -> Sample {
        Sample {
            lower,
            upper,
            overshot: false,
        }
    }

    /// The poll times of a wait of `plan` that never completes within `timeout`.
    fn polls(plan: Plan, timeout: Duration) -> Vec<Duration> {
        let mut at = Duration::ZERO;
        let mut out = vec![];
        while at < timeout {
            at = plan.next_poll(at).min(timeout);
            out.push(at);
        }
        out
    }

    #[test]
    fn without_history_the_wait_backs_off_from_20_us() {
        let p = polls(Plan::COLD, Duration::from_secs(1));
        assert_eq!(&p[..4], &[us(20), us(80), us(320), us(1280)]);
        // Intervals never exceed POLL_MAX; a second costs ten wake-ups.
        assert!(p.windows(2).all(|w| w[1] - w[0] <= POLL_MAX));
        assert_eq!(p.len(), 10, "{p:?}");
    }

    #[test]
    fn history_forgets_all_but_the_recent_waits() {
        let mut h = History::default();
        assert_eq!(h.plan(), Plan::COLD);
        h.record(sample(ms(3), ms(3)));
        for _ in 0..HISTORY {
            h.record(sample(ms(7), ms(7)));
        }
        // The 3 ms wait fell out of the window.
        assert_eq!(h.plan().horizon, ms(7) - Duration::from_nanos(218_750));
    }

    #[test]
    fn a_steady_history_sleeps_until_just_before_and_polls_finely() {
        let mut h = History::default();
        for _ in 0..4 {
            h.record(sample(us(2000), us(2040)));
        }
        let p = h.plan();
        let margin = Duration::from_nanos(63_125); // 2.02 ms / 32
        assert_eq!(p.horizon, us(2020) - margin);
        assert_eq!(p.step, FINE_STEP_MIN);
        let at = polls(p, Duration::from_secs(1));
        assert_eq!(at[0], p.horizon);
        assert_eq!(at[1], p.horizon + FINE_STEP_MIN);
        // Never completing after that history: about a dozen wake-ups a second.
        assert!(at.len() <= 14, "{}: {at:?}", at.len());
    }

    #[test]
    fn one_delayed_step_does_not_coarsen_the_plan() {
        let mut h = History::default();
        for i in 0..10 {
            let lo = us(2000 + 10 * i);
            h.record(sample(lo, lo + us(40)));
        }
        h.record(sample(ms(15), ms(20)));
        let p = h.plan();
        assert_eq!(p.step, FINE_STEP_MIN);
        assert!(p.fine_end < ms(3), "{p:?}");
    }

    #[test]
    fn rough_brackets_give_way_to_finer_ones() {
        let mut h = History::default();
        // A cold wait: the event completed between 20.48 and 81.92 ms (middle 51.2).
        h.record(sample(us(20_480), us(81_920)));
        let p = h.plan();
        assert_eq!(p.horizon, us(51_200) - us(500));
        // Polled across to the bracket's end, not only around its middle.
        assert!(p.fine_end >= us(81_900) && p.step < ms(6), "{p:?}");
        // The next wait polls from just before 51.2 ms; one that sees the completion at
        // 60 ms brackets it within a step, and the plan follows.
        h.record(sample(ms(60), ms(60) + FINE_STEP_MIN));
        let q = h.plan();
        // The rough bracket holds the fine one, so only the fine one counts.
        assert_eq!(q.horizon, ms(60) + us(20) - us(500));
        assert!(q.fine_end >= ms(60), "{q:?}");
        assert!(q.step < ms(2), "{q:?}");
    }

    #[test]
    fn a_sleep_stalled_by_a_busy_host_does_not_pull_the_horizon_early() {
        // CI, loaded: the first query saw the event pending at 0, the 20 µs sleep
        // overran to 61 ms (middle 30.5 ms); three waits after it bracketed 60 ms.
        let mut h = History::default();
        h.record(sample(Duration::ZERO, ms(61)));
        for _ in 0..3 {
            h.record(sample(ms(59), ms(60)));
        }
        let p = h.plan();
        assert!(p.horizon > ms(58), "{p:?}");
        // Completions that differ (no bracket holds another) all count.
        let mut v = History::default();
        v.record(sample(ms(40), ms(160)));
        v.record(sample(ms(9), ms(11)));
        let q = v.plan();
        assert!(q.horizon < ms(10) && q.fine_end > ms(99), "{q:?}");
    }

    #[test]
    fn an_overshot_horizon_steps_back_instead_of_halving() {
        // Completions at 60 ms, then one wait whose sleep to the horizon (62 ms, a
        // slower step before) found it already complete: pending at 0, done by 62 ms.
        let mut h = History::default();
        h.record(sample(ms(61), ms(63)));
        h.record(Sample {
            lower: us(50),
            upper: ms(62),
            overshot: true,
        });
        let p = h.plan();
        // 62 ms less an eighth, less the margin: before 60 ms, nowhere near 31 ms.
        assert!(p.horizon > ms(50) && p.horizon < ms(60), "{p:?}");
    }

    #[test]
    fn varied_completions_spread_the_six_fine_polls() {
        let mut h = History::default();
        for lo in [500, 1700, 2900, 4100, 5000] {
            h.record(sample(us(lo), us(lo + 100)));
        }
        let p = h.plan();
        assert_eq!(p.horizon, us(530));
        assert_eq!(p.step, (us(5050) - us(530)) / FINE_POLLS);
        assert_eq!(p.fine_end, p.horizon + p.step * FINE_POLLS);
    }
}
