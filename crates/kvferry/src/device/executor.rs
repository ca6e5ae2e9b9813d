//! The executor side of the host and sim backends: a stream of either is a tokio task
//! that runs the work queued on it in order ([`Queued`]: copies, records, waits on
//! other events). [`enqueue`] hands it an item and returns the event the item settles;
//! [`copy_inline`] moves a copy's bytes on the calling thread (the sim backend, tests).
//! A stream whose task has ended refuses new work with [`DeviceError::Closed`].

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use crate::mem::HostMemory;

use super::event::{Event, EventMeta, PushSignal};
use super::stream::{CopyDirection, CopyOp, D2dOp};
use super::DeviceError;

/// Work queued on a host or sim stream's executor task.
pub(crate) enum Queued {
    /// A copy; settle `signal` once it has finished and its memory is quiet.
    Copy { op: CopyOp, signal: Arc<PushSignal> },
    /// A device-to-device copy; settle `signal` once it has finished.
    CopyD2d { op: D2dOp, signal: Arc<PushSignal> },
    /// Settle `signal` once reached.
    Record { signal: Arc<PushSignal> },
    /// Block the stream until `event` has settled.
    Wait { event: Event },
}

impl Queued {
    /// Whether this is a copy.
    pub(crate) fn is_copy(&self) -> bool {
        matches!(self, Queued::Copy { .. } | Queued::CopyD2d { .. })
    }
}

/// Queues `item` (with the backend's per-item `extra`) on an executor task; returns the
/// event it settles (for copies and records).
pub(crate) fn enqueue<P>(
    tx: &UnboundedSender<(Queued, P)>,
    stream: &str,
    item: Queued,
    meta: Option<EventMeta>,
    extra: P,
) -> Result<Option<Event>, DeviceError> {
    let event = match (&item, meta) {
        (Queued::Copy { signal, .. } | Queued::CopyD2d { signal, .. } | Queued::Record { signal }, Some(meta)) => {
            Some(Event::new(meta, signal.clone()))
        }
        _ => None,
    };
    tx.send((item, extra))
        .map_err(|_| DeviceError::Closed(stream.to_string()))?;
    Ok(event)
}

/// Copies a copy operation's bytes on the calling thread (sim backend; tests).
pub(crate) fn copy_inline(op: &CopyOp) -> Result<(), String> {
    let host: &dyn HostMemory = &*op.host;
    for part in &op.parts {
        let dev = part
            .buffer
            .backend()
            .host_memory()
            .ok_or("device buffer is not host-visible")?;
        let (src, dst): (&dyn HostMemory, &dyn HostMemory) = match op.direction {
            CopyDirection::DeviceToHost => (&*dev, host),
            CopyDirection::HostToDevice => (host, &*dev),
        };
        for seg in &part.segments {
            let mut src_runs = Vec::new();
            src.for_each_run(seg.src, seg.len, &mut |p, n| src_runs.push((p, n)))
                .map_err(|e| e.to_string())?;
            let mut d = seg.dst;
            for (p, n) in src_runs {
                let mut done = 0;
                dst.for_each_run(d, n, &mut |q, m| {
                    // SAFETY: both ranges were validated against their memories, which
                    // the operation keeps alive; destination ranges do not overlap
                    // sources (different memories).
                    unsafe { std::ptr::copy_nonoverlapping(p.add(done), q, m) };
                    done += m;
                })
                .map_err(|e| e.to_string())?;
                d += n;
            }
        }
    }
    Ok(())
}

/// Copies a device-to-device operation's bytes on the calling thread (sim backend).
pub(crate) fn copy_inline_d2d(op: &D2dOp) -> Result<(), String> {
    for seg in &op.segments {
        let src = seg
            .src
            .buffer
            .backend()
            .host_memory()
            .ok_or("source is not host-visible")?;
        let dst = seg
            .dst
            .buffer
            .backend()
            .host_memory()
            .ok_or("destination is not host-visible")?;
        let mut src_runs = Vec::new();
        src.for_each_run(seg.src.offset, seg.src.len, &mut |p, n| src_runs.push((p, n)))
            .map_err(|e| e.to_string())?;
        let mut d = seg.dst.offset;
        for (p, n) in src_runs {
            let mut done = 0;
            dst.for_each_run(d, n, &mut |q, m| {
                // SAFETY: both ranges were validated against their memories, which the
                // operation keeps alive; the destination is writable memory of this
                // device and the source is read (imported memory is another mapping).
                unsafe { std::ptr::copy(p.add(done), q, m) };
                done += m;
            })
            .map_err(|e| e.to_string())?;
            d += n;
        }
    }
    Ok(())
}
