//! What the chaos run moves and how every landed byte is checked.
//!
//! Each producer holds a fixed table of **request sets**: 1–3 chunks of 1–2 blocks of
//! the `llama3-70b-tp8` layout (640 KiB per block in 4 KiB pieces), each chunk's bytes a
//! seeded random pattern that differs across chunks, sets and producers, and a length
//! that usually ends inside its last block (exercising truncated ranges). A transfer
//! asks one producer for one set.
//!
//! Destinations are **slots** of [`BLOCKS_PER_SLOT`] blocks in the consumer's KV region
//! (fully contiguous, while producers are layer-separate), or a **private** region for
//! transfers whose future may be dropped (the caller then gets no drain fence, so the
//! region is checked only once the library has dropped its last reference to it).
//! Bytes not written by a transfer hold [`POISON`]:
//!
//! - after a successful transfer the destination must equal the landed prefix of the
//!   set, exactly, and poison everywhere else;
//! - after a failure, once its fence fired, every byte must be poison or the byte the
//!   set puts there (a partial landing of the right bytes is allowed, anything else —
//!   another request's bytes — is corruption);
//! - a slot is re-poisoned when it is handed back, and must still be poison when it is
//!   taken again and at the end of the run (a write after the fence fired).

use std::sync::{Arc, Mutex};

use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::Region;
use kvferry::peer::Destination;
use kvferry::wire::ChunkKey;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// The model preset of every layout in the run (producers are started with it).
pub const MODEL: &str = "llama3-70b-tp8";
/// Blocks per destination slot (the largest set).
pub const BLOCKS_PER_SLOT: u32 = 6;
/// The byte every unwritten destination byte holds.
pub const POISON: u8 = 0xEE;

/// One chunk of a request set.
pub struct Chunk {
    /// Its key on the producer.
    pub key: ChunkKey,
    /// Blocks it occupies.
    pub blocks: u32,
    /// Its bytes.
    pub data: Vec<u8>,
}

/// Chunks asked for together.
pub struct Set {
    /// The chunks, in key order.
    pub chunks: Vec<Chunk>,
}

impl Set {
    /// Blocks of all chunks.
    pub fn blocks(&self) -> u32 {
        self.chunks.iter().map(|c| c.blocks).sum()
    }

    /// The keys.
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.chunks.iter().map(|c| c.key).collect()
    }

    /// Bytes of the first `n` chunks.
    pub fn bytes(&self, n: usize) -> usize {
        self.chunks.iter().take(n).map(|c| c.data.len()).sum()
    }
}

/// The request sets of every producer.
pub struct Workload {
    /// `sets[producer][set]`.
    pub sets: Vec<Vec<Set>>,
}

impl Workload {
    /// Seeded sets for `producers` producers.
    pub fn new(seed: u64, producers: usize, sets_per_producer: usize) -> anyhow::Result<Workload> {
        let bb = layout(1)?.block_bytes();
        let mut sets = Vec::with_capacity(producers);
        for p in 0..producers {
            let mut mine = Vec::with_capacity(sets_per_producer);
            for s in 0..sets_per_producer {
                let mut rng = StdRng::seed_from_u64(mix(seed, &[1, p as u64, s as u64]));
                let n = rng.gen_range(1..=3);
                let chunks = (0..n)
                    .map(|c| {
                        let blocks = if rng.gen_bool(0.25) { 2 } else { 1 };
                        let full = blocks as usize * bb;
                        // Mostly a partial last block; sometimes exactly full.
                        let len = if rng.gen_bool(0.2) {
                            full
                        } else {
                            rng.gen_range(full - bb + 1..=full)
                        };
                        let mut data = vec![0u8; len];
                        rng.fill_bytes(&mut data);
                        Chunk {
                            key: ChunkKey::from_name(&format!("chaos/p{p}/s{s}/c{c}")),
                            blocks,
                            data,
                        }
                    })
                    .collect();
                mine.push(Set { chunks });
            }
            sets.push(mine);
        }
        Ok(Workload { sets })
    }

