//! Model-based property test of the chunk store: random sequences of put, replace, pin,
//! unpin, lookup and allocation pressure — over keys that include the ones the store once
//! used internally for replaced pinned chunks — match an exact model (LRU order, capacity,
//! pins, retired chunks), keep `free + live + retired == total` blocks with no block held
//! twice, and always give every block back once all pins drop.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::Region;
use kvferry::peer::{ChunkPins, ChunkStore};
use kvferry::wire::ChunkKey;
use proptest::prelude::*;

const BLOCKS: u32 = 24;

#[derive(Debug, Clone)]
enum Op {
    /// Store a chunk of `n` blocks (less `cut` bytes) under key `k`.
    Put { k: usize, n: usize, cut: usize },
    /// Store a new chunk under the `i`-th live key.
    Replace { i: usize, n: usize },
    /// Pin the leading held chunks among these keys (a stage starts).
    Pin(Vec<usize>),
    /// Drop the `i`-th outstanding pin set (a stage is done).
    Unpin(usize),
    /// Look one key up (refreshes its LRU position).
    Lookup(usize),
    /// Take `n` blocks (evicting as needed) and give them back.
    Pressure(usize),
}

fn op(nkeys: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..nkeys, 1usize..5, 0usize..4).prop_map(|(k, n, cut)| Op::Put { k, n, cut }),
        3 => (any::<usize>(), 1usize..5).prop_map(|(i, n)| Op::Replace { i, n }),
        3 => prop::collection::vec(0..nkeys, 1..4).prop_map(Op::Pin),
        3 => any::<usize>().prop_map(Op::Unpin),
        2 => (0..nkeys).prop_map(Op::Lookup),
        1 => (1usize..=BLOCKS as usize).prop_map(Op::Pressure),
    ]
}

/// The key the store once kept a replaced pinned chunk under: byte 0 flipped, bytes
/// 24..32 the generation.
fn old_tombstone(key: &ChunkKey, gen: u64) -> ChunkKey {
    let mut k = key.0;
    k[0] ^= 0xA5;
    k[24..32].copy_from_slice(&gen.to_le_bytes());
    ChunkKey(k)
}

/// Plain keys plus crafted tombstone-style keys for the small generations a run reaches.
fn keys() -> Vec<ChunkKey> {
    let plain: Vec<ChunkKey> = (0..3).map(|i| ChunkKey::from_name(&format!("k{i}"))).collect();
    let mut all = plain.clone();
    all.extend((1..=6).map(|g| old_tombstone(&plain[0], g)));
    all.extend((1..=3).map(|g| old_tombstone(&plain[1], g)));
    all
}

#[derive(Debug, Clone)]
struct MEntry {
    blocks: Vec<u32>,
    len: usize,
    gen: u64,
    tick: u64,
    pins: usize,
}

/// The store as it should be.
struct Model {
    capacity: usize,
    live: HashMap<ChunkKey, MEntry>,
    retired: HashMap<u64, MEntry>,
    free: usize,
    tick: u64,
}

impl Model {
    fn evict(&mut self, need: usize) {
        while self.live.len() > self.capacity || self.free < need {
            let victim = self
                .live
                .iter()
                .filter(|(_, e)| e.pins == 0)
                .min_by_key(|(_, e)| e.tick)
                .map(|(k, _)| *k);
            let Some(k) = victim else { return };
            let e = self.live.remove(&k).unwrap();
            self.free += e.blocks.len();
        }
    }

    /// Whether `alloc_blocks(n)` succeeds (after evicting what it may).
    fn alloc(&mut self, n: usize) -> bool {
        self.evict(n);
        if self.free < n {
            return false;
        }
        self.free -= n;
        true
    }

    fn insert(&mut self, key: ChunkKey, blocks: Vec<u32>, len: usize) {
        self.tick += 1;
        let e = MEntry {
            blocks,
            len,
            gen: self.tick,
            tick: self.tick,
            pins: 0,
        };
        if let Some(old) = self.live.insert(key, e) {
            if old.pins == 0 {
                self.free += old.blocks.len();
            } else {
                assert!(self.retired.insert(old.gen, old).is_none());
            }
        }
        self.evict(0);
    }

    fn lookup(&mut self, key: &ChunkKey) -> usize {
        self.tick += 1;
        match self.live.get_mut(key) {
            Some(e) => {
                e.tick = self.tick;
                1
            }
            None => 0,
        }
    }

    fn pin(&mut self, keys: &[ChunkKey]) -> Vec<(ChunkKey, u64, Vec<u32>, usize)> {
        let mut out = Vec::new();
        for k in keys {
            let Some(e) = self.live.get_mut(k) else { break };
            e.pins += 1;
            out.push((*k, e.gen, e.blocks.clone(), e.len));
        }
        out
    }

    fn unpin(&mut self, pinned: &[(ChunkKey, u64)]) {
        for (k, gen) in pinned {
            match self.live.get_mut(k) {
                Some(e) if e.gen == *gen => e.pins -= 1,
                _ => {
                    let e = self.retired.get_mut(gen).expect("pinned chunk is retired");
                    e.pins -= 1;
                    if e.pins == 0 {
                        let e = self.retired.remove(gen).unwrap();
                        self.free += e.blocks.len();
                    }
                }
            }
        }
    }

    /// Every block held by a live or retired chunk.
    fn held(&self) -> Vec<u32> {
        self.live
            .values()
            .chain(self.retired.values())
            .flat_map(|e| e.blocks.iter().copied())
            .collect()
    }
}

