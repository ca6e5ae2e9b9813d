//! Staging: a consumer's (or the engine's) request for chunks becomes a lease in the
//! ledger, recorded only once what it will send is ready — copy before advertise.
//!
//! What a stage serves, in order: the leading **published** keys when the first key is
//! published — host publications sent in place (no copy; the lease holds them and
//! sends from the cache, under the checksums taken at publication), or device
//! publications of one cache gathered into fresh staging pages and checksummed — or
//! else the leading **store** chunks that fit the requester's quota, pinned in the
//! store and sent from its blocks with the checksum they were stored with. A
//! **selection** (a partial get) stages only the selected part of published keys, all
//! of them published from one cache. Every staging page is charged to the requester's
//! quotas (pinned store chunks are charged the pages a copy would take). A key listed
//! twice is refused; nothing found is a miss (lease 0), not an error.
//!
//! # Cancellation
//!
//! A stage dropped mid-way (its request's connection torn down, or the caller's
//! future dropped) drops its [`Staging`] guard, which ends the lease in the ledger
//! (see `guards`). A device gather dropped mid-way leaves its staging pages
//! quarantined until the device confirms, and its quota charge drops with it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::guards::Staging;
use super::staged::{StagedData, StagedLease};
use super::Producer;
use crate::device::{DeviceKvCache, KvCacheRef};
use crate::layout::KvCache;
use crate::peer::error::PeerError;
use crate::peer::ledger::{LeaseTerms, PubId};
use crate::peer::publish::{PubSource, Publication};
use crate::peer::quota::{Charge, Holder};
use crate::peer::selection::plan_source;
use crate::peer::unit_crcs::{selected_checksum, UnitCrcs};
use crate::wire::{ChunkKey, ChunkMeta, LeaseId, Limits, SelectedShape, SelectionError, WireSelection};

/// A stage's outcome: lease id, staged chunks, granted TTL in milliseconds, and for a
/// selection the shape of the selected stream.
type StageResult = Result<(LeaseId, Vec<ChunkMeta>, u32, Option<SelectedShape>), PeerError>;

/// One staged chunk gathered from a device cache: its key, length and ranges.
type GatherFrame = (ChunkKey, usize, Vec<(usize, usize)>);

/// What a stage of published keys serves, decided under the ledger's lock from the
/// first key's publication.
enum Leading<'a> {
    /// The selected part of every key (one cache, either kind).
    Selected(&'a WireSelection),
    /// The leading host publications: their chunks (checksums from publication) and
    /// caches, in key order.
    Host {
        chunks: Vec<ChunkMeta>,
        caches: Vec<Arc<KvCache>>,
    },
    /// The leading publications of one device cache, to be gathered.
    Device(Arc<DeviceKvCache>),
}

impl Producer {
    /// Stages the leading held chunks of `keys` (as many as fit in free arena pages)
    /// and records them under a new lease with `ttl`. Copy before advertise: the lease
    /// is recorded only after the gather completed and checksums were computed.
    pub async fn stage(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        owner: &str,
    ) -> Result<(LeaseId, Vec<ChunkMeta>, u32), PeerError> {
        let (lease, chunks, ttl, _) = self.stage_for(keys, ttl, &Holder::local(owner), None, None).await?;
        Ok((lease, chunks, ttl))
    }

    /// [`stage`](Self::stage) of the selected part of published keys (see
    /// [`crate::peer::selection`]): only the selected bytes are staged (device caches) or
    /// pinned for sending (host caches). Returns the frames and the stream's shape.
    pub async fn stage_selected(
        &self,
        keys: &[ChunkKey],
        select: &WireSelection,
        ttl: Duration,
        owner: &str,
    ) -> Result<(LeaseId, Vec<ChunkMeta>, u32, Option<SelectedShape>), PeerError> {
        self.stage_for(keys, ttl, &Holder::local(owner), None, Some(select))
            .await
    }

