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
//! - CUDA events (`torch.cuda.Event`, whose `cuda_event` is the raw `CUevent`, and a
//!   `torch.Event` on a CUDA device, whose `event_id` is) are queried from Rust with
//!   `cuEventQuery` through the cuda backend's dynamic loading of the driver, with the
//!   GIL released for the whole wait; a driver error (a sticky fault, a bad handle) is
//!   a `kvferry.DeviceError`. An event never recorded (handle 0) counts as complete, as
//!   torch's `query()` says. Builds without the `cuda` feature use `query()`.
//! - Any other event is polled with its `query()` (truthy: complete), holding the GIL
//!   only for that call; an exception raised by `query()` propagates unchanged.
//! - No busy spin: between queries the thread sleeps with the GIL released, on a
//!   schedule that adapts. Each `what` remembers, for its last 16 waits that found the
//!   event pending at first, when the event completed (between the last query that
//!   saw it pending and the one that saw it complete). A wait sleeps in one stretch
//!   (pieces of at most 100 ms) until shortly before the earliest of those times —
//!   the event's usual completion — then polls finely (10 µs, each interval 1.2 times
//!   the last) across their spread (1 to 20 ms), then coarsely (doubling, up to
//!   100 ms). A wait with no history polls coarsely from 10 µs; the next one polls
//!   finely across the rough bracket the first one found, after which the history is
//!   precise. So a wait that ends when its history says resumes within tens of
//!   microseconds, and a second on an event that never completes costs about 25
//!   queries. During the wait the thread's timer slack is 1 µs (Linux), so short
//!   sleeps are as short as asked; it is restored afterwards.
//! - Ctrl-C: the wait checks for signals between polls (CUDA waits on the main
//!   thread at most every 50 ms), so `KeyboardInterrupt` ends it.
//!
//! # Cancellation
//!
//! There is no future to drop: the call is synchronous. An interrupt (a signal
//! handler raising) ends the wait like a timeout does — the event is left as it is.

use kvferry::ErrorCode;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::errors::ErrInfo;

/// First interval between queries.
const POLL_MIN: Duration = Duration::from_micros(10);
/// Longest interval between queries.
const POLL_MAX: Duration = Duration::from_millis(100);
/// Growth of the interval in the fine window, as a ratio num/den (1.2).
const FINE_NUM: u32 = 6;
const FINE_DEN: u32 = 5;
/// Growth of the interval after the fine window (doubling).
const COARSE_NUM: u32 = 2;
const COARSE_DEN: u32 = 1;
/// The fine window: at least this long, at most [`FINE_MAX`] (the spread of recent
/// completion times in between).
const FINE_MIN: Duration = Duration::from_millis(1);
const FINE_MAX: Duration = Duration::from_millis(20);
/// Waits remembered per `what`.
const HISTORY: usize = 16;
/// `what` names remembered (a bound on the table; beyond it the oldest is forgotten).
const MAX_NAMES: usize = 256;
/// How often a CUDA wait on the main thread takes the GIL to check for signals.
const SIGNAL_EVERY: Duration = Duration::from_millis(50);

/// When the event of one past wait completed: after `lower` (the last query that saw it
/// pending) and by `upper` (the query that saw it complete), from the wait's start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Sample {
    lower: Duration,
    upper: Duration,
}

impl Sample {
    /// Whether it brackets the completion closely: within 1/8 of it or 500 µs.
    fn precise(&self) -> bool {
        self.upper - self.lower <= (self.lower / 8).max(Duration::from_micros(500))
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

    /// The plan its samples give (see [`plan`]).
    fn plan(&self) -> Plan {
        let recent = &self.recent[..self.len];
        let precise: Vec<Sample> = recent.iter().copied().filter(Sample::precise).collect();
        let (lo, window) = if precise.is_empty() {
            // Only rough brackets (a wait that polled coarsely): start at the earliest
            // completion they allow and poll finely across the widest of them, which
            // makes this wait's bracket precise.
            let Some(lo) = recent.iter().map(|s| s.lower).min() else {
                return Plan::COLD;
            };
            (lo, recent.iter().map(|s| s.upper - s.lower).max().unwrap_or_default())
        } else {
            let lo = precise.iter().map(|s| s.lower).min().unwrap_or_default();
            let hi = precise.iter().map(|s| s.lower).max().unwrap_or_default();
            (lo, hi - lo)
        };
        // A margin of 1/32 of it, between 50 µs and 500 µs, before the earliest.
        let margin = (lo / 32).clamp(Duration::from_micros(50), Duration::from_micros(500));
        Plan {
            horizon: lo.saturating_sub(margin),
            fine: (window + margin).clamp(FINE_MIN, FINE_MAX),
        }
    }
}

/// The schedule of one wait: sleep in one stretch until `horizon`, then poll finely
/// for `fine` (intervals from [`POLL_MIN`] growing 1.2×), then coarsely (doubling, up
/// to [`POLL_MAX`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    horizon: Duration,
    fine: Duration,
}

