//! Stable, machine-readable error codes.
//!
//! Every error type of the crate has a `code()` that names what went wrong as an
//! [`ErrorCode`]: a closed set whose string forms ([`ErrorCode::as_str`]) are part of
//! the public interface and never change meaning. Messages are for people and may be
//! reworded; programs (and tests) match codes. The Python package raises one
//! exception class per family of codes and puts the code on the exception's `code`
//! attribute.
//!
//! New codes are added at the end of [`ErrorCode::ALL`]; a code is never renamed or
//! reused for another meaning. The enum is deliberately exhaustive: the Python binding
//! maps every code to an exception class with a `match`, so a new code does not
//! compile until it has one.

use std::fmt;

/// What went wrong, as a stable code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// An argument is unusable.
    InvalidArgument,
    /// A configuration value is unusable.
    InvalidConfig,
    /// A layout, block id or destination does not fit what it is used with.
    LayoutMismatch,
    /// Something is larger than a limit allows.
    TooLarge,
    /// The operation did not finish within its deadline.
    Timeout,
    /// The caller cancelled the operation.
    Cancelled,
    /// The peer closed, reset or went away mid-operation.
    PeerLost,
    /// The peer could not be reached (connect failed).
    ConnectFailed,
    /// The peer is shutting down.
    PeerShuttingDown,
    /// The peer restarted (a new incarnation) since the handle or transfer began.
    PeerRestarted,
    /// A reference names an earlier incarnation of the peer.
    StaleIncarnation,
    /// The peer at an address is not the one the directory names.
    WrongPeer,
    /// A staged lease expired, or was too close to expiry to pull.
    LeaseExpired,
    /// The peer knows no such lease.
    UnknownLease,
    /// The shared secret did not verify.
    AuthFailed,
    /// The peer requires a shared secret this side did not offer.
    AuthRequired,
    /// The peer is too busy right now (concurrency or connection limits).
    Busy,
    /// Not enough staging pages for the request.
    StagingExhausted,
    /// A peer's share of the staging arena is used up.
    QuotaExceeded,
    /// The chunk store has no room.
    StoreFull,
    /// The peer holds none of the keys asked for.
    NotFound,
    /// Received bytes did not match their checksum.
    ChecksumMismatch,
    /// A region or cache is still in use by transfers or publications.
    InUse,
    /// The engine, producer or consumer is closed.
    Closed,
    /// The region or cache was never registered (or already deregistered).
    NotRegistered,
    /// A device copy failed, or did not complete within its bound.
    Device,
    /// No device (or no driver) of the kind asked for.
    NoDevice,
    /// Device memory could not be allocated.
    DeviceOutOfMemory,
    /// The peer broke the protocol (a malformed or unexpected message).
    Protocol,
    /// An operating-system I/O error.
    Io,
    /// Binding a listening socket failed.
    BindFailed,
    /// The peer directory (etcd) failed or refused.
    Directory,
    /// Another live process holds the peer id.
    DuplicatePeerId,
    /// Host memory (arena, pinned backing) could not be provided.
    Memory,
    /// A bug: a state that should be impossible.
    Internal,
    /// A rank of a cluster step failed (reported by the rank).
    RankFailed,
    /// A worker process died or never started.
    WorkerDied,
    /// A selection (partial get) does not fit the publication or the destination.
    Selection,
}

impl ErrorCode {
    /// Every code, in a fixed order (new codes go at the end).
    pub const ALL: [ErrorCode; 38] = [
        ErrorCode::InvalidArgument,
        ErrorCode::InvalidConfig,
        ErrorCode::LayoutMismatch,
        ErrorCode::TooLarge,
        ErrorCode::Timeout,
        ErrorCode::Cancelled,
        ErrorCode::PeerLost,
        ErrorCode::ConnectFailed,
        ErrorCode::PeerShuttingDown,
        ErrorCode::PeerRestarted,
        ErrorCode::StaleIncarnation,
        ErrorCode::WrongPeer,
        ErrorCode::LeaseExpired,
        ErrorCode::UnknownLease,
        ErrorCode::AuthFailed,
        ErrorCode::AuthRequired,
        ErrorCode::Busy,
        ErrorCode::StagingExhausted,
        ErrorCode::QuotaExceeded,
        ErrorCode::StoreFull,
        ErrorCode::NotFound,
        ErrorCode::ChecksumMismatch,
        ErrorCode::InUse,
        ErrorCode::Closed,
        ErrorCode::NotRegistered,
        ErrorCode::Device,
        ErrorCode::NoDevice,
        ErrorCode::DeviceOutOfMemory,
        ErrorCode::Protocol,
        ErrorCode::Io,
        ErrorCode::BindFailed,
        ErrorCode::Directory,
        ErrorCode::DuplicatePeerId,
        ErrorCode::Memory,
        ErrorCode::Internal,
        ErrorCode::RankFailed,
        ErrorCode::WorkerDied,
        ErrorCode::Selection,
    ];

    /// The code's stable string form (snake case), e.g. `"timeout"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::InvalidConfig => "invalid_config",
            ErrorCode::LayoutMismatch => "layout_mismatch",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::PeerLost => "peer_lost",
            ErrorCode::ConnectFailed => "connect_failed",
            ErrorCode::PeerShuttingDown => "peer_shutting_down",
            ErrorCode::PeerRestarted => "peer_restarted",
            ErrorCode::StaleIncarnation => "stale_incarnation",
            ErrorCode::WrongPeer => "wrong_peer",
            ErrorCode::LeaseExpired => "lease_expired",
            ErrorCode::UnknownLease => "unknown_lease",
            ErrorCode::AuthFailed => "auth_failed",
            ErrorCode::AuthRequired => "auth_required",
            ErrorCode::Busy => "busy",
            ErrorCode::StagingExhausted => "staging_exhausted",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::StoreFull => "store_full",
            ErrorCode::NotFound => "not_found",
            ErrorCode::ChecksumMismatch => "checksum_mismatch",
            ErrorCode::InUse => "in_use",
            ErrorCode::Closed => "closed",
            ErrorCode::NotRegistered => "not_registered",
            ErrorCode::Device => "device",
            ErrorCode::NoDevice => "no_device",
            ErrorCode::DeviceOutOfMemory => "device_out_of_memory",
            ErrorCode::Protocol => "protocol",
            ErrorCode::Io => "io",
            ErrorCode::BindFailed => "bind_failed",
            ErrorCode::Directory => "directory",
            ErrorCode::DuplicatePeerId => "duplicate_peer_id",
            ErrorCode::Memory => "memory",
            ErrorCode::Internal => "internal",
            ErrorCode::RankFailed => "rank_failed",
            ErrorCode::WorkerDied => "worker_died",
            ErrorCode::Selection => "selection",
        }
    }

    /// The code whose string form is `s`.
    pub fn parse(s: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_a_distinct_string_that_parses_back() {
        let mut seen = std::collections::HashSet::new();
        for c in ErrorCode::ALL {
            assert!(seen.insert(c.as_str()), "{c:?} repeats {}", c.as_str());
            assert_eq!(ErrorCode::parse(c.as_str()), Some(c));
            assert!(c.as_str().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'));
        }
        assert_eq!(ErrorCode::parse("no such code"), None);
    }
}
