//! What a staged lease holds until the ledger lets go of it: [`StagedLease`], its
//! bytes ([`StagedData`]: store chunks, staging pages, published host blocks, a
//! selection of them, or device blocks a same-host consumer copies), its quota charge
//! and the publications it serves; and [`ProducerLedger`], the ledger over such
//! payloads. Nothing here refers to the producer: the payload is dropped (pages and
//! charges returned, publications let go of) wherever the ledger's outcome is acted on.

use std::sync::Arc;

use super::store::PinnedChunks;
use crate::layout::KvCache;
use crate::mem::Lease;
use crate::peer::ledger::Ledger;
use crate::peer::publish::Publication;
use crate::peer::quota::Charge;
use crate::peer::selection::SourcePlan;
use crate::wire::ChunkMeta;

/// What a staged lease sends from.
pub(super) enum StagedData {
    /// Store chunks, pinned in the store until the lease ends and sent from its blocks.
    Store { chunks: PinnedChunks },
    /// Staging pages holding copies of store chunks, chunk `i` at `offsets[i]`.
    Pages { lease: Lease, offsets: Vec<usize> },
    /// Published host blocks (the lease's `publications`, publication `i` in
    /// `caches[i]`), sent straight from the engine's caches.
    Pinned { caches: Vec<Arc<KvCache>> },
    /// The selected part of published host blocks of one `cache`, sent straight from
    /// it frame by frame.
    Selected { plan: Arc<SourcePlan>, cache: Arc<KvCache> },
    /// Published device blocks of one `cache` (the lease's `publications`), pinned
    /// for a consumer that copies them device to device (device IPC); never sent
    /// over the socket.
    Device { _cache: Arc<crate::device::DeviceKvCache> },
}

/// A staged lease's payload: what it sends from and the quota charge of its pages.
/// Who owns it and until when is the ledger's.
pub(super) struct StagedLease {
    pub(super) data: StagedData,
    pub(super) chunks: Vec<ChunkMeta>,
    /// Its staging pages' quota charge (uncharged when the payload drops, on every
    /// path: `Done`, expiry, release, a failed or aborted send, shutdown).
    pub(super) _charge: Option<Charge>,
    /// The publications it sends (what `data` reads from for pinned and selected
    /// leases; empty for store chunks).
    pub(super) publications: Vec<Arc<Publication>>,
}

impl StagedLease {
    /// Chunk (or frame) `i`'s bytes, as slices of the memory they are served from:
    /// the store, staging pages, or the engine's cache (the lease holds the
    /// publication, and so the cache, while the slices are used).
    pub(super) fn parts(&self, i: usize) -> Result<Vec<&[u8]>, crate::mem::MemError> {
        let len = self.chunks[i].len as usize;
        match &self.data {
            StagedData::Store { chunks } => chunks.io_slices(i),
            StagedData::Pages { lease, offsets } => lease.io_slices(offsets[i], len),
            StagedData::Pinned { caches } => caches[i].io_slices(&self.publications[i].ranges),
            // A selection: frame `i`'s ranges of the (one) host cache.
            StagedData::Selected { plan, cache } => cache.io_slices(&plan.frame_ranges(i)),
            // Granted by device IPC: the consumer copies it; nothing is sent from here.
            StagedData::Device { .. } => Err(crate::mem::MemError::InvalidConfig(
                "a device-IPC grant is copied by the consumer, never sent over the socket".into(),
            )),
        }
    }
}

/// The ledger of a producer.
pub(super) type ProducerLedger = Ledger<StagedLease, Arc<Publication>>;
