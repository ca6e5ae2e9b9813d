//! The CMA mover (same host, host memory): the consumer reads the granted bytes from
//! the producer's memory itself, with `process_vm_readv` on its copy threads.
//!
//! # A mapped get
//!
//! `GetMapped` → `StagedMapped` (the lease, chunk checksums, and the `(address,
//! length)` runs of the producer's memory holding the stream). The consumer builds a
//! [`CopyPlan`] from a [`RemoteSource`] over those runs into the same destination a
//! socket receive would fill — the destination blocks (direct path) or staging pages
//! (staged path, landed afterwards exactly as received bytes are) — with one checksum
//! group per chunk, and runs it on its copy engine: slices of about 1 MiB on the copy
//! threads, each read checksummed while in cache. Every chunk is verified against the
//! grant's checksum before the transfer reports anything landed; a mismatch (a
//! producer that wrote its published blocks) is a `ChecksumMismatch`, and the
//! destination is reported dirty. `Done` then follows on the same connection.
//!
//! A delayed pull of whole chunks goes the same way (`PullMapped` → `StagedMapped` for
//! the staged lease). A producer that will not name the bytes in one reply hands the
//! transfer back to the socket ([`Carried::Refused`]).
//!
//! A producer that dies mid-read turns the reads into `ESRCH`/`EFAULT` or short
//! reads: the transfer fails with `PeerLost`, never hangs (a read is one system call).
//!
//! # Cancellation
//!
//! The transfer task may drop the read (its cancel, or its deadline). Started slices
//! still run to their end: the copy job's [`DrainFence`](crate::copy::DrainFence) is
//! kept in the transfer context before the first slice starts, and the transfer's own
//! fence fires only after it (see `consumer::transfer`), so no read writes a
//! destination that was reported quiet.

use std::sync::Arc;

use super::device_ipc::DeviceGrant;
use super::one_sided::{check_fits, check_granted_keys, count_landed, verify_landed};
use super::{BulkMover, Carried};
use crate::copy::{CopyError, CopyPlan, Endpoint, RemoteSource};
use crate::device::KvCacheRef;
use crate::mem::HostMemory;
use crate::net::{NetError, PooledConnection};
use crate::peer::consumer::shared::{unexpected, Request};
use crate::peer::consumer::transfer::{Sink, TransferCtx};
use crate::peer::consumer::types::StagedHandle;
use crate::peer::error::PeerError;
use crate::wire::{ChunkKey, ChunkMeta, ErrorKind, Message, WireSelection};

/// The CMA mover for one transfer: reads process `pid`'s granted memory.
pub(in crate::peer) struct Cma {
    /// The producer's pid, as probed for its incarnation.
    pub(in crate::peer) pid: u32,
}

impl BulkMover for Cma {
    async fn carry(
        &self,
        t: &mut TransferCtx<'_>,
        conn: &mut PooledConnection,
        id: u64,
        req: &Request,
        sink: &mut Sink,
        caps: &[usize],
    ) -> Result<Carried, PeerError> {
        match req {
            Request::Get { keys, select } => {
                t.receive_mapped(conn, id, keys, select.clone(), None, sink, caps, self.pid)
                    .await
            }
            Request::Pull { handle } => t.pull_mapped(conn, id, handle, sink, caps, self.pid).await,
        }
    }
}

