//! The device-IPC mover (same host, device memory, on top of a CMA choice): the
//! consumer asks for device memory (`GetDeviceMapped`) and lands the producer's
//! `StagedDeviceMapped` grant (a producer that answers `StagedMapped` instead is read
//! by CMA, `cma.rs`). The consumer opens the producer's export once
//! per incarnation on its destination cache's device, copies device to device on the
//! cache's own stream, verifies every chunk against the grant's checksums and sends
//! `Done`. A selected grant's frames land in the destination's selected ranges, in
//! order (the grant's shape is checked against the destination first, as for a
//! selected socket stream). While the copy runs it watches the producer's process (a
//! pidfd): a producer that ends is `PeerLost` at once.
//!
//! # Cancellation
//!
//! The transfer task may drop the landing (its cancel, or its deadline). The copy's
//! event is the transfer's unconfirmed device copy until it settles, so a dropped or
//! timed-out landing leaves the destination reported busy until the device confirms,
//! exactly as a host-to-device landing does (see `transfer`).

use std::sync::Arc;

use super::one_sided::{check_fits, check_granted_keys, count_landed, verify_landed};
use super::{BulkMover, Carried};
use crate::device::{DeviceError, DeviceKvCache};
use crate::net::{NetError, PooledConnection};
use crate::peer::consumer::shared::unexpected;
use crate::peer::consumer::shared::Request;
use crate::peer::consumer::transfer::{Sink, TransferCtx};
use crate::peer::error::PeerError;
use crate::wire::{ChunkKey, ChunkMeta, Message, SelectedShape};

/// The device-IPC mover for one get: the destination's device opens exports of
/// `kind`, which the producer (process `pid`) offered for its incarnation.
pub(in crate::peer) struct DeviceIpc {
    /// The producer's pid, as probed for its incarnation (watched during a copy).
    pub(in crate::peer) pid: u32,
    /// The device-IPC kind both sides speak.
    pub(in crate::peer) kind: &'static str,
}

impl BulkMover for DeviceIpc {
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
                t.receive_mapped(conn, id, keys, select.clone(), Some(self.kind), sink, caps, self.pid)
                    .await
            }
            // Never chosen for a pull (`choose`): the staged lease is host memory.
            Request::Pull { .. } => Ok(Carried::Refused),
        }
    }
}

/// A producer's device-IPC grant (`StagedDeviceMapped`).
pub(in crate::peer) struct DeviceGrant {
    pub(in crate::peer) lease_id: crate::wire::LeaseId,
    pub(in crate::peer) incarnation: u64,
    pub(in crate::peer) chunks: Vec<ChunkMeta>,
    pub(in crate::peer) export_id: u64,
    pub(in crate::peer) kind: String,
    pub(in crate::peer) buffers: Vec<(Vec<u8>, u64)>,
    /// A selected stream's shape (its frames are `chunks`).
    pub(in crate::peer) shape: Option<SelectedShape>,
    pub(in crate::peer) runs: Vec<(u32, u64, u64)>,
}

