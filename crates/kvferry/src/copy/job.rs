//! One copy in flight: its slices, its ledger, the plan it owns until it has drained,
//! and the [`CopyJob`] future and [`DrainFence`]s that observe it.
//!
//! # Cancellation
//!
//! Dropping a [`CopyJob`] stops unstarted slices and returns immediately. The plan —
//! and with it the pages and regions it owns — is dropped by whichever side comes last:
//! the copy thread that accounts the last slice, or the dropped handle if the job had
//! already drained. Either way, after every started slice has stopped.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::ledger::SliceLedger;
use super::plan::CopyPlan;
use super::CopyError;

/// A copy that did not complete, handing its plan (and so its memory) back.
#[derive(Debug)]
pub struct CopyFailure {
    /// Why.
    pub error: CopyError,
    /// The plan with both endpoints, returned after the drain.
    pub plan: CopyPlan,
}

impl std::fmt::Display for CopyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for CopyFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A contiguous piece of one copy: within one source run and one destination run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    pub(crate) src: *const u8,
    pub(crate) dst: *mut u8,
    pub(crate) len: usize,
    /// Index of the checksum group this piece belongs to (0 without checksums).
    pub(crate) group: u32,
}

// SAFETY: a piece is an address pair inside memory owned by its job's plan; copy
// threads dereference it only between `SliceLedger::begin` and `finish`, while the
// plan is guaranteed alive.
unsafe impl Send for Piece {}
// SAFETY: as above.
unsafe impl Sync for Piece {}

struct PlanSlot {
    plan: Option<CopyPlan>,
    settled: bool,
    handle_gone: bool,
}

/// The checksum of a run of consecutive pieces of one group, from one slice.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Partial {
    pub(crate) first_piece: usize,
    pub(crate) group: u32,
    pub(crate) crc: u32,
    pub(crate) len: usize,
}

/// Shared "has drained" signal, separate from the job so that a fence never keeps the
/// job's memory alive.
pub(crate) struct Settle {
    done: AtomicBool,
    notify: Notify,
}

impl Settle {
    fn set(&self) {
        self.done.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    fn is_set(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

pub(crate) struct Job {
    pub(crate) id: u64,
    pub(crate) ledger: SliceLedger,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) slices: Vec<Range<usize>>,
    pub(crate) skipped: AtomicUsize,
    /// Partial checksums reported by slices, when the plan asked for checksums.
    pub(crate) partials: Option<Mutex<Vec<Partial>>>,
    groups: usize,
    /// The process a remote source reads (`process_vm_readv` instead of memcpy).
    pub(crate) remote_pid: Option<i32>,
    /// The typed failure of a remote read, picked up by the thread that fails the job.
    pub(crate) remote_error: Mutex<Option<super::RemoteReadError>>,
    error: Mutex<Option<CopyError>>,
    slot: Mutex<PlanSlot>,
    waker: AtomicWaker,
    settle: Arc<Settle>,
}

impl Job {
    pub(crate) fn new(id: u64, plan: CopyPlan, pieces: Vec<Piece>, slices: Vec<Range<usize>>) -> Job {
        let groups = plan.checksum_groups().map_or(0, |g| g.len());
        let partials = plan.checksum_groups().map(|_| Mutex::new(Vec::new()));
        Job {
            partials,
            groups,
            remote_pid: plan.src.remote_pid(),
            remote_error: Mutex::new(None),
            id,
            ledger: SliceLedger::new(slices.len()),
            pieces,
            slices,
            skipped: AtomicUsize::new(0),
            error: Mutex::new(None),
            slot: Mutex::new(PlanSlot {
                plan: Some(plan),
                settled: false,
                handle_gone: false,
            }),
            waker: AtomicWaker::new(),
            settle: Arc::new(Settle {
                done: AtomicBool::new(false),
                notify: Notify::new(),
            }),
        }
    }

    /// Records the first error and stops unstarted slices.
    pub(crate) fn fail(&self, error: CopyError) {
        let mut e = self.error.lock();
        if e.is_none() {
            *e = Some(error);
        }
        drop(e);
        self.ledger.stop();
    }

    /// Called once, by the thread that accounted the last slice.
    pub(crate) fn settle(&self) {
        let release = {
            let mut slot = self.slot.lock();
            slot.settled = true;
            if slot.handle_gone {
                slot.plan.take()
            } else {
                None
            }
        };
        // Drop order matters: a cancelled job's memory returns to its owners *before*
        // fences fire, so a fence means "drained and released".
        drop(release);
        self.settle.set();
        self.waker.wake();
    }
}

/// A copy in flight. Resolves to the plan once every slice has run, or to a
/// [`CopyFailure`] (with the plan) once every started slice has stopped.
#[must_use = "dropping a CopyJob cancels the copy"]
pub struct CopyJob {
    job: Option<Arc<Job>>,
    immediate: Option<Result<CopyPlan, CopyFailure>>,
}

impl std::fmt::Debug for CopyJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyJob")
            .field("id", &self.job.as_ref().map(|j| j.id))
            .finish()
    }
}

