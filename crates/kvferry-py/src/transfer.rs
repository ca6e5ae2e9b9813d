//! `Transfer`: a get in flight. It runs as a task on the engine's runtime; Python
//! waits on it with the GIL released, in short slices so that Ctrl-C is noticed
//! within tens of milliseconds.
//!
//! A waiting thread first polls for the outcome for the engine's adaptive spin budget
//! (at most `wait_spin_us`; see [`crate::spin`]) and only then sleeps on a condition
//! variable: a transfer that finishes within it (a miss, a small chunk) is seen at once
//! instead of after a sleeping thread's wake-up.
//!
//! `done()` and `drained()` are two moments: `done()` is true once the outcome is
//! known (landed, or the error: what `wait` returns); `drained()` once nothing —
//! socket, copy thread, device stream — writes the destination blocks any more. A
//! success is drained when it is done. A failure usually is too, but not always: a
//! host-to-device copy that outlived the transfer's deadline keeps writing until the
//! device confirms it, so a caller that hands the destination back to its owner (an
//! engine freeing the blocks) waits for `drained()`, polling it without blocking.
//!
//! # Cancellation
//!
//! `cancel()` (and a `KeyboardInterrupt` during `wait`) cancels the transfer and
//! returns only after its drain: no socket or copy thread touches the destination
//! blocks any more and its staging pages are back. `cancel(timeout=0)` only asks:
//! it returns at once, and `drained()` says when the drain finished.

use kvferry::ErrorCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::engine::DrainFence;
use kvferry::engine::{GetFailure, Landed, PeerError};
use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::errors::ErrInfo;
use crate::linger::Linger;
use crate::spin::{spin_until, AdaptiveSpin};

/// Bound on waiting for a cancelled transfer's drain (it is itself bounded by the
/// engine's I/O timeout and one copy slice; this only keeps Python responsive).
const DRAIN_BOUND: Duration = Duration::from_secs(10);
/// How often a waiting thread looks at Python's signals.
const SIGNAL_SLICE: Duration = Duration::from_millis(10);

type Outcome = Result<usize, ErrInfo>;

#[derive(Default)]
struct Shared {
    outcome: Mutex<Option<Outcome>>,
    /// Set (after `outcome`) once the transfer finished: what a spinning waiter polls.
    finished: AtomicBool,
    done: Condvar,
    callbacks: Mutex<Vec<Py<PyAny>>>,
}

impl Shared {
    fn finish(&self, o: Outcome) {
        *self.outcome.lock() = Some(o);
        self.finished.store(true, Ordering::Release);
        self.done.notify_all();
        let cbs: Vec<Py<PyAny>> = std::mem::take(&mut *self.callbacks.lock());
        if !cbs.is_empty() {
            Python::attach(|py| {
                for cb in cbs {
                    if let Err(e) = cb.call0(py) {
                        e.print(py);
                    }
                }
            });
        }
    }
}

/// Where a transfer runs and how its waiters wait.
#[derive(Clone)]
pub struct Waiting {
    /// The engine's runtime.
    pub runtime: Handle,
    /// How long a waiter polls before it sleeps (adapting; zero max: never).
    pub spin: Arc<AdaptiveSpin>,
    /// The runtime's lingering window, opened while transfers are short.
    pub linger: Arc<Linger>,
}

/// A transfer in flight (from `Engine.get`).
#[pyclass(name = "Transfer", module = "kvferry._kvferry", frozen)]
pub struct PyTransfer {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    fence: DrainFence,
    runtime: Handle,
    spin: Arc<AdaptiveSpin>,
    peer: String,
}

/// What a finished transfer means for Python: chunks landed, or why not.
pub fn outcome(peer: &str, r: Result<Landed, GetFailure>, what: &str) -> Outcome {
    match r {
        Ok(l) if l.chunks == 0 => Err(
            ErrInfo::new(ErrorCode::NotFound, format!("{peer} holds none of the keys"))
                .peer(peer)
                .op(what),
        ),
        Ok(l) => Ok(l.chunks),
        Err(f) => Err(ErrInfo::from(&f).peer(peer).op(what)),
    }
}

