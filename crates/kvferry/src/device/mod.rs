//! The device layer: accelerator-generic devices, streams, events and device buffers,
//! with asynchronous device-to-host (D2H) and host-to-device (H2D) copies between device
//! buffers and arena [`Lease`](crate::mem::Lease)s, and a bounded, cheap event wait.
//!
//! # Model
//!
//! - A [`Device`] (one per rank) allocates [`DeviceBuffer`]s and creates [`Stream`]s.
//! - A [`Stream`] runs its work in submission order. [`Stream::copy_d2h`],
//!   [`Stream::copy_d2h_gather`] and [`Stream::copy_h2d`] queue a copy and return a
//!   [`PendingCopy`] at once; [`Stream::record`] returns an [`Event`] that completes
//!   after all work queued before it; [`Stream::wait_event`] makes later work on the
//!   stream wait for an event of another stream.
//! - Every operation gets a **fresh** [`Event`] (a new [`EventId`]); events are never
//!   reused across operations.
//! - A [`DeviceKvCache`] is a paged KV cache in device buffers, with the gather and
//!   scatter that put it on the transfer path; [`KvCacheRef`] is the one cache type
//!   over both memory kinds (a host [`KvCache`](crate::layout::KvCache) or a device
//!   cache) that the layers above register, publish from and land into.
//! - [`AsyncOutput`] is the "async output" primitive: after the main stream's work, copy
//!   a set of device buffers into one lease on a dedicated copy stream, then
//!   [`AsyncOutput::get`] the bytes within a deadline.
//!
//! # Guarantees
//!
//! - **Every wait is bounded.** [`Event::wait`] returns when the event completes, or
//!   [`DeviceError::Timeout`] naming the operation and rank at the deadline. A deadline
//!   given as a timeout ([`Event::wait_for`], [`PendingCopy::wait_for`],
//!   [`AsyncOutput::get_for`]) is measured from the operation's own submission, so a
//!   long earlier step does not eat it. A zero timeout is
//!   [`DeviceError::InvalidArgument`].
//! - **Waiting is cheap.** Host and sim events are completed by a completer (the stream's
//!   executor task, after the copy engine or the simulated timer finished) that wakes
//!   waiters through a [`tokio::sync::Notify`] (async) or a condition variable
//!   ([`Event::wait_blocking`]); nothing polls. CUDA events are polled with
//!   `cuEventQuery` under exponential backoff (20 µs doubling to 1 ms).
//! - **Memory a device may still target is never reused.** A copy owns its lease until
//!   the device confirms completion. If the caller stops waiting first (timeout, dropped
//!   future, dropped [`PendingCopy`]), the lease's pages are **quarantined**
//!   ([`Lease::quarantine`](crate::mem::Lease::quarantine)): counted in
//!   [`ArenaStats::quarantined_pages`](crate::mem::ArenaStats::quarantined_pages), never
//!   handed out, and released to the free list only when the device later confirms
//!   completion — or never, if it does not (or reports a fault).
//! - A copy that **fails** (the device reports the failure after it stopped touching the
//!   memory) returns its lease's pages to the arena and reports
//!   [`DeviceError::CopyFailed`].
//!
//! # Backends
//!
//! - [`HostDevice`]: device memory is host memory; copies run on the
//!   [`CopyEngine`](crate::copy::CopyEngine).
//! - [`SimDevice`]: simulated latency and bandwidth plus fault injection (an event that
//!   never completes, a copy that fails, a stream that stalls, a slow operation), per
//!   rank, with late completion ([`SimDevice::release_stuck`]).
//! - `CudaDevice` (cargo feature `cuda`): the CUDA driver API through `cudarc` with
//!   dynamic loading, so building needs no CUDA; without a driver or GPU,
//!   `CudaDevice::open` returns [`DeviceError::NoDevice`] and never panics. Pinned host
//!   memory for an arena comes from `cuda_pinned_backing` / `cuda_pinned_arena`.
//!
//! Host and sim streams run on a tokio runtime (captured when the device is created);
//! waits need a runtime with timers enabled, except the `*_blocking` variants.
//!
//! # Cancellation
//!
//! Every future in this layer may be dropped at any time. Dropping a wait (or a
//! [`PendingCopy`] / [`AsyncOutput`] that was never awaited) does not cancel the device
//! work and never frees memory under it: a pending copy's lease is quarantined and
//! released once the device completes the copy. Dropping an [`Event`] has no effect on
//! the operation.

mod buffer;
mod cache_ref;
#[cfg(feature = "cuda")]
mod cuda;
mod event;
mod executor;
mod host;
mod kv_cache;
mod output;
mod pending;
mod shm;
mod sim;
mod stream;

pub use buffer::{BufferBackend, DeviceBuffer, DeviceSlice};
pub use cache_ref::KvCacheRef;
#[cfg(feature = "cuda")]
pub use cuda::{
    cuda_device_count, cuda_pinned_arena, cuda_pinned_backing, on_raw_event_complete, query_raw_event,
    raw_event_watch_stats, CudaDevice, CUDA_IPC, MAX_BUSY_WATCH_STREAMS,
};
pub use event::{
    BoxFuture, Event, EventId, EventMeta, EventSignal, EventStatus, EventTrigger, PushSignal, SettleCallback,
};
pub use host::HostDevice;
pub use kv_cache::{CacheExport, DeviceKvCache, MAX_STREAMS as KV_CACHE_MAX_STREAMS};
pub use output::{AsyncOutput, OutputBytes};
pub use pending::{HostPages, PendingCopy};
pub use shm::{ShmError, ShmHandle};
pub use sim::{Fault, FaultRule, SimConfig, SimDevice, Trigger, SIM_IPC};
pub use stream::{
    CopyDirection, CopyOp, CopyPart, D2dOp, D2dSegment, GatherSegment, ScatterSegment, Stream, StreamBackend,
};

