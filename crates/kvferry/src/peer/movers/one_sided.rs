//! What every one-sided mover (CMA's `process_vm_readv`, device IPC) does around its
//! reads, in one place: check the grant against the request, check each chunk fits its
//! destination blocks, verify each landed chunk against the producer's checksum, count
//! the transfer, and release the producer's lease with `Done` once every byte is in
//! place and verified.
//!
//! # Cancellation
//!
//! [`TransferCtx::done_after_landing`] awaits one request on the transfer's
//! connection (see [`TransferCtx::release_on`]). Dropped mid-request, the lease stays
//! in `lease_to_release` or is already released: either way the producer's grace or
//! TTL ends it, never a read (every read has returned before this is called).

use std::sync::atomic::{AtomicU64, Ordering};

use super::Carried;
use crate::net::PooledConnection;
use crate::peer::consumer::client::Counters;
pub(in crate::peer) use crate::peer::consumer::shared::{check_granted_keys, verify_landed};
use crate::peer::consumer::transfer::TransferCtx;
use crate::peer::error::PeerError;
use crate::wire::ChunkMeta;

/// A granted chunk fits the destination blocks it lands in (`cap` bytes).
pub(in crate::peer) fn check_fits(meta: &ChunkMeta, cap: usize) -> Result<(), PeerError> {
    if meta.len as usize > cap {
        return Err(PeerError::InvalidArgument(format!(
            "chunk {} is {} bytes but its destination blocks hold {cap}",
            meta.key, meta.len
        )));
    }
    Ok(())
}

/// Counts a one-sided transfer of `chunks` (`total` bytes) in the consumer's counters
/// and in the mover's own (`transfers`, `bytes`).
pub(in crate::peer) fn count_landed(
    counters: &Counters,
    transfers: &AtomicU64,
    bytes: &AtomicU64,
    chunks: &[ChunkMeta],
) {
    let total: u64 = chunks.iter().map(|c| c.len).sum();
    transfers.fetch_add(1, Ordering::Relaxed);
    bytes.fetch_add(total, Ordering::Relaxed);
    counters.bytes_received.fetch_add(total, Ordering::Relaxed);
    counters
        .chunks_received
        .fetch_add(chunks.len() as u64, Ordering::Relaxed);
}

impl TransferCtx<'_> {
    /// Every byte of `chunks` is in place and verified: release the producer's lease
    /// with `Done` on the same connection, as the socket receive does
    /// ([`TransferCtx::release_on`]).
    pub(in crate::peer) async fn done_after_landing(
        &mut self,
        conn: &mut PooledConnection,
        chunks: Vec<ChunkMeta>,
    ) -> Result<Carried, PeerError> {
        let reuse = self.release_on(conn).await?;
        Ok(Carried::Landed { chunks, reuse })
    }
}
