//! Streams and the copies queued on them.
//!
//! A [`Stream`] is an ordered queue of device work. Copies between device buffers and an
//! arena [`Lease`] ([`Stream::copy_d2h`], [`Stream::copy_d2h_gather`],
//! [`Stream::copy_h2d`]) are submitted without blocking and return a [`PendingCopy`]
//! that owns the lease until the device confirms completion.
//!
//! # Ownership of the lease
//!
//! At submission the lease moves into an operation cell shared by the [`PendingCopy`]
//! and the backend's view of its pages ([`HostPages`]). Its pages leave the cell only
//! when:
//!
//! - the copy completed and [`PendingCopy::wait`] hands the lease back;
//! - the copy failed (the device reported it after it stopped touching the pages): the
//!   pages return to the arena and the wait reports [`DeviceError::CopyFailed`];
//! - the caller stopped waiting first (timeout, dropped future, dropped
//!   [`PendingCopy`]): the pages are **quarantined** at once and released to the free
//!   list by the completer when the device completes the copy — or never, if it never
//!   does or reports a fault.
//!
//! A submission that fails returns an error before the device was given any work; the
//! lease's pages go straight back to the arena.
//!
//! # Cancellation
//!
//! Dropping the future of [`PendingCopy::wait`] / [`PendingCopy::wait_for`] (or the
//! [`PendingCopy`] itself) while the copy is pending quarantines the lease as above; the
//! copy itself continues on the device.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::copy::Segment;
use crate::mem::{HostMemory, Lease, MemError, Quarantined};

use super::buffer::{check_range, DeviceBuffer, DeviceSlice};
use super::event::{Event, EventMeta, EventStatus};
use super::{check_timeout, DeviceError};

/// Which way a copy moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// Device buffer → host pages. Segment `src` offsets are in the buffer, `dst` in the
    /// host pages.
    DeviceToHost,
    /// Host pages → device buffer. Segment `src` offsets are in the host pages, `dst` in
    /// the buffer.
    HostToDevice,
}

/// The segments of one copy that touch one device buffer.
#[derive(Debug)]
pub struct CopyPart {
    /// The device buffer (kept alive by the operation).
    pub buffer: DeviceBuffer,
    /// The segments, oriented by the copy's [`CopyDirection`].
    pub segments: Vec<Segment>,
}

/// One copy as handed to a [`StreamBackend`]: validated (every range in bounds, device
/// buffers of this stream's device, destination ranges disjoint).
#[derive(Debug)]
pub struct CopyOp {
    /// The operation's identity (use it for the returned event).
    pub meta: EventMeta,
    /// Which way bytes move.
    pub direction: CopyDirection,
    /// The lease's pages.
    pub host: Arc<HostPages>,
    /// The device side, grouped by buffer.
    pub parts: Vec<CopyPart>,
}

impl CopyOp {
    /// Total bytes the copy moves.
    pub fn bytes(&self) -> usize {
        self.parts.iter().flat_map(|p| p.segments.iter()).map(|s| s.len).sum()
    }
}

/// A backend's stream.
///
/// Contract: `copy` and `record` return a fresh [`Event`] whose signal settles
/// [`Complete`](EventStatus::Complete) or [`Failed`](EventStatus::Failed) only after all
/// work queued before it (on this stream, and the events it was told to wait for) has
/// finished and the device no longer touches the operation's memory; the backend keeps
/// the [`CopyOp`] (its [`HostPages`] and buffers) alive until then. An `Err` from `copy`
/// means no work was queued.
pub trait StreamBackend: Send + Sync + std::fmt::Debug + 'static {
    /// The stream's name.
    fn name(&self) -> &str;

    /// The id of the device the stream belongs to.
    fn device_id(&self) -> u64;

    /// The rank of that device.
    fn rank(&self) -> u32;

    /// Queues a copy; returns the event that completes with it.
    fn copy(&self, op: CopyOp) -> Result<Event, DeviceError>;

    /// Queues an event that completes after all work queued so far.
    fn record(&self, meta: EventMeta) -> Result<Event, DeviceError>;

    /// Makes work queued after this call wait until `event` has settled.
    fn wait_event(&self, event: &Event) -> Result<(), DeviceError>;

    /// Queues a device-to-device copy (validated as for `copy`); returns the event that
    /// completes with it. Backends without device-to-device copies refuse it (nothing
    /// queued).
    fn copy_d2d(&self, op: D2dOp) -> Result<Event, DeviceError> {
        let _ = op;
        Err(DeviceError::InvalidArgument(format!(
            "stream {:?} does not copy device to device",
            self.name()
        )))
    }
}

/// One segment of a device-to-device copy: `src` into `dst`, of equal lengths.
#[derive(Clone, Debug)]
pub struct D2dSegment {
    /// The bytes read (memory of this device, or imported onto it).
    pub src: DeviceSlice,
    /// Where they land (memory of this device, never imported memory).
    pub dst: DeviceSlice,
}

