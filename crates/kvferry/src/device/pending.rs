//! A copy in flight and the arena pages it owns: the operation cell holding the lease
//! (leased, then handed back, returned, or quarantined), the backend's view of those
//! pages ([`HostPages`]), and the caller's handle ([`PendingCopy`]). Where the lease goes
//! on each path is in [`super::stream`]'s module docs.
//!
//! # Cancellation
//!
//! Dropping the future of [`PendingCopy::wait`] / [`PendingCopy::wait_for`] (or the
//! [`PendingCopy`] itself) while the copy is pending quarantines the lease; the completer
//! releases it when the device settles the copy quietly.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::mem::{HostMemory, Lease, MemError, Quarantined};

use super::event::{Event, EventStatus};
use super::{check_timeout, DeviceError};

enum Holding {
    Leased(Lease),
    Quarantined(Quarantined),
    Empty,
}

/// The lease of one copy in flight.
pub(crate) struct OpCell {
    holding: Mutex<Holding>,
}

impl OpCell {
    fn take_lease(&self) -> Option<Lease> {
        let mut h = self.holding.lock();
        match std::mem::replace(&mut *h, Holding::Empty) {
            Holding::Leased(l) => Some(l),
            other => {
                *h = other;
                None
            }
        }
    }

    /// The caller stopped waiting while the device may still target the pages.
    fn quarantine(&self) {
        let mut h = self.holding.lock();
        if let Holding::Leased(l) = std::mem::replace(&mut *h, Holding::Empty) {
            *h = Holding::Quarantined(l.quarantine());
        }
    }

    /// The device settled the copy: release the pages if it confirmed it stopped
    /// touching them, keep them quarantined forever if it faulted.
    fn settle(&self, status: &EventStatus) {
        let holding = std::mem::replace(&mut *self.holding.lock(), Holding::Empty);
        let quiet = matches!(status, EventStatus::Complete | EventStatus::Failed(_));
        match holding {
            Holding::Quarantined(q) if quiet => q.release(),
            Holding::Quarantined(q) => drop(q), // stays quarantined, counted
            Holding::Leased(l) if quiet => drop(l),
            Holding::Leased(l) => drop(l.quarantine()),
            Holding::Empty => {}
        }
    }
}

/// One contiguous run of a lease: `len` bytes at `ptr`, at logical offset `start`.
#[derive(Clone, Copy, Debug)]
struct Run {
    ptr: *mut u8,
    start: usize,
    len: usize,
}

/// The pages of a lease owned by a copy in flight, as [`HostMemory`] for the backend.
///
/// Holding a `HostPages` keeps the lease's pages leased or quarantined (never free), so
/// the addresses stay valid and unshared for as long as the backend holds it.
pub struct HostPages {
    _cell: Arc<OpCell>,
    runs: Vec<Run>,
    len: usize,
}

// SAFETY: the runs point into arena pages held (leased or quarantined, never free) by
// the cell this value keeps alive; the arena's memory stays mapped while the cell's
// lease or quarantine exists. Access is coordinated by the copy protocol (only the
// device writes or reads them while the copy is in flight).
unsafe impl Send for HostPages {}
// SAFETY: as above; `&HostPages` only hands out addresses.
unsafe impl Sync for HostPages {}

impl std::fmt::Debug for HostPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPages")
            .field("len", &self.len)
            .field("runs", &self.runs.len())
            .finish()
    }
}

impl HostPages {
    pub(super) fn capture(lease: Lease) -> Result<(Arc<OpCell>, HostPages), DeviceError> {
        let mut runs = Vec::new();
        let mut start = 0;
        lease.for_each_run(0, lease.len(), &mut |ptr, len| {
            runs.push(Run { ptr, start, len });
            start += len;
        })?;
        let len = lease.len();
        let cell = Arc::new(OpCell {
            holding: Mutex::new(Holding::Leased(lease)),
        });
        Ok((cell.clone(), HostPages { _cell: cell, runs, len }))
    }
}

