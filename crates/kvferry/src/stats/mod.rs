//! Counters that lower layers keep and exporters read: a lock-free latency
//! [`Histogram`] and the [`RequestStats`] of a server.
//!
//! This is a leaf module (it imports nothing else from the crate), so `peer`, `cluster`
//! and the rest may use it; the `metrics` module sits above them and encodes what these
//! types hold. Nothing here knows any exposition format.

mod histogram;
mod requests;

pub use histogram::{Histogram, HistogramSnapshot, LATENCY_BUCKETS};
pub use requests::{RequestCount, RequestKind, RequestOutcome, RequestStats};

/// Errors of the stats module.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    /// Histogram bucket bounds are unusable.
    #[error("invalid histogram buckets: {0}")]
    InvalidBuckets(String),
}

impl StatsError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            StatsError::InvalidBuckets(_) => C::InvalidArgument,
        }
    }
}