    /// [`stage`](Self::stage) for `holder`, the lease bound to `incarnation` too when
    /// given (a claimed identity); only the `select`ed part when given.
    pub(super) async fn stage_for(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        holder: &Holder,
        incarnation: Option<u64>,
        select: Option<&WireSelection>,
    ) -> StageResult {
        let owner = holder.identity.as_str();
        let inner = &self.inner;
        let ttl = self.clamp_ttl(ttl);
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        if let Some(k) = keys.iter().find(|k| !seen.insert(**k)) {
            return Err(PeerError::InvalidArgument(format!(
                "key {k} listed twice in one request"
            )));
        }
        if let Some(r) = self.stage_published(keys, ttl, holder, incarnation, select).await {
            return r;
        }
        if select.is_some() {
            if inner.store.lookup(keys) > 0 {
                let why = format!("key {} is a store chunk: selections apply to published blocks", keys[0]);
                return Err(SelectionError::Unsupported(why).into());
            }
            return Ok((0, Vec::new(), ttl.as_millis() as u32, None));
        }
        // Store chunks are served in place: pinned until the lease ends, sent from the
        // store's blocks with the checksum they were stored with (no staging copy, no
        // pass over the bytes). The pages a copy would take are still charged to the
        // requester's quotas, so what one peer can hold pinned stays bounded as before.
        let room = inner.quotas.room(holder);
        let arena = &inner.arena;
        let pinned = inner.store.pin_for_send(keys, |bytes| arena.pages_for(bytes) <= room)?;
        if pinned.is_empty() {
            let Some(len) = pinned.unfit_len() else {
                return Ok((0, Vec::new(), ttl.as_millis() as u32, None));
            };
            let pages = inner.arena.pages_for(len);
            // Names the scope that is full.
            return Err(self.charge(holder, pages).err().unwrap_or(PeerError::QuotaExceeded {
                peer: owner.to_string(),
                held: 0,
                asked: pages,
                quota: room,
            }));
        }
        let bytes: usize = pinned.locations().iter().map(|l| l.len).sum();
        let charge = self.charge(holder, inner.arena.pages_for(bytes))?; // owned by the lease's payload
        let mut chunks = Vec::with_capacity(pinned.len());
        for (i, loc) in pinned.locations().iter().enumerate() {
            chunks.push(ChunkMeta {
                key: loc.key,
                len: loc.len as u64,
                checksum: pinned.checksum(i)?,
            });
        }
        let pages = inner.arena.pages_for(bytes);
        let payload = StagedLease {
            data: StagedData::Store { chunks: pinned },
            chunks: chunks.clone(),
            _charge: Some(charge),
            publications: Vec::new(),
        };
        let lease_id = self.begin(holder, incarnation, Vec::new()).grant(payload, pages, ttl)?;
        Ok((lease_id, chunks, ttl.as_millis() as u32, None))
    }

