//! [`PeerError`]: the errors of producers and consumers, and their stable codes
//! ([`PeerError::code`]). Transport errors convert into the peer errors callers know
//! (a lost connection is `PeerLost`, a peer shutting down is `ShuttingDown`).

use std::time::Duration;

use crate::copy::CopyError;
use crate::layout::LayoutError;
use crate::mem::MemError;
use crate::net::NetError;
use crate::wire::{ChunkKey, ErrorKind};

/// Errors from producers and consumers.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// An argument is unusable (zero timeout, empty key list, mismatched destination…).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The operation did not finish by its deadline; in-flight work is cancelled and
    /// drained in the background.
    #[error("{op} timed out after {waited:?}")]
    Timeout {
        /// What timed out.
        op: &'static str,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The caller cancelled the operation.
    #[error("cancelled")]
    Cancelled,
    /// The peer closed, reset or could not be reached.
    #[error("peer {peer} lost: {reason}")]
    PeerLost {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The peer re-registered in the directory with a new incarnation: everything in
    /// flight with (or staged on) the old one is gone.
    #[error("peer {peer} restarted: incarnation {old:#x} replaced by {new:#x}")]
    PeerRestarted {
        /// The peer (its address).
        peer: String,
        /// The incarnation the transfer was running against.
        old: u64,
        /// The new incarnation.
        new: u64,
    },
    /// A staged lease has (or would have, within the guard margin) expired.
    #[error("lease {lease_id} expired or too close to expiry ({remaining:?} left)")]
    LeaseExpired {
        /// The lease.
        lease_id: crate::wire::LeaseId,
        /// Time left when refused (zero if already expired).
        remaining: Duration,
    },
    /// A reference to an earlier incarnation of a restarted peer.
    #[error("stale incarnation: handle is for incarnation {handle:#x}, peer is now {current:#x}")]
    StaleIncarnation {
        /// The incarnation the handle names.
        handle: u64,
        /// The peer's current incarnation.
        current: u64,
    },
    /// The peer refused the request.
    #[error("peer refused: {kind:?}: {message}")]
    Remote {
        /// Why.
        kind: ErrorKind,
        /// The peer's message.
        message: String,
    },
    /// Not enough staging pages for the whole request: a miss.
    #[error("staging arena exhausted: need {needed} pages, {free} free")]
    StagingExhausted {
        /// Pages needed.
        needed: usize,
        /// Pages free.
        free: usize,
    },
    /// A device copy (gather of published device blocks, or landing into a device
    /// cache) failed or did not complete in time; its staging pages are quarantined
    /// until the device confirms.
    #[error("device KV cache {cache}: {error}")]
    Device {
        /// The cache.
        cache: String,
        /// What the device layer reported (names the operation and rank).
        error: crate::device::DeviceError,
    },
    /// The peer already holds its share of the staging arena.
    #[error("staging quota of {peer} exceeded: holds {held} pages, asked {asked}, quota {quota}")]
    QuotaExceeded {
        /// The peer.
        peer: String,
        /// Pages it holds.
        held: usize,
        /// Pages asked for.
        asked: usize,
        /// Its quota.
        quota: usize,
    },
    /// No room in the store for a chunk.
    #[error("chunk store full: need {needed} blocks, {free} free")]
    StoreFull {
        /// Blocks needed.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// A chunk's bytes did not match its checksum; nothing was landed.
    #[error("checksum mismatch on chunk {key}: expected {expected:#010x}, got {actual:#010x}")]
    ChecksumMismatch {
        /// The chunk.
        key: ChunkKey,
        /// The checksum advertised at staging.
        expected: u32,
        /// The checksum of the bytes received.
        actual: u32,
    },
    /// Layout problem.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Memory problem.
    #[error(transparent)]
    Mem(#[from] MemError),
    /// Copy problem.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// Transport problem not covered above.
    #[error(transparent)]
    Net(NetError),
    /// The producer or consumer is shutting down.
    #[error("shutting down")]
    ShuttingDown,
    /// A selection (partial get) does not fit the publication or the destination.
    #[error("selection does not fit: {0}")]
    Selection(#[from] crate::wire::SelectionError),
}

impl PeerError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            PeerError::InvalidArgument(_) => C::InvalidArgument,
            PeerError::Timeout { .. } => C::Timeout,
            PeerError::Cancelled => C::Cancelled,
            PeerError::PeerLost { .. } => C::PeerLost,
            PeerError::PeerRestarted { .. } => C::PeerRestarted,
            PeerError::LeaseExpired { .. } => C::LeaseExpired,
            PeerError::StaleIncarnation { .. } => C::StaleIncarnation,
            PeerError::Remote { kind, .. } => kind.code(),
            PeerError::StagingExhausted { .. } => C::StagingExhausted,
            PeerError::Device { error, .. } => error.code(),
            PeerError::QuotaExceeded { .. } => C::QuotaExceeded,
            PeerError::StoreFull { .. } => C::StoreFull,
            PeerError::ChecksumMismatch { .. } => C::ChecksumMismatch,
            PeerError::Layout(e) => e.code(),
            PeerError::Mem(e) => e.code(),
            PeerError::Copy(e) => e.code(),
            PeerError::Net(e) => e.code(),
            PeerError::ShuttingDown => C::Closed,
            PeerError::Selection(_) => C::Selection,
        }
    }
}

impl From<NetError> for PeerError {
    fn from(e: NetError) -> Self {
        match e {
            NetError::Lost { peer, reason } => PeerError::PeerLost { peer, reason },
            NetError::Connect { addr, reason } => PeerError::PeerLost { peer: addr, reason },
            NetError::Timeout { op, waited } => PeerError::Timeout { op, waited },
            NetError::Remote {
                kind: ErrorKind::ShuttingDown,
                ..
            } => PeerError::ShuttingDown,
            NetError::Remote { kind, message } => PeerError::Remote { kind, message },
            other => PeerError::Net(other),
        }
    }
}
