//! The producer's local chunk store: key → chunk (block ids in a registered host
//! region laid out by a [`KvLayout`]), bounded by a chunk capacity and by the region's
//! blocks, evicting the least recently used chunk.
//!
//! A chunk being sent is **pinned**: its blocks cannot be evicted or reused until the
//! lease that serves it ends. The pin is released by dropping a [`ChunkPins`], which
//! the lease's payload owns (store chunks are sent in place, from their blocks) — so it
//! is released after the socket write stopped, on every path. ([`PinnedRegion`] offers
//! pinned chunks as a copy source to an embedder that gathers them itself.)
//!
//! Eviction skips pinned chunks; a chunk replaced while pinned is **retired**: it leaves
//! the key table at once (lookups miss it, the key holds the new chunk) and waits in a
//! separate retired table, keyed by its generation — a number unique to each insertion —
//! until its last pin drops, which frees its blocks. Internal bookkeeping never shares a
//! keyspace with client keys, so no key a client chooses can overwrite or reach a retired
//! entry.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::layout::KvLayout;
use crate::mem::{HostMemory, MemError, Region};
use crate::peer::error::PeerError;
use crate::wire::ChunkKey;

#[derive(Debug)]
struct Entry {
    blocks: Vec<u32>,
    len: usize,
    pins: usize,
    /// The crc32c of the chunk's `len` bytes in canonical order, when known.
    checksum: Option<u32>,
    /// Identity of this insertion (pins refer to it).
    gen: u64,
    /// Last use, for LRU.
    tick: u64,
}

struct State {
    /// Live chunks, by client key.
    map: HashMap<ChunkKey, Entry>,
    /// Chunks replaced while pinned, by generation, until their last pin drops.
    retired: HashMap<u64, Entry>,
    free_blocks: Vec<u32>,
    /// Monotonic counter for generations and LRU ticks.
    tick: u64,
}

/// Store counters.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct StoreStats {
    /// Chunks held.
    pub chunks: usize,
    /// Capacity in chunks.
    pub capacity: usize,
    /// Free blocks in the region.
    pub free_blocks: usize,
    /// Chunks replaced while pinned, holding their blocks until unpinned.
    pub retired: usize,
}

/// The chunk store. Cheap to clone.
#[derive(Clone)]
pub struct ChunkStore {
    inner: Arc<Inner>,
}

struct Inner {
    region: Arc<Region>,
    layout: KvLayout,
    capacity: usize,
    state: Mutex<State>,
}

/// A chunk found in the store: where its bytes are.
#[derive(Clone, Debug)]
pub struct ChunkLocation {
    /// The key.
    pub key: ChunkKey,
    /// Its blocks, in order.
    pub blocks: Vec<u32>,
    /// Its length in bytes (a prefix of the blocks' canonical bytes).
    pub len: usize,
    /// The crc32c of its bytes, when the store knows it.
    pub checksum: Option<u32>,
}

/// Pins on some chunks; dropping it unpins them (and frees blocks of chunks that were
/// replaced while pinned).
pub struct ChunkPins {
    store: ChunkStore,
    /// Each pinned chunk's key and generation.
    keys: Vec<(ChunkKey, u64)>,
}

impl std::fmt::Debug for ChunkPins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChunkPins({})", self.keys.len())
    }
}

impl Drop for ChunkPins {
    fn drop(&mut self) {
        let mut st = self.store.inner.state.lock();
        let st = &mut *st;
        for (key, gen) in &self.keys {
            // The pinned entry is live under its key, or retired under its generation.
            if let Some(e) = st.map.get_mut(key).filter(|e| e.gen == *gen) {
                debug_assert!(e.pins > 0, "unpinning an unpinned chunk");
                e.pins = e.pins.saturating_sub(1);
            } else if let Some(e) = st.retired.get_mut(gen) {
                debug_assert!(e.pins > 0, "unpinning an unpinned retired chunk");
                e.pins = e.pins.saturating_sub(1);
                if e.pins == 0 {
                    if let Some(e) = st.retired.remove(gen) {
                        st.free_blocks.extend(e.blocks);
                    }
                }
            } else {
                debug_assert!(false, "pinned chunk (generation {gen}) is gone");
            }
        }
    }
}

/// The region as a copy source, holding pins until the copy drops its plan.
pub struct PinnedRegion {
    region: Arc<Region>,
    _pins: ChunkPins,
}

impl HostMemory for PinnedRegion {
    fn size(&self) -> usize {
        self.region.size()
    }
    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError> {
        self.region.for_each_run(offset, len, f)
    }
}

