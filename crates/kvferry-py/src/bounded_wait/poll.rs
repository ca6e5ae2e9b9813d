//! Sleeping and polling for `bounded_wait`: [`poll_loop`] queries at once, then at the
//! times a [`Plan`] gives until the event completes or the deadline passes, with the
//! thread's timer slack tightened to 1 µs (Linux) meanwhile; [`sleep_until`] reports a
//! signal that interrupted the sleep, and [`sleep_on`] sleeps on a notifier, running
//! Python's signal handlers when a signal interrupts it. [`Outcome`] says how a wait
//! ended and what it teaches the schedule.
//!
//! # Cancellation
//!
//! Nothing here is a future. A signal handler that raises ends the wait with its
//! exception; one that raises nothing lets the wait sleep on.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::completion::{Notifier, Woke};

use super::schedule::Plan;
use super::{bump, STATS};

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
pub(super) fn sleep_until(until: Instant) -> bool {
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
pub(super) struct Outcome {
    pub(super) completed: bool,
    pub(super) waited: Duration,
    /// Whether the first query found the event pending (only such waits teach the
    /// history how long the event takes).
    pub(super) pending_at_start: bool,
    /// When the last query that found it pending was made.
    pub(super) last_pending: Duration,
    /// The first poll after the immediate query, made at a plan's horizon, saw it
    /// complete (see [`Sample::overshot`](super::schedule::Sample::overshot)).
    pub(super) overshot: bool,
}

impl Outcome {
    pub(super) fn at_once(start: Instant) -> Outcome {
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
pub(super) fn poll_loop(
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
pub(super) fn sleep_on(n: &Notifier, deadline: Instant) -> PyResult<bool> {
    loop {
        match n.wait_until(deadline) {
            Woke::Set => return Ok(true),
            Woke::Deadline => return Ok(false),
            Woke::Interrupted => Python::attach(|py| py.check_signals())?,
        }
    }
}
