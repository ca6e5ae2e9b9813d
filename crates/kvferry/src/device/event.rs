//! Events: the completion of one device operation, and bounded waits on it.
//!
//! An [`Event`] pairs an operation's identity ([`EventMeta`]: a fresh [`EventId`], the
//! operation's name, the rank, the submission instant) with an [`EventSignal`] that the
//! backend settles. Each operation gets a new event; events are never reused.
//!
//! [`PushSignal`] is the signal of the host and sim backends (and of manual events,
//! [`Event::manual`]): a completer sets it once and wakes every waiter — async waiters
//! through a [`Notify`], blocking waiters through a condition variable — and runs the
//! callbacks registered with [`EventSignal::on_settled`]. Nothing polls.
//!
//! # Cancellation
//!
//! [`Event::wait`], [`Event::wait_for`] and [`EventSignal::settled`] are cancel-safe:
//! dropping them only stops waiting; the operation and its signal are unaffected.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{check_timeout, DeviceError};

/// A boxed, sendable future (the return type of [`EventSignal::settled`]).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A callback run once an event has settled (see [`EventSignal::on_settled`]).
pub type SettleCallback = Box<dyn FnOnce(&EventStatus) + Send>;

/// Where an operation stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventStatus {
    /// Not finished; the device may still read or write the operation's memory.
    Pending,
    /// Finished successfully; the device no longer touches the operation's memory.
    Complete,
    /// Failed; the device no longer touches the operation's memory.
    Failed(String),
    /// The device faulted; whether it still touches the memory is unknown, so that
    /// memory stays quarantined.
    Faulted(String),
}

impl EventStatus {
    /// True unless [`Pending`](EventStatus::Pending).
    pub fn is_settled(&self) -> bool {
        !matches!(self, EventStatus::Pending)
    }
}

/// How a backend reports an operation's completion.
///
/// Contract: a signal settles at most once, and reports
/// [`Complete`](EventStatus::Complete) or [`Failed`](EventStatus::Failed) only after the
/// device has stopped touching the operation's memory.
pub trait EventSignal: Send + Sync + 'static {
    /// The current status (non-blocking).
    fn status(&self) -> EventStatus;

    /// Resolves once the status is no longer pending. Unbounded: callers bound it with a
    /// deadline. Cancel-safe.
    fn settled(&self) -> BoxFuture<'_, ()>;

    /// Blocks the calling thread until the status is no longer pending or `deadline`
    /// passes, without spinning.
    fn settled_blocking(&self, deadline: std::time::Instant);

    /// Runs `f` once the event has settled: now if it already has, later on the
    /// completer's thread otherwise, or never if it never settles.
    fn on_settled(&self, f: SettleCallback);

    /// The concrete signal, for backends that need their own event handle (CUDA).
    fn as_any(&self) -> &dyn Any;
}

struct PushState {
    status: EventStatus,
    settling: bool,
    callbacks: Vec<SettleCallback>,
}

/// A signal settled by a completer: sets the status once, wakes every waiter, runs the
/// settle callbacks.
pub struct PushSignal {
    done: AtomicBool,
    state: Mutex<PushState>,
    cv: Condvar,
    notify: Notify,
}

impl std::fmt::Debug for PushSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushSignal")
            .field("status", &self.state.lock().status)
            .finish()
    }
}

impl PushSignal {
    /// A pending signal.
    pub fn new() -> Arc<PushSignal> {
        Arc::new(PushSignal {
            done: AtomicBool::new(false),
            state: Mutex::new(PushState {
                status: EventStatus::Pending,
                settling: false,
                callbacks: Vec::new(),
            }),
            cv: Condvar::new(),
            notify: Notify::new(),
        })
    }

    /// Settles as [`EventStatus::Complete`]. False if it had already settled.
    pub fn complete(&self) -> bool {
        self.settle(EventStatus::Complete)
    }

    /// Settles as [`EventStatus::Failed`]. False if it had already settled.
    pub fn fail(&self, message: impl Into<String>) -> bool {
        self.settle(EventStatus::Failed(message.into()))
    }

    /// Settles with `status` (ignored if `Pending`): runs the settle callbacks on this
    /// thread, then publishes the status and wakes every waiter. False if it had already
    /// settled (or is settling).
    pub fn settle(&self, status: EventStatus) -> bool {
        if !status.is_settled() {
            return false;
        }
        // Callbacks registered so far run *before* waiters can observe the status, so a
        // waiter that sees the operation settled also sees its memory released.
        let first = {
            let mut st = self.state.lock();
            if st.settling || st.status.is_settled() {
                return false;
            }
            st.settling = true;
            std::mem::take(&mut st.callbacks)
        };
        for cb in first {
            cb(&status);
        }
        let late = {
            let mut st = self.state.lock();
            st.status = status.clone();
            self.done.store(true, Ordering::Release);
            std::mem::take(&mut st.callbacks)
        };
        self.cv.notify_all();
        self.notify.notify_waiters();
        for cb in late {
            cb(&status);
        }
        true
    }
}