    /// Stages the leading published keys: host publications with no copy (the lease
    /// holds them and sends from the cache), device publications of one cache gathered
    /// into staging pages. `None` when the first key is not published (the store
    /// serves the request).
    async fn stage_published(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        holder: &Holder,
        incarnation: Option<u64>,
        select: Option<&WireSelection>,
    ) -> Option<StageResult> {
        // The leading live publications, held by a new lease from the same instant
        // (under one lock): none can be released while this stage reads them.
        let (pubs, leading, staging) = {
            let mut ledger = self.inner.ledger.lock();
            let found = ledger.lookup(keys, Instant::now());
            let first = found.first()?;
            let mut pubs: Vec<(PubId, Arc<Publication>)> = Vec::with_capacity(found.len());
            let leading = match (&first.1.source, select) {
                // A selection takes every key (it checks they share one cache).
                (_, Some(select)) => {
                    pubs.extend(found.iter().map(|(id, p)| (*id, Arc::clone(p))));
                    Leading::Selected(select)
                }
                // The leading host publications, sent in place.
                (PubSource::Host { .. }, None) => {
                    let (mut chunks, mut caches) = (Vec::new(), Vec::new());
                    for (id, p) in &found {
                        let PubSource::Host { cache, sums } = &p.source else {
                            break;
                        };
                        chunks.push(ChunkMeta {
                            key: p.key,
                            len: p.len as u64,
                            checksum: sums.checksum,
                        });
                        caches.push(cache.clone());
                        pubs.push((*id, Arc::clone(p)));
                    }
                    Leading::Host { chunks, caches }
                }
                // The leading publications of the first one's device cache, gathered.
                (PubSource::Device { cache }, None) => {
                    pubs.extend(
                        found
                            .iter()
                            .take_while(|(_, p)| p.source.is_of_device(cache))
                            .map(|(id, p)| (*id, Arc::clone(p))),
                    );
                    Leading::Device(cache.clone())
                }
            };
            let terms = LeaseTerms {
                owner: holder.identity.clone(),
                owner_incarnation: incarnation,
                claimed_by: holder.claimed.clone(),
                publications: pubs.iter().map(|(id, _)| *id).collect(),
            };
            let id = ledger.begin(terms, rand::random::<LeaseId>);
            (
                pubs.into_iter().map(|(_, p)| p).collect::<Vec<_>>(),
                leading,
                Staging {
                    producer: self,
                    id,
                    armed: true,
                },
            )
        };
        let (chunks, data, charge) = match leading {
            Leading::Selected(select) => {
                return Some(self.stage_selected_pubs(staging, keys, pubs, select, ttl, holder).await)
            }
            Leading::Host { chunks, caches } => (chunks, StagedData::Pinned { caches }, None),
            Leading::Device(cache) => {
                let frames = pubs.iter().map(|p| (p.key, p.len, p.ranges.clone())).collect();
                match self.gather_device(&cache, frames, holder).await {
                    Ok((chunks, data, charge)) => (chunks, data, Some(charge)),
                    Err(e) => return Some(Err(e)),
                }
            }
        };
        let pages = charge.as_ref().map_or(0, Charge::pages);
        let payload = StagedLease {
            data,
            chunks: chunks.clone(),
            _charge: charge,
            publications: pubs,
        };
        Some(
            staging
                .grant(payload, pages, ttl)
                .map(|lease_id| (lease_id, chunks, ttl.as_millis() as u32, None)),
        )
    }

