//! Staging: gather byte ranges of engine memory into freshly leased arena pages.
//!
//! `stage` allocates the pages (waiting until the deadline in the arena's FIFO queue),
//! gathers the ranges into them, contiguous and in order, and only then hands the
//! lease to the caller — who may advertise it (copy before advertise).
//!
//! # Cancellation
//!
//! Dropping the future before the pages are allocated leaves the arena queue; dropping
//! it during the gather cancels the copy: the lease is owned by the copy job, and its
//! pages return to the arena only after every started slice has stopped. A failed
//! gather returns the pages the same way.

use tokio::time::Instant;

use crate::mem::{Arena, Lease, MemError};

use super::{CopyEngine, CopyError, CopyPlan, Endpoint};

/// Why staging failed. The pages are back in the arena when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// No pages (timeout, arena too small, closed).
    #[error("staging allocation failed: {0}")]
    Alloc(#[from] MemError),
    /// The gather failed or was cancelled; reported after the drain.
    #[error("staging copy failed: {0}")]
    Copy(#[from] CopyError),
}

impl StageError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        match self {
            StageError::Alloc(e) => e.code(),
            StageError::Copy(e) => e.code(),
        }
    }
}

/// Staged bytes: the lease holding them and the source handed back (not the wire
/// reply `Message::Staged`, which announces a lease to a consumer).
#[derive(Debug)]
pub struct StagedBytes {
    /// Arena pages holding the ranges back to back from offset 0.
    pub lease: Lease,
    /// The source endpoint, handed back.
    pub src: Endpoint,
    /// Bytes staged.
    pub bytes: usize,
}

/// Gathers `ranges` (`(offset, len)` in `src`) into new arena pages.
pub async fn stage(
    engine: &CopyEngine,
    arena: &Arena,
    src: impl Into<Endpoint>,
    ranges: &[(usize, usize)],
    deadline: Instant,
) -> Result<StagedBytes, StageError> {
    let bytes: usize = ranges.iter().map(|r| r.1).sum();
    let lease = arena.alloc(arena.pages_for(bytes), deadline).await?;
    let mut plan = CopyPlan::new(src, lease);
    let mut at = 0;
    for &(off, len) in ranges {
        plan.push(off, at, len);
        at += len;
    }
    match engine.copy(plan).await {
        Ok(plan) => {
            let (src, dst) = plan.into_parts();
            let lease = dst.into_lease().expect("destination is the lease we built");
            Ok(StagedBytes { lease, src, bytes })
        }
        // Dropping the failure's plan returns the pages; the job has drained.
        Err(failure) => Err(StageError::Copy(failure.error)),
    }
}
