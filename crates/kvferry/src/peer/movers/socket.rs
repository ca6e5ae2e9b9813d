//! The socket mover: the producer writes the granted bytes onto the transfer's
//! connection, a crc32c per frame, and the consumer receives them into the transfer's
//! destination — straight into the destination blocks of a host cache (direct), or
//! into staging pages landed afterwards (staged). Works anywhere, and is every other
//! mover's fallback.
//!
//! # Cancellation
//!
//! The reads are the connection's receives: dropping [`Socket::carry`]'s future drops
//! the connection (closed, never pooled mid-stream), and nothing writes the
//! destination after that. There is nothing left to quiesce.

use std::sync::atomic::Ordering;

use super::{BulkMover, Carried};
use crate::net::{NetError, PooledConnection};
use crate::peer::consumer::shared::{check_granted_keys, unexpected, verify_landed, Request};
use crate::peer::consumer::transfer::{Sink, TransferCtx};
use crate::peer::error::PeerError;
use crate::wire::{ChunkMeta, Message};

/// The socket mover.
pub(in crate::peer) struct Socket;

impl BulkMover for Socket {
    async fn carry(
        &self,
        t: &mut TransferCtx<'_>,
        conn: &mut PooledConnection,
        id: u64,
        req: &Request,
        sink: &mut Sink,
        caps: &[usize],
    ) -> Result<Carried, PeerError> {
        t.take_staging(sink, caps)?;
        let chunks = match req {
            Request::Get { keys, select } => {
                let ttl_ms = t.consumer.inner.cfg.lease_ttl.as_millis() as u32;
                let selected = select.is_some();
                let msg = match select {
                    None => Message::Get {
                        keys: keys.clone(),
                        ttl_ms,
                    },
                    Some(select) => Message::GetSelected {
                        keys: keys.clone(),
                        ttl_ms,
                        select: select.clone(),
                    },
                };
                conn.send(id, &msg).await?;
                match conn.recv_reply(id).await? {
                    Message::StagedSelected {
                        lease_id,
                        chunks,
                        shape,
                        ..
                    } if selected => {
                        if lease_id != 0 {
                            t.lease_to_release = Some(lease_id);
                        }
                        if !chunks.is_empty() {
                            t.plan_landing(&chunks, &shape)?;
                        }
                        chunks
                    }
                    Message::Staged { lease_id, chunks, .. } if !selected => {
                        if lease_id != 0 {
                            t.lease_to_release = Some(lease_id);
                        }
                        check_granted_keys(&chunks, keys)?;
                        chunks
                    }
                    other => {
                        let expected = if selected { "StagedSelected" } else { "Staged" };
                        return Err(unexpected(expected, &other));
                    }
                }
            }
            Request::Pull { handle } => {
                if let Some(s) = &handle.selection {
                    t.plan_landing(&handle.chunks, &s.shape)?;
                }
                conn.send(
                    id,
                    &Message::Pull {
                        lease_id: handle.lease_id,
                        incarnation: handle.incarnation,
                    },
                )
                .await?;
                if handle.selection.is_some() {
                    handle.chunks.clone()
                } else {
                    handle.chunks.iter().take(caps.len()).cloned().collect()
                }
            }
        };
        if chunks.is_empty() {
            return Ok(Carried::Landed { chunks, reuse: true });
        }
        receive_frames(t, conn, id, &chunks, sink, caps).await?;
        match conn.recv_reply(id).await? {
            Message::PullDone { .. } => {}
            other => return Err(unexpected("PullDone", &other)),
        }
        // Every byte is here: the producer's copy is no longer needed.
        let reuse = t.release_on(conn).await?;
        Ok(Carried::Landed { chunks, reuse })
    }
}

/// Receives the frames of `chunks` (request `id`) into `sink`, verifying each.
async fn receive_frames(
    t: &mut TransferCtx<'_>,
    conn: &mut PooledConnection,
    id: u64,
    chunks: &[ChunkMeta],
    sink: &mut Sink,
    caps: &[usize],
) -> Result<(), PeerError> {
    let landing = t.landing.take();
    let mut cursor = landing.as_ref().map(|l| l.cursor());
    let mut at = 0; // a selected stream's offset in the staging lease
    for (i, meta) in chunks.iter().enumerate() {
        if let Some(cur) = cursor.as_mut() {
            // A selected stream: frame `i` fills the next `len` bytes.
            let len = meta.len as usize;
            let received = match sink {
                Sink::Staging { lease, .. } => {
                    let mut parts = lease.io_slices_mut(at, len)?;
                    at += len;
                    conn.recv_bulk(id, &mut parts).await
                }
                Sink::Direct(cache) => {
                    let ranges = cur.take(len)?;
                    t.dirty = true;
                    // SAFETY: the destination's blocks were checked distinct and
                    // the selection's destination ranges disjoint and inside each
                    // piece (`Destination::check_selected`, `LandingPlan::new`),
                    // so the slices do not overlap; the task owns `dst` until it
                    // has stopped, and the engine leaves the blocks alone until
                    // the fence fires.
                    let mut parts = unsafe { cache.io_slices_mut(&ranges)? };
                    conn.recv_bulk(id, &mut parts).await
                }
                Sink::Lent | Sink::Deferred => return Err(lent()),
            };
            verify(t, meta, received)?;
            continue;
        }
        if meta.len as usize > caps[i] {
            return Err(PeerError::InvalidArgument(format!(
                "chunk {} is {} bytes but its destination blocks hold {}",
                meta.key, meta.len, caps[i]
            )));
        }
        let len = meta.len as usize;
        let received = match sink {
            Sink::Staging { lease, offsets } => {
                let mut parts = lease.io_slices_mut(offsets[i], len)?;
                conn.recv_bulk(id, &mut parts).await
            }
            Sink::Direct(cache) => {
                let ranges = cache.chunk_ranges(&t.dst.chunks[i], len)?;
                t.dirty = true;
                // SAFETY: the destination's blocks were checked distinct
                // (`Destination::check`), so the slices do not overlap; the task
                // owns `dst` (and through it the memory) until it has stopped, and
                // the engine leaves the blocks alone until the transfer reports
                // them quiet (the fence).
                let mut parts = unsafe { cache.io_slices_mut(&ranges)? };
                conn.recv_bulk(id, &mut parts).await
            }
            Sink::Lent | Sink::Deferred => return Err(lent()),
        };
        verify(t, meta, received)?;
    }
    // Kept for the landing copy of a staged selected stream.
    t.landing = landing;
    Ok(())
}

/// Counts a received frame and checks its checksum against the announced one.
fn verify(t: &TransferCtx<'_>, meta: &ChunkMeta, received: Result<u32, NetError>) -> Result<(), PeerError> {
    let actual = match received {
        Ok(crc) => crc,
        // The frame's checksum is the one computed at staging: a mismatch
        // means the bytes changed between staging and here.
        Err(NetError::Wire(crate::wire::WireError::ChecksumMismatch { actual, .. })) => actual,
        Err(e) => return Err(e.into()),
    };
    let counters = &t.consumer.inner.counters;
    counters.bytes_received.fetch_add(meta.len, Ordering::Relaxed);
    counters.chunks_received.fetch_add(1, Ordering::Relaxed);
    verify_landed(meta, actual)
}

/// A receive found its staging pages lent to a same-host read (never expected).
fn lent() -> PeerError {
    PeerError::Net(NetError::Protocol("staging pages are lent to a same-host read".into()))
}