impl ChunkStore {
    /// A store over `region` (which must hold `layout`), holding at most `capacity`
    /// chunks.
    pub fn new(region: Arc<Region>, layout: KvLayout, capacity: usize) -> Result<ChunkStore, PeerError> {
        if region.len() < layout.region_bytes() {
            return Err(PeerError::InvalidArgument(format!(
                "region of {} bytes is smaller than the layout's {}",
                region.len(),
                layout.region_bytes()
            )));
        }
        if capacity == 0 {
            return Err(PeerError::InvalidArgument(
                "store capacity must be at least 1 chunk".into(),
            ));
        }
        Ok(ChunkStore {
            inner: Arc::new(Inner {
                region,
                layout,
                capacity,
                state: Mutex::new(State {
                    map: HashMap::new(),
                    retired: HashMap::new(),
                    free_blocks: (0..layout.blocks).rev().collect(),
                    tick: 0,
                }),
            }),
        })
    }

    /// The region.
    pub fn region(&self) -> &Arc<Region> {
        &self.inner.region
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.inner.layout
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        let st = self.inner.state.lock();
        StoreStats {
            chunks: st.map.len(),
            capacity: self.inner.capacity,
            free_blocks: st.free_blocks.len(),
            retired: st.retired.len(),
        }
    }

    /// Registers a chunk whose bytes the caller already wrote into `blocks`.
    pub fn insert_blocks(&self, key: ChunkKey, blocks: Vec<u32>, len: usize) -> Result<(), PeerError> {
        self.insert_entry(key, blocks, len, None)
    }

    /// [`insert_blocks`](Self::insert_blocks) of a chunk whose crc32c (over its `len`
    /// bytes in canonical order) is `checksum`: serving it then needs no pass over it.
    pub fn insert_checked(&self, key: ChunkKey, blocks: Vec<u32>, len: usize, checksum: u32) -> Result<(), PeerError> {
        self.insert_entry(key, blocks, len, Some(checksum))
    }

    fn insert_entry(
        &self,
        key: ChunkKey,
        blocks: Vec<u32>,
        len: usize,
        checksum: Option<u32>,
    ) -> Result<(), PeerError> {
        if len > self.inner.layout.chunk_bytes(blocks.len()) || blocks.iter().any(|b| *b >= self.inner.layout.blocks) {
            return Err(PeerError::InvalidArgument("chunk does not fit its blocks".into()));
        }
        let mut st = self.inner.state.lock();
        st.tick += 1;
        let tick = st.tick;
        let entry = Entry {
            blocks,
            len,
            pins: 0,
            checksum,
            gen: tick,
            tick,
        };
        if let Some(old) = st.map.insert(key, entry) {
            release_locked(&mut st, old);
        }
        self.evict_locked(&mut st, 0);
        Ok(())
    }

    /// Takes `n` free blocks for a new chunk, evicting least recently used unpinned
    /// chunks as needed. The blocks are the caller's until passed to `insert_blocks`
    /// or returned with `free_blocks`.
    pub fn alloc_blocks(&self, n: usize) -> Result<Vec<u32>, PeerError> {
        let mut st = self.inner.state.lock();
        self.evict_locked(&mut st, n);
        if st.free_blocks.len() < n {
            return Err(PeerError::StoreFull {
                needed: n,
                free: st.free_blocks.len(),
            });
        }
        let at = st.free_blocks.len() - n;
        Ok(st.free_blocks.split_off(at))
    }

    /// Returns blocks taken with `alloc_blocks` that were not inserted.
    pub fn free_blocks(&self, blocks: Vec<u32>) {
        self.inner.state.lock().free_blocks.extend(blocks);
    }

    /// Evicts LRU unpinned chunks until within capacity and `need_blocks` are free.
    fn evict_locked(&self, st: &mut State, need_blocks: usize) {
        loop {
            if st.map.len() <= self.inner.capacity && st.free_blocks.len() >= need_blocks {
                return;
            }
            let victim = st
                .map
                .iter()
                .filter(|(_, e)| e.pins == 0)
                .min_by_key(|(_, e)| e.tick)
                .map(|(k, _)| *k);
            match victim.and_then(|k| st.map.remove(&k)) {
                Some(e) => release_locked(st, e),
                None => return,
            }
        }
    }

    /// Number of leading keys held.
    pub fn lookup(&self, keys: &[ChunkKey]) -> usize {
        let mut st = self.inner.state.lock();
        st.tick += 1;
        let tick = st.tick;
        let mut hits = 0;
        for k in keys {
            match st.map.get_mut(k) {
                Some(e) => {
                    e.tick = e.tick.max(tick);
                    hits += 1;
                }
                None => break,
            }
        }
        hits
    }