impl PyTransfer {
    /// Runs `fut` (a transfer whose fence is `fence`) on `how.runtime`.
    pub fn spawn<F>(how: &Waiting, peer: String, fence: DrainFence, fut: F) -> PyTransfer
    where
        F: std::future::Future<Output = Result<Landed, GetFailure>> + Send + 'static,
    {
        Self::spawn_op(how, peer, fence, fut, "get")
    }

    /// As [`spawn`](Self::spawn), naming the operation `op` in errors.
    pub fn spawn_op<F>(how: &Waiting, peer: String, fence: DrainFence, fut: F, op: &'static str) -> PyTransfer
    where
        F: std::future::Future<Output = Result<Landed, GetFailure>> + Send + 'static,
    {
        let shared = Arc::new(Shared::default());
        let cancel = CancellationToken::new();
        let (s, c, p) = (shared.clone(), cancel.clone(), peer.clone());
        // How long the transfer took, for the adaptive spin. A timeout's `waited` is
        // the operation's own, from the caller's call (the library's `start_*`
        // instant): one clock, not replaced here.
        let called = Instant::now();
        let spin = how.spin.clone();
        // Transfers on this engine are short (a waiter spins): keep a worker polling for
        // the answer instead of sleeping through its arrival.
        if !how.spin.budget().is_zero() {
            how.linger.poke(how.spin.max());
        }
        how.runtime.spawn(async move {
            let r = tokio::select! {
                r = fut => r,
                // Dropping `fut` cancels the transfer; its drain goes on in the
                // background and fires the fence.
                _ = c.cancelled() => Err(GetFailure {
                    error: PeerError::Cancelled,
                    fence: DrainFence::ready(),
                    dirty: true,
                }),
            };
            let o = outcome(&p, r, op);
            // How long the transfer took adapts how long waits on this engine spin
            // (whoever waits: `wait`, `await`, polling `done()`).
            spin.record(called.elapsed());
            s.finish(o);
        });
        PyTransfer {
            shared,
            cancel,
            fence,
            runtime: how.runtime.clone(),
            spin: how.spin.clone(),
            peer,
        }
    }

    /// Waits for the outcome; `None` when `timeout` passed first. Python signals are
    /// checked every few milliseconds: a `KeyboardInterrupt` cancels the transfer,
    /// waits for its drain, and is returned.
    pub fn wait_outcome(&self, py: Python<'_>, timeout: Option<Duration>) -> PyResult<Option<Outcome>> {
        if self.shared.finished.load(Ordering::Acquire) {
            return Ok(self.shared.outcome.lock().clone());
        }
        let started = Instant::now();
        let deadline = timeout.map(|t| started + t);
        let spin = self.spin.budget();
        if !spin.is_zero() {
            let budget = timeout.map_or(spin, |t| t.min(spin));
            let shared = self.shared.clone();
            if py.detach(move || spin_until(&shared.finished, budget)) {
                return Ok(self.shared.outcome.lock().clone());
            }
        }
        loop {
            let slice = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(self.shared.outcome.lock().clone());
                    }
                    left.min(SIGNAL_SLICE)
                }
                None => SIGNAL_SLICE,
            };
            let shared = self.shared.clone();
            let got = py.detach(move || {
                let mut o = shared.outcome.lock();
                if o.is_none() {
                    shared.done.wait_for(&mut o, slice);
                }
                o.clone()
            });
            if got.is_some() {
                return Ok(got);
            }
            if let Err(e) = py.check_signals() {
                self.cancel_and_drain(py);
                return Err(e);
            }
        }
    }

    fn cancel_and_drain(&self, py: Python<'_>) -> bool {
        self.cancel_within(py, DRAIN_BOUND)
    }

    /// Cancels, then waits at most `bound` for the drain (and the outcome).
    fn cancel_within(&self, py: Python<'_>, bound: Duration) -> bool {
        self.cancel.cancel();
        if bound.is_zero() {
            return self.fence.is_drained();
        }
        let (fence, rt, shared) = (self.fence.clone(), self.runtime.clone(), self.shared.clone());
        py.detach(move || {
            let until = Instant::now() + bound;
            let drained = rt.block_on(fence.wait_until(tokio::time::Instant::now() + bound));
            // The task records its outcome right after the cancel wins its race (or
            // the transfer finished first): wait for it too, so `done()` and `error`
            // are settled when `cancel()` returns. Bounded like the drain.
            let mut o = shared.outcome.lock();
            while o.is_none() {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() || shared.done.wait_for(&mut o, left).timed_out() {
                    break;
                }
            }
            drained
        })
    }
}

