//! Published block leases: the zero-copy ("pin") way a producer offers blocks of an
//! engine's own registered cache (a [`KvCache`] in host memory, or device memory).
//!
//! `Producer::publish` (through [`Engine::publish`](crate::engine::Engine::publish))
//! records a chunk key for some blocks of a registered cache. The engine promises not to write those blocks until kvferry
//! reports them released (the "delay free blocks" contract inference engines already
//! keep for their connectors); kvferry sends them to consumers with vectored writes
//! straight from the cache, with the checksum computed at publication.
//!
//! Blocks in **device** memory ([`DeviceKvCache`]) are published the same way, by the
//! same call: a publication is of one [`KvCacheRef`] (either memory kind) and holds
//! its registration until it is released. Only the data path differs: when a consumer
//! asks, device blocks are gathered into staging pages on the cache's copy stream (a
//! device-to-host copy with a bounded wait) and sent from there. `PubSource` keeps
//! what each kind needs (a host publication's checksum, computed at publication).
//!
//! Who holds a publication, and when it is released, is decided by the producer's
//! [ledger](super::ledger): it is retired (leaves the key table) by the consumer's
//! `Done` (when published `once`), a consumer's `Release`, TTL expiry, the engine's
//! unpublish, replacement or shutdown, and *released* — reported once through the
//! [`ReleaseQueue`] — when no staged lease holds it any more. A send in progress holds
//! its lease checked out, so it always finishes from live, unreleased blocks: the
//! engine hears "released" only after the last socket write stopped.
//!
//! # Cancellation
//!
//! The only future here, the release queue's `wait`, holds a `Notified` and nothing
//! else: dropping it loses no release (the queue keeps them until `take`).

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::device::{DeviceKvCache, KvCacheRef};
use crate::layout::KvCache;
use crate::wire::ChunkKey;

/// Why a publication was released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// A consumer's `Done` for a transfer that sent it (publications made `once`).
    Done,
    /// Its TTL passed without a `Done`.
    Expired,
    /// The engine released it explicitly.
    Released,
    /// Published again under the same key.
    Replaced,
    /// The producer shut down.
    Shutdown,
    /// A consumer said it will not pull it (`Release`, publications made `once`).
    Declined,
}

/// A publication's blocks are free for the engine again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    /// The key it was published under.
    pub key: ChunkKey,
    /// Why.
    pub reason: ReleaseReason,
}

/// Where released publications are reported.
#[derive(Default)]
pub(crate) struct ReleaseQueue {
    queue: Mutex<Vec<Released>>,
    notify: tokio::sync::Notify,
}

impl ReleaseQueue {
    pub(crate) fn push(&self, r: Released) {
        self.queue.lock().push(r);
        self.notify.notify_waiters();
    }

    /// Takes everything reported so far.
    pub(crate) fn take(&self) -> Vec<Released> {
        std::mem::take(&mut *self.queue.lock())
    }

    /// Waits until something is reported (or `deadline`).
    pub(crate) async fn wait(&self, deadline: Instant) {
        let notified = self.notify.notified();
        if !self.queue.lock().is_empty() {
            return;
        }
        let _ = tokio::time::timeout_at(deadline, notified).await;
    }
}

/// Where a publication's blocks live.
pub(crate) enum PubSource {
    /// Host memory: sent straight from the cache under `sums`, taken at publication
    /// (or shared with a live publication of the same blocks).
    Host { cache: Arc<KvCache>, sums: Arc<HostSums> },
    /// Device memory: gathered into staging pages (D2H) when a consumer asks.
    Device { cache: Arc<DeviceKvCache> },
}

/// The checksums of a host publication's bytes. Publications of the same blocks of
/// one cache published while an earlier one is still live (the reader slots of one
/// request) share them: the engine promised not to write those blocks meanwhile, so
/// one pass describes them all.
#[derive(Debug)]
pub(crate) struct HostSums {
    /// The crc32c of the whole chunk, taken at publication.
    pub checksum: u32,
    /// The crc of every 4 KiB unit, taken in the same pass (what a selected get's
    /// checksums are made of, see [`super::unit_crcs`]).
    pub units: super::unit_crcs::UnitCrcs,
}

impl PubSource {
    /// The cache the blocks live in.
    pub(crate) fn cache(&self) -> KvCacheRef {
        match self {
            PubSource::Host { cache, .. } => KvCacheRef::Host(cache.clone()),
            PubSource::Device { cache } => KvCacheRef::Device(cache.clone()),
        }
    }

    /// True for blocks of device cache `cache`.
    pub(crate) fn is_of_device(&self, cache: &Arc<DeviceKvCache>) -> bool {
        matches!(self, PubSource::Device { cache: c } if Arc::ptr_eq(c, cache))
    }
}

/// One published chunk: blocks of a cache, pinned until the ledger releases it. Its
/// key table entry, expiry and `once` flag live in the ledger.
pub(crate) struct Publication {
    pub key: ChunkKey,
    pub source: PubSource,
    /// The chunk's ranges in its cache's address space.
    pub ranges: Vec<(usize, usize)>,
    /// The published block ids, in order (what a selection's positions index).
    pub blocks: Vec<u32>,
    pub len: usize,
}

impl std::fmt::Debug for Publication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Publication({}, {} bytes)", self.key, self.len)
    }
}