impl EventSignal for PushSignal {
    fn status(&self) -> EventStatus {
        self.state.lock().status.clone()
    }

    fn settled(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            loop {
                let notified = self.notify.notified();
                tokio::pin!(notified);
                // Register before checking, so a settle between the check and the await
                // still wakes us.
                notified.as_mut().enable();
                if self.done.load(Ordering::Acquire) {
                    return;
                }
                notified.await;
            }
        })
    }

    fn settled_blocking(&self, deadline: std::time::Instant) {
        let mut st = self.state.lock();
        while !st.status.is_settled() {
            if self.cv.wait_until(&mut st, deadline).timed_out() {
                return;
            }
        }
    }

    fn on_settled(&self, f: SettleCallback) {
        let status = {
            let mut st = self.state.lock();
            if !st.status.is_settled() {
                st.callbacks.push(f);
                return;
            }
            st.status.clone()
        };
        f(&status);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A process-unique event id: every operation gets a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct EventId(pub u64);

impl std::fmt::Display for EventId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ev{}", self.0)
    }
}

/// The identity of one operation: a fresh id, its name and rank, and when it was
/// submitted (deadlines given as timeouts are measured from here).
#[derive(Clone, Debug)]
pub struct EventMeta {
    id: EventId,
    op: String,
    rank: u32,
    submitted: Instant,
    submitted_std: std::time::Instant,
}

impl EventMeta {
    /// A new identity for operation `op` on `rank`, submitted now.
    pub fn new(op: impl Into<String>, rank: u32) -> EventMeta {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        EventMeta {
            id: EventId(NEXT.fetch_add(1, Ordering::Relaxed)),
            op: op.into(),
            rank,
            submitted: Instant::now(),
            submitted_std: std::time::Instant::now(),
        }
    }

    /// The event's id.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// The operation's name.
    pub fn op(&self) -> &str {
        &self.op
    }

    /// The rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// When the operation was submitted (tokio clock, honours paused test time).
    pub fn submitted(&self) -> Instant {
        self.submitted
    }

    /// When the operation was submitted (std clock, for blocking waits).
    pub fn submitted_std(&self) -> std::time::Instant {
        self.submitted_std
    }
}

/// The completion of one device operation. Cheap to clone (clones observe the same
/// operation).
#[derive(Clone)]
pub struct Event {
    meta: Arc<EventMeta>,
    signal: Arc<dyn EventSignal>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("id", &self.meta.id)
            .field("op", &self.meta.op)
            .field("rank", &self.meta.rank)
            .field("status", &self.signal.status())
            .finish()
    }
}

/// Settles a manual event ([`Event::manual`]). Dropping it without settling leaves the
/// event pending forever.
#[derive(Debug)]
pub struct EventTrigger {
    signal: Arc<PushSignal>,
}

impl EventTrigger {
    /// Completes the event. False if it had already settled.
    pub fn complete(&self) -> bool {
        self.signal.complete()
    }

    /// Fails the event. False if it had already settled.
    pub fn fail(&self, message: impl Into<String>) -> bool {
        self.signal.fail(message)
    }
}

impl Event {
    /// An event for `meta`, settled by `signal` (for backends).
    pub fn new(meta: EventMeta, signal: Arc<dyn EventSignal>) -> Event {
        Event {
            meta: Arc::new(meta),
            signal,
        }
    }

    /// A host-side event settled by hand through the returned trigger — e.g. to make a
    /// host or sim stream wait for something outside the device.
    pub fn manual(op: impl Into<String>, rank: u32) -> (Event, EventTrigger) {
        let signal = PushSignal::new();
        (
            Event::new(EventMeta::new(op, rank), signal.clone()),
            EventTrigger { signal },
        )
    }

    /// The event's id (fresh per operation).
    pub fn id(&self) -> EventId {
        self.meta.id
    }

    /// The operation's name.
    pub fn op(&self) -> &str {
        &self.meta.op
    }

    /// The rank.
    pub fn rank(&self) -> u32 {
        self.meta.rank
    }

    /// The operation's identity.
    pub fn meta(&self) -> &EventMeta {
        &self.meta
    }

    /// The backend's signal.
    pub fn signal(&self) -> &Arc<dyn EventSignal> {
        &self.signal
    }

    /// Queries the event without waiting.
    pub fn query(&self) -> EventStatus {
        self.signal.status()
    }

    /// True once the operation completed successfully.
    pub fn is_complete(&self) -> bool {
        self.query() == EventStatus::Complete
    }

    /// The deadline `timeout` after the operation's submission. A zero timeout is
    /// [`DeviceError::InvalidArgument`].
    pub fn deadline_after(&self, timeout: Duration) -> Result<Instant, DeviceError> {
        check_timeout(timeout, self.op())?;
        Ok(self.meta.submitted + timeout)
    }

