//! [`EngineError`]: errors of the engine's own (non-transfer) operations — start,
//! registration, publication, the store — each with its stable
//! [`ErrorCode`](crate::ErrorCode). Transfers fail with [`PeerError`] in a
//! [`GetFailure`](crate::peer::GetFailure) instead.

use std::time::Duration;

use crate::layout::LayoutError;
use crate::mem::MemError;
use crate::peer::PeerError;

/// Errors of the engine's own (non-transfer) operations.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A setting is unusable; the message names it.
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The engine is closed.
    #[error("engine is closed")]
    Closed,
    /// A registered cache is still used by transfers or publications.
    #[error("{name} is still in use by {holders} transfer(s) or publication(s) after {waited:?}")]
    InUse {
        /// The cache.
        name: String,
        /// Holders other than the caller.
        holders: usize,
        /// How long deregistration waited.
        waited: Duration,
    },
    /// The cache is not registered with this engine.
    #[error("{0} is not registered with this engine")]
    NotRegistered(String),
    /// Memory problem (arena, region).
    #[error(transparent)]
    Mem(#[from] MemError),
    /// Layout problem.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Producer or consumer problem.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// The peer directory refused or failed (e.g. the peer id is held by another
    /// live process).
    #[error(transparent)]
    Directory(#[from] crate::directory::DirectoryError),
}

impl EngineError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            EngineError::InvalidConfig(_) => C::InvalidConfig,
            EngineError::Bind { .. } => C::BindFailed,
            EngineError::Closed => C::Closed,
            EngineError::InUse { .. } => C::InUse,
            EngineError::NotRegistered(_) => C::NotRegistered,
            EngineError::Mem(e) => e.code(),
            EngineError::Layout(e) => e.code(),
            EngineError::Peer(e) => e.code(),
            EngineError::Directory(e) => e.code(),
        }
    }
}
