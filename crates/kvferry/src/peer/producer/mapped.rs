//! The producer's side of the CMA mover (see [`crate::peer::movers`]): the same-host
//! offer (`MoverHello` → `MoverOffer`) and mapped gets (`GetMapped` →
//! `StagedMapped`).
//!
//! A mapped get is staged exactly as an eager get (published host blocks pinned,
//! store chunks pinned, device blocks gathered into staging pages), with the same
//! quotas and checksums. Instead of writing the bytes, the producer answers where
//! they are: `(address, length)` runs of its own memory whose concatenation is the
//! stream. The lease then waits in the ledger, tied to the connection like an eager
//! get's: it ends with the consumer's `Done` (which follows the read on the same
//! connection), with the connection's close after the grace, or at its TTL. Until then
//! the memory the runs name stays pinned and mapped. Nothing on this side runs during
//! the read: the consumer's kernel reads this process's pages.
//!
//! A delayed pull goes the same way (`PullMapped` → `StagedMapped`) for a lease staged
//! earlier by `Stage`, of whole chunks: the reply names the lease's memory, and the
//! lease stays a delayed pull's (not tied to the connection; ended by `Done` or its
//! TTL, pulled again after a failed read). A staged selection is pulled over the
//! socket.
//!
//! # Never corrupt, here
//!
//! The consumer verifies every chunk against the checksums in the reply, which were
//! taken when the bytes were staged or published; a producer that writes its
//! published blocks during the read is caught there, never landed as good.
//!
//! # Device IPC
//!
//! A consumer on this host whose destination is device memory asks which device-IPC
//! kinds this producer grants by (`DeviceIpcHello` → `DeviceIpcOffer`, once per
//! incarnation), then sends `GetDeviceMapped`. When the leading keys are published
//! blocks of one device cache whose memory is exportable (a sim device's shared
//! memory; see `device::shm`), the lease pins those publications (no gather, no
//! staging pages), their checksums are taken now from the device memory, and the reply
//! (`StagedDeviceMapped`) names the cache's export (made once per registration) and
//! `(buffer, offset, length)` runs of it. With a selection every key must be such a
//! publication: the grant then names only the selected ranges, as the frames of the
//! selected stream (planned as for `GetSelected`), with the stream's shape; a selection
//! that does not fit is refused `BadSelection` as a staged one is. Otherwise the
//! request is served exactly as
//! `GetMapped` (staged, `StagedMapped`). The lease is tied to the connection as a
//! mapped get's; the publications stay pinned until `Done`, so the exported
//! allocations stay alive (an importer's mapping keeps them alive beyond that).
//!
//! # Cancellation
//!
//! Both handlers answer synchronously once staging completed; a handler dropped while
//! staging ends the staging as an eager get's does.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::guards::Staging;
use super::staged::{StagedData, StagedLease};
use super::Producer;
use crate::device::DeviceKvCache;
use crate::peer::error::PeerError;
use crate::peer::ledger::{LeaseTerms, Who};
use crate::peer::movers::{device_ipc_kinds, Transport};
use crate::peer::publish::{PubSource, Publication};
use crate::peer::quota::Holder;
use crate::peer::selection::plan_source;
use crate::wire::{
    ChunkKey, ChunkMeta, CmaOffer, ErrorKind, LeaseId, Limits, Message, SelectedShape, WireSelection, MAX_MAPPED_RUNS,
};

/// The `(address, length)` runs of this process's memory whose concatenation is
/// `lease`'s stream (adjacent parts merged), or `TooLarge` when one reply cannot name
/// them all (the consumer then uses the socket).
fn memory_runs(lease: &StagedLease) -> Result<Vec<(u64, u64)>, (ErrorKind, String)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for i in 0..lease.chunks.len() {
        let parts = lease.parts(i).map_err(|e| (ErrorKind::Internal, e.to_string()))?;
        for p in parts.iter().filter(|p| !p.is_empty()) {
            let (addr, len) = (p.as_ptr() as u64, p.len() as u64);
            match runs.last_mut() {
                // Contiguous with the previous run: one run (fewer iovecs).
                Some((a, l)) if *a + *l == addr => *l += len,
                _ => runs.push((addr, len)),
            }
        }
    }
    if runs.len() > MAX_MAPPED_RUNS {
        let why = format!(
            "the grant needs {} memory runs, over the {MAX_MAPPED_RUNS} one reply may name; get it over the socket",
            runs.len()
        );
        return Err((ErrorKind::TooLarge, why));
    }
    Ok(runs)
}