impl TransferCtx<'_> {
    /// A mapped get on `conn` (request `id`): the producer grants and names its
    /// memory, the copy engine reads it into `sink`. With `device` (a device IPC kind
    /// the pair agreed on, for a device destination of that kind) it asks for device
    /// memory (`GetDeviceMapped`, a selection too: the producer names the selected
    /// ranges of its device memory), and a `StagedDeviceMapped` grant is landed device
    /// to device; a `StagedMapped` answer is read by CMA either way.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::peer) async fn receive_mapped(
        &mut self,
        conn: &mut PooledConnection,
        id: u64,
        keys: &[ChunkKey],
        select: Option<WireSelection>,
        device: Option<&'static str>,
        sink: &mut Sink,
        caps: &[usize],
        pid: u32,
    ) -> Result<Carried, PeerError> {
        let inner = &self.consumer.inner;
        let ttl_ms = inner.cfg.lease_ttl.as_millis() as u32;
        let selected = select.is_some();
        // Device IPC copies in place; every other grant lands through staging pages
        // (a device destination's, taken now), before the request.
        if device.is_none() {
            self.take_staging(sink, caps)?;
        }
        let msg = match device {
            Some(kind) => Message::GetDeviceMapped {
                keys: keys.to_vec(),
                ttl_ms,
                kind: kind.to_string(),
                select,
            },
            None => Message::GetMapped {
                keys: keys.to_vec(),
                ttl_ms,
                select,
            },
        };
        conn.send(id, &msg).await?;
        let reply = match conn.recv_reply(id).await {
            Err(NetError::Remote {
                kind: ErrorKind::TooLarge,
                message,
            }) => Message::Error {
                kind: ErrorKind::TooLarge,
                message,
            },
            other => other?,
        };
        let (lease_id, chunks, shape, runs) = match reply {
            Message::StagedDeviceMapped {
                lease_id,
                incarnation,
                chunks,
                export_id,
                kind,
                buffers,
                shape,
                runs,
            } if device.is_some() => {
                if shape.is_some() != selected {
                    return Err(PeerError::Net(NetError::Protocol(
                        "a device grant's shape does not match the request".into(),
                    )));
                }
                let KvCacheRef::Device(cache) = &self.dst.target else {
                    return Err(PeerError::Net(NetError::Protocol(
                        "device grant for a host destination".into(),
                    )));
                };
                let cache = cache.clone();
                let grant = DeviceGrant {
                    lease_id,
                    incarnation,
                    chunks,
                    export_id,
                    kind,
                    buffers,
                    shape,
                    runs,
                };
                return self.land_device_ipc(conn, keys, sink, caps, &cache, grant, pid).await;
            }
            Message::StagedMapped {
                lease_id,
                chunks,
                shape,
                runs,
                ..
            } => (lease_id, chunks, shape, runs),
            Message::Error {
                kind: ErrorKind::TooLarge,
                message,
            } => {
                tracing::debug!(target: "kvferry::peer", reason = %message, "mapped get refused: over the socket");
                return Ok(Carried::Refused);
            }
            other => return Err(unexpected("StagedMapped", &other)),
        };
        if lease_id != 0 {
            self.lease_to_release = Some(lease_id);
        }
        // Asked for device IPC but granted memory to read: through staging (the lease
        // is released if there is none to take).
        self.take_staging(sink, caps)?;
        if chunks.is_empty() {
            return Ok(Carried::Landed { chunks, reuse: true });
        }
        let protocol = |m: &str| PeerError::Net(NetError::Protocol(m.to_string()));
        match (selected, &shape) {
            (true, Some(shape)) => self.plan_landing(&chunks, shape)?,
            (false, None) => {
                check_granted_keys(&chunks, keys)?;
            }
            _ => return Err(protocol("a mapped grant's shape does not match the request")),
        }
        self.read_granted(conn, chunks, runs, sink, caps, pid).await
    }

    /// A delayed pull of `handle` (a staged lease of whole chunks) on `conn` (request
    /// `id`) by CMA: the producer names where the lease's bytes are and the copy
    /// engine reads them into `sink`, as [`receive_mapped`](Self::receive_mapped)
    /// does. `Carried::Refused` when the producer will not name them (too many runs, or
    /// a lease it pulls over the socket only): nothing was read, pull it on the same
    /// connection. The caller has set the lease to release.
    pub(in crate::peer) async fn pull_mapped(
        &mut self,
        conn: &mut PooledConnection,
        id: u64,
        handle: &StagedHandle,
        sink: &mut Sink,
        caps: &[usize],
        pid: u32,
    ) -> Result<Carried, PeerError> {
        self.take_staging(sink, caps)?;
        let msg = Message::PullMapped {
            lease_id: handle.lease_id,
            incarnation: handle.incarnation,
        };
        conn.send(id, &msg).await?;
        let reply = match conn.recv_reply(id).await {
            Err(NetError::Remote {
                kind: kind @ (ErrorKind::TooLarge | ErrorKind::BadRequest),
                message,
            }) => {
                tracing::debug!(target: "kvferry::peer", ?kind, reason = %message, "mapped pull refused: over the socket");
                return Ok(Carried::Refused);
            }
            other => other?,
        };
        let Message::StagedMapped {
            lease_id,
            chunks,
            shape: None,
            runs,
            ..
        } = reply
        else {
            return Err(unexpected("StagedMapped", &reply));
        };
        // The grant is the lease staged earlier, chunk for chunk.
        if lease_id != handle.lease_id || chunks != handle.chunks {
            return Err(PeerError::Net(NetError::Protocol(
                "a mapped pull's grant is not the staged lease".into(),
            )));
        }
        // The destination may take a prefix of the staged chunks (as a socket pull).
        let take = chunks.len().min(caps.len());
        let total: u64 = chunks[..take].iter().map(|c| c.len).sum();
        let runs = prefix_runs(runs, total);
        let chunks = chunks.into_iter().take(take).collect();
        self.read_granted(conn, chunks, runs, sink, caps, pid).await
    }

    /// Reads granted `chunks` (their bytes at `runs` of process `pid`) into `sink`,
    /// verifies every chunk, and sends `Done`.
    async fn read_granted(
        &mut self,
        conn: &mut PooledConnection,
        chunks: Vec<ChunkMeta>,
        runs: Vec<(u64, u64)>,
        sink: &mut Sink,
        caps: &[usize],
        pid: u32,
    ) -> Result<Carried, PeerError> {
        let inner = &self.consumer.inner;
        let protocol = |m: &str| PeerError::Net(NetError::Protocol(m.to_string()));
        let source = RemoteSource::new(pid, runs).map_err(PeerError::Copy)?;
        let total: u64 = chunks.iter().map(|c| c.len).sum();
        if source.size() as u64 != total {
            return Err(protocol("a mapped grant's runs do not hold its chunks' bytes"));
        }
        // Where each chunk lands, in the memory the plan writes.
        let targets = self.mapped_targets(&chunks, sink, caps)?;
        let (dst, offsets) = match std::mem::replace(sink, Sink::Lent) {
            Sink::Staging { lease, offsets } => (Endpoint::Lease(lease), Some(offsets)),
            Sink::Direct(cache) => {
                let memory: Arc<dyn HostMemory> = cache.memory().clone();
                *sink = Sink::Direct(cache);
                self.dirty = true;
                (Endpoint::Memory(memory), None)
            }
            Sink::Lent | Sink::Deferred => return Err(protocol("staging pages already lent")),
        };
        let mut plan = CopyPlan::new(Endpoint::Remote(source), dst);
        let (mut at, mut ends, mut groups) = (0usize, Vec::new(), Vec::new());
        for (i, ranges) in targets.iter().enumerate() {
            for &(off, n) in ranges {
                plan.push(at, off, n);
                at += n;
            }
            if chunks[i].len > 0 {
                ends.push(plan.segments().len());
                groups.push(i);
            }
        }
        let mut job = inner.engine.copy(plan.with_checksum_groups(ends));
        // Kept until the transfer ends: its fence waits for started reads.
        self.copy_fence = Some(job.fence());
        let plan = match (&mut job).await {
            Ok(plan) => plan,
            Err(failure) => return Err(copy_failure(self.pool.addr(), failure.error)),
        };
        let counters = &inner.counters;
        count_landed(counters, &counters.cma_transfers, &counters.cma_bytes, &chunks);
        let sums = plan.group_checksums().unwrap_or_default().to_vec();
        for (&i, actual) in groups.iter().zip(sums) {
            verify_landed(&chunks[i], actual)?;
        }
        // An empty chunk's checksum is that of no bytes.
        for c in chunks.iter().filter(|c| c.len == 0) {
            verify_landed(c, 0)?;
        }
        if let Some(offsets) = offsets {
            let (_, dst) = plan.into_parts();
            let lease = dst
                .into_lease()
                .ok_or_else(|| protocol("staging lease not handed back"))?;
            *sink = Sink::Staging { lease, offsets };
        }
        self.done_after_landing(conn, chunks).await
    }

    /// The destination ranges of each chunk, in the memory the read writes: staging
    /// pages (offsets in the lease) or the host cache's memory (direct).
    fn mapped_targets(
        &mut self,
        chunks: &[ChunkMeta],
        sink: &Sink,
        caps: &[usize],
    ) -> Result<Vec<Vec<(usize, usize)>>, PeerError> {
        let mut out = Vec::with_capacity(chunks.len());
        if let Some(landing) = self.landing.take() {
            let mut cursor = landing.cursor();
            let mut at = 0;
            for meta in chunks {
                let len = meta.len as usize;
                out.push(match sink {
                    Sink::Direct(_) => cursor.take(len)?,
                    _ => {
                        at += len;
                        vec![(at - len, len)]
                    }
                });
            }
            // Kept for the landing copy of a staged selected stream.
            self.landing = Some(landing);
            return Ok(out);
        }
        for (i, meta) in chunks.iter().enumerate() {
            check_fits(meta, caps[i])?;
            let len = meta.len as usize;
            out.push(match sink {
                Sink::Staging { offsets, .. } => vec![(offsets[i], len)],
                Sink::Direct(cache) => cache.chunk_ranges(&self.dst.chunks[i], len)?,
                Sink::Lent | Sink::Deferred => Vec::new(),
            });
        }
        Ok(out)
    }
}

/// The leading runs of `runs` holding its first `total` bytes (the last one cut).
fn prefix_runs(runs: Vec<(u64, u64)>, total: u64) -> Vec<(u64, u64)> {
    let mut left = total;
    let mut out = Vec::with_capacity(runs.len());
    for (addr, len) in runs {
        if left == 0 {
            break;
        }
        let take = len.min(left);
        out.push((addr, take));
        left -= take;
    }
    out
}

/// A failed read as the transfer reports it: the producer gone (its process exited,
/// or it unmapped what it granted) is `PeerLost`.
fn copy_failure(peer: &str, error: CopyError) -> PeerError {
    match error {
        CopyError::RemoteRead { error, .. } if error.is_gone() => PeerError::PeerLost {
            peer: peer.to_string(),
            reason: format!("its memory can no longer be read: {error}"),
        },
        other => PeerError::Copy(other),
    }
}
