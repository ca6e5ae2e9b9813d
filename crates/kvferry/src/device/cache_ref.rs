//! [`KvCacheRef`]: one KV cache type over every kind of memory — a shared handle to
//! either a host cache ([`KvCache`], engine memory the CPU addresses: a `RegionSet`)
//! or a device cache ([`DeviceKvCache`], buffers of a [`Device`](super::Device): the
//! host, sim or CUDA device, with its copy streams and op timeout).
//!
//! It lives in the device layer because that is the lowest layer that sees both kinds
//! (`device` imports `layout`). Everything above speaks of caches through it: the
//! engine registers, publishes and deregisters one `KvCacheRef` (one registration map,
//! one id space), the producer's publications and the consumer's destinations hold
//! one. [`From`] conversions from both cache types (owned or in an `Arc`) keep call
//! sites short: `engine.register(host_cache)` and `engine.register(Arc::new(dev))`.
//!
//! # Semantics
//!
//! - **Shape is kind-independent**: both kinds have a name and a [`BlockMap`]; a
//!   chunk's canonical bytes and ranges are the same whatever memory holds them, so
//!   selections, capacities and compatibility checks need no match on the kind.
//! - **The data path is kind-specific**, and only there is the kind matched: host
//!   blocks are sent straight from the cache with vectored writes and received
//!   straight into it (the direct path) or landed by the copy engine; device blocks
//!   are gathered device-to-host into staging pages before they are sent, and received
//!   into staging pages then scattered host-to-device (a device destination is always
//!   staged). Both device copies run on the cache's own streams with waits bounded by
//!   its op timeout.
//! - **Identity** is the shared allocation: two handles are the same cache when
//!   [`ptr_eq`](KvCacheRef::ptr_eq) says so (clones of one handle, or handles made
//!   from clones of one `Arc`).

use std::sync::Arc;

use super::DeviceKvCache;
use crate::layout::{BlockMap, KvCache, LayoutError};

/// A KV cache in host or device memory (a cheap, shared handle).
#[derive(Clone, Debug)]
pub enum KvCacheRef {
    /// Host memory: sent and received in place.
    Host(Arc<KvCache>),
    /// Device memory: gathered into and scattered from staging pages on the cache's
    /// copy streams.
    Device(Arc<DeviceKvCache>),
}

impl KvCacheRef {
    /// The cache's name.
    pub fn name(&self) -> &str {
        match self {
            KvCacheRef::Host(c) => c.name(),
            KvCacheRef::Device(c) => c.name(),
        }
    }

    /// Where blocks live.
    pub fn map(&self) -> &BlockMap {
        match self {
            KvCacheRef::Host(c) => c.map(),
            KvCacheRef::Device(c) => c.map(),
        }
    }

    /// Ranges (in the cache's address space) of a chunk of `blocks`, cut to its first
    /// `len` bytes.
    pub fn chunk_ranges(&self, blocks: &[u32], len: usize) -> Result<Vec<(usize, usize)>, LayoutError> {
        self.map().chunk_ranges_cut(blocks, len)
    }

    /// The memory kind, for messages and metrics: `"host"`, or the device's kind
    /// (`"host"`, `"sim"`, `"cuda"`) for a device cache.
    pub fn memory_kind(&self) -> String {
        match self {
            KvCacheRef::Host(_) => "host".to_string(),
            KvCacheRef::Device(c) => c.device().kind().to_string(),
        }
    }

    /// True for a cache in device memory.
    pub fn is_device(&self) -> bool {
        matches!(self, KvCacheRef::Device(_))
    }

    /// The host cache, if it is one.
    pub fn as_host(&self) -> Option<&Arc<KvCache>> {
        match self {
            KvCacheRef::Host(c) => Some(c),
            KvCacheRef::Device(_) => None,
        }
    }

    /// The device cache, if it is one.
    pub fn as_device(&self) -> Option<&Arc<DeviceKvCache>> {
        match self {
            KvCacheRef::Host(_) => None,
            KvCacheRef::Device(c) => Some(c),
        }
    }

    /// True when both handles are the same cache (the same allocation).
    pub fn ptr_eq(&self, other: &KvCacheRef) -> bool {
        match (self, other) {
            (KvCacheRef::Host(a), KvCacheRef::Host(b)) => Arc::ptr_eq(a, b),
            (KvCacheRef::Device(a), KvCacheRef::Device(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl From<KvCache> for KvCacheRef {
    fn from(c: KvCache) -> Self {
        KvCacheRef::Host(Arc::new(c))
    }
}

impl From<Arc<KvCache>> for KvCacheRef {
    fn from(c: Arc<KvCache>) -> Self {
        KvCacheRef::Host(c)
    }
}

impl From<&Arc<KvCache>> for KvCacheRef {
    fn from(c: &Arc<KvCache>) -> Self {
        KvCacheRef::Host(c.clone())
    }
}

impl From<DeviceKvCache> for KvCacheRef {
    fn from(c: DeviceKvCache) -> Self {
        KvCacheRef::Device(Arc::new(c))
    }
}

impl From<Arc<DeviceKvCache>> for KvCacheRef {
    fn from(c: Arc<DeviceKvCache>) -> Self {
        KvCacheRef::Device(c)
    }
}

impl From<&Arc<DeviceKvCache>> for KvCacheRef {
    fn from(c: &Arc<DeviceKvCache>) -> Self {
        KvCacheRef::Device(c.clone())
    }
}

impl From<&KvCacheRef> for KvCacheRef {
    fn from(c: &KvCacheRef) -> Self {
        c.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::device::{Device, SimConfig, SimDevice};
    use crate::mem::Region;

    #[tokio::test]
    async fn both_kinds_share_shape_and_identity() {
        let host = Arc::new(KvCache::contiguous(Arc::new(Region::host("h", 128).unwrap()), 64).unwrap());
        let dev: Arc<dyn Device> = SimDevice::new(SimConfig::new(0)).unwrap();
        let buf = dev.alloc(128).unwrap();
        let d = Arc::new(DeviceKvCache::contiguous("d", dev, buf, 64, Duration::from_secs(1)).unwrap());
        let (h, d): (KvCacheRef, KvCacheRef) = (host.clone().into(), (&d).into());
        assert_eq!(h.map().blocks(), 2);
        assert_eq!(d.map().blocks(), 2);
        assert_eq!(h.chunk_ranges(&[1], 64).unwrap(), d.chunk_ranges(&[1], 64).unwrap());
        assert_eq!((h.name(), d.name()), ("h", "d"));
        assert!(!h.is_device() && d.is_device());
        assert_eq!((h.memory_kind().as_str(), d.memory_kind().as_str()), ("host", "sim"));
        assert!(h.ptr_eq(&KvCacheRef::from(&host)));
        assert!(!h.ptr_eq(&d));
        assert!(h.as_host().is_some() && h.as_device().is_none());
        assert!(d.as_device().is_some() && d.as_host().is_none());
    }
}