impl Producer {
    /// What this producer offers a consumer whose boot id is `theirs`.
    pub(super) fn mover_offer(&self, theirs: &str) -> Message {
        let incarnation = self.inner.incarnation;
        let refuse = |why: &str| Message::MoverOffer {
            incarnation,
            cma: None,
            refused: why.to_string(),
        };
        let same = &self.inner.same_host;
        if self.inner.cfg.transport == Transport::Tcp {
            return refuse("the producer's transport is tcp");
        }
        match &same.boot_id {
            None => refuse("the producer cannot read its boot id"),
            Some(_) if theirs.is_empty() => refuse("the consumer did not say its boot id"),
            Some(mine) if mine != theirs => refuse("another host (boot ids differ)"),
            Some(_) => Message::MoverOffer {
                incarnation,
                cma: Some(CmaOffer {
                    pid: std::process::id(),
                    probe_addr: same.probe.as_ptr() as u64,
                    probe: *same.probe,
                }),
                refused: String::new(),
            },
        }
    }

    /// The reply to a mapped get staged as `lease_id` (0: a miss): where each chunk's
    /// bytes are. The lease is checked back in, tied to connection `conn` (ended by
    /// `Done`, the connection's close after the grace, or its TTL).
    pub(super) fn map_lease(
        &self,
        lease_id: LeaseId,
        chunks: Vec<ChunkMeta>,
        shape: Option<SelectedShape>,
        who: &Who,
        conn: u64,
    ) -> Result<Message, (ErrorKind, String)> {
        let incarnation = self.inner.incarnation;
        if lease_id == 0 {
            return Ok(Message::StagedMapped {
                lease_id,
                incarnation,
                chunks,
                shape,
                runs: Vec::new(),
            });
        }
        let sending = self.check_out(lease_id, who, Some(conn))?;
        // On an error the guard drops: the lease ends, as a failed eager send's does.
        let runs = memory_runs(sending.lease())?;
        sending.check_in();
        Ok(Message::StagedMapped {
            lease_id,
            incarnation,
            chunks,
            shape,
            runs,
        })
    }

    /// The reply to a `PullMapped` of staged lease `lease_id` granted by incarnation
    /// `incarnation`: where its chunks' bytes are. The lease stays as a delayed pull's
    /// does (until `Done` or its TTL; a failed read may be pulled again), and is not
    /// tied to this connection. A lease of a selection, or one whose memory needs more
    /// runs than a reply may name, is refused: the consumer pulls it over the socket.
    pub(super) fn map_pull(
        &self,
        lease_id: LeaseId,
        incarnation: u64,
        who: &Who,
    ) -> Result<Message, (ErrorKind, String)> {
        if incarnation != self.inner.incarnation {
            let m = format!(
                "lease from incarnation {incarnation:#x}, this is {:#x}",
                self.inner.incarnation
            );
            return Err((ErrorKind::StaleIncarnation, m));
        }
        let sending = self.check_out(lease_id, who, None)?;
        let lease = sending.lease();
        if matches!(lease.data, StagedData::Selected { .. } | StagedData::Device { .. }) {
            let m = format!("lease {lease_id} holds a selection: pull it over the socket");
            sending.check_in();
            return Err((ErrorKind::BadRequest, m));
        }
        let reply = memory_runs(lease).map(|runs| Message::StagedMapped {
            lease_id,
            incarnation,
            chunks: lease.chunks.clone(),
            shape: None,
            runs,
        });
        // Kept either way: a delayed pull may be retried, over the socket too.
        sending.check_in();
        reply
    }

    /// What this producer offers a consumer (already on CMA) that can open device
    /// memory of `theirs` kinds.
    pub(super) fn device_ipc_offer(&self, theirs: &[String]) -> Message {
        let incarnation = self.inner.incarnation;
        if self.inner.cfg.transport == Transport::Tcp {
            return Message::DeviceIpcOffer {
                incarnation,
                kinds: Vec::new(),
                refused: "the producer's transport is tcp".into(),
            };
        }
        let kinds: Vec<String> = device_ipc_kinds().into_iter().filter(|k| theirs.contains(k)).collect();
        let refused = if kinds.is_empty() {
            format!(
                "no device-IPC kind in common (the producer speaks {:?})",
                device_ipc_kinds()
            )
        } else {
            String::new()
        };
        Message::DeviceIpcOffer {
            incarnation,
            kinds,
            refused,
        }
    }