impl Plan {
    /// Without history: coarse polling (doubling from [`POLL_MIN`]) from the start.
    const COLD: Plan = Plan {
        horizon: Duration::ZERO,
        fine: Duration::ZERO,
    };
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

/// The plan of a wait for `what`. From the history: sleep until shortly before the
/// earliest recent completion, poll finely across the spread of recent completions
/// (precise brackets only, when there are some). Without history: coarse from the start.
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

/// How one wait ended.
struct Outcome {
    completed: bool,
    waited: Duration,
    /// Whether the first query found the event pending (only such waits teach the
    /// history how long the event takes).
    pending_at_start: bool,
    /// When the last query that found it pending was made.
    last_pending: Duration,
}

/// The wait loop: `poll` says whether the event completed, `pause` sleeps (releasing
/// whatever must be released) and may end the wait with an error (a signal).
fn wait_loop(
    start: Instant,
    timeout: Duration,
    plan: Plan,
    mut poll: impl FnMut() -> PyResult<bool>,
    mut pause: impl FnMut(Duration) -> PyResult<()>,
) -> PyResult<Outcome> {
    let deadline = start + timeout;
    if poll()? {
        return Ok(Outcome {
            completed: true,
            waited: start.elapsed(),
            pending_at_start: false,
            last_pending: Duration::ZERO,
        });
    }
    let mut last_pending = start.elapsed();
    let _slack = TimerSlack::tighten();
    let horizon = plan.horizon.min(timeout);
    let fine_until = horizon + plan.fine;
    let mut interval = POLL_MIN;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Ok(Outcome {
                completed: false,
                waited: now - start,
                pending_at_start: true,
                last_pending,
            });
        }
        let elapsed = now - start;
        let nap = if elapsed < horizon {
            // Towards the horizon, in pieces of at most POLL_MAX.
            (horizon - elapsed).min(POLL_MAX)
        } else {
            let nap = interval;
            interval = if elapsed < fine_until {
                interval * FINE_NUM / FINE_DEN
            } else {
                interval * COARSE_NUM / COARSE_DEN
            }
            .min(POLL_MAX);
            nap
        };
        pause(nap.min(deadline - now))?;
        let before = start.elapsed();
        if poll()? {
            return Ok(Outcome {
                completed: true,
                waited: start.elapsed(),
                pending_at_start: true,
                last_pending,
            });
        }
        last_pending = before;
    }
}

/// How the event is queried.
enum Source {
    /// A raw `CUevent` (0: never recorded).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda(usize),
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

fn is_main_thread(py: Python<'_>) -> bool {
    (|| -> PyResult<bool> {
        let threading = py.import("threading")?;
        let main = threading.call_method0("main_thread")?;
        let current = threading.call_method0("current_thread")?;
        Ok(main.is(&current))
    })()
    .unwrap_or(false)
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
    let source = match cuda_handle(event, device.as_deref()) {
        Some(h) => Source::Cuda(h),
        None => Source::Query,
    };
    let device = device.unwrap_or_else(|| match source {
        Source::Cuda(_) => "cuda".to_string(),
        Source::Query => "an unnamed device".to_string(),
    });
    let plan = plan(&what);
    let start = Instant::now();
    let outcome = match source {
        Source::Query => wait_loop(
            start,
            timeout_d,
            plan,
            || event.call_method0("query")?.is_truthy(),
            |d| {
                py.detach(|| std::thread::sleep(d));
                py.check_signals()
            },
        )?,
        Source::Cuda(handle) => {
            let main = is_main_thread(py);
            let (what_ref, device_ref) = (what.as_str(), device.as_str());
            py.detach(|| {
                let mut checked = Instant::now();
                wait_loop(
                    start,
                    timeout_d,
                    plan,
                    || query_cuda(handle, what_ref, device_ref),
                    |d| {
                        std::thread::sleep(d);
                        if main && checked.elapsed() >= SIGNAL_EVERY {
                            checked = Instant::now();
                            Python::attach(|py| py.check_signals())?;
                        }
                        Ok(())
                    },
                )
            })?
        }
    };
    if outcome.completed {
        if outcome.pending_at_start {
            record(
                &what,
                Sample {
                    lower: outcome.last_pending,
                    upper: outcome.waited,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sample(lower: Duration, upper: Duration) -> Sample {
        Sample { lower, upper }
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
    fn plan_sleeps_until_shortly_before_the_usual_completion() {
        let name = "tests::plan";
        assert_eq!(plan(name), Plan::COLD);
        record(name, sample(ms(2), ms(2) + Duration::from_micros(20)));
        let margin = Duration::from_nanos(62_500); // 2 ms / 32
        assert_eq!(
            plan(name),
            Plan {
                horizon: ms(2) - margin,
                fine: FINE_MIN,
            }
        );
        // A spread of completion times widens the fine window, up to FINE_MAX.
        record(name, sample(ms(7), ms(7)));
        assert_eq!(plan(name).fine, ms(5) + margin);
        record(name, sample(ms(90), ms(90)));
        assert_eq!(plan(name).fine, FINE_MAX);
    }

    #[test]
    fn rough_brackets_give_way_to_precise_ones() {
        let mut h = History::default();
        // A coarse wait: the event completed between 41 and 82 ms.
        h.record(sample(ms(41), ms(82)));
        let p = h.plan();
        assert_eq!(p.horizon, ms(41) - Duration::from_micros(500));
        assert_eq!(p.fine, FINE_MAX);
        // The next wait polled finely and bracketed it at 60 ms: the rough one is ignored.
        h.record(sample(ms(60), ms(60) + Duration::from_micros(100)));
        assert_eq!(
            h.plan(),
            Plan {
                horizon: ms(60) - Duration::from_micros(500),
                fine: FINE_MIN,
            }
        );
    }
}