/// A device-to-device copy as handed to a [`StreamBackend`]: validated (ranges in
/// bounds, buffers of the stream's device, destinations writable and disjoint). It
/// keeps every buffer it names alive until the backend drops it.
#[derive(Debug)]
pub struct D2dOp {
    /// The operation's identity (use it for the returned event).
    pub meta: EventMeta,
    /// The segments, in order.
    pub segments: Vec<D2dSegment>,
}

impl D2dOp {
    /// Total bytes the copy moves.
    pub fn bytes(&self) -> usize {
        self.segments.iter().map(|s| s.dst.len).sum()
    }
}

/// One segment of a gather: a device range copied to `dst_offset` in the lease.
#[derive(Clone, Debug)]
pub struct GatherSegment {
    /// The device bytes.
    pub src: DeviceSlice,
    /// Where they land in the lease.
    pub dst_offset: usize,
}

/// One segment of a scatter: lease bytes at `src_offset` copied into a device range.
#[derive(Clone, Debug)]
pub struct ScatterSegment {
    /// Where the bytes are in the lease.
    pub src_offset: usize,
    /// The device range they go to.
    pub dst: DeviceSlice,
}

/// An ordered queue of device work. Cheap to clone (clones are the same stream).
#[derive(Clone, Debug)]
pub struct Stream {
    inner: Arc<dyn StreamBackend>,
}

impl Stream {
    /// Wraps a backend's stream.
    pub fn new(inner: Arc<dyn StreamBackend>) -> Stream {
        Stream { inner }
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// The rank of its device.
    pub fn rank(&self) -> u32 {
        self.inner.rank()
    }

    /// The id of its device.
    pub fn device_id(&self) -> u64 {
        self.inner.device_id()
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` into `dst` at
    /// `dst_offset`, after the work already queued. The lease is owned by the copy until
    /// the returned [`PendingCopy`] hands it back (see the module docs).
    pub fn copy_d2h(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: Lease,
        dst_offset: usize,
        len: usize,
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        let seg = GatherSegment {
            src: src.slice(src_offset, len),
            dst_offset,
        };
        self.copy_d2h_gather(std::slice::from_ref(&seg), dst, op)
    }

    /// Queues a gather of several device ranges (of any buffers of this device) into one
    /// lease. Destination ranges must not overlap.
    pub fn copy_d2h_gather(
        &self,
        segments: &[GatherSegment],
        dst: Lease,
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        let mut dst_ranges = Vec::with_capacity(segments.len());
        for s in segments {
            self.check_buffer(&s.src.buffer)?;
            s.src.check()?;
            check_range(s.dst_offset, s.src.len, dst.len(), "lease")?;
            if s.src.len > 0 {
                dst_ranges.push((s.dst_offset, s.dst_offset + s.src.len));
            }
        }
        dst_ranges.sort_unstable();
        if let Some(w) = dst_ranges.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(DeviceError::InvalidArgument(format!(
                "destination ranges overlap in the lease at offset {}",
                w[1].0
            )));
        }
        let mut parts: Vec<CopyPart> = Vec::new();
        for s in segments.iter().filter(|s| s.src.len > 0) {
            let seg = Segment {
                src: s.src.offset,
                dst: s.dst_offset,
                len: s.src.len,
            };
            match parts.last_mut() {
                Some(p) if p.buffer.same_buffer(&s.src.buffer) => p.segments.push(seg),
                _ => parts.push(CopyPart {
                    buffer: s.src.buffer.clone(),
                    segments: vec![seg],
                }),
            }
        }
        self.submit(CopyDirection::DeviceToHost, dst, parts, op)
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` into `dst` at
    /// `dst_offset`. The lease is owned by the copy until the returned [`PendingCopy`]
    /// hands it back: the device reads it until then.
    pub fn copy_h2d(
        &self,
        src: Lease,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        self.check_buffer(dst)?;
        check_writable(dst)?;
        check_range(dst_offset, len, dst.len(), "device buffer")?;
        check_range(src_offset, len, src.len(), "lease")?;
        let mut parts = Vec::new();
        if len > 0 {
            parts.push(CopyPart {
                buffer: dst.clone(),
                segments: vec![Segment {
                    src: src_offset,
                    dst: dst_offset,
                    len,
                }],
            });
        }
        self.submit(CopyDirection::HostToDevice, src, parts, op)
    }

    /// Queues a scatter of lease ranges into several device ranges (of any buffers of
    /// this device): segment `i` copies `segments[i].dst.len` bytes from the lease at
    /// `segments[i].src_offset`. Destination ranges within one buffer must not overlap.
    /// The lease is owned by the copy until the returned [`PendingCopy`] hands it back.
    pub fn copy_h2d_scatter(
        &self,
        src: Lease,
        segments: &[ScatterSegment],
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        let mut dst_ranges: Vec<(u64, usize, usize)> = Vec::with_capacity(segments.len());
        for s in segments {
            self.check_buffer(&s.dst.buffer)?;
            check_writable(&s.dst.buffer)?;
            s.dst.check()?;
            check_range(s.src_offset, s.dst.len, src.len(), "lease")?;
            if s.dst.len > 0 {
                let id = Arc::as_ptr(s.dst.buffer.backend()) as *const () as u64;
                dst_ranges.push((id, s.dst.offset, s.dst.offset + s.dst.len));
            }
        }
        dst_ranges.sort_unstable();
        if let Some(w) = dst_ranges.windows(2).find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
            return Err(DeviceError::InvalidArgument(format!(
                "destination ranges overlap in a device buffer at offset {}",
                w[1].1
            )));
        }
        let mut parts: Vec<CopyPart> = Vec::new();
        for s in segments.iter().filter(|s| s.dst.len > 0) {
            let seg = Segment {
                src: s.src_offset,
                dst: s.dst.offset,
                len: s.dst.len,
            };
            match parts.last_mut() {
                Some(p) if p.buffer.same_buffer(&s.dst.buffer) => p.segments.push(seg),
                _ => parts.push(CopyPart {
                    buffer: s.dst.buffer.clone(),
                    segments: vec![seg],
                }),
            }
        }
        self.submit(CopyDirection::HostToDevice, src, parts, op)
    }

    /// Queues a device-to-device copy of `segments` (sources may be memory imported
    /// from another process with [`Device::open_ipc`](super::Device::open_ipc)); returns
    /// its fresh event. No host memory is involved, so nothing is quarantined here:
    /// the caller must treat the destination ranges as busy until the event settles
    /// (a timeout or cancel leaves them so until the device confirms).
    pub fn copy_d2d(&self, segments: &[D2dSegment], op: &str) -> Result<Event, DeviceError> {
        let mut dst_ranges: Vec<(u64, usize, usize)> = Vec::with_capacity(segments.len());
        for s in segments {
            self.check_buffer(&s.src.buffer)?;
            self.check_buffer(&s.dst.buffer)?;
            s.src.check()?;
            s.dst.check()?;
            if s.src.len != s.dst.len {
                return Err(DeviceError::InvalidArgument(format!(
                    "a device-to-device segment copies {} bytes into {}",
                    s.src.len, s.dst.len
                )));
            }
            if s.dst.buffer.is_read_only() {
                return Err(DeviceError::InvalidArgument(
                    "a device-to-device copy may not write imported (read-only) memory".into(),
                ));
            }
            if s.dst.len > 0 {
                let id = Arc::as_ptr(s.dst.buffer.backend()) as *const () as u64;
                dst_ranges.push((id, s.dst.offset, s.dst.offset + s.dst.len));
            }
        }
        dst_ranges.sort_unstable();
        if let Some(w) = dst_ranges.windows(2).find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
            return Err(DeviceError::InvalidArgument(format!(
                "destination ranges overlap in a device buffer at offset {}",
                w[1].1
            )));
        }
        let segments = segments.iter().filter(|s| s.dst.len > 0).cloned().collect();
        self.inner.copy_d2d(D2dOp {
            meta: EventMeta::new(op, self.inner.rank()),
            segments,
        })
    }