    /// Stages the selected part of publications `pubs` (the leading published ones
    /// of `keys`): all keys must be published, from one cache. A host cache's
    /// selected bytes are sent from the cache under checksums made of the units taken
    /// at publication (read again only where the units do not cover a range exactly);
    /// a device cache's are gathered into staging pages.
    async fn stage_selected_pubs(
        &self,
        staging: Staging<'_>,
        keys: &[ChunkKey],
        pubs: Vec<Arc<Publication>>,
        select: &WireSelection,
        ttl: Duration,
        holder: &Holder,
    ) -> StageResult {
        let ttl_ms = ttl.as_millis() as u32;
        if pubs.len() < keys.len() {
            // Not everything is published (yet): a selection over missing blocks
            // cannot be served, so the request is a miss.
            return Ok((0, Vec::new(), ttl_ms, None));
        }
        let cache = pubs[0].source.cache();
        if let Some(p) = pubs.iter().find(|p| !p.source.cache().ptr_eq(&cache)) {
            let why = format!("keys {} and {} are published from different caches", pubs[0].key, p.key);
            return Err(SelectionError::Unsupported(why).into());
        }
        let map = cache.map().clone();
        let lists: Vec<(ChunkKey, &[u32])> = pubs.iter().map(|p| (p.key, p.blocks.as_slice())).collect();
        let limits = Limits::default();
        let plan = plan_source(&lists, &map, select, limits.max_keys, limits.max_bulk_bytes)?;
        let shape = plan.shape.clone();
        let (chunks, data, charge) = match cache {
            KvCacheRef::Host(cache) => {
                // From the units taken at publication wherever they cover the selected
                // ranges: no second pass, and checked against the published bytes.
                let units: Vec<&UnitCrcs> = pubs
                    .iter()
                    .filter_map(|p| match &p.source {
                        PubSource::Host { sums, .. } => Some(&sums.units),
                        PubSource::Device { .. } => None,
                    })
                    .collect();
                let mut chunks = Vec::with_capacity(plan.frame_count());
                for i in 0..plan.frame_count() {
                    let (key, len) = plan.frame(i);
                    let checksum = selected_checksum(&units, &cache, &plan.frame_ranges(i))?;
                    chunks.push(ChunkMeta {
                        key,
                        len: len as u64,
                        checksum,
                    });
                }
                let data = StagedData::Selected {
                    plan: Arc::new(plan),
                    cache,
                };
                (chunks, data, None)
            }
            KvCacheRef::Device(cache) => {
                let all = plan.all_ranges()?;
                let frames = all
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| {
                        let (key, len) = plan.frame(i);
                        (key, len, r)
                    })
                    .collect();
                let (chunks, data, charge) = self.gather_device(&cache, frames, holder).await?;
                (chunks, data, Some(charge))
            }
        };
        let pages = charge.as_ref().map_or(0, Charge::pages);
        let payload = StagedLease {
            data,
            chunks: chunks.clone(),
            _charge: charge,
            publications: pubs,
        };
        let lease_id = staging.grant(payload, pages, ttl)?;
        Ok((lease_id, chunks, ttl_ms, Some(shape)))
    }

    /// Gathers device publications into fresh staging pages (device-to-host on the
    /// cache's copy stream, waited for at most the cache's op timeout) and checksums
    /// them. On timeout or cancel the pages are quarantined until the device confirms.
    ///
    /// `frames`: what to gather, one staged chunk each: its key, length and ranges in
    /// the cache (a publication's, or a frame of a selection).
    async fn gather_device(
        &self,
        cache: &Arc<DeviceKvCache>,
        frames: Vec<GatherFrame>,
        holder: &Holder,
    ) -> Result<(Vec<ChunkMeta>, StagedData, Charge), PeerError> {
        let inner = &self.inner;
        let total: usize = frames.iter().map(|f| f.1).sum();
        let pages = inner.arena.pages_for(total);
        let lease = inner.arena.try_alloc(pages).map_err(|_| {
            inner.counters.busy.fetch_add(1, Ordering::Relaxed);
            PeerError::StagingExhausted {
                needed: pages,
                free: inner.arena.stats().free_pages,
            }
        })?;
        let charge = self.charge(holder, lease.page_count())?;
        let mut offsets = Vec::with_capacity(frames.len());
        let mut plan = Vec::with_capacity(frames.len());
        let mut metas = Vec::with_capacity(frames.len());
        let mut at = 0;
        for (key, len, ranges) in frames {
            offsets.push(at);
            plan.push((at, ranges));
            metas.push((key, len));
            at += len;
        }
        let device_err = |error| PeerError::Device {
            cache: cache.name().to_string(),
            error,
        };
        let gathered = async {
            let pending = cache.gather(&plan, lease, "stage: device-to-host gather")?;
            let deadline = pending.event().meta().submitted() + cache.op_timeout();
            pending.wait(deadline).await
        }
        .await;
        let lease = match gathered {
            Ok(l) => l,
            Err(e) => {
                // The pages are back (failed copy) or quarantined (timeout): either way
                // no longer this peer's (the charge drops here).
                drop(charge);
                return Err(device_err(e));
            }
        };
        let mut chunks = Vec::with_capacity(metas.len());
        for (&(key, len), &off) in metas.iter().zip(&offsets) {
            let mut crc = 0u32;
            for s in lease.io_slices(off, len)? {
                crc = crate::checksum::append(crc, s);
            }
            chunks.push(ChunkMeta {
                key,
                len: len as u64,
                checksum: crc,
            });
        }
        Ok((chunks, StagedData::Pages { lease, offsets }, charge))
    }
}
