//! [`KvCache`]: registered memory holding a paged KV cache, and the [`BlockMap`] that
//! says where each block lives in it. It is what a producer publishes blocks of and
//! what a consumer lands blocks into.
//!
//! The cache holds its memory through an `Arc`; every transfer that touches the cache
//! holds the cache, so the memory (and any foreign object it keeps alive, such as a
//! Python array) outlives every copy and socket operation on it.

use std::sync::Arc;

use super::{BlockMap, KvLayout, LayoutError, Span};
use crate::mem::{HostMemory, MemError, Region, RegionSet};

/// A registered paged KV cache.
pub struct KvCache {
    name: String,
    memory: Arc<RegionSet>,
    map: BlockMap,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("name", &self.name)
            .field("blocks", &self.map.blocks())
            .field("block_bytes", &self.map.block_bytes())
            .finish()
    }
}

impl KvCache {
    /// A cache over `parts`: each region with the spans of every block that lie in it
    /// (offsets relative to that region). A block's canonical bytes are the spans in
    /// the order given, region after region.
    pub fn new(
        name: impl Into<String>,
        parts: Vec<(Arc<Region>, Vec<Span>)>,
        blocks: u32,
    ) -> Result<KvCache, LayoutError> {
        let regions: Vec<Arc<Region>> = parts.iter().map(|(r, _)| r.clone()).collect();
        let memory = RegionSet::new(regions);
        let mut spans = Vec::new();
        for (i, (region, rs)) in parts.iter().enumerate() {
            // Each region's spans must stay inside it.
            let local = BlockMap::new(rs.clone(), blocks)?;
            if local.extent() > region.len() {
                return Err(LayoutError::Invalid(format!(
                    "{}: blocks need {} bytes but the buffer has {}",
                    region.name(),
                    local.extent(),
                    region.len()
                )));
            }
            let base = memory.start_of(i);
            spans.extend(rs.iter().map(|s| Span {
                offset: s.offset + base,
                ..*s
            }));
        }
        let map = BlockMap::new(spans, blocks)?;
        Ok(KvCache {
            name: name.into(),
            memory: Arc::new(memory),
            map,
        })
    }

    /// One buffer of consecutive blocks of `block_bytes` each; the buffer's length must
    /// be a multiple of `block_bytes`.
    pub fn contiguous(region: Arc<Region>, block_bytes: usize) -> Result<KvCache, LayoutError> {
        if block_bytes == 0 || region.is_empty() || !region.len().is_multiple_of(block_bytes) {
            return Err(LayoutError::Invalid(format!(
                "{}: buffer of {} bytes is not a whole number of {block_bytes}-byte blocks",
                region.name(),
                region.len()
            )));
        }
        let blocks = u32::try_from(region.len() / block_bytes)
            .map_err(|_| LayoutError::Invalid("more than 2^32 blocks".into()))?;
        let name = region.name().to_string();
        let span = Span {
            offset: 0,
            stride: block_bytes,
            len: block_bytes,
        };
        KvCache::new(name, vec![(region, vec![span])], blocks)
    }

    /// A region laid out by a [`KvLayout`].
    pub fn with_layout(region: Arc<Region>, layout: &KvLayout) -> Result<KvCache, LayoutError> {
        if region.len() < layout.region_bytes() {
            return Err(LayoutError::Invalid(format!(
                "{}: region of {} bytes is smaller than the layout's {}",
                region.name(),
                region.len(),
                layout.region_bytes()
            )));
        }
        let map = BlockMap::from_layout(layout);
        let name = region.name().to_string();
        KvCache::new(name, vec![(region, map.spans().to_vec())], layout.blocks)
    }

    /// The cache's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where blocks live.
    pub fn map(&self) -> &BlockMap {
        &self.map
    }

    /// The memory (all regions, end to end).
    pub fn memory(&self) -> &Arc<RegionSet> {
        &self.memory
    }

    /// Memory ranges of a chunk made of `blocks`, cut to its first `len` bytes.
    pub fn chunk_ranges(&self, blocks: &[u32], len: usize) -> Result<Vec<(usize, usize)>, LayoutError> {
        self.map.chunk_ranges_cut(blocks, len)
    }

    /// The crc32c of `ranges`' bytes, in order, read in place.
    pub fn checksum(&self, ranges: &[(usize, usize)]) -> Result<u32, MemError> {
        self.append_checksum(0, ranges)
    }