    /// Blocks a producer needs to hold all its sets.
    pub fn producer_blocks(&self) -> u32 {
        self.sets
            .iter()
            .map(|s| s.iter().map(Set::blocks).sum())
            .max()
            .unwrap_or(0)
    }
}

/// The run's layout, fully contiguous, with `blocks` blocks.
pub fn layout(blocks: u32) -> anyhow::Result<KvLayout> {
    let preset: Preset = MODEL.parse()?;
    Ok(KvLayout::preset(preset, blocks, Arrangement::FullyContiguous)?)
}

/// A seed derived from `seed` and `parts` (splitmix64 steps).
pub fn mix(seed: u64, parts: &[u64]) -> u64 {
    let mut x = seed;
    for p in parts {
        x = x.wrapping_add(p.wrapping_add(0x9E37_79B9_7F4A_7C15));
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
    }
    x
}

fn not_poison(bytes: &[u8]) -> usize {
    if bytes.iter().all(|b| *b == POISON) {
        return 0;
    }
    bytes.iter().filter(|b| **b != POISON).count()
}

/// The consumer's KV region cut into slots of [`BLOCKS_PER_SLOT`] blocks.
pub struct Slots {
    region: Arc<Region>,
    layout: KvLayout,
    free: Mutex<Vec<u32>>,
    permits: Semaphore,
    count: u32,
}

impl Slots {
    /// `count` slots, all poisoned.
    pub fn new(count: u32) -> anyhow::Result<Slots> {
        let layout = layout(count * BLOCKS_PER_SLOT)?;
        let region = Arc::new(Region::host("chaos-consumer-kv", layout.region_bytes())?);
        region.fill(0, region.len(), POISON)?;
        Ok(Slots {
            region,
            layout,
            free: Mutex::new((0..count).rev().collect()),
            permits: Semaphore::new(count as usize),
            count,
        })
    }

    /// Slots in all.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Slots free now.
    pub fn free_count(&self) -> usize {
        self.free.lock().unwrap().len()
    }

    /// Takes a free slot for `set` by `deadline` (check it with [`Dest::scrub`]).
    pub async fn acquire(self: &Arc<Self>, set: &Set, deadline: Instant) -> Option<Dest> {
        let permit = tokio::time::timeout_at(deadline, self.permits.acquire())
            .await
            .ok()?
            .ok()?;
        permit.forget();
        let slot = self.free.lock().unwrap().pop().expect("a permit means a free slot");
        Some(Dest {
            region: self.region.clone(),
            layout: self.layout,
            base: slot * BLOCKS_PER_SLOT,
            span: set.blocks(),
            slot: Some((self.clone(), slot)),
        })
    }

    /// Non-poison bytes in the free slots (writes after a slot was handed back).
    pub fn check_free(&self) -> usize {
        let free = self.free.lock().unwrap().clone();
        let span = BLOCKS_PER_SLOT as usize * self.layout.block_bytes();
        free.iter()
            .map(|s| not_poison(&self.region.to_vec(*s as usize * span, span).unwrap_or_default()))
            .sum()
    }

    fn release(&self, slot: u32) {
        self.free.lock().unwrap().push(slot);
        self.permits.add_permits(1);
    }
}

/// Where one transfer lands: the first blocks of a slot, or a private region.
pub struct Dest {
    region: Arc<Region>,
    layout: KvLayout,
    /// First block.
    base: u32,
    /// Blocks the set uses.
    span: u32,
    slot: Option<(Arc<Slots>, u32)>,
}

/// How strictly [`Dest::check`] compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// After a success: the first `n` chunks exactly, poison elsewhere.
    Landed(usize),
    /// After a failure or a drop: each byte is poison or the set's byte there.
    PoisonOrOwn,
}