    /// Pins the leading held chunks among `keys` (at most `max`), returning where they
    /// are and the pins.
    pub fn pin_prefix(&self, keys: &[ChunkKey], max: usize) -> (Vec<ChunkLocation>, ChunkPins) {
        let mut st = self.inner.state.lock();
        let mut locs = Vec::new();
        let mut pinned = Vec::new();
        for k in keys.iter().take(max) {
            match st.map.get_mut(k) {
                Some(e) => {
                    e.pins += 1;
                    pinned.push((*k, e.gen));
                    locs.push(ChunkLocation {
                        key: *k,
                        blocks: e.blocks.clone(),
                        len: e.len,
                        checksum: e.checksum,
                    });
                }
                None => break,
            }
        }
        (
            locs,
            ChunkPins {
                store: self.clone(),
                keys: pinned,
            },
        )
    }

    /// The region wrapped as a copy source that keeps `pins` until the copy drains.
    pub fn pinned_source(&self, pins: ChunkPins) -> PinnedRegion {
        PinnedRegion {
            region: self.inner.region.clone(),
            _pins: pins,
        }
    }

    /// Pins the leading held chunks among `keys` for serving in place (see
    /// [`PinnedChunks`]): as many as `fits(total bytes)` allows.
    pub fn pin_for_send(&self, keys: &[ChunkKey], fits: impl Fn(usize) -> bool) -> Result<PinnedChunks, PeerError> {
        let (mut locs, mut pins) = self.pin_prefix(keys, keys.len());
        let mut total = 0;
        let mut k = 0;
        while k < locs.len() && fits(total + locs[k].len) {
            total += locs[k].len;
            k += 1;
        }
        // The pins past what fits go at once.
        drop(ChunkPins {
            store: self.clone(),
            keys: pins.keys.split_off(k),
        });
        let unfit_len = locs.get(k).map(|l| l.len);
        locs.truncate(k);
        let mut ranges = Vec::with_capacity(k);
        for loc in &locs {
            ranges.push(self.ranges(loc)?);
        }
        Ok(PinnedChunks {
            store: self.clone(),
            locs,
            ranges,
            unfit_len,
            _pins: pins,
        })
    }

    /// Takes fresh blocks for a chunk of `len` bytes about to arrive (evicting as
    /// [`alloc_blocks`](Self::alloc_blocks) does); see [`PutBlocks`].
    pub fn alloc_put(&self, len: usize) -> Result<PutBlocks, PeerError> {
        let layout = &self.inner.layout;
        let n = len.div_ceil(layout.block_bytes()).max(1);
        let blocks = self.alloc_blocks(n)?;
        let ranges = match layout.chunk_ranges(&blocks) {
            Ok(mut r) => {
                truncate_ranges(&mut r, len);
                r
            }
            Err(e) => {
                self.free_blocks(blocks);
                return Err(e.into());
            }
        };
        Ok(PutBlocks {
            store: self.clone(),
            blocks,
            ranges,
            len,
        })
    }

    /// Canonical-order region ranges of a chunk's first `len` bytes.
    pub fn ranges(&self, loc: &ChunkLocation) -> Result<Vec<(usize, usize)>, PeerError> {
        let mut ranges = self.inner.layout.chunk_ranges(&loc.blocks)?;
        truncate_ranges(&mut ranges, loc.len);
        Ok(ranges)
    }
}

/// Store chunks pinned for a send straight from the store's region: the pins hold
/// until this drops, so the slices it hands out stay the chunks' bytes (pinned blocks
/// are neither evicted nor reused, and a chunk's blocks are never written once
/// inserted).
pub struct PinnedChunks {
    store: ChunkStore,
    locs: Vec<ChunkLocation>,
    ranges: Vec<Vec<(usize, usize)>>,
    /// The length of the first held chunk that did not fit, if any.
    unfit_len: Option<usize>,
    _pins: ChunkPins,
}

impl std::fmt::Debug for PinnedChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedChunks({})", self.locs.len())
    }
}

impl PinnedChunks {
    /// The pinned chunks, in order.
    pub fn locations(&self) -> &[ChunkLocation] {
        &self.locs
    }

    /// How many chunks are pinned.
    pub fn len(&self) -> usize {
        self.locs.len()
    }

    /// True when nothing is pinned.
    pub fn is_empty(&self) -> bool {
        self.locs.is_empty()
    }

    /// The length of the first held chunk that did not fit (`None`: every leading
    /// held chunk fitted).
    pub fn unfit_len(&self) -> Option<usize> {
        self.unfit_len
    }

