//! Failing a peer's transfers at once when the directory says it is gone.
//!
//! Each peer address has a [`PeerWatch`]: a cancellation token whose children are the
//! tokens of that peer's transfers, and the reason it was cancelled. When the
//! directory announces that the peer restarted (a new incarnation) or left (its lease
//! expired), [`Consumer::fail_peer`](super::Consumer::fail_peer) records the reason,
//! cancels the token — every transfer to the peer stops and drains exactly as a
//! caller's cancellation would — forgets the pool's idle connections, and installs a
//! fresh watch for transfers started afterwards. Their errors read `PeerRestarted` or
//! `PeerLost`, not `Cancelled`.
//!
//! # Cancellation
//!
//! [`PeerWatch::race`] drops the raced future when the peer is declared gone: only
//! used for requests that own no memory (lookups, stages, pushes, releases).

use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio_util::sync::CancellationToken;

use super::super::error::PeerError;
use super::shared::TaskError;

/// Why a peer is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerGone {
    /// It re-registered with a new incarnation.
    Restarted {
        /// The incarnation transfers were running against.
        old: u64,
        /// The new one.
        new: u64,
    },
    /// It left the directory.
    Lost {
        /// Why (e.g. "lease expired").
        reason: String,
    },
}

pub(crate) struct PeerWatch {
    addr: String,
    token: CancellationToken,
    gone: OnceLock<PeerGone>,
}

impl PeerWatch {
    pub(super) fn new(addr: &str) -> PeerWatch {
        PeerWatch {
            addr: addr.to_string(),
            token: CancellationToken::new(),
            gone: OnceLock::new(),
        }
    }

    /// Declares the peer gone: records why (the first reason wins) and cancels the
    /// token, failing every transfer and request raced against it.
    pub(super) fn declare_gone(&self, gone: PeerGone) {
        let _ = self.gone.set(gone);
        self.token.cancel();
    }

    /// A token cancelled when the peer is declared gone (or when cancelled itself).
    pub(super) fn child_token(&self) -> CancellationToken {
        self.token.child_token()
    }

    /// The error for a transfer stopped because the peer is gone, if it is.
    fn error(&self) -> Option<PeerError> {
        self.gone.get().map(|g| match g {
            PeerGone::Restarted { old, new } => PeerError::PeerRestarted {
                peer: self.addr.clone(),
                old: *old,
                new: *new,
            },
            PeerGone::Lost { reason } => PeerError::PeerLost {
                peer: self.addr.clone(),
                reason: reason.clone(),
            },
        })
    }

    /// A transfer's `Cancelled` becomes the reason the peer is gone, when it is.
    pub(super) fn explain(&self, e: TaskError) -> TaskError {
        match (&e.error, self.error()) {
            (PeerError::Cancelled, Some(error)) => TaskError { error, dirty: e.dirty },
            _ => e,
        }
    }

    /// Runs `fut`, or fails it as soon as the peer is declared gone.
    pub(super) async fn race<T>(
        self: Arc<Self>,
        fut: impl Future<Output = Result<T, PeerError>>,
    ) -> Result<T, PeerError> {
        tokio::select! {
            r = fut => r,
            _ = self.token.cancelled() => Err(self.error().unwrap_or(PeerError::Cancelled)),
        }
    }
}