impl TransferCtx<'_> {
    /// Lands a device-IPC grant: opens (once per incarnation) the producer's export on
    /// the destination cache's device, copies device to device on the cache's own
    /// stream (bounded by its op timeout; the copy's event is the transfer's
    /// unconfirmed device copy until it settles, so a cancel or timeout leaves the
    /// destination reported busy until the device confirms), watches the producer's
    /// process meanwhile (gone: `PeerLost`), verifies every chunk against the grant's
    /// checksums, then sends `Done`. An export that cannot be opened releases the
    /// lease and answers [`Carried::Refused`] (and device IPC is given up for the peer).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::peer) async fn land_device_ipc(
        &mut self,
        conn: &mut PooledConnection,
        keys: &[ChunkKey],
        sink: &mut Sink,
        caps: &[usize],
        cache: &Arc<DeviceKvCache>,
        grant: DeviceGrant,
        pid: u32,
    ) -> Result<Carried, PeerError> {
        let inner = &self.consumer.inner;
        let protocol = |m: &str| PeerError::Net(NetError::Protocol(m.to_string()));
        let DeviceGrant {
            lease_id,
            incarnation,
            chunks,
            export_id,
            kind,
            buffers,
            shape,
            runs,
        } = grant;
        if lease_id != 0 {
            self.lease_to_release = Some(lease_id);
        }
        if chunks.is_empty() {
            return Ok(Carried::Landed { chunks, reuse: true });
        }
        // Where each chunk lands: its destination blocks, or (a selected stream)
        // the next ranges of the destination's selection.
        let landing = match &shape {
            Some(shape) => {
                self.plan_landing(&chunks, shape)?;
                self.landing.take()
            }
            None => {
                check_granted_keys(&chunks, keys)?;
                None
            }
        };
        let mut cursor = landing.as_ref().map(|l| l.cursor());
        let mut dst = Vec::new();
        let mut per_chunk = Vec::with_capacity(chunks.len());
        for (i, meta) in chunks.iter().enumerate() {
            let len = meta.len as usize;
            let ranges = match cursor.as_mut() {
                Some(cursor) => cursor.take(len)?,
                None => {
                    check_fits(meta, caps[i])?;
                    cache.chunk_ranges(&self.dst.chunks[i], len)?
                }
            };
            dst.extend_from_slice(&ranges);
            per_chunk.push(ranges);
        }
        let total: u64 = chunks.iter().map(|c| c.len).sum();
        if runs.iter().map(|r| r.2).sum::<u64>() != total {
            return Err(protocol("a device grant's runs do not hold its chunks' bytes"));
        }
        let peer = self.pool.addr().to_string();
        let sources = match cache.import(&peer, incarnation, export_id, &kind, &buffers) {
            Ok(s) => s,
            Err(e) => {
                // Nothing was written: release the grant and get the bytes over the
                // socket on the same connection.
                self.consumer.device_ipc_refused(
                    &peer,
                    format!("the producer's device memory cannot be opened here: {e}"),
                );
                if let Some(lease_id) = self.lease_to_release.take() {
                    match conn.request(&Message::Done { lease_id }).await {
                        Ok(Message::DoneAck) => {}
                        Ok(other) => return Err(unexpected("DoneAck", &other)),
                        Err(e) => return Err(e.into()),
                    }
                }
                return Ok(Carried::Refused);
            }
        };
        let device_err = |error| PeerError::Device {
            cache: cache.name().to_string(),
            error,
        };
        self.dirty = true;
        let event = cache
            .copy_in(&sources, &runs, &dst, "land: device-to-device (device IPC)")
            .map_err(device_err)?;
        // Until it settles the copy may write the destination: the transfer's drain
        // waits for it (bounded, as for a host-to-device landing).
        self.unconfirmed = Some(event.clone());
        let deadline = event.meta().submitted() + cache.op_timeout();
        let waited = tokio::select! {
            r = event.wait(deadline) => r,
            gone = producer_exit(pid) => {
                return Err(PeerError::PeerLost {
                    peer,
                    reason: format!("its process ended during a device-to-device copy ({gone})"),
                });
            }
        };
        match waited {
            Ok(()) => self.unconfirmed = None,
            Err(e @ DeviceError::CopyFailed { .. }) => {
                // Settled: the device no longer touches the destination.
                self.unconfirmed = None;
                return Err(device_err(e));
            }
            Err(e) => return Err(device_err(e)),
        }
        // Every chunk, as landed, against the producer's checksum.
        for (meta, ranges) in chunks.iter().zip(&per_chunk) {
            verify_landed(meta, cache.checksum_ranges(ranges).map_err(device_err)?)?;
        }
        self.dirty = false;
        let counters = &inner.counters;
        count_landed(
            counters,
            &counters.device_ipc_transfers,
            &counters.device_ipc_bytes,
            &chunks,
        );
        // Landed in place: nothing to land from staging pages (the transfer's landing
        // step sees no staging sink and reports the chunks landed).
        *sink = Sink::Lent;
        self.done_after_landing(conn, chunks).await
    }
}

/// Resolves when process `pid` has ended (a pidfd becomes readable then); never
/// resolves when it cannot be watched (the copy's own bound still applies).
async fn producer_exit(pid: u32) -> String {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if raw < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ESRCH) {
            return "no such process".into();
        }
        return std::future::pending().await;
    }
    // SAFETY: `raw` is a descriptor we just opened and own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    // SAFETY: `fd` is an open pidfd owned by the `AsyncFd` for its whole life; an
    // `OwnedFd` always reports the same descriptor.
    match unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
        Ok(afd) => match afd.readable().await {
            Ok(_) => "exited".into(),
            Err(_) => std::future::pending().await,
        },
        Err(_) => std::future::pending().await,
    }
}