    /// Serves a `GetDeviceMapped`: by device IPC when the leading keys are published
    /// blocks of one exportable device cache of `kind` (with a selection: every key,
    /// and only the selected ranges), else exactly as `GetMapped`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn device_mapped(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        kind: &str,
        select: Option<&WireSelection>,
        holder: &Holder,
        incarnation: Option<u64>,
        who: &Who,
        conn: u64,
    ) -> Result<Message, (ErrorKind, String)> {
        if let Some(reply) = self.grant_device(keys, ttl, kind, select, holder, incarnation, who, conn)? {
            return Ok(reply);
        }
        let staged = self.stage_for(keys, ttl, holder, incarnation, select).await;
        let (lease_id, chunks, _ttl_ms, shape) = staged.map_err(|e| (super::serving::kind_of(&e), e.to_string()))?;
        self.map_lease(lease_id, chunks, shape, who, conn)
    }

    /// The device-IPC grant, or `None` when the keys are not published device blocks
    /// of one exportable cache of `kind` (the caller stages them instead). Without a
    /// selection the leading such keys are granted whole; with one, every key must be
    /// (a selection spans them all) and the grant names the selected ranges only, as
    /// frames of the selected stream.
    #[allow(clippy::too_many_arguments)]
    fn grant_device(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        kind: &str,
        select: Option<&WireSelection>,
        holder: &Holder,
        incarnation: Option<u64>,
        who: &Who,
        conn: u64,
    ) -> Result<Option<Message>, (ErrorKind, String)> {
        let internal = |e: String| (ErrorKind::Internal, e);
        let refused = |e: PeerError| (super::serving::kind_of(&e), e.to_string());
        // The leading publications of one exportable device cache, held by a new lease
        // from the same instant (under one lock).
        let (cache, pubs, staging) = {
            let mut ledger = self.inner.ledger.lock();
            let found = ledger.lookup(keys, Instant::now());
            let Some((_, first)) = found.first() else {
                return Ok(None);
            };
            let PubSource::Device { cache } = &first.source else {
                return Ok(None);
            };
            match cache.export() {
                Ok(e) if e.kind == kind => {}
                _ => return Ok(None),
            }
            let cache: Arc<DeviceKvCache> = cache.clone();
            let pubs: Vec<_> = found
                .iter()
                .take_while(|(_, p)| p.source.is_of_device(&cache))
                .map(|(id, p)| (*id, Arc::clone(p)))
                .collect();
            if select.is_some() && pubs.len() < keys.len() {
                // A selection spans every key: staged (a miss, or the error that
                // names why the keys cannot be selected from together).
                return Ok(None);
            }
            let terms = LeaseTerms {
                owner: holder.identity.clone(),
                owner_incarnation: incarnation,
                claimed_by: holder.claimed.clone(),
                publications: pubs.iter().map(|(id, _)| *id).collect(),
            };
            let id = ledger.begin(terms, rand::random::<LeaseId>);
            let pubs: Vec<Arc<Publication>> = pubs.into_iter().map(|(_, p)| p).collect();
            (
                cache,
                pubs,
                Staging {
                    producer: self,
                    id,
                    armed: true,
                },
            )
        };
        // What each chunk (or frame of a selected stream) is made of, in the cache.
        // On an error the guard drops: the lease ends.
        let (frames, shape) = match select {
            None => {
                let frames: Vec<_> = pubs.iter().map(|p| (p.key, p.len, p.ranges.clone())).collect();
                (frames, None)
            }
            Some(select) => {
                let lists: Vec<(ChunkKey, &[u32])> = pubs.iter().map(|p| (p.key, p.blocks.as_slice())).collect();
                let limits = Limits::default();
                let plan = plan_source(&lists, cache.map(), select, limits.max_keys, limits.max_bulk_bytes)
                    .map_err(|e| refused(e.into()))?;
                let frames = plan
                    .all_ranges()
                    .map_err(|e| refused(e.into()))?
                    .into_iter()
                    .enumerate()
                    .map(|(i, ranges)| {
                        let (key, len) = plan.frame(i);
                        (key, len, ranges)
                    })
                    .collect();
                (frames, Some(plan.shape.clone()))
            }
        };
        let export = cache.export().map_err(internal)?.clone();
        // Checksums now, from the device memory: the engine promised not to write
        // published blocks; a producer that does is caught by the consumer.
        let mut chunks = Vec::with_capacity(frames.len());
        for (key, len, ranges) in &frames {
            let checksum = cache.checksum_ranges(ranges).map_err(|e| internal(e.to_string()))?;
            chunks.push(ChunkMeta {
                key: *key,
                len: *len as u64,
                checksum,
            });
        }
        // Where the stream lies in the export, adjacent ranges as one run.
        let stream: Vec<(usize, usize)> = frames.iter().flat_map(|f| f.2.iter().copied()).collect();
        let runs = cache.export_runs(&stream).map_err(|e| internal(e.to_string()))?;
        if runs.len() > MAX_MAPPED_RUNS {
            // The guard drops: the lease ends; the caller stages the keys instead.
            drop(staging);
            return Ok(None);
        }
        let payload = StagedLease {
            data: StagedData::Device { _cache: cache },
            chunks: chunks.clone(),
            _charge: None,
            publications: pubs,
        };
        let lease_id = staging.grant(payload, 0, ttl).map_err(refused)?;
        // Tied to this connection until `Done`, as a mapped get's lease.
        self.check_out(lease_id, who, Some(conn))?.check_in();
        Ok(Some(Message::StagedDeviceMapped {
            lease_id,
            incarnation: self.inner.incarnation,
            chunks,
            export_id: export.id,
            kind: export.kind.to_string(),
            buffers: export.buffers,
            shape,
            runs,
        }))
    }
}
