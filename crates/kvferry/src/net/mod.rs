//! TCP transport: connection set-up with bounded timeouts, the handshake (peer id,
//! incarnation, optional HMAC challenge-response in which the client proves first),
//! framed requests over a [`Connection`] (I/O timeouts are progress timeouts),
//! per-peer connection [`Pool`]s, and the accepting [`Server`] (a small budget of
//! handshaking connections, a cap on authenticated ones, and a per-address limit on
//! failed authentications). Optionally over mutual TLS ([`TlsConfig`]), which
//! encrypts the wire and authenticates peers by certificate.
//!
//! # Ownership of bytes in flight
//!
//! A socket write borrows the pages it sends from a lease that the sending task owns,
//! so the pages cannot return to the arena before the write has finished or the
//! connection (and with it the write future) has been torn down. Reads land in pages
//! owned the same way; a dropped read stops writing into them at once.
//!
//! # Cancellation
//!
//! A [`Connection`] whose request future is dropped mid-frame is out of sync: it is not
//! returned to its pool (only [`PooledConnection::finish`] returns it), so it is closed.

mod admission;
mod config;
mod conn;
mod handshake;
mod pool;
mod progress;
mod server;
mod stream;
mod tls;

pub use config::NetConfig;
pub use conn::Connection;
pub use handshake::PeerInfo;
pub use pool::{Pool, PoolStats, PooledConnection};
pub use server::{Handler, Server, ServerStats};
pub use tls::{TlsConfig, TlsError};

use std::time::Duration;

use crate::wire::{ErrorKind, WireError};

/// Errors from the transport.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A setting is unusable (zero timeout, zero connections…).
    #[error("invalid network configuration: {0}")]
    InvalidConfig(String),
    /// Could not connect within the connect timeout, or the connection was refused.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The peer address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// An operation did not finish within its bound.
    #[error("{op} timed out after {waited:?}")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// The peer closed or reset the connection, or it broke.
    #[error("connection to {peer} lost: {reason}")]
    Lost {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The handshake failed authentication (wrong or missing secret).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The peer answered with an error message.
    #[error("peer error {kind:?}: {message}")]
    Remote {
        /// The error's kind.
        kind: ErrorKind,
        /// The peer's message.
        message: String,
    },
    /// The peer sent something that is not valid at this point of the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The peer answered with a message of the wrong kind (named, not dumped: a reply
    /// may carry thousands of entries).
    #[error("protocol violation: expected {expected}, got {got}")]
    Unexpected {
        /// The message kind expected.
        expected: &'static str,
        /// The message kind received.
        got: &'static str,
    },
    /// The peer that answered is not the one the directory's record names (another
    /// peer id or incarnation at that address: a stale or forged record).
    #[error("{addr} answered as {got_id} (incarnation {got_incarnation:#x}), not as {expected_id} (incarnation {expected_incarnation:#x}) named by the directory; refusing it")]
    WrongPeer {
        /// The address dialled.
        addr: String,
        /// The peer id the record names.
        expected_id: String,
        /// The incarnation the record names.
        expected_incarnation: u64,
        /// The peer id presented in the handshake.
        got_id: String,
        /// The incarnation presented in the handshake.
        got_incarnation: u64,
    },
    /// A frame could not be read or written.
    #[error(transparent)]
    Wire(#[from] WireError),
}

impl NetError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            NetError::InvalidConfig(_) => C::InvalidConfig,
            NetError::Connect { .. } => C::ConnectFailed,
            NetError::Timeout { .. } => C::Timeout,
            NetError::Lost { .. } => C::PeerLost,
            NetError::Auth(_) => C::AuthFailed,
            NetError::Remote { kind, .. } => kind.code(),
            NetError::Protocol(_) | NetError::Unexpected { .. } => C::Protocol,
            NetError::WrongPeer { .. } => C::WrongPeer,
            NetError::Wire(e) => e.code(),
        }
    }
}

impl NetError {
    /// True when the server this client dialled failed to prove the shared secret,
    /// after this client had proved it: whatever answers there is not a holder of the
    /// secret. (A server that refused this client's proof — another secret there, a
    /// rejected certificate — is not proven wrong by that: false.)
    pub fn server_unproven(&self) -> bool {
        matches!(self, NetError::Auth(m) if m.contains(handshake::SERVER_UNPROVEN))
    }

    /// True when the connection can no longer be used (lost, broken frame, timeout).
    pub fn is_connection_fatal(&self) -> bool {
        !matches!(self, NetError::Remote { .. })
    }
}