    fn check_buffer(&self, b: &DeviceBuffer) -> Result<(), DeviceError> {
        if b.device_id() != self.inner.device_id() {
            return Err(DeviceError::InvalidArgument(format!(
                "buffer of device {} used on stream {:?} of device {}",
                b.device_id(),
                self.name(),
                self.inner.device_id()
            )));
        }
        Ok(())
    }

    fn submit(
        &self,
        direction: CopyDirection,
        lease: Lease,
        parts: Vec<CopyPart>,
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        let bytes = parts.iter().flat_map(|p| p.segments.iter()).map(|s| s.len).sum();
        let (cell, host) = HostPages::capture(lease)?;
        let meta = EventMeta::new(op, self.inner.rank());
        let event = self.inner.copy(CopyOp {
            meta,
            direction,
            host: Arc::new(host),
            parts,
        })?;
        Ok(PendingCopy {
            event,
            cell: Some(cell),
            bytes,
        })
    }

    /// Queues a fresh event that completes after all work queued so far.
    pub fn record(&self, op: &str) -> Result<Event, DeviceError> {
        self.inner.record(EventMeta::new(op, self.inner.rank()))
    }

    /// Makes work queued on this stream after this call wait until `event` (typically of
    /// another stream) has settled. The wait happens on the device, not in the caller.
    pub fn wait_event(&self, event: &Event) -> Result<(), DeviceError> {
        self.inner.wait_event(event)
    }

    /// Makes this stream wait for the work queued so far on `other`; returns the event
    /// recorded on `other` (named `op`).
    pub fn wait_stream(&self, other: &Stream, op: &str) -> Result<Event, DeviceError> {
        let ev = other.record(op)?;
        self.wait_event(&ev)?;
        Ok(ev)
    }

    /// The backend's stream.
    pub fn backend(&self) -> &Arc<dyn StreamBackend> {
        &self.inner
    }
}

fn check_writable(b: &DeviceBuffer) -> Result<(), DeviceError> {
    if b.is_read_only() {
        return Err(DeviceError::InvalidArgument(
            "a copy may not write device memory imported from another process".into(),
        ));
    }
    Ok(())
}

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
    fn capture(lease: Lease) -> Result<(Arc<OpCell>, HostPages), DeviceError> {
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