    /// Waits until the event completes or `deadline` passes.
    ///
    /// Returns `Ok` on completion, [`DeviceError::CopyFailed`] or
    /// [`DeviceError::Fault`] if the operation failed, and [`DeviceError::Timeout`]
    /// (naming the operation and rank) at the deadline. A deadline already past still
    /// reports an operation that has completed.
    ///
    /// # Cancellation
    ///
    /// Cancel-safe: dropping the future only stops waiting.
    pub async fn wait(&self, deadline: Instant) -> Result<(), DeviceError> {
        let _ = tokio::time::timeout_at(deadline, self.signal.settled()).await;
        self.outcome()
    }

    /// [`wait`](Self::wait) with the deadline `timeout` after the operation's
    /// submission. A zero timeout is [`DeviceError::InvalidArgument`].
    ///
    /// # Cancellation
    ///
    /// Cancel-safe, as [`wait`](Self::wait).
    pub async fn wait_for(&self, timeout: Duration) -> Result<(), DeviceError> {
        let deadline = self.deadline_after(timeout)?;
        self.wait(deadline).await
    }

    /// [`wait`](Self::wait) for synchronous callers: blocks this thread (sleeping, not
    /// spinning) until completion or `deadline`.
    pub fn wait_blocking(&self, deadline: std::time::Instant) -> Result<(), DeviceError> {
        self.signal.settled_blocking(deadline);
        self.outcome()
    }

    /// [`wait_blocking`](Self::wait_blocking) with the deadline `timeout` after the
    /// operation's submission. A zero timeout is [`DeviceError::InvalidArgument`].
    pub fn wait_blocking_for(&self, timeout: Duration) -> Result<(), DeviceError> {
        check_timeout(timeout, self.op())?;
        self.wait_blocking(self.meta.submitted_std + timeout)
    }

    /// The result the status implies now.
    pub(crate) fn outcome(&self) -> Result<(), DeviceError> {
        match self.signal.status() {
            EventStatus::Complete => Ok(()),
            EventStatus::Failed(message) => Err(DeviceError::CopyFailed {
                op: self.meta.op.clone(),
                rank: self.meta.rank,
                message,
            }),
            EventStatus::Faulted(message) => Err(DeviceError::Fault(format!(
                "operation {:?} on rank {}: {message}",
                self.meta.op, self.meta.rank
            ))),
            EventStatus::Pending => Err(DeviceError::Timeout {
                op: self.meta.op.clone(),
                rank: self.meta.rank,
                waited: self.meta.submitted.elapsed(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn manual_event_times_out_then_completes() {
        let (ev, trigger) = Event::manual("op-a", 3);
        let t0 = Instant::now();
        let err = ev.wait(t0 + Duration::from_millis(100)).await.unwrap_err();
        match err {
            DeviceError::Timeout { op, rank, waited } => {
                assert_eq!((op.as_str(), rank), ("op-a", 3));
                assert_eq!(waited, Duration::from_millis(100));
            }
            other => panic!("unexpected {other}"),
        }
        assert!(trigger.complete());
        assert!(!trigger.fail("late"), "settles once");
        ev.wait(t0).await.unwrap();
        assert!(ev.is_complete());
    }

    #[test]
    fn callbacks_run_once_on_settle_or_immediately() {
        let (ev, trigger) = Event::manual("cb", 0);
        let hits = Arc::new(AtomicU64::new(0));
        let h = hits.clone();
        ev.signal().on_settled(Box::new(move |s| {
            assert_eq!(*s, EventStatus::Failed("boom".into()));
            h.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        trigger.fail("boom");
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        let h = hits.clone();
        ev.signal().on_settled(Box::new(move |_| {
            h.fetch_add(10, Ordering::SeqCst);
        }));
        assert_eq!(hits.load(Ordering::SeqCst), 11);
        assert!(matches!(
            ev.wait_blocking(std::time::Instant::now()),
            Err(DeviceError::CopyFailed { .. })
        ));
    }

    #[test]
    fn blocking_wait_wakes_on_completion_from_another_thread() {
        let (ev, trigger) = Event::manual("blocking", 1);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            trigger.complete();
        });
        ev.wait_blocking(std::time::Instant::now() + Duration::from_secs(30))
            .unwrap();
        t.join().unwrap();
    }

    #[test]
    fn zero_timeout_is_invalid_and_ids_are_fresh() {
        let (a, _ta) = Event::manual("a", 0);
        let (b, _tb) = Event::manual("a", 0);
        assert_ne!(a.id(), b.id());
        assert!(matches!(
            a.wait_blocking_for(Duration::ZERO),
            Err(DeviceError::InvalidArgument(_))
        ));
        assert!(matches!(
            a.deadline_after(Duration::ZERO),
            Err(DeviceError::InvalidArgument(_))
        ));
    }
}
