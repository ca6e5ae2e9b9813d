//! Publishing blocks of an engine's own registered cache (see [`crate::peer::publish`]):
//! a publication is recorded in the ledger under its key, holding its registration
//! until it is released; the engine hears of releases through
//! [`take_released`](Producer::take_released).
//!
//! Checksums: a host publication's crc32c, and the crc of every 4 KiB unit (what a
//! selected get's checksums are made of, see [`crate::peer::unit_crcs`]), are taken
//! at publication, in one pass over the blocks. A publication of the same blocks of
//! the same cache as the last host publication, while that one is still live, shares
//! its checksums ([`live_sums_of`](Producer::live_sums_of)): a request published under
//! several reader-slot keys in a row is read once. Device publications are checksummed
//! when they are gathered for a stage.
//!
//! # Cancellation
//!
//! The only future here, [`wait_released`](Producer::wait_released), holds a
//! notification and nothing else: dropping it loses no release (the queue keeps them
//! until they are taken).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Producer;
use crate::device::KvCacheRef;
use crate::layout::KvCache;
use crate::peer::error::PeerError;
use crate::peer::ledger::RegId;
use crate::peer::publish::{HostSums, PubSource, Publication, Released};
use crate::peer::unit_crcs::UnitCrcs;
use crate::wire::ChunkKey;

impl Producer {
    /// Publishes `blocks` of `cache` — registration `reg`, held by the publication
    /// until it is released — under `key`. The engine must not write the blocks until
    /// they are reported released ([`take_released`](Self::take_released)): after a
    /// consumer's `Done` when `once`, after `ttl` (capped at `max_ttl`; zero = the
    /// default TTL), or after [`unpublish`](Self::unpublish). Publishing a key again
    /// replaces (and releases) the earlier publication.
    ///
    /// One path for both memory kinds; only how the blocks are sent differs: host
    /// blocks are sent straight from the cache (zero copy, checksum computed now),
    /// device blocks are gathered into staging pages (device-to-host on the cache's
    /// copy stream, bounded by its op timeout) when a consumer asks, and sent from
    /// there.
    pub(crate) fn publish(
        &self,
        key: ChunkKey,
        cache: KvCacheRef,
        reg: u64,
        blocks: &[u32],
        ttl: Duration,
        once: bool,
    ) -> Result<(), PeerError> {
        cache
            .map()
            .check_blocks(blocks)
            .map_err(|e| PeerError::InvalidArgument(format!("publish {key}: {e}")))?;
        let len = cache.map().chunk_bytes(blocks.len());
        let ranges = cache.chunk_ranges(blocks, len)?;
        let source = match cache {
            KvCacheRef::Host(cache) => {
                let sums = match self.live_sums_of(&cache, blocks) {
                    Some(sums) => sums,
                    None => {
                        let (units, checksum) = UnitCrcs::compute(&cache, &ranges)?;
                        Arc::new(HostSums { checksum, units })
                    }
                };
                PubSource::Host { cache, sums }
            }
            KvCacheRef::Device(cache) => PubSource::Device { cache },
        };
        let p = Publication {
            key,
            source,
            ranges,
            blocks: blocks.to_vec(),
            len,
        };
        self.insert_publication(p, ttl, once, RegId(reg))
    }

    /// The checksums of the last host publication if it is of `blocks` of `cache` and
    /// still live (published, not expired): the engine promised not to write those
    /// blocks since it was taken, so it describes them now. A request published under
    /// several reader-slot keys in a row is read once instead of once per key.
    fn live_sums_of(&self, cache: &Arc<KvCache>, blocks: &[u32]) -> Option<Arc<HostSums>> {
        let last = self.inner.last_host_pub.lock().upgrade()?;
        let PubSource::Host { cache: c, sums } = &last.source else {
            return None;
        };
        if !Arc::ptr_eq(c, cache) || last.blocks != blocks {
            return None;
        }
        let ledger = self.inner.ledger.lock();
        let found = ledger.lookup(std::slice::from_ref(&last.key), Instant::now());
        let live = found.first().is_some_and(|(_, p)| Arc::ptr_eq(p, &last));
        live.then(|| sums.clone())
    }

    fn insert_publication(&self, p: Publication, ttl: Duration, once: bool, reg: RegId) -> Result<(), PeerError> {
        let ttl = self.clamp_ttl(ttl);
        let key = p.key;
        let now = Instant::now();
        let p = Arc::new(p);
        let host = matches!(p.source, PubSource::Host { .. });
        let published = self
            .inner
            .ledger
            .lock()
            .publish(key, p.clone(), once, now + ttl, Some(reg), now);
        match published {
            Ok((_, out)) => {
                if host {
                    *self.inner.last_host_pub.lock() = Arc::downgrade(&p);
                }
                self.act(out);
                self.note_arrival();
                Ok(())
            }
            Err(e) => Err(PeerError::InvalidArgument(format!("publish {key}: the cache is {e}"))),
        }
    }

    /// Releases a publication now (the engine's own release). False if unknown. The
    /// release is reported once every transfer sending it has stopped.
    pub fn unpublish(&self, key: &ChunkKey) -> bool {
        let out = self.inner.ledger.lock().unpublish(key, Instant::now());
        match out {
            Some(out) => {
                self.act(out);
                true
            }
            None => false,
        }
    }

    /// Publications released since the last call: their blocks are the engine's again.
    pub fn take_released(&self) -> Vec<Released> {
        self.inner.releases.take()
    }

    /// Waits until a release is reported or `deadline` passes.
    pub async fn wait_released(&self, deadline: Instant) {
        self.inner.releases.wait(deadline).await
    }
}
