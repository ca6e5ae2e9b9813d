//! What the consumer's files share: the request a transfer task runs ([`Request`]),
//! the outcome labels of its latency histograms ([`OUTCOMES`]), a failed transfer as
//! the task reports it ([`TaskError`]), two checks of a producer's replies
//! ([`check_frames`], [`unexpected`]) and of a grant's keys ([`check_granted_keys`]),
//! the check of a request's keys
//! ([`check_keys`]) and of a landed chunk's checksum ([`verify_landed`]). Kept apart so
//! that `client`, `exchange`, `get`, `transfer`, `one_sided` and `peer_watch` do not
//! import each other in a cycle.
//!
//! Nothing here awaits.

use super::super::error::PeerError;
use super::types::{GetFailure, StagedHandle};
use crate::copy::DrainFence;
use crate::net::NetError;
use crate::wire::{ChunkKey, ChunkMeta, Message, SelectionError, WireSelection};

/// Outcome labels of the latency histograms, indexing `Inner::latency`.
pub(in crate::peer) const OUTCOMES: [&str; 3] = ["completed", "failed", "cancelled"];

pub(in crate::peer) enum Request {
    /// An eager get; with a selection, its wire form (checked against the
    /// destination).
    Get {
        keys: Vec<ChunkKey>,
        select: Option<WireSelection>,
    },
    Pull {
        handle: StagedHandle,
    },
}

/// A failed transfer as the task reports it (the caller adds the fence).
#[derive(Debug)]
pub(crate) struct TaskError {
    /// What went wrong.
    pub error: PeerError,
    /// Whether destination bytes may have been written.
    pub dirty: bool,
}

impl TaskError {
    pub(in crate::peer) fn with_fence(self, fence: DrainFence) -> GetFailure {
        GetFailure {
            error: self.error,
            fence,
            dirty: self.dirty,
        }
    }
}

/// The frames a producer announced for a selected stream: their lengths add up to
/// the stream's shape.
pub(in crate::peer) fn check_frames(chunks: &[crate::wire::ChunkMeta], total: u64) -> Result<(), SelectionError> {
    let sum = chunks.iter().fold(0u64, |a, c| a.saturating_add(c.len));
    if sum != total {
        return Err(SelectionError::Stream(format!(
            "frames of {sum} bytes announced for a stream of {total}"
        )));
    }
    Ok(())
}

/// A reply of the wrong kind, named without dumping its (possibly huge) contents.
pub(in crate::peer) fn unexpected(expected: &'static str, got: &Message) -> PeerError {
    PeerError::Net(NetError::Unexpected {
        expected,
        got: got.name(),
    })
}

/// A request's keys: at least one, and no more than a peer accepts in one request
/// (`max_keys`, the transport's limit, which peers share by default): refused here with
/// a clear error rather than by the peer closing the connection.
pub(in crate::peer) fn check_keys(keys: &[ChunkKey], max_keys: usize) -> Result<(), PeerError> {
    if keys.is_empty() {
        return Err(PeerError::InvalidArgument("empty key list".into()));
    }
    if keys.len() > max_keys {
        return Err(PeerError::InvalidArgument(format!(
            "{} keys in one request; at most {max_keys} (split the request or raise the limit)",
            keys.len()
        )));
    }
    Ok(())
}

/// A landed chunk's bytes (`actual`: their checksum) are the ones the producer
/// published (every mover checks this before a chunk counts as landed).
pub(in crate::peer) fn verify_landed(meta: &crate::wire::ChunkMeta, actual: u32) -> Result<(), PeerError> {
    if actual != meta.checksum {
        return Err(PeerError::ChecksumMismatch {
            key: meta.key,
            expected: meta.checksum,
            actual,
        });
    }
    Ok(())
}

/// A producer's grant (a socket `Staged` or a one-sided mover's) names the requested
/// keys, in order (a selected stream's frames are checked by its landing plan instead).
pub(in crate::peer) fn check_granted_keys(chunks: &[ChunkMeta], keys: &[ChunkKey]) -> Result<(), PeerError> {
    if chunks.len() > keys.len() || chunks.iter().zip(keys).any(|(c, k)| c.key != *k) {
        return Err(PeerError::Net(NetError::Protocol(
            "staged chunks do not match the keys".to_string(),
        )));
    }
    Ok(())
}