impl Dest {
    /// A private, poisoned region sized for `set`.
    pub fn private(set: &Set) -> anyhow::Result<Dest> {
        let layout = layout(set.blocks())?;
        let region = Arc::new(Region::host("chaos-private", layout.region_bytes())?);
        region.fill(0, region.len(), POISON)?;
        Ok(Dest {
            region,
            layout,
            base: 0,
            span: set.blocks(),
            slot: None,
        })
    }

    /// The region (a private one is checked once this is its only reference).
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// The library's view: chunk `i` of `set` in consecutive blocks from the base.
    pub fn destination(&self, set: &Set) -> Destination {
        Destination::from_layout(self.region.clone(), &self.layout, self.chunk_blocks(set)).expect("valid destination")
    }

    fn chunk_blocks(&self, set: &Set) -> Vec<Vec<u32>> {
        let mut at = self.base;
        set.chunks
            .iter()
            .map(|c| {
                let blocks: Vec<u32> = (at..at + c.blocks).collect();
                at += c.blocks;
                blocks
            })
            .collect()
    }

    fn span_bytes(&self) -> (usize, usize) {
        let bb = self.layout.block_bytes();
        (self.base as usize * bb, self.span as usize * bb)
    }

    fn read(&self) -> Vec<u8> {
        let (off, len) = self.span_bytes();
        self.region.to_vec(off, len).unwrap_or_default()
    }

    /// Bytes of the destination that break `check` for `set`.
    pub fn check(&self, set: &Set, check: Check) -> usize {
        let got = self.read();
        let (start, _) = self.span_bytes();
        let mut ranges_seen: Vec<(usize, usize)> = Vec::new();
        let mut bad = 0;
        for (i, (c, blocks)) in set.chunks.iter().zip(self.chunk_blocks(set)).enumerate() {
            let Ok(ranges) = self.layout.chunk_ranges(&blocks) else {
                return got.len();
            };
            let mut done = 0;
            for (off, n) in ranges {
                let n = n.min(c.data.len() - done);
                if n == 0 {
                    break;
                }
                let (g, w) = (&got[off - start..off - start + n], &c.data[done..done + n]);
                done += n;
                ranges_seen.push((off - start, n));
                bad += match check {
                    Check::Landed(landed) if i < landed => {
                        if g == w {
                            0
                        } else {
                            g.iter().zip(w).filter(|(a, b)| a != b).count()
                        }
                    }
                    Check::Landed(_) => not_poison(g),
                    Check::PoisonOrOwn => {
                        if g == w {
                            0
                        } else {
                            g.iter().zip(w).filter(|(a, b)| a != b && **a != POISON).count()
                        }
                    }
                };
            }
        }
        // Everything no chunk covers must still be poison.
        ranges_seen.sort_unstable();
        let mut at = 0;
        for (off, n) in ranges_seen {
            bad += not_poison(&got[at..off.max(at)]);
            at = at.max(off + n);
        }
        bad += not_poison(&got[at..]);
        bad
    }

    /// Bytes of a freshly taken slot that are no longer poison (written after it was
    /// handed back); re-poisons them.
    pub fn scrub(&self) -> usize {
        let bad = not_poison(&self.read());
        if bad > 0 {
            self.poison();
        }
        bad
    }

    /// Flips the first byte (`--sabotage corrupt`).
    pub fn tamper(&self) {
        let (off, _) = self.span_bytes();
        if let Ok(b) = self.region.to_vec(off, 1) {
            let _ = self.region.write(off, &[b[0] ^ 0xFF]);
        }
    }

    fn poison(&self) {
        let (off, len) = self.span_bytes();
        let _ = self.region.fill(off, len, POISON);
    }

    /// The destination is quiet: re-poison a slot and hand it back (a private region
    /// is simply dropped).
    pub fn finish(self) {
        if let Some((slots, slot)) = &self.slot {
            self.poison();
            slots.release(*slot);
        }
    }
}