    /// Chunk `i`'s bytes as slices of the region, in canonical order (for a vectored
    /// write).
    pub fn io_slices(&self, i: usize) -> Result<Vec<&[u8]>, MemError> {
        let mut out = Vec::with_capacity(self.ranges[i].len());
        for &(off, len) in &self.ranges[i] {
            self.store.inner.region.for_each_run(off, len, &mut |p, n| {
                // SAFETY: `for_each_run` yields in-bounds runs of the region, which the
                // store (held by `self`) keeps alive as long as the borrow of `self`.
                // The runs are blocks of a pinned chunk: pinned blocks are never freed
                // or reused while `self` holds the pins, and a chunk's blocks are not
                // written after it was inserted, so nothing writes them while read.
                out.push(unsafe { std::slice::from_raw_parts(p as *const u8, n) })
            })?;
        }
        Ok(out)
    }

    /// Chunk `i`'s crc32c: the one it was stored with, or computed in place.
    pub fn checksum(&self, i: usize) -> Result<u32, MemError> {
        if let Some(c) = self.locs[i].checksum {
            return Ok(c);
        }
        let mut crc = 0u32;
        for s in self.io_slices(i)? {
            crc = crate::checksum::append(crc, s);
        }
        Ok(crc)
    }
}

/// Fresh blocks a push lands into, owned by this guard until [`commit`](Self::commit)
/// inserts them under a key; dropped uncommitted (a failed or aborted read), they
/// return to the free list.
pub struct PutBlocks {
    store: ChunkStore,
    blocks: Vec<u32>,
    ranges: Vec<(usize, usize)>,
    len: usize,
}

impl std::fmt::Debug for PutBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PutBlocks({} blocks, {} bytes)", self.blocks.len(), self.len)
    }
}

impl PutBlocks {
    /// The blocks' first `len` bytes as mutable slices, in canonical order (for a
    /// vectored read straight into them).
    pub fn io_slices_mut(&mut self) -> Result<Vec<&mut [u8]>, MemError> {
        let mut out = Vec::with_capacity(self.ranges.len());
        for &(off, len) in &self.ranges {
            self.store.inner.region.for_each_run(off, len, &mut |p, n| {
                // SAFETY: in-bounds runs of the region, kept alive by the store `self`
                // holds. The blocks were taken off the free list for this guard alone:
                // no chunk, pin or other guard refers to them until `commit`, and the
                // `&mut self` borrow makes these slices the only access meanwhile.
                // The ranges of distinct blocks do not overlap.
                out.push(unsafe { std::slice::from_raw_parts_mut(p, n) })
            })?;
        }
        Ok(out)
    }

    /// Registers the landed bytes under `key`, with their crc32c `checksum`.
    pub fn commit(mut self, key: ChunkKey, checksum: u32) -> Result<(), PeerError> {
        let blocks = std::mem::take(&mut self.blocks);
        self.store.insert_checked(key, blocks, self.len, checksum)
    }
}

impl Drop for PutBlocks {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            self.store.free_blocks(std::mem::take(&mut self.blocks));
        }
    }
}

/// Releases an entry taken out of the key table: frees its blocks, or retires it if pinned.
fn release_locked(st: &mut State, e: Entry) {
    if e.pins == 0 {
        st.free_blocks.extend(e.blocks);
    } else if let Some(prev) = st.retired.insert(e.gen, e) {
        // Generations are unique (one per insertion, and an entry leaves the key table
        // once), so this cannot happen; were it to, the earlier entry is still pinned and
        // its blocks must not be reused, so they are deliberately not freed.
        debug_assert!(false, "generation {} retired twice", prev.gen);
    }
}

