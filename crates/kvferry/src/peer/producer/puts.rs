//! Puts: chunks pushed into the producer's store, by a remote consumer (`Put`) or
//! locally ([`put_local`](Producer::put_local)). A remote put's bytes land straight
//! into fresh store blocks — no staging copy — charged to the sender's quotas like
//! staging pages before a byte of the body is read; the chunk is registered under its
//! key only once its wire checksum matched.
//!
//! # Cancellation
//!
//! A put dropped mid-read (its connection torn down) drops its fresh blocks, which
//! return to the store's free list (nothing was registered under the key), and its
//! quota charge.

use std::sync::atomic::Ordering;

use super::serving::refuse;
use super::store::truncate_ranges;
use super::Producer;
use crate::net::{Connection, NetError};
use crate::peer::error::PeerError;
use crate::peer::quota::Holder;
use crate::wire::{ChunkKey, ErrorKind, FrameKind, Message};

impl Producer {
    /// Writes `data` into free blocks and registers it under `key` (the local put).
    pub fn put_local(&self, key: ChunkKey, data: &[u8]) -> Result<(), PeerError> {
        let layout = *self.inner.store.layout();
        let nblocks = data.len().div_ceil(layout.block_bytes()).max(1);
        let blocks = self.inner.store.alloc_blocks(nblocks)?;
        let mut ranges = layout.chunk_ranges(&blocks)?;
        truncate_ranges(&mut ranges, data.len());
        let mut at = 0;
        for (off, len) in ranges {
            self.inner.store.region().write(off, &data[at..at + len])?;
            at += len;
        }
        let checksum = crate::checksum::checksum(data);
        self.inner.store.insert_checked(key, blocks, data.len(), checksum)?;
        self.note_arrival();
        Ok(())
    }

    /// Push: bytes land straight into fresh store blocks (their quota charged like
    /// staging pages), registered under the key with their verified wire checksum.
    pub(super) async fn receive_put(
        &self,
        conn: &mut Connection,
        id: u64,
        key: ChunkKey,
        len: u64,
        holder: &Holder,
    ) -> Result<(), NetError> {
        let inner = &self.inner;
        let header = conn.read_header(conn.io_timeout()).await?;
        if header.request_id != id || header.kind != FrameKind::Bulk {
            // Not this put's bytes: skip the frame (the connection stays in sync) and
            // refuse, rather than storing (and acknowledging) another request's frame.
            conn.skip(&header).await?;
            let m = format!(
                "put {id} expects its bulk frame, got a {:?} frame for request {}",
                header.kind, header.request_id
            );
            return refuse(conn, id, ErrorKind::BadRequest, m).await;
        }
        let layout = *inner.store.layout();
        let len = len as usize;
        let cap = layout.block_bytes() * layout.blocks as usize;
        if header.len as usize != len || len == 0 || len > cap {
            conn.skip(&header).await?;
            let m = format!(
                "put of {len} bytes (frame {}) does not fit a chunk (max {cap})",
                header.len
            );
            return refuse(conn, id, ErrorKind::TooLarge, m).await;
        }
        // Charged to the sender's quotas before a byte of the body is read (a put that
        // stalls holds no more than its sender may), uncharged when this request ends.
        let pages = inner.arena.pages_for(len);
        let _charge = match self.charge(holder, pages) {
            Ok(c) => c,
            Err(e) => {
                conn.skip(&header).await?;
                return refuse(conn, id, ErrorKind::Busy, e.to_string()).await;
            }
        };
        // Straight into fresh store blocks (no staging copy); they return to the free
        // list if the read fails, and hold the chunk only once its checksum matched.
        let mut blocks = match inner.store.alloc_put(len) {
            Ok(b) => b,
            Err(e) => {
                conn.skip(&header).await?;
                return refuse(conn, id, ErrorKind::Busy, e.to_string()).await;
            }
        };
        let checksum = {
            let mut parts = blocks.io_slices_mut().map_err(|e| NetError::Protocol(e.to_string()))?;
            conn.read_bulk_into(&header, &mut parts).await?
        };
        inner.counters.bytes_received.fetch_add(len as u64, Ordering::Relaxed);
        if let Err(e) = blocks.commit(key, checksum) {
            return refuse(conn, id, ErrorKind::Internal, e.to_string()).await;
        }
        inner.counters.pushed.fetch_add(1, Ordering::Relaxed);
        self.note_arrival();
        conn.send(id, &Message::PutAck { key }).await
    }
}
