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
//!
//! The cell, [`HostPages`] and [`PendingCopy`] live in `pending.rs`.

use std::sync::Arc;

use crate::copy::Segment;
use crate::mem::Lease;

use super::buffer::{check_range, DeviceBuffer, DeviceSlice};
use super::event::{Event, EventMeta};
use super::pending::{HostPages, PendingCopy};
use super::DeviceError;

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
                dst_ranges.push((0, s.dst_offset, s.dst_offset + s.src.len));
            }
        }
        check_disjoint(dst_ranges, "the lease")?;
        let parts = parts_by_buffer(segments.iter().map(|s| {
            let seg = Segment {
                src: s.src.offset,
                dst: s.dst_offset,
                len: s.src.len,
            };
            (&s.src.buffer, seg)
        }));
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
                dst_ranges.push(buffer_range(&s.dst));
            }
        }
        check_disjoint(dst_ranges, "a device buffer")?;
        let parts = parts_by_buffer(segments.iter().map(|s| {
            let seg = Segment {
                src: s.src_offset,
                dst: s.dst.offset,
                len: s.dst.len,
            };
            (&s.dst.buffer, seg)
        }));
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
                dst_ranges.push(buffer_range(&s.dst));
            }
        }
        check_disjoint(dst_ranges, "a device buffer")?;
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
        Ok(PendingCopy::new(event, cell, bytes))
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

/// A device slice as a destination range keyed by its buffer (for [`check_disjoint`]).
fn buffer_range(slice: &DeviceSlice) -> (u64, usize, usize) {
    let id = Arc::as_ptr(slice.buffer.backend()) as *const () as u64;
    (id, slice.offset, slice.offset + slice.len)
}

/// No two destination ranges `(place id, start, end)` of the same place overlap;
/// `place` names it in the error.
fn check_disjoint(mut ranges: Vec<(u64, usize, usize)>, place: &str) -> Result<(), DeviceError> {
    ranges.sort_unstable();
    if let Some(w) = ranges.windows(2).find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2) {
        return Err(DeviceError::InvalidArgument(format!(
            "destination ranges overlap in {place} at offset {}",
            w[1].1
        )));
    }
    Ok(())
}

/// The non-empty segments, grouped into one part per run of the same device buffer,
/// in order.
fn parts_by_buffer<'a>(segments: impl Iterator<Item = (&'a DeviceBuffer, Segment)>) -> Vec<CopyPart> {
    let mut parts: Vec<CopyPart> = Vec::new();
    for (buffer, seg) in segments.filter(|(_, seg)| seg.len > 0) {
        match parts.last_mut() {
            Some(p) if p.buffer.same_buffer(buffer) => p.segments.push(seg),
            _ => parts.push(CopyPart {
                buffer: buffer.clone(),
                segments: vec![seg],
            }),
        }
    }
    parts
}