    /// `crc` extended by the bytes of `ranges`, in order.
    pub fn append_checksum(&self, crc: u32, ranges: &[(usize, usize)]) -> Result<u32, MemError> {
        let mut crc = crc;
        for s in self.io_slices(ranges)? {
            crc = crate::checksum::append(crc, s);
        }
        Ok(crc)
    }

    /// The bytes of `ranges` as slices, for a vectored socket write.
    ///
    /// The slices alias memory the engine shares with kvferry: they are meaningful
    /// only for blocks the engine promised not to write (a published block lease), and
    /// must not outlive the cache (they borrow it).
    pub fn io_slices(&self, ranges: &[(usize, usize)]) -> Result<Vec<&[u8]>, MemError> {
        let mut out = Vec::with_capacity(ranges.len());
        for &(off, len) in ranges {
            self.memory.for_each_run(off, len, &mut |p, n| {
                // SAFETY: `for_each_run` yields in-bounds runs of live memory owned by
                // this cache's regions, which the borrow of `self` keeps alive; the
                // caller reads only blocks nobody writes (see the method's contract).
                out.push(unsafe { std::slice::from_raw_parts(p as *const u8, n) })
            })?;
        }
        Ok(out)
    }

    /// The bytes of `ranges` as mutable slices, for a vectored socket read straight
    /// into destination blocks.
    ///
    /// # Safety
    ///
    /// The ranges must not overlap each other (distinct blocks of one transfer, see
    /// [`BlockMap::check_blocks`]), no other transfer may target them at the same time,
    /// and the engine must not touch them until the transfer reports them quiet.
    #[allow(clippy::mut_from_ref)] // shared memory by design: exclusivity is the caller's `# Safety` duty
    pub unsafe fn io_slices_mut(&self, ranges: &[(usize, usize)]) -> Result<Vec<&mut [u8]>, MemError> {
        let mut out = Vec::with_capacity(ranges.len());
        for &(off, len) in ranges {
            self.memory.for_each_run(off, len, &mut |p, n| {
                // SAFETY: in-bounds runs of live memory kept alive by the borrow of
                // `self`; exclusivity is the caller's obligation (see `# Safety`).
                out.push(unsafe { std::slice::from_raw_parts_mut(p, n) })
            })?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Arrangement, Preset};

    #[test]
    fn per_layer_tensors_form_one_cache() {
        // Two "layer tensors" of 4 blocks x 8 bytes each: block i = layer0[i] ++ layer1[i].
        let l0 = Arc::new(Region::host("l0", 32).unwrap());
        let l1 = Arc::new(Region::host("l1", 32).unwrap());
        for b in 0..4u8 {
            l0.write(b as usize * 8, &[b; 8]).unwrap();
            l1.write(b as usize * 8, &[100 + b; 8]).unwrap();
        }
        let span = Span {
            offset: 0,
            stride: 8,
            len: 8,
        };
        let c = KvCache::new("kv", vec![(l0, vec![span]), (l1, vec![span])], 4).unwrap();
        assert_eq!(c.map().block_bytes(), 16);
        let r = c.chunk_ranges(&[2], 16).unwrap();
        let bytes: Vec<u8> = c.io_slices(&r).unwrap().concat();
        assert_eq!(bytes, [[2u8; 8], [102u8; 8]].concat());
        assert_eq!(c.checksum(&r).unwrap(), crc32c::crc32c(&bytes));
        let too_big = Span {
            offset: 0,
            stride: 8,
            len: 8,
        };
        let small = Arc::new(Region::host("s", 16).unwrap());
        assert!(KvCache::new("bad", vec![(small, vec![too_big])], 4).is_err());
    }

    #[test]
    fn layout_and_contiguous_constructors() {
        let l = KvLayout::preset(Preset::Tiny, 4, Arrangement::LayerSeparate).unwrap();
        let c = KvCache::with_layout(Arc::new(Region::host("kv", l.region_bytes()).unwrap()), &l).unwrap();
        assert_eq!(c.map().chunk_ranges(&[1]).unwrap(), l.chunk_ranges(&[1]).unwrap());
        assert!(KvCache::contiguous(Arc::new(Region::host("x", 100).unwrap()), 64).is_err());
        let c = KvCache::contiguous(Arc::new(Region::host("x", 128).unwrap()), 64).unwrap();
        assert_eq!(c.map().blocks(), 2);
    }
}