/// Checks the store against the model without disturbing either.
fn check(s: &ChunkStore, m: &Model, keys: &[ChunkKey]) -> Result<(), TestCaseError> {
    let st = s.stats();
    prop_assert_eq!(st.free_blocks, m.free);
    prop_assert_eq!(st.chunks, m.live.len());
    prop_assert_eq!(st.retired, m.retired.len());
    let held = m.held();
    prop_assert_eq!(st.free_blocks + held.len(), BLOCKS as usize, "blocks lost or invented");
    let distinct: BTreeSet<u32> = held.iter().copied().collect();
    prop_assert_eq!(distinct.len(), held.len(), "a block is held twice");
    prop_assert!(held.iter().all(|b| *b < BLOCKS));
    for k in keys {
        // A pin taken and dropped at once is a lookup that leaves the LRU order alone.
        let (locs, pins) = s.pin_prefix(&[*k], 1);
        drop(pins);
        match m.live.get(k) {
            Some(e) => {
                prop_assert_eq!(locs.len(), 1, "live key {:?} missing", k);
                prop_assert_eq!(&locs[0].blocks, &e.blocks);
                prop_assert_eq!(locs[0].len, e.len);
            }
            None => prop_assert!(locs.is_empty(), "dead key {:?} found", k),
        }
    }
    Ok(())
}

/// Checks that fresh blocks from the store are distinct and held by no chunk.
fn check_fresh(m: &Model, got: &[u32]) -> Result<(), TestCaseError> {
    let held: BTreeSet<u32> = m.held().into_iter().collect();
    let fresh: BTreeSet<u32> = got.iter().copied().collect();
    prop_assert_eq!(fresh.len(), got.len(), "alloc returned a block twice: {:?}", got);
    prop_assert!(fresh.is_disjoint(&held), "alloc returned a held block: {:?}", got);
    prop_assert!(got.iter().all(|b| *b < BLOCKS));
    Ok(())
}

fn run(capacity: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let keys = keys();
    let layout = KvLayout::preset(Preset::Tiny, BLOCKS, Arrangement::LayerSeparate).unwrap();
    let region = Arc::new(Region::host("store-model", layout.region_bytes()).unwrap());
    let s = ChunkStore::new(region, layout, capacity).unwrap();
    let mut m = Model {
        capacity,
        live: HashMap::new(),
        retired: HashMap::new(),
        free: BLOCKS as usize,
        tick: 0,
    };
    let mut stages: Vec<(ChunkPins, Vec<(ChunkKey, u64)>)> = Vec::new();
    check(&s, &m, &keys)?;
    for op in ops {
        match op {
            Op::Put { k, n, cut } => put(&s, &mut m, keys[k], n, cut)?,
            Op::Replace { i, n } => {
                let mut live: Vec<ChunkKey> = m.live.keys().copied().collect();
                live.sort_by_key(|k| k.0);
                if !live.is_empty() {
                    put(&s, &mut m, live[i % live.len()], n, 0)?;
                }
            }
            Op::Pin(ix) => {
                let ks: Vec<ChunkKey> = ix.iter().map(|i| keys[*i]).collect();
                let (locs, pins) = s.pin_prefix(&ks, ks.len());
                let want = m.pin(&ks);
                prop_assert_eq!(locs.len(), want.len());
                for (l, w) in locs.iter().zip(&want) {
                    prop_assert_eq!(l.key, w.0);
                    prop_assert_eq!(&l.blocks, &w.2);
                    prop_assert_eq!(l.len, w.3);
                }
                stages.push((pins, want.into_iter().map(|w| (w.0, w.1)).collect()));
            }
            Op::Unpin(i) => {
                if !stages.is_empty() {
                    let (pins, pinned) = stages.swap_remove(i % stages.len());
                    drop(pins);
                    m.unpin(&pinned);
                }
            }
            Op::Lookup(k) => {
                prop_assert_eq!(s.lookup(&[keys[k]]), m.lookup(&keys[k]));
            }
            Op::Pressure(n) => {
                let got = s.alloc_blocks(n);
                prop_assert_eq!(got.is_ok(), m.alloc(n));
                if let Ok(got) = got {
                    check_fresh(&m, &got)?;
                    s.free_blocks(got);
                    m.free += n;
                }
            }
        }
        check(&s, &m, &keys)?;
    }
    // Every stage finishes: all retired chunks go, and every block comes back.
    for (pins, pinned) in stages.drain(..) {
        drop(pins);
        m.unpin(&pinned);
        check(&s, &m, &keys)?;
    }
    prop_assert_eq!(s.stats().retired, 0);
    let mut all = s.alloc_blocks(BLOCKS as usize).expect("capacity returns once unpinned");
    prop_assert_eq!(s.stats().chunks, 0);
    all.sort_unstable();
    prop_assert_eq!(all.clone(), (0..BLOCKS).collect::<Vec<_>>());
    s.free_blocks(all);
    prop_assert_eq!(s.stats().free_blocks, BLOCKS as usize);
    Ok(())
}

/// Allocates `n` blocks and stores them under `key`, in the store and the model.
fn put(s: &ChunkStore, m: &mut Model, key: ChunkKey, n: usize, cut: usize) -> Result<(), TestCaseError> {
    let got = s.alloc_blocks(n);
    prop_assert_eq!(got.is_ok(), m.alloc(n));
    let Ok(blocks) = got else { return Ok(()) };
    check_fresh(m, &blocks)?;
    let len = s.layout().chunk_bytes(n) - cut;
    s.insert_blocks(key, blocks.clone(), len).unwrap();
    m.insert(key, blocks, len);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(capacity in 2usize..16, ops in prop::collection::vec(op(keys().len()), 1..80)) {
        run(capacity, ops)?;
    }
}
