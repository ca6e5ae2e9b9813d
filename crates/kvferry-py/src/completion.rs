//! Events that notify their waiters: [`Notifier`], a one-shot completion flag that a
//! thread sleeps on until it is set or a deadline passes, and `kvferry.CompletionEvent`,
//! the Python object around one.
//!
//! Semantics:
//! - A notifier starts pending and is set at most once ([`Notifier::set`]; later calls do
//!   nothing). Setting it wakes every thread waiting in [`Notifier::wait_until`] at
//!   once; nothing polls. It may be set from any thread, a driver's callback thread
//!   included, and never blocks or allocates there.
//! - On Linux a waiter sleeps in one `futex` wait with the deadline as its timeout: one
//!   wake-up when it is set, one when the deadline passes, none in between. A signal
//!   delivered to the waiting thread ends the sleep early with [`Woke::Interrupted`]
//!   (so the caller can run Python's signal handlers and wait again). Elsewhere it
//!   sleeps on a condition variable.
//! - `kvferry.CompletionEvent` (`set()`, `query()`, `is_set()`, `device`): what a
//!   thread or a callback completes for another to wait on; `kvferry.bounded_wait`
//!   waits for it on its notifier, without polling. `set()` releases the GIL while it
//!   wakes the waiters, so a woken waiter can take the GIL at once.
//!
//! # Cancellation
//!
//! No future: waits are synchronous and leave the notifier as it is when they end
//! (deadline, signal). A notifier lives in an `Arc`, so whoever sets it late (a driver
//! callback after its waiter timed out) owns what it touches.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use pyo3::prelude::*;

/// How [`Notifier::wait_until`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Woke {
    /// The notifier is set.
    Set,
    /// The deadline passed first.
    Deadline,
    /// A signal interrupted the sleep (Linux); the notifier may still be pending.
    Interrupted,
}

/// A one-shot completion flag with deadline waits (see the module docs).
#[derive(Debug, Default)]
pub struct Notifier {
    /// 0: pending; 1: set.
    state: AtomicU32,
    #[cfg(not(target_os = "linux"))]
    lock: parking_lot::Mutex<()>,
    #[cfg(not(target_os = "linux"))]
    cv: parking_lot::Condvar,
}

impl Notifier {
    /// A pending notifier.
    pub fn new() -> Notifier {
        Notifier::default()
    }

    /// Whether it is set.
    pub fn is_set(&self) -> bool {
        self.state.load(Ordering::Acquire) == 1
    }

    /// Sets it and wakes every waiter; returns whether this call set it (false: it
    /// already was).
    pub fn set(&self) -> bool {
        if self.state.swap(1, Ordering::AcqRel) == 1 {
            return false;
        }
        #[cfg(target_os = "linux")]
        // SAFETY: FUTEX_WAKE on a live, aligned u32 of ours; no other memory is touched.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.state.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                i32::MAX,
            );
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _g = self.lock.lock();
            self.cv.notify_all();
        }
        true
    }

    /// Sleeps until it is set or `deadline` passes (see [`Woke`]).
    pub fn wait_until(&self, deadline: Instant) -> Woke {
        loop {
            if self.is_set() {
                return Woke::Set;
            }
            let now = Instant::now();
            if now >= deadline {
                return Woke::Deadline;
            }
            #[cfg(target_os = "linux")]
            {
                let left = deadline - now;
                let ts = libc::timespec {
                    tv_sec: left.as_secs() as libc::time_t,
                    tv_nsec: left.subsec_nanos() as libc::c_long,
                };
                // SAFETY: FUTEX_WAIT on a live, aligned u32 of ours, with a valid
                // relative timeout; it sleeps only while the value is still 0.
                let r = unsafe {
                    libc::syscall(
                        libc::SYS_futex,
                        self.state.as_ptr(),
                        libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                        0u32,
                        &ts as *const libc::timespec,
                    )
                };
                if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    return if self.is_set() { Woke::Set } else { Woke::Interrupted };
                }
                // 0 (woken or spurious), EAGAIN (already set), ETIMEDOUT: look again.
            }
            #[cfg(not(target_os = "linux"))]
            {
                let mut g = self.lock.lock();
                if !self.is_set() {
                    self.cv.wait_until(&mut g, deadline);
                }
            }
        }
    }
}

/// `kvferry.CompletionEvent`: an event that a thread or a callback completes with
/// `set()`, and that `kvferry.bounded_wait` waits for without polling.
#[pyclass(name = "CompletionEvent", module = "kvferry._kvferry", frozen)]
pub struct PyCompletionEvent {
    pub(crate) notifier: std::sync::Arc<Notifier>,
    device: String,
}

#[pymethods]
impl PyCompletionEvent {
    /// A pending event; `device` names where its work runs (in errors).
    #[new]
    #[pyo3(signature = (*, device = "host".to_string()))]
    fn new(device: String) -> Self {
        PyCompletionEvent {
            notifier: std::sync::Arc::new(Notifier::new()),
            device,
        }
    }

    /// Completes the event and wakes its waiters (with the GIL released); returns
    /// whether this call completed it (False: it already was).
    fn set(&self, py: Python<'_>) -> bool {
        let n = self.notifier.clone();
        py.detach(move || n.set())
    }

    /// Whether it has completed (never blocks).
    fn query(&self) -> bool {
        self.notifier.is_set()
    }

    /// Whether it has completed (as `threading.Event.is_set`).
    fn is_set(&self) -> bool {
        self.notifier.is_set()
    }

    /// Where its work runs, as given.
    #[getter]
    fn device(&self) -> String {
        self.device.clone()
    }

    fn __repr__(&self) -> String {
        let state = if self.notifier.is_set() { "set" } else { "pending" };
        format!("CompletionEvent(device={:?}, {state})", self.device)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_set_notifier_returns_at_once() {
        let n = Notifier::new();
        assert!(n.set());
        assert!(!n.set());
        assert_eq!(n.wait_until(Instant::now() + Duration::from_secs(10)), Woke::Set);
    }

    #[test]
    fn a_pending_notifier_waits_until_the_deadline() {
        let n = Notifier::new();
        let t0 = Instant::now();
        assert_eq!(n.wait_until(t0 + Duration::from_millis(50)), Woke::Deadline);
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(50), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
    }

    #[test]
    fn another_thread_wakes_the_waiter_before_its_deadline() {
        let n = Arc::new(Notifier::new());
        let setter = {
            let n = n.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                n.set();
            })
        };
        let t0 = Instant::now();
        assert_eq!(n.wait_until(t0 + Duration::from_secs(30)), Woke::Set);
        assert!(t0.elapsed() < Duration::from_secs(10));
        setter.join().unwrap();
    }
}