/// Cuts a range list down to its first `len` bytes.
pub(crate) fn truncate_ranges(ranges: &mut Vec<(usize, usize)>, len: usize) {
    crate::layout::cut_ranges(ranges, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Arrangement, Preset};

    fn store(blocks: u32, cap: usize) -> ChunkStore {
        let layout = KvLayout::preset(Preset::Tiny, blocks, Arrangement::LayerSeparate).unwrap();
        let region = Arc::new(Region::host("store", layout.region_bytes()).unwrap());
        ChunkStore::new(region, layout, cap).unwrap()
    }

    fn put(s: &ChunkStore, name: &str, blocks: usize) {
        let b = s.alloc_blocks(blocks).unwrap();
        let len = s.layout().chunk_bytes(blocks);
        s.insert_blocks(ChunkKey::from_name(name), b, len).unwrap();
    }

    #[test]
    fn lru_eviction_respects_capacity_and_pins() {
        let s = store(8, 2);
        put(&s, "a", 1);
        put(&s, "b", 1);
        assert_eq!(s.lookup(&[ChunkKey::from_name("a")]), 1); // a is now more recent than b
        put(&s, "c", 1);
        assert_eq!(s.lookup(&[ChunkKey::from_name("b")]), 0, "b was least recently used");
        assert_eq!(s.lookup(&[ChunkKey::from_name("a"), ChunkKey::from_name("c")]), 2);
        // Pinned chunks are not evicted: with a and c pinned, a third chunk cannot make room
        // by evicting them and the store temporarily exceeds capacity.
        let (locs, pins) = s.pin_prefix(&[ChunkKey::from_name("a"), ChunkKey::from_name("c")], 8);
        assert_eq!(locs.len(), 2);
        put(&s, "d", 1);
        assert_eq!(s.lookup(&[ChunkKey::from_name("a")]), 1);
        drop(pins);
        put(&s, "e", 1);
        assert_eq!(s.stats().chunks, 2);
    }

    #[test]
    fn replaced_pinned_chunk_keeps_its_blocks_until_unpinned() {
        let s = store(4, 4);
        put(&s, "a", 2);
        let (locs, pins) = s.pin_prefix(&[ChunkKey::from_name("a")], 1);
        let old_blocks = locs[0].blocks.clone();
        put(&s, "a", 2); // replace while pinned: needs the other 2 blocks
        assert_eq!(s.stats().free_blocks, 0);
        // Making room evicts the new, unpinned "a" — never the pinned old blocks.
        let got = s.alloc_blocks(2).unwrap();
        assert!(
            got.iter().all(|b| !old_blocks.contains(b)),
            "pinned blocks reused: {got:?}"
        );
        assert!(s.alloc_blocks(1).is_err(), "only pinned blocks are left");
        drop(pins);
        assert_eq!(s.stats().free_blocks, 2);
        let mut again = s.alloc_blocks(2).unwrap();
        again.sort();
        let mut o = old_blocks;
        o.sort();
        assert_eq!(again, o, "unpinning frees the replaced chunk's blocks");
    }

    /// The key the old store kept a replaced pinned chunk under (a client could choose it).
    fn old_tombstone(key: &ChunkKey, gen: u64) -> ChunkKey {
        let mut k = key.0;
        k[0] ^= 0xA5;
        k[24..32].copy_from_slice(&gen.to_le_bytes());
        ChunkKey(k)
    }

    #[test]
    fn crafted_tombstone_keys_cannot_steal_capacity() {
        let s = store(32, 64);
        let total = s.layout().blocks as usize;
        let victim = ChunkKey::from_name("victim");
        let b = s.alloc_blocks(2).unwrap();
        s.insert_blocks(victim, b, s.layout().chunk_bytes(2)).unwrap();
        // The attacker stores chunks under every plausible tombstone key of `victim`.
        let crafted: Vec<ChunkKey> = (1..=8).map(|g| old_tombstone(&victim, g)).collect();
        for k in &crafted {
            let b = s.alloc_blocks(3).unwrap();
            s.insert_blocks(*k, b, s.layout().chunk_bytes(3)).unwrap();
        }
        assert_eq!(s.stats().free_blocks, total - 2 - 3 * crafted.len());
        // Two stages pin the victim; it is replaced while pinned; both pins drop.
        let (l1, p1) = s.pin_prefix(&[victim], 1);
        let (l2, p2) = s.pin_prefix(&[victim], 1);
        assert_eq!((l1.len(), l2.len()), (1, 1));
        let b = s.alloc_blocks(2).unwrap();
        s.insert_blocks(victim, b, s.layout().chunk_bytes(2)).unwrap();
        drop(p1);
        drop(p2);
        for (i, k) in crafted.iter().enumerate() {
            assert_eq!(s.lookup(&[*k]), 1, "crafted chunk {} lost", i + 1);
        }
        assert_eq!(s.lookup(&[victim]), 1);
        assert_eq!(s.stats().chunks, 1 + crafted.len());
        assert_eq!(s.stats().free_blocks, total - 2 - 3 * crafted.len());
        // Evicting everything gives every block back, exactly once.
        let mut all = s.alloc_blocks(total).unwrap();
        assert_eq!(s.stats().chunks, 0);
        all.sort_unstable();
        assert_eq!(all, (0..total as u32).collect::<Vec<_>>());
        s.free_blocks(all);
        assert_eq!(s.stats().free_blocks, total);
    }

    #[test]
    fn truncating_ranges() {
        let mut r = vec![(0, 10), (20, 10), (40, 10)];
        truncate_ranges(&mut r, 15);
        assert_eq!(r, vec![(0, 10), (20, 5)]);
    }
}