use std::time::Duration;

use crate::copy::CopyError;
use crate::mem::MemError;

/// Errors from the device layer.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No usable device: no driver library, no GPU, or the ordinal does not exist.
    #[error("no device: {0}")]
    NoDevice(String),
    /// The operation did not complete by its deadline. Memory it targets is quarantined.
    #[error("device operation {op:?} on rank {rank} timed out after {waited:?}")]
    Timeout {
        /// The operation that did not complete.
        op: String,
        /// The rank whose device runs it.
        rank: u32,
        /// Time since the operation was submitted.
        waited: Duration,
    },
    /// The operation (a copy, or the work before a recorded event) failed; the device no
    /// longer touches its memory.
    #[error("device operation {op:?} on rank {rank} failed: {message}")]
    CopyFailed {
        /// The operation that failed.
        op: String,
        /// The rank whose device ran it.
        rank: u32,
        /// What the device reported.
        message: String,
    },
    /// The device reported a fault after which the state of in-flight work is unknown;
    /// memory targeted by that work stays quarantined.
    #[error("device fault: {0}")]
    Fault(String),
    /// A bad argument: out-of-range offsets, a zero timeout, a buffer of another device.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The device could not allocate the requested memory.
    #[error("device out of memory: requested {requested} bytes ({detail})")]
    OutOfMemory {
        /// Bytes requested.
        requested: usize,
        /// What the device said (or the configured limit).
        detail: String,
    },
    /// The stream's executor is gone (its runtime shut down); nothing was submitted.
    #[error("stream {0:?} is closed")]
    Closed(String),
    /// An error from the memory layer.
    #[error(transparent)]
    Mem(#[from] MemError),
    /// An error from the copy engine.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// A driver call failed.
    #[error("driver error: {0}")]
    Driver(String),
}

impl DeviceError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            DeviceError::NoDevice(_) | DeviceError::Driver(_) => C::NoDevice,
            DeviceError::Timeout { .. } | DeviceError::CopyFailed { .. } | DeviceError::Fault(_) => C::Device,
            DeviceError::InvalidArgument(_) => C::InvalidArgument,
            DeviceError::OutOfMemory { .. } => C::DeviceOutOfMemory,
            DeviceError::Closed(_) => C::Closed,
            DeviceError::Mem(e) => e.code(),
            DeviceError::Copy(e) => e.code(),
        }
    }
}

/// Which backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum DeviceKind {
    /// Host memory standing in for device memory; copies on the copy engine.
    Host,
    /// Simulated device with latency, bandwidth and fault injection.
    Sim,
    /// A CUDA GPU.
    Cuda,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Host => "host",
            DeviceKind::Sim => "sim",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// An accelerator: allocates device buffers and creates streams. Implemented by
/// [`HostDevice`], [`SimDevice`] and (feature `cuda`) `CudaDevice`; usable as
/// `Arc<dyn Device>`.
pub trait Device: Send + Sync + std::fmt::Debug + 'static {
    /// The backend.
    fn kind(&self) -> DeviceKind;

    /// The rank this device serves (named in errors).
    fn rank(&self) -> u32;

    /// A process-unique id; buffers and events of one device are rejected by another.
    fn id(&self) -> u64;

    /// A human-readable name (e.g. the GPU model).
    fn name(&self) -> String;

    /// Allocates `len` bytes of device memory (zeroed on host and sim).
    fn alloc(&self, len: usize) -> Result<DeviceBuffer, DeviceError>;

    /// Creates a stream: an ordered queue of device work.
    fn create_stream(&self, name: &str) -> Result<Stream, DeviceError>;

    /// The kind of device IPC this device's exported memory speaks (`"sim-shm"`,
    /// `"cuda-ipc"`), `None` when it exports none. Two devices exchange memory only
    /// when their kinds are equal.
    fn ipc_kind(&self) -> Option<&'static str> {
        None
    }

    /// Opens memory another process of this host exported
    /// ([`DeviceBuffer::export_handle`]) as a read-only buffer of this device, usable
    /// as the source of [`Stream::copy_d2d`]. The import is closed when the returned
    /// buffer and every copy reading it are gone.
    fn open_ipc(&self, handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        let _ = handle;
        Err(DeviceError::InvalidArgument(format!(
            "{} cannot open memory of another process",
            self.name()
        )))
    }
}

/// Rejects a zero timeout (a deadline already past at submission is instead allowed and
/// times out at once).
pub(crate) fn check_timeout(timeout: Duration, what: &str) -> Result<(), DeviceError> {
    if timeout.is_zero() {
        return Err(DeviceError::InvalidArgument(format!(
            "{what}: timeout must be greater than zero"
        )));
    }
    Ok(())
}

/// A process-unique device id.
pub(crate) fn next_device_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