impl HostMemory for HostPages {
    fn size(&self) -> usize {
        self.len
    }

    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(MemError::OutOfBounds {
                    offset,
                    len,
                    size: self.len,
                })
            }
        }
        let end = offset + len;
        let mut i = self.runs.partition_point(|r| r.start + r.len <= offset);
        let mut off = offset;
        while off < end {
            let r = self.runs[i];
            let within = off - r.start;
            let n = (r.len - within).min(end - off);
            // SAFETY: `within < r.len`, so the address lies inside run `r`.
            f(unsafe { r.ptr.add(within) }, n);
            off += n;
            i += 1;
        }
        Ok(())
    }
}

/// A copy in flight. Owns its lease until the device confirms completion; see the module
/// docs for where the lease goes on each path.
#[must_use = "dropping a PendingCopy quarantines its lease until the device completes the copy"]
pub struct PendingCopy {
    event: Event,
    cell: Option<Arc<OpCell>>,
    bytes: usize,
}

impl std::fmt::Debug for PendingCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingCopy")
            .field("event", &self.event)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PendingCopy {
    /// A copy submitted as `event`, owning `cell`'s lease until the device confirms.
    pub(super) fn new(event: Event, cell: Arc<OpCell>, bytes: usize) -> PendingCopy {
        PendingCopy {
            event,
            cell: Some(cell),
            bytes,
        }
    }

    /// The event that completes with the copy (fresh for this copy).
    pub fn event(&self) -> &Event {
        &self.event
    }

    /// Bytes the copy moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Waits for the copy until `deadline`; returns the lease on success.
    ///
    /// On [`DeviceError::Timeout`] the lease's pages are quarantined and released to the
    /// arena when the device completes the copy later; on [`DeviceError::CopyFailed`]
    /// they are back in the arena already.
    ///
    /// # Cancellation
    ///
    /// Dropping the future while the copy is pending quarantines the lease exactly as a
    /// timeout does.
    pub async fn wait(mut self, deadline: Instant) -> Result<Lease, DeviceError> {
        let result = self.event.wait(deadline).await;
        self.finish(result)
    }

    /// [`wait`](Self::wait) with the deadline `timeout` after the copy's submission. A
    /// zero timeout is [`DeviceError::InvalidArgument`] (and drops the handle, as
    /// dropping a pending copy does).
    ///
    /// # Cancellation
    ///
    /// As [`wait`](Self::wait).
    pub async fn wait_for(self, timeout: Duration) -> Result<Lease, DeviceError> {
        check_timeout(timeout, self.event.op())?;
        let deadline = self.event.meta().submitted() + timeout;
        self.wait(deadline).await
    }

    /// [`wait`](Self::wait) for synchronous callers: blocks (sleeping, not spinning)
    /// until completion or `deadline`.
    pub fn wait_blocking(mut self, deadline: std::time::Instant) -> Result<Lease, DeviceError> {
        let result = self.event.wait_blocking(deadline);
        self.finish(result)
    }

    fn finish(&mut self, result: Result<(), DeviceError>) -> Result<Lease, DeviceError> {
        let cell = self.cell.take().expect("finish runs once");
        match result {
            Ok(()) => cell
                .take_lease()
                .ok_or_else(|| DeviceError::Driver("completed copy lost its lease (internal error)".into())),
            Err(e @ DeviceError::CopyFailed { .. }) => {
                // The device stopped touching the pages: return them to the arena.
                drop(cell.take_lease());
                Err(e)
            }
            Err(e) => {
                abandon(&self.event, cell);
                Err(e)
            }
        }
    }
}

/// Quarantines the cell's lease and releases it once the event settles quietly.
fn abandon(event: &Event, cell: Arc<OpCell>) {
    cell.quarantine();
    event.signal().on_settled(Box::new(move |status| cell.settle(status)));
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            match self.event.query() {
                EventStatus::Complete | EventStatus::Failed(_) => drop(cell.take_lease()),
                EventStatus::Pending | EventStatus::Faulted(_) => abandon(&self.event, cell),
            }
        }
    }
}
