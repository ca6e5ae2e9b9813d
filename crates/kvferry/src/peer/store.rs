//! The producer's local chunk store: key → chunk (block ids in a registered host
//! region laid out by a [`KvLayout`]), bounded by a chunk capacity and by the region's
//! blocks, evicting the least recently used chunk.
//!
//! A chunk being staged is **pinned**: its blocks cannot be evicted or reused until the
//! gather that reads them has drained. The pin is released by dropping a [`ChunkPins`],
//! which the staging copy's plan owns (through [`PinnedRegion`]) — so it is released
//! after the copy threads have left, on every path.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::PeerError;
use crate::layout::KvLayout;
use crate::mem::{HostMemory, MemError, Region};
use crate::wire::ChunkKey;

#[derive(Debug)]
struct Entry {
    blocks: Vec<u32>,
    len: usize,
    pins: usize,
    /// Identity of this insertion (pins refer to it).
    gen: u64,
    /// Last use, for LRU.
    tick: u64,
    evicted: bool,
}

struct State {
    map: HashMap<ChunkKey, Entry>,
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
}

/// Pins on some chunks; dropping it unpins them (and frees blocks of chunks that were
/// evicted or replaced while pinned).
pub struct ChunkPins {
    store: ChunkStore,
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
        for (key, tick) in &self.keys {
            // A replaced entry lives on under a tombstone key until unpinned.
            let tomb = tombstone(key, *tick);
            let mut free = None;
            for k in [tomb, *key] {
                if let Some(e) = st.map.get_mut(&k) {
                    if e.gen == *tick {
                        e.pins -= 1;
                        if e.pins == 0 && e.evicted {
                            free = st.map.remove(&k).map(|e| e.blocks);
                        }
                        break;
                    }
                }
            }
            if let Some(blocks) = free {
                st.free_blocks.extend(blocks);
            }
        }
    }
}

fn tombstone(key: &ChunkKey, tick: u64) -> ChunkKey {
    let mut k = key.0;
    k[0] ^= 0xA5;
    k[24..32].copy_from_slice(&tick.to_le_bytes());
    ChunkKey(k)
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
            chunks: st.map.values().filter(|e| !e.evicted).count(),
            capacity: self.inner.capacity,
            free_blocks: st.free_blocks.len(),
        }
    }

    /// Registers a chunk whose bytes the caller already wrote into `blocks`.
    pub fn insert_blocks(&self, key: ChunkKey, blocks: Vec<u32>, len: usize) -> Result<(), PeerError> {
        if len > self.inner.layout.chunk_bytes(blocks.len()) || blocks.iter().any(|b| *b >= self.inner.layout.blocks) {
            return Err(PeerError::InvalidArgument("chunk does not fit its blocks".into()));
        }
        let mut st = self.inner.state.lock();
        st.tick += 1;
        let tick = st.tick;
        self.remove_locked(&mut st, &key);
        st.map.insert(
            key,
            Entry {
                blocks,
                len,
                pins: 0,
                gen: tick,
                tick,
                evicted: false,
            },
        );
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

    fn remove_locked(&self, st: &mut State, key: &ChunkKey) {
        if let Some(mut e) = st.map.remove(key) {
            if e.pins == 0 {
                st.free_blocks.extend(e.blocks);
            } else {
                e.evicted = true;
                let tomb = tombstone(key, e.gen);
                st.map.insert(tomb, e);
            }
        }
    }

    /// Evicts LRU unpinned chunks until within capacity and `need_blocks` are free.
    fn evict_locked(&self, st: &mut State, need_blocks: usize) {
        loop {
            let live = st.map.values().filter(|e| !e.evicted).count();
            if live <= self.inner.capacity && st.free_blocks.len() >= need_blocks {
                return;
            }
            let victim = st
                .map
                .iter()
                .filter(|(_, e)| !e.evicted && e.pins == 0)
                .min_by_key(|(_, e)| e.tick)
                .map(|(k, _)| *k);
            match victim {
                Some(k) => self.remove_locked(st, &k),
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
                Some(e) if !e.evicted => {
                    e.tick = e.tick.max(tick);
                    hits += 1;
                }
                _ => break,
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
                Some(e) if !e.evicted => {
                    e.pins += 1;
                    pinned.push((*k, e.gen));
                    locs.push(ChunkLocation {
                        key: *k,
                        blocks: e.blocks.clone(),
                        len: e.len,
                    });
                }
                _ => break,
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

    /// Canonical-order region ranges of a chunk's first `len` bytes.
    pub fn ranges(&self, loc: &ChunkLocation) -> Result<Vec<(usize, usize)>, PeerError> {
        let mut ranges = self.inner.layout.chunk_ranges(&loc.blocks)?;
        truncate_ranges(&mut ranges, loc.len);
        Ok(ranges)
    }
}

/// Cuts a range list down to its first `len` bytes.
pub(crate) fn truncate_ranges(ranges: &mut Vec<(usize, usize)>, len: usize) {
    let mut left = len;
    let mut keep = 0;
    for r in ranges.iter_mut() {
        if left == 0 {
            break;
        }
        r.1 = r.1.min(left);
        left -= r.1;
        keep += 1;
    }
    ranges.truncate(keep);
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

    #[test]
    fn truncating_ranges() {
        let mut r = vec![(0, 10), (20, 10), (40, 10)];
        truncate_ranges(&mut r, 15);
        assert_eq!(r, vec![(0, 10), (20, 5)]);
    }
}