#[pymethods]
impl PyTransfer {
    /// Waits until the transfer finished (at most `timeout` seconds; `None`: no
    /// bound) and returns the number of chunks landed. Raises the transfer's error,
    /// or `kvferry.TimeoutError` when `timeout` passed first (the transfer goes on:
    /// wait again or `cancel()` it).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<usize> {
        let t = crate::engine::duration(timeout, "timeout")?;
        match self.wait_outcome(py, t)? {
            Some(Ok(n)) => Ok(n),
            Some(Err(e)) => Err(e.to_py(py)),
            None => {
                let mut e = ErrInfo::new(
                    ErrorCode::Timeout,
                    format!("transfer still running after {timeout:?} s"),
                )
                .peer(&self.peer)
                .op("wait");
                e.waited = t;
                Err(e.to_py(py))
            }
        }
    }

    /// True once the transfer has finished (landed or failed): its outcome is known.
    /// A failed transfer may still be draining (see `drained`).
    fn done(&self) -> bool {
        self.shared.outcome.lock().is_some()
    }

    /// True once nothing writes the destination blocks any more and the transfer's
    /// staging pages are back (never blocks). Until then the blocks are not the
    /// caller's to reuse, even after `done()`: a device copy that outlived a failed
    /// transfer is waited for (bounded; a device that never confirms leaves this
    /// False for good, like a quarantined page).
    fn drained(&self) -> bool {
        self.fence.is_drained() && self.shared.outcome.lock().is_some()
    }

    /// Cancels the transfer and returns once its drain finished (the destination
    /// blocks are quiet and staging pages are back): True then, False if the drain
    /// did not finish within `timeout` seconds (default 10; it goes on in the
    /// background, and `drained()` tells when it finished). `timeout=0` returns at
    /// once.
    #[pyo3(signature = (timeout=None))]
    fn cancel(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let bound = match timeout {
            None => DRAIN_BOUND,
            Some(t) if t.is_finite() && t >= 0.0 => Duration::from_secs_f64(t.min(DRAIN_BOUND.as_secs_f64())),
            Some(t) => {
                return Err(ErrInfo::invalid(format!("timeout must be >= 0 seconds, got {t}")).into());
            }
        };
        Ok(self.cancel_within(py, bound))
    }

    /// The transfer's exception if it failed, else None (also None while running).
    #[getter]
    fn error(&self, py: Python<'_>) -> Option<PyErr> {
        match &*self.shared.outcome.lock() {
            Some(Err(e)) => Some(e.to_py(py)),
            _ => None,
        }
    }

    /// The number of chunks landed, once finished successfully; else None.
    #[getter]
    fn result(&self) -> Option<usize> {
        match &*self.shared.outcome.lock() {
            Some(Ok(n)) => Some(*n),
            _ => None,
        }
    }

    /// Calls `callback()` (from an engine thread, holding the GIL) once the transfer
    /// finished; at once if it already has. Used by `await transfer`.
    fn add_done_callback(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        {
            let mut cbs = self.shared.callbacks.lock();
            if self.shared.outcome.lock().is_none() {
                cbs.push(callback);
                return Ok(());
            }
        }
        callback.call0(py)?;
        Ok(())
    }

    fn __repr__(&self) -> String {
        let state = match &*self.shared.outcome.lock() {
            None => "running".to_string(),
            Some(Ok(n)) => format!("landed {n} chunk(s)"),
            Some(Err(e)) => format!("failed: {}", e.code),
        };
        format!("Transfer(peer={:?}, {state})", self.peer)
    }
}
