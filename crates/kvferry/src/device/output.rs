//! The "async output" primitive: after the main stream's work, copy a set of device
//! buffers into pinned host pages (one arena [`Lease`]) on a dedicated copy stream, and
//! get the bytes later within a deadline.
//!
//! This is the bounded replacement for "record a blocking event on the output stream and
//! `synchronize()` it" (an unbounded wait that hung workers forever when an accelerator
//! event stopped completing): [`AsyncOutput::get`] returns the bytes or a typed error —
//! [`DeviceError::Timeout`] names the operation and rank — by its deadline, and on
//! timeout the lease is quarantined, never freed under a late copy.
//!
//! # Cancellation
//!
//! Dropping an [`AsyncOutput`], or the future of [`AsyncOutput::get`] /
//! [`AsyncOutput::get_for`], while the copy is pending quarantines the lease; it returns
//! to the arena when the device completes the copy.

use std::ops::Range;
use std::time::Duration;

use tokio::time::Instant;

use crate::mem::Lease;

use super::buffer::DeviceSlice;
use super::event::Event;
use super::pending::PendingCopy;
use super::stream::{GatherSegment, Stream};
use super::DeviceError;

/// Device outputs being copied to host pages. See the module docs.
#[must_use = "dropping an AsyncOutput quarantines its lease until the copy completes"]
#[derive(Debug)]
pub struct AsyncOutput {
    pending: PendingCopy,
    main: Event,
    parts: Vec<Range<usize>>,
}

/// The host bytes of an [`AsyncOutput`]: the lease and where each output lies in it.
#[derive(Debug)]
pub struct OutputBytes {
    lease: Lease,
    parts: Vec<Range<usize>>,
}

impl OutputBytes {
    /// The byte range of output `i` in the lease (in the order given to
    /// [`AsyncOutput::start`]).
    pub fn parts(&self) -> &[Range<usize>] {
        &self.parts
    }

    /// Output `i` as a new vector.
    pub fn part(&self, i: usize) -> Result<Vec<u8>, DeviceError> {
        let r = self
            .parts
            .get(i)
            .ok_or_else(|| DeviceError::InvalidArgument(format!("output {i} of {}", self.parts.len())))?;
        Ok(self.lease.to_vec(r.start, r.len())?)
    }

    /// The lease holding the bytes.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Gives back the lease.
    pub fn into_lease(self) -> Lease {
        self.lease
    }
}

impl AsyncOutput {
    /// Records the end of the work queued so far on `main`, makes `copy` wait for it, and
    /// queues on `copy` a gather of `outputs` into `lease`, packed back to back from
    /// offset 0 (`op` names the copy in errors). Fails with
    /// [`DeviceError::InvalidArgument`] if the outputs do not fit the lease.
    pub fn start(
        main: &Stream,
        copy: &Stream,
        outputs: &[DeviceSlice],
        lease: Lease,
        op: &str,
    ) -> Result<AsyncOutput, DeviceError> {
        let total = outputs.iter().try_fold(0usize, |acc, s| acc.checked_add(s.len));
        match total {
            Some(t) if t <= lease.len() => {}
            _ => {
                return Err(DeviceError::InvalidArgument(format!(
                    "async output {op:?}: outputs do not fit the lease of {} bytes",
                    lease.len()
                )))
            }
        }
        let mut parts = Vec::with_capacity(outputs.len());
        let mut segments = Vec::with_capacity(outputs.len());
        let mut at = 0;
        for s in outputs {
            parts.push(at..at + s.len);
            segments.push(GatherSegment {
                src: s.clone(),
                dst_offset: at,
            });
            at += s.len;
        }
        let main_done = copy.wait_stream(main, &format!("{op} (main stream)"))?;
        let pending = copy.copy_d2h_gather(&segments, lease, op)?;
        Ok(AsyncOutput {
            pending,
            main: main_done,
            parts,
        })
    }

    /// The event of the copy (fresh for this output).
    pub fn event(&self) -> &Event {
        self.pending.event()
    }

    /// The event recorded on the main stream that the copy waits for.
    pub fn main_event(&self) -> &Event {
        &self.main
    }

    /// Waits for the bytes until `deadline`: the lease with the outputs, or
    /// [`DeviceError::Timeout`] (naming the operation and rank; the lease is quarantined
    /// until the device completes the copy), [`DeviceError::CopyFailed`] or
    /// [`DeviceError::Fault`].
    ///
    /// # Cancellation
    ///
    /// Dropping the future while the copy is pending quarantines the lease.
    pub async fn get(self, deadline: Instant) -> Result<OutputBytes, DeviceError> {
        let AsyncOutput { pending, parts, .. } = self;
        let lease = pending.wait(deadline).await?;
        Ok(OutputBytes { lease, parts })
    }

    /// [`get`](Self::get) with the deadline `timeout` after the copy's submission (e.g.
    /// an engine's iteration timeout). A zero timeout is
    /// [`DeviceError::InvalidArgument`].
    ///
    /// # Cancellation
    ///
    /// As [`get`](Self::get).
    pub async fn get_for(self, timeout: Duration) -> Result<OutputBytes, DeviceError> {
        let deadline = self.pending.event().deadline_after(timeout)?;
        self.get(deadline).await
    }

    /// [`get`](Self::get) for synchronous callers (e.g. an output thread): blocks,
    /// sleeping, until the bytes are there or `deadline`.
    pub fn get_blocking(self, deadline: std::time::Instant) -> Result<OutputBytes, DeviceError> {
        let AsyncOutput { pending, parts, .. } = self;
        let lease = pending.wait_blocking(deadline)?;
        Ok(OutputBytes { lease, parts })
    }
}
