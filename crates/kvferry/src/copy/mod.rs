//! The copy engine: dedicated copy threads that execute [`CopyPlan`]s — scatter and
//! gather between arena [`Lease`](crate::mem::Lease)s and registered
//! [`Region`](crate::mem::Region)s — cut into slices of similar byte size.
//!
//! # Semantics
//!
//! [`CopyEngine::copy`] takes the plan **by value**: the plan owns its source and
//! destination (a lease, or an `Arc` of a region) for as long as any copy thread may
//! touch them. The returned [`CopyJob`] is a future that resolves to the plan (handing
//! the memory back) or to a [`CopyFailure`] that also hands it back.
//!
//! - A failing slice stops unstarted slices from starting; the error is reported only
//!   once every started slice has stopped.
//! - Completion is observed through a waker; no thread is parked per in-flight copy.
//!
//! # Cancellation
//!
//! Dropping a [`CopyJob`] cancels it without blocking: slices not yet started are
//! skipped, slices already running finish, and **only then** is the plan dropped — its
//! lease pages return to the arena after the last copy thread has left the job.
//! Dropping again (a second `cancel` future, a timeout around it) changes nothing: the
//! memory is owned by the job, not by any future. [`CopyJob::cancel`] is for callers
//! that must know the drain finished: it resolves only after it, and hands the plan
//! back. A [`DrainFence`] lets anyone else wait for the same instant.

mod engine;
mod job;
mod ledger;
mod plan;
mod remote;
mod stage;

pub use engine::{CopyBody, CopyConfig, CopyEngine, CopyStats, MemcpyBody, SliceWork};
pub use job::{CopyFailure, CopyJob, DrainFence, DrainSignal};
pub use plan::{CopyPlan, Endpoint, RawBuffer, Segment};
pub use remote::{read_remote, RemoteReadError, RemoteSource};
pub use stage::{stage, StageError, StagedBytes};

#[cfg(kvferry_loom)]
pub use ledger::SliceLedger;

/// Errors from the copy engine.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CopyError {
    /// The plan addresses bytes outside its source or destination, or its destination
    /// ranges overlap each other or the source.
    #[error("invalid copy plan: {0}")]
    InvalidPlan(String),
    /// The copy was cancelled before it completed (reported after the drain).
    #[error("copy cancelled")]
    Cancelled,
    /// One slice failed; its siblings were drained before this was reported.
    #[error("copy slice {slice} failed: {message}")]
    SliceFailed {
        /// Index of the failing slice.
        slice: usize,
        /// What the slice body reported.
        message: String,
    },
    /// A slice reading another process's memory failed (see [`RemoteSource`]); its
    /// siblings were drained before this was reported.
    #[error("copy slice {slice} failed: {error}")]
    RemoteRead {
        /// Index of the failing slice.
        slice: usize,
        /// What the kernel said.
        error: RemoteReadError,
    },
    /// The engine was shut down before the copy could run.
    #[error("copy engine is shut down")]
    ShutDown,
    /// The engine's configuration is unusable.
    #[error("invalid copy engine configuration: {0}")]
    InvalidConfig(String),
}

impl CopyError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            CopyError::InvalidPlan(_) => C::InvalidArgument,
            CopyError::InvalidConfig(_) => C::InvalidConfig,
            CopyError::Cancelled => C::Cancelled,
            CopyError::SliceFailed { .. } => C::Internal,
            CopyError::RemoteRead { error, .. } if error.is_refused() => C::Internal,
            CopyError::RemoteRead { .. } => C::PeerLost,
            CopyError::ShutDown => C::Closed,
        }
    }
}