impl CopyJob {
    pub(crate) fn running(job: Arc<Job>) -> CopyJob {
        CopyJob {
            job: Some(job),
            immediate: None,
        }
    }

    pub(crate) fn finished(result: Result<CopyPlan, CopyFailure>) -> CopyJob {
        CopyJob {
            job: None,
            immediate: Some(result),
        }
    }

    /// A fence that fires once this copy has drained (and, if the job was dropped,
    /// after its memory was released). Holding a fence does not keep memory alive.
    pub fn fence(&self) -> DrainFence {
        match &self.job {
            Some(job) => DrainFence {
                settle: Some(job.settle.clone()),
            },
            None => DrainFence { settle: None },
        }
    }

    /// Whether every started slice has stopped.
    pub fn is_drained(&self) -> bool {
        self.job.as_ref().is_none_or(|j| j.settle.is_set())
    }

    /// Cancels the copy and resolves once it has drained: `Ok(plan)` if it had
    /// already completed, else `Err(CopyFailure { error: Cancelled, plan })`.
    ///
    /// # Cancellation
    ///
    /// Dropping this future (e.g. a second cancel by a timeout) is harmless: the copy
    /// stays cancelled and its memory is released after the drain.
    pub async fn cancel(mut self) -> Result<CopyPlan, CopyFailure> {
        if let Some(job) = &self.job {
            job.ledger.stop();
        }
        (&mut self).await
    }
}

impl Future for CopyJob {
    type Output = Result<CopyPlan, CopyFailure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(r) = self.immediate.take() {
            return Poll::Ready(r);
        }
        let job = self.job.as_ref().expect("CopyJob polled after it completed");
        if !job.settle.is_set() {
            job.waker.register(cx.waker());
            if !job.settle.is_set() {
                return Poll::Pending;
            }
        }
        let mut plan = job.slot.lock().plan.take().expect("plan present until taken once");
        if let Some(partials) = &job.partials {
            // Fold the slices' partial checksums, in piece order, into one per group.
            let mut parts = std::mem::take(&mut *partials.lock());
            parts.sort_unstable_by_key(|p| p.first_piece);
            let mut per_group = vec![0u32; job.groups];
            for p in parts {
                let g = &mut per_group[p.group as usize];
                *g = crate::checksum::combine(*g, p.crc, p.len);
            }
            plan.set_group_checksums(per_group);
        }
        let error = job
            .error
            .lock()
            .take()
            .or_else(|| (job.skipped.load(Ordering::Acquire) > 0).then_some(CopyError::Cancelled));
        self.job = None;
        Poll::Ready(match error {
            None => Ok(plan),
            Some(error) => Err(CopyFailure { error, plan }),
        })
    }
}

impl Drop for CopyJob {
    fn drop(&mut self) {
        if let Some(job) = self.job.take() {
            job.ledger.stop();
            let release = {
                let mut slot = job.slot.lock();
                slot.handle_gone = true;
                if slot.settled {
                    slot.plan.take()
                } else {
                    None
                }
            };
            drop(release);
        }
    }
}

/// Waits for a copy to drain. Cheap to clone; does not keep the copy's memory alive.
#[derive(Clone)]
pub struct DrainFence {
    settle: Option<Arc<Settle>>,
}

impl std::fmt::Debug for DrainFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainFence")
            .field("drained", &self.is_drained())
            .finish()
    }
}

/// Fires its [`DrainFence`]s when dropped — on every path, including panics and
/// cancellation of whatever owns it. Used by work other than a single copy job (e.g. a
/// transfer whose receive, landing copy and release must all finish).
pub struct DrainSignal {
    settle: Arc<Settle>,
}

impl std::fmt::Debug for DrainSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DrainSignal")
    }
}

impl Drop for DrainSignal {
    fn drop(&mut self) {
        self.settle.set();
    }
}

impl DrainFence {
    /// A signal and the fence it fires (when the signal is dropped).
    pub fn pair() -> (DrainSignal, DrainFence) {
        let settle = Arc::new(Settle {
            done: AtomicBool::new(false),
            notify: Notify::new(),
        });
        (
            DrainSignal { settle: settle.clone() },
            DrainFence { settle: Some(settle) },
        )
    }

    /// A fence that has already fired.
    pub fn ready() -> DrainFence {
        DrainFence { settle: None }
    }

    /// Whether the copy has drained.
    pub fn is_drained(&self) -> bool {
        self.settle.as_ref().is_none_or(|s| s.is_set())
    }

    /// Resolves once the copy has drained.
    ///
    /// # Cancellation
    ///
    /// Cancel-safe: dropping this future has no effect on the copy.
    pub async fn wait(&self) {
        let Some(s) = &self.settle else { return };
        loop {
            let n = s.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if s.is_set() {
                return;
            }
            n.await;
        }
    }

    /// Waits until drained or `deadline`; true if drained.
    pub async fn wait_until(&self, deadline: tokio::time::Instant) -> bool {
        tokio::time::timeout_at(deadline, self.wait()).await.is_ok()
    }
}
