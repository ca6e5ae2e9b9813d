//! Partial gets ([`Selection`]) end to end over real loopback sockets, two engines per
//! test: a subset of a publication's blocks, a head slice of every per-layer piece,
//! an HND→NHD permutation (many small ranges, on either side), a prefill block of 16
//! tokens landing in half a decode block of 32 and the reverse, on the direct path,
//! the staged path, the delayed pull and a sim device; malformed selections from the
//! API and a malicious one on the wire (typed errors, the server keeps serving); the
//! byte counters show the wire carried exactly the selected bytes; a cancelled
//! selected get reports its destination quiet only after the drain.
//!
//! Every landed byte is compared with a reference the test computes from the source
//! bytes and the selection.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::engines::{pair_with, pattern, Pair};
use kvferry::device::{Device, DeviceKvCache, SimConfig, SimDevice};
use kvferry::engine::{Engine, EngineConfig, Registered, Selection, SelectionError};
use kvferry::layout::{KvCache, Span};
use kvferry::mem::Region;
use kvferry::net::{NetConfig, NetError, Pool};
use kvferry::peer::{Destination, GetFailure, Landed, PeerError, TransferPath};
use kvferry::wire::{ChunkKey, ErrorKind, Message, WireSelection};
use tokio::time::Instant;

/// Bytes of one head of one token (16 fp16 values).
const D: usize = 32;
/// Pieces per block (2 layers, K and V).
const PIECES: usize = 4;

/// The common small engine with a 4 MiB staging arena and a 3 s I/O timeout.
fn config(peer_id: &str) -> EngineConfig {
    let mut cfg = common::engines::config(peer_id).arena(4 << 20, 64 << 10);
    cfg.net.io_timeout = Duration::from_secs(3);
    cfg
}

async fn pair() -> Pair {
    pair_with(config).await
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn key(name: &str) -> ChunkKey {
    ChunkKey::from_name(name)
}

/// A layer-separate KV cache in one region: piece `p` of block `b` at
/// `(p * blocks + b) * piece`.
struct Kv {
    region: Arc<Region>,
    reg: Registered,
    blocks: u32,
    piece: usize,
}

impl Kv {
    fn new(engine: &Engine, name: &str, blocks: u32, piece: usize, seed: Option<u64>) -> Kv {
        let region = Arc::new(Region::host(name, PIECES * blocks as usize * piece).unwrap());
        if let Some(seed) = seed {
            region.write(0, &pattern(seed, region.len())).unwrap();
        }
        let spans = spans(blocks, piece);
        let cache = KvCache::new(name, vec![(region.clone(), spans)], blocks).unwrap();
        let reg = engine.register(cache).unwrap();
        Kv {
            region,
            reg,
            blocks,
            piece,
        }
    }

    fn at(&self, b: u32, p: usize) -> usize {
        (p * self.blocks as usize + b as usize) * self.piece
    }

    fn piece(&self, b: u32, p: usize) -> Vec<u8> {
        self.region.to_vec(self.at(b, p), self.piece).unwrap()
    }

    fn snapshot(&self) -> Vec<u8> {
        self.region.to_vec(0, self.region.len()).unwrap()
    }

    fn dst(&self, blocks: Vec<u32>, path: TransferPath, sel: Selection) -> Destination {
        Destination::new(self.reg.cache.clone(), vec![blocks])
            .with_path(path)
            .with_selection(Some(sel))
    }
}

fn spans(blocks: u32, piece: usize) -> Vec<Span> {
    (0..PIECES)
        .map(|p| Span {
            offset: p * blocks as usize * piece,
            stride: piece,
            len: piece,
        })
        .collect()
}

/// What a destination region must hold after landing: `before` with, for every
/// (source block, destination block) pair and every piece, the source piece's
/// `src` ranges' bytes written, in order, into the destination piece's `dst`
/// ranges.
fn reference(
    before: &[u8],
    src: &Kv,
    dst: &Kv,
    pairs: &[(u32, u32)],
    src_ranges: Option<&[(usize, usize)]>,
    dst_ranges: Option<&[(usize, usize)]>,
) -> Vec<u8> {
    let mut out = before.to_vec();
    for &(sb, db) in pairs {
        for p in 0..PIECES {
            let piece = src.piece(sb, p);
            let bytes: Vec<u8> = match src_ranges {
                None => piece,
                Some(r) => r.iter().flat_map(|&(o, l)| piece[o..o + l].to_vec()).collect(),
            };
            let whole = [(0, dst.piece)];
            let mut at = 0;
            for &(o, l) in dst_ranges.unwrap_or(&whole) {
                let start = dst.at(db, p) + o;
                out[start..start + l].copy_from_slice(&bytes[at..at + l]);
                at += l;
            }
            assert_eq!(at, bytes.len(), "the test's own selection must balance");
        }
    }
    out
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    if got != want {
        let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        panic!("{what}: {bad} bytes differ (first at {first:?})");
    }
}

/// (consumer bytes received, producer bytes sent).
fn wire_bytes(p: &Pair) -> (u64, u64) {
    (
        p.decode.stats().consumer.bytes_received,
        p.prefill.stats().producer.bytes_sent,
    )
}

/// The wire counters once the producer's counter has stopped moving: after a get
/// that failed on the consumer's side (a checksum mismatch), the producer may still
/// be finishing its write of that get — its fence is not the consumer's — and count
/// those bytes a moment after the consumer returned. Read the same three times 10 ms
/// apart (at most 2 s).
async fn settled_wire_bytes(p: &Pair) -> (u64, u64) {
    let mut last = wire_bytes(p);
    let mut same = 0;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = wire_bytes(p);
        same = if now == last { same + 1 } else { 0 };
        last = now;
        if same >= 3 {
            break;
        }
    }
    last
}

/// Runs a selected get and checks the landing against the reference and the wire
/// counters against the selected bytes.
#[allow(clippy::too_many_arguments)]
async fn get_and_check(
    p: &Pair,
    keys: &[ChunkKey],
    src: &Kv,
    dst: &Kv,
    pairs: &[(u32, u32)],
    sel: Selection,
    path: TransferPath,
    what: &str,
) -> Landed {
    let before = dst.snapshot();
    let want = reference(&before, src, dst, pairs, sel.src_ranges(), sel.dst_ranges());
    let (rx0, tx0) = settled_wire_bytes(p).await;
    let blocks = pairs.iter().map(|x| x.1).collect();
    let landed = p
        .decode
        .get(&p.addr, keys, dst.dst(blocks, path, sel.clone()), soon())
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_same(what, &dst.snapshot(), &want);
    let per_piece = sel.dst_ranges().map_or(dst.piece, |r| r.iter().map(|x| x.1).sum());
    let selected = (pairs.len() * PIECES * per_piece) as u64;
    let (rx1, tx1) = wire_bytes(p);
    assert_eq!(
        rx1 - rx0,
        selected,
        "{what}: the consumer received exactly the selected bytes"
    );
    assert_eq!(
        tx1 - tx0,
        selected,
        "{what}: the producer sent exactly the selected bytes"
    );
    assert_eq!(landed.bytes as u64, selected, "{what}");
    assert_eq!(landed.chunks, keys.len(), "{what}");
    landed
}

async fn close_clean(e: &Engine) {
    let r = e.close(soon()).await;
    assert!(r.is_clean(), "close left something out: {r:?}");
}

fn failure(r: Result<Landed, GetFailure>) -> GetFailure {
    match r {
        Ok(l) => panic!("expected a failure, landed {l:?}"),
        Err(f) => f,
    }
}

/// The producer's refusal of a selection, as the consumer sees it.
fn bad_selection(f: &GetFailure) -> &str {
    match &f.error {
        PeerError::Remote {
            kind: ErrorKind::BadSelection,
            message,
        } => message,
        other => panic!("expected the producer's BadSelection, got {other:?}"),
    }
}

fn sel(blocks: Option<Vec<u32>>, src: Option<Vec<(usize, usize)>>, dst: Option<Vec<(usize, usize)>>) -> Selection {
    Selection::new(blocks, src, dst).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_of_blocks_lands_exactly_and_only_they_cross_the_wire() {
    let p = pair().await;
    let piece = 4 * 16 * D;
    let src = Kv::new(&p.prefill, "src", 16, piece, Some(1));
    p.prefill
        .publish(key("a"), &src.reg, &[2, 3, 4], Duration::ZERO, false)
        .unwrap();
    p.prefill
        .publish(key("b"), &src.reg, &[9, 1], Duration::ZERO, false)
        .unwrap();
    let dst = Kv::new(&p.decode, "dst", 16, piece, None);
    let keys = [key("a"), key("b")];
    for path in [TransferPath::Direct, TransferPath::Staged] {
        // Positions 4 and 1 of [2, 3, 4, 9, 1]: source blocks 1 and 3, across keys.
        let s = sel(Some(vec![4, 1]), None, None);
        let what = format!("subset ({path})");
        get_and_check(&p, &keys, &src, &dst, &[(1, 7), (3, 12)], s, path, &what).await;
        // Every block (blocks None) into one flat destination list.
        let what = format!("all ({path})");
        let pairs = [(2, 0), (3, 1), (4, 2), (9, 3), (1, 4)];
        get_and_check(&p, &keys, &src, &dst, &pairs, Selection::all(), path, &what).await;
    }
    assert_eq!(p.decode.arena().stats().leased_pages, 0, "staging pages back");
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_slice_lands_into_a_smaller_destination_on_both_paths() {
    // HND pieces: [heads][tokens][D]. Prefill has 4 heads; each decode rank 2.
    let p = pair().await;
    let (heads, tokens) = (4, 16);
    let src = Kv::new(&p.prefill, "src", 8, heads * tokens * D, Some(2));
    p.prefill
        .publish(key("r"), &src.reg, &[0, 5, 6], Duration::ZERO, false)
        .unwrap();
    let dst = Kv::new(&p.decode, "dst", 8, 2 * tokens * D, None);
    for (rank, path) in [(0, TransferPath::Direct), (1, TransferPath::Staged)] {
        let slice = vec![(rank * 2 * tokens * D, 2 * tokens * D)];
        let s = sel(None, Some(slice), None);
        let what = format!("head slice of rank {rank} ({path})");
        get_and_check(&p, &[key("r")], &src, &dst, &[(0, 1), (5, 2), (6, 3)], s, path, &what).await;
    }
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

/// An engine that writes a published block before its release breaks its promise;
/// the checksums catch it for a selected get as for a whole one: a head slice's crc is
/// made of the crcs taken at publication (4 KiB heads here), not of the bytes as they
/// are sent — before or after the publication's first selected get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_slice_written_after_publication_fails_its_checksum() {
    let p = pair().await;
    let (heads, tokens) = (4, 128); // a head of a block: 128 tokens x 32 B = 4 KiB
    let head = tokens * D;
    let src = Kv::new(&p.prefill, "src", 4, heads * head, Some(7));
    let dst = Kv::new(&p.decode, "dst", 4, 2 * head, None);
    let rank0 = || sel(None, Some(vec![(0, 2 * head)]), None);
    let rank1 = || sel(None, Some(vec![(2 * head, 2 * head)]), None);
    // Flips one byte of head 3 of `block`, layer piece 1 (in rank 1's slice).
    let break_promise = |block: u32| {
        let at = src.at(block, 1) + 3 * head + 100;
        let old = src.region.to_vec(at, 1).unwrap()[0];
        src.region.write(at, &[old ^ 0x5A]).unwrap();
    };
    let mismatch = |f: &GetFailure, what: &str| {
        assert!(
            matches!(f.error, PeerError::ChecksumMismatch { .. }),
            "{what}: a slice written after publication must fail its checksum, got {}",
            f.error
        );
    };

    // Written before any get of the publication.
    p.prefill
        .publish(key("early"), &src.reg, &[0, 3], Duration::ZERO, false)
        .unwrap();
    break_promise(0);
    // And after a first get of another one.
    p.prefill
        .publish(key("late"), &src.reg, &[1, 2], Duration::ZERO, false)
        .unwrap();
    get_and_check(
        &p,
        &[key("late")],
        &src,
        &dst,
        &[(1, 0), (2, 1)],
        rank1(),
        TransferPath::Direct,
        "before",
    )
    .await;
    break_promise(2);
    for path in [TransferPath::Direct, TransferPath::Staged] {
        for k in ["early", "late"] {
            let f = failure(
                p.decode
                    .get(&p.addr, &[key(k)], dst.dst(vec![0, 1], path, rank1()), soon())
                    .await,
            );
            mismatch(&f, &format!("{k} ({path})"));
            f.fence.wait().await;
        }
        // Heads 0..2 (rank 0) were not written: they land and match.
        let what = format!("untouched heads ({path})");
        get_and_check(&p, &[key("late")], &src, &dst, &[(1, 0), (2, 1)], rank0(), path, &what).await;
    }
    // The whole publication: caught as before.
    let whole = Kv::new(&p.decode, "whole", src.blocks, src.piece, None);
    let f = failure(
        p.decode
            .get(
                &p.addr,
                &[key("early")],
                Destination::new(whole.reg.cache.clone(), vec![vec![0, 1]]),
                soon(),
            )
            .await,
    );
    mismatch(&f, "whole");
    f.fence.wait().await;
    assert_eq!(p.decode.arena().stats().leased_pages, 0, "staging pages back");
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

/// The reader slots of one request are the same blocks published under several keys
/// in a row: a publication of the blocks of a live publication shares its checksums
/// (one pass over the bytes, not one per key). Shared, they describe the bytes as first
/// published — a write between the two publishes fails the second key's get too — and
/// once the first is released, the next publish takes them afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publications_of_the_same_live_blocks_share_their_checksums() {
    let p = pair().await;
    let piece = 4 << 10;
    let src = Kv::new(&p.prefill, "src", 4, piece, Some(11));
    let dst = Kv::new(&p.decode, "dst", 4, piece, None);
    let flip = |at: usize| {
        let old = src.region.to_vec(at, 1).unwrap()[0];
        src.region.write(at, &[old ^ 0x33]).unwrap();
    };
    let (decode, addr) = (&p.decode, p.addr.as_str());
    let whole_get = |k: &'static str| {
        let dst = Destination::new(dst.reg.cache.clone(), vec![vec![0]]);
        async move { decode.get(addr, &[key(k)], dst, soon()).await }
    };
    p.prefill
        .publish(key("slot0"), &src.reg, &[1], Duration::ZERO, false)
        .unwrap();
    flip(src.at(1, 2) + 7); // the engine breaks its promise...
    p.prefill
        .publish(key("slot1"), &src.reg, &[1], Duration::ZERO, false)
        .unwrap();
    for k in ["slot0", "slot1"] {
        let f = failure(whole_get(k).await);
        assert!(
            matches!(f.error, PeerError::ChecksumMismatch { .. }),
            "{k}: {}",
            f.error
        );
        f.fence.wait().await;
    }
    // Released: the blocks are the engine's again; a new publication reads them now.
    assert!(p.prefill.unpublish(&key("slot0")) && p.prefill.unpublish(&key("slot1")));
    p.prefill
        .publish(key("slot2"), &src.reg, &[1], Duration::ZERO, false)
        .unwrap();
    whole_get("slot2").await.expect("a publication after the release lands");
    assert_same("slot2", &dst.piece(0, 2), &src.piece(1, 2));
    // Other blocks are never shared.
    p.prefill
        .publish(key("other"), &src.reg, &[2], Duration::ZERO, false)
        .unwrap();
    flip(src.at(2, 0));
    p.prefill
        .publish(key("other-later"), &src.reg, &[3], Duration::ZERO, false)
        .unwrap();
    let dst3 = Destination::new(dst.reg.cache.clone(), vec![vec![3]]);
    p.decode
        .get(&p.addr, &[key("other-later")], dst3, soon())
        .await
        .expect("block 3 untouched");
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hnd_to_nhd_permutation_lands_by_many_small_ranges_on_either_side() {
    let p = pair().await;
    let (heads, tokens) = (4, 16);
    let piece = heads * tokens * D;
    let src = Kv::new(&p.prefill, "src", 8, piece, Some(3));
    p.prefill
        .publish(key("r"), &src.reg, &[1, 2], Duration::ZERO, false)
        .unwrap();
    let dst = Kv::new(&p.decode, "dst", 8, piece, None);
    // Source HND [h][t][D] read in NHD order [t][h][D]: the producer permutes.
    let nhd_order: Vec<(usize, usize)> = (0..tokens)
        .flat_map(|t| (0..heads).map(move |h| ((h * tokens + t) * D, D)))
        .collect();
    let s = sel(None, Some(nhd_order), None);
    get_and_check(
        &p,
        &[key("r")],
        &src,
        &dst,
        &[(1, 0), (2, 1)],
        s,
        TransferPath::Direct,
        "src permute",
    )
    .await;
    // The same permutation done by the consumer: the stream is HND, each (h, t) lands
    // at its NHD place.
    let nhd_places: Vec<(usize, usize)> = (0..heads)
        .flat_map(|h| (0..tokens).map(move |t| ((t * heads + h) * D, D)))
        .collect();
    for (path, blocks) in [(TransferPath::Direct, (4, 5)), (TransferPath::Staged, (6, 7))] {
        let s = sel(None, None, Some(nhd_places.clone()));
        let pairs = [(1, blocks.0), (2, blocks.1)];
        get_and_check(
            &p,
            &[key("r")],
            &src,
            &dst,
            &pairs,
            s,
            path,
            &format!("dst permute ({path})"),
        )
        .await;
    }
    // Both give the same bytes.
    for p_ in 0..PIECES {
        assert_eq!(dst.piece(0, p_), dst.piece(4, p_), "piece {p_}");
        assert_eq!(dst.piece(1, p_), dst.piece(7, p_), "piece {p_}");
    }
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_16_lands_in_half_a_block_32_and_32_splits_into_two_16() {
    // NHD pieces [t][h][D]: a block of 32 tokens is two blocks of 16 end to end.
    let p = pair().await;
    let heads = 2;
    let small = 16 * heads * D;
    let big = 2 * small;
    // Prefill blocks of 16 tokens, decode blocks of 32.
    let src16 = Kv::new(&p.prefill, "src16", 8, small, Some(4));
    p.prefill
        .publish(key("p16"), &src16.reg, &[3, 4], Duration::ZERO, false)
        .unwrap();
    let dst32 = Kv::new(&p.decode, "dst32", 4, big, None);
    for (pos, half) in [(0u32, 0usize), (1, 1)] {
        let s = sel(Some(vec![pos]), None, Some(vec![(half * small, small)]));
        let pairs = [(3 + pos, 2)];
        let what = format!("16 -> half {half} of 32");
        get_and_check(
            &p,
            &[key("p16")],
            &src16,
            &dst32,
            &pairs,
            s,
            TransferPath::Direct,
            &what,
        )
        .await;
    }
    for p_ in 0..PIECES {
        let joined = [src16.piece(3, p_), src16.piece(4, p_)].concat();
        assert_eq!(
            dst32.piece(2, p_),
            joined,
            "piece {p_}: two 16-token blocks make one of 32"
        );
    }
    // Prefill blocks of 32, decode blocks of 16: each half of the source to its block.
    let src32 = Kv::new(&p.prefill, "src32", 4, big, Some(5));
    p.prefill
        .publish(key("p32"), &src32.reg, &[1], Duration::ZERO, false)
        .unwrap();
    let dst16 = Kv::new(&p.decode, "dst16", 8, small, None);
    for (half, db, path) in [(0usize, 6u32, TransferPath::Direct), (1, 7, TransferPath::Staged)] {
        let s = sel(None, Some(vec![(half * small, small)]), None);
        let what = format!("half {half} of 32 -> 16 ({path})");
        get_and_check(&p, &[key("p32")], &src32, &dst16, &[(1, db)], s, path, &what).await;
    }
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_pulls_move_only_the_selection() {
    let p = pair().await;
    let (heads, tokens) = (4, 16);
    let src = Kv::new(&p.prefill, "src", 8, heads * tokens * D, Some(6));
    p.prefill
        .publish(key("r"), &src.reg, &[0, 1, 2, 3], Duration::ZERO, false)
        .unwrap();
    let dst = Kv::new(&p.decode, "dst", 8, 2 * tokens * D, None);
    let slice = vec![(2 * tokens * D, 2 * tokens * D)];
    // start_pull: stage (with the destination's expectation) then resolve.
    let s = sel(Some(vec![3, 0]), Some(slice.clone()), None);
    let before = dst.snapshot();
    let want = reference(&before, &src, &dst, &[(3, 1), (0, 2)], Some(&slice), None);
    let (rx0, _) = wire_bytes(&p);
    for path in [TransferPath::Direct, TransferPath::Staged] {
        let t = p
            .decode
            .start_pull(&p.addr, &[key("r")], dst.dst(vec![1, 2], path, s.clone()), soon());
        let landed = t.await.unwrap();
        assert_eq!(landed.chunks, 1);
        assert_same(&format!("pull ({path})"), &dst.snapshot(), &want);
    }
    let (rx1, _) = wire_bytes(&p);
    assert_eq!(
        rx1 - rx0,
        2 * (2 * PIECES * 2 * tokens * D) as u64,
        "two pulls of the selection"
    );
    // stage_selected, then resolve into other destination ranges: each source head
    // slice lands reversed (second head first) into a larger piece's tail.
    let big = Kv::new(&p.decode, "big", 4, heads * tokens * D, None);
    let staged = p.decode.stage_selected(&p.addr, &[key("r")], &s, soon()).await.unwrap();
    let half = tokens * D;
    let land = vec![(3 * half, half), (2 * half, half)];
    let before = big.snapshot();
    let want = reference(&before, &src, &big, &[(3, 0), (0, 3)], Some(&slice), Some(&land));
    let d = big.dst(vec![0, 3], TransferPath::Direct, s.with_dst_ranges(Some(land)).unwrap());
    p.decode.resolve(staged, d, soon()).await.unwrap();
    assert_same("resolve with its own landing", &big.snapshot(), &want);
    // A resolve whose selection names other source bytes is refused, typed.
    let staged = p.decode.stage_selected(&p.addr, &[key("r")], &s, soon()).await.unwrap();
    let other = sel(Some(vec![1, 2]), Some(slice.clone()), None);
    let f = failure(
        p.decode
            .resolve(staged.clone(), dst.dst(vec![1, 2], TransferPath::Direct, other), soon())
            .await,
    );
    assert!(
        matches!(f.error, PeerError::Selection(SelectionError::Unsupported(_))),
        "{f}"
    );
    p.decode.release_staged(&staged, soon()).await.unwrap();
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_device_gathers_and_scatters_only_the_selection() {
    let p = pair().await;
    let (heads, tokens) = (4, 64);
    let piece = heads * tokens * D;
    let blocks = 8u32;
    let dev = |rank| -> Arc<dyn Device> {
        SimDevice::new(SimConfig::new(rank).with_latency(Duration::from_micros(100))).unwrap()
    };
    let (pdev, ddev) = (dev(0), dev(1));
    let device_cache = |d: &Arc<dyn Device>, name: &str, piece: usize| {
        let buf = d.alloc(PIECES * blocks as usize * piece).unwrap();
        Arc::new(
            DeviceKvCache::new(
                name,
                d.clone(),
                vec![(buf, spans(blocks, piece))],
                blocks,
                Duration::from_secs(3),
            )
            .unwrap(),
        )
    };
    let src = device_cache(&pdev, "dsrc", piece);
    let src_bytes = pattern(7, PIECES * blocks as usize * piece);
    src.buffers()[0].write(0, &src_bytes).unwrap();
    let src_reg = p.prefill.register(src.clone()).unwrap();
    p.prefill
        .publish(key("d"), &src_reg, &[5, 6, 7], Duration::ZERO, false)
        .unwrap();
    let half = 2 * tokens * D;
    let dst = device_cache(&ddev, "ddst", half);
    let s = sel(Some(vec![2, 0]), Some(vec![(half, half)]), None);
    let (rx0, tx0) = wire_bytes(&p);
    let landed = p
        .decode
        .get(
            &p.addr,
            &[key("d")],
            Destination::new(dst.clone(), vec![vec![1, 4]]).with_selection(Some(s.clone())),
            soon(),
        )
        .await
        .unwrap();
    let selected = (2 * PIECES * half) as u64;
    assert_eq!(landed.bytes as u64, selected);
    let (rx1, tx1) = wire_bytes(&p);
    assert_eq!(
        (rx1 - rx0, tx1 - tx0),
        (selected, selected),
        "only the selection crossed"
    );
    let got = dst.buffers()[0].to_vec(0, PIECES * blocks as usize * half).unwrap();
    common::halves::assert_second_halves_landed(
        &got,
        &src_bytes,
        &[(7, 1), (5, 4)],
        PIECES,
        blocks as usize,
        piece,
        "sim device",
    );
    // A stage of a device selection holds staging pages for the selected bytes only.
    let staged = p.decode.stage_selected(&p.addr, &[key("d")], &s, soon()).await.unwrap();
    let pages = p.prefill.arena().pages_for(selected as usize);
    assert_eq!(
        p.prefill.arena().stats().leased_pages,
        pages,
        "staged only the selection"
    );
    assert!(pages < p.prefill.arena().pages_for(3 * PIECES * piece));
    p.decode.release_staged(&staged, soon()).await.unwrap();
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_selections_are_typed_errors_and_the_engines_keep_serving() {
    let p = pair().await;
    let piece = 2 * 16 * D;
    let src = Kv::new(&p.prefill, "src", 8, piece, Some(8));
    p.prefill
        .publish(key("r"), &src.reg, &[0, 1, 2, 3], Duration::ZERO, false)
        .unwrap();
    p.prefill.put(key("stored"), &[1u8; 4096]).unwrap();
    let dst = Kv::new(&p.decode, "dst", 8, piece, None);
    let keys = [key("r")];
    let get = |blocks: Vec<u32>, s: Selection| {
        p.decode
            .get(&p.addr, &keys, dst.dst(blocks, TransferPath::Direct, s), soon())
    };

    // Built by the API: bad ranges never make a Selection.
    assert!(matches!(
        Selection::new(None, None, Some(vec![(0, 64), (32, 64)])),
        Err(SelectionError::Overlap { .. })
    ));
    assert!(matches!(
        Selection::new(None, Some(vec![(8, 0)]), None),
        Err(SelectionError::BadRange { .. })
    ));
    assert!(matches!(
        Selection::new(Some(vec![]), None, None),
        Err(SelectionError::NoBlocks)
    ));
    // Checked on the consumer before anything is sent.
    let f = failure(get(vec![1], sel(Some(vec![0, 1]), None, None)).await);
    assert_eq!(
        f.error.to_string(),
        "selection does not fit: 2 blocks selected but 1 destination blocks given"
    );
    let f = failure(get(vec![1], sel(None, None, Some(vec![(piece - 8, 16)]))).await);
    assert!(
        f.error
            .to_string()
            .contains(&format!("exceeds piece 0 of {piece} bytes")),
        "{f}"
    );
    let f = failure(get(vec![1], sel(None, Some(vec![(0, 64)]), None)).await);
    assert!(
        matches!(
            f.error,
            PeerError::Selection(SelectionError::TotalsDiffer { src: 64, .. })
        ),
        "{f}"
    );
    assert!(!f.dirty);
    // Checked by the producer: position, source range, piece count.
    let f = failure(get(vec![1], sel(Some(vec![9]), None, None)).await);
    assert!(bad_selection(&f).contains("block position 9 of 4"), "{f}");
    let f = failure(get(vec![1], sel(None, Some(vec![(piece - 4, 8)]), Some(vec![(0, 8)]))).await);
    assert!(
        bad_selection(&f).contains(&format!("exceeds piece 0 of {piece} bytes")),
        "{f}"
    );
    let two_pieces = Arc::new(Region::host("two", 2 * 8 * piece).unwrap());
    let spans2 = spans(8, piece)[..2].to_vec();
    let narrow = p
        .decode
        .register(KvCache::new("two", vec![(two_pieces, spans2)], 8).unwrap())
        .unwrap();
    let d = Destination::new(narrow.cache.clone(), vec![vec![0]]).with_selection(Some(sel(Some(vec![0]), None, None)));
    let f = failure(p.decode.get(&p.addr, &[key("r")], d, soon()).await);
    assert!(
        bad_selection(&f).contains("piece counts differ: the source has 4 pieces per block, the destination 2"),
        "{f}"
    );
    // Keys published from different caches cannot be selected from together.
    let other = Kv::new(&p.prefill, "other", 8, piece, Some(11));
    p.prefill
        .publish(key("o"), &other.reg, &[0], Duration::ZERO, false)
        .unwrap();
    let d = dst.dst(vec![0, 1], TransferPath::Direct, sel(Some(vec![0, 4]), None, None));
    let f = failure(p.decode.get(&p.addr, &[key("r"), key("o")], d, soon()).await);
    assert!(bad_selection(&f).contains("published from different caches"), "{f}");
    // A store chunk cannot be selected from; an unpublished key is a miss.
    let d = dst.dst(vec![0], TransferPath::Direct, sel(Some(vec![0]), None, None));
    let f = failure(p.decode.get(&p.addr, &[key("stored")], d, soon()).await);
    assert!(bad_selection(&f).contains("store chunk"), "{f}");
    let d = dst.dst(vec![0], TransferPath::Direct, sel(Some(vec![0]), None, None));
    let landed = p
        .decode
        .get(&p.addr, &[key("r"), key("nobody")], d, soon())
        .await
        .unwrap();
    assert_eq!(landed.chunks, 0, "not every key published: a miss");
    assert_eq!(p.decode.arena().stats().leased_pages, 0);
    // Nothing leaked, and the next good get lands.
    let s = sel(Some(vec![3]), None, None);
    get_and_check(
        &p,
        &[key("r")],
        &src,
        &dst,
        &[(3, 5)],
        s,
        TransferPath::Direct,
        "after refusals",
    )
    .await;
    assert_eq!(p.prefill.stats().producer.staged_now, 0, "refusals staged nothing");
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malicious_selections_on_the_wire_are_refused_and_the_server_keeps_serving() {
    let p = pair().await;
    let piece = 2 * 16 * D;
    let src = Kv::new(&p.prefill, "src", 8, piece, Some(9));
    p.prefill
        .publish(key("r"), &src.reg, &[0, 1], Duration::ZERO, false)
        .unwrap();
    let pool = Pool::new(p.addr.clone(), NetConfig::new("mallory")).unwrap();
    let mut conn = pool.checkout(soon()).await.unwrap();
    let hostile = [
        WireSelection {
            ranges: Some(vec![(u64::MAX, 5)]),
            ..Default::default()
        },
        WireSelection {
            ranges: Some(vec![(0, u64::MAX)]),
            ..Default::default()
        },
        WireSelection {
            blocks: Some(vec![u32::MAX, 0]),
            ..Default::default()
        },
        WireSelection {
            blocks: Some(vec![]),
            ..Default::default()
        },
        WireSelection {
            ranges: Some(vec![]),
            ..Default::default()
        },
        WireSelection {
            expect_pieces: Some(vec![u64::MAX; 4]),
            expect_blocks: Some(2),
            ..Default::default()
        },
        WireSelection {
            expect_blocks: Some(7),
            ..Default::default()
        },
    ];
    for (i, select) in hostile.into_iter().enumerate() {
        for msg in [
            Message::GetSelected {
                keys: vec![key("r")],
                ttl_ms: 0,
                select: select.clone(),
            },
            Message::StageSelected {
                keys: vec![key("r")],
                ttl_ms: 0,
                select,
            },
        ] {
            match conn.request(&msg).await {
                Ok(Message::Error {
                    kind: ErrorKind::BadSelection,
                    message,
                }) => assert!(!message.is_empty()),
                Err(NetError::Remote {
                    kind: ErrorKind::BadSelection,
                    ..
                }) => {}
                other => panic!("hostile selection {i} ({}): {other:?}", msg.name()),
            }
        }
    }
    // The same connection still serves.
    assert_eq!(conn.request(&Message::Ping).await.unwrap(), Message::Pong);
    // A list over its bound is refused from the frame (TooLarge) and this connection
    // closed; others are served.
    let huge = Message::GetSelected {
        keys: vec![key("r")],
        ttl_ms: 0,
        select: WireSelection {
            blocks: Some(vec![0; kvferry::wire::selection::MAX_SELECTED_BLOCKS + 1]),
            ..Default::default()
        },
    };
    let r = conn.request(&huge).await;
    assert!(
        matches!(
            r,
            Err(NetError::Remote {
                kind: ErrorKind::TooLarge,
                ..
            }) | Ok(Message::Error {
                kind: ErrorKind::TooLarge,
                ..
            })
        ),
        "{r:?}"
    );
    drop(conn);
    let dst = Kv::new(&p.decode, "dst", 8, piece, None);
    let s = sel(Some(vec![1]), None, None);
    get_and_check(
        &p,
        &[key("r")],
        &src,
        &dst,
        &[(1, 0)],
        s,
        TransferPath::Staged,
        "after mallory",
    )
    .await;
    assert_eq!(p.prefill.stats().producer.staged_now, 0);
    assert_eq!(p.prefill.arena().stats().leased_pages, 0);
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_selected_get_reports_quiet_only_after_the_drain() {
    let p = pair().await;
    let piece = 4 * 16 * D;
    let src = Kv::new(&p.prefill, "src", 16, piece, Some(10));
    let blocks: Vec<u32> = (0..16).collect();
    p.prefill
        .publish(key("r"), &src.reg, &blocks, Duration::ZERO, false)
        .unwrap();
    let dst = Kv::new(&p.decode, "dst", 16, piece / 2, None);
    // Small frames would make many sends; a slow producer holds the get mid-receive.
    p.prefill
        .producer()
        .faults()
        .send_delay_us
        .store(300_000, std::sync::atomic::Ordering::Relaxed);
    for path in [TransferPath::Direct, TransferPath::Staged] {
        let s = sel(None, Some(vec![(0, piece / 2)]), None);
        let t = p
            .decode
            .start_get(&p.addr, &[key("r")], dst.dst(blocks.clone(), path, s), soon());
        let fence = t.fence();
        let handle = tokio::spawn(t);
        tokio::time::sleep(Duration::from_millis(100)).await;
        handle.abort();
        let _ = handle.await;
        tokio::time::timeout(Duration::from_secs(5), fence.wait())
            .await
            .expect("the fence fires after the drain");
        assert_eq!(
            p.decode.stats().consumer.draining,
            0,
            "{path}: nothing draining once quiet"
        );
        assert_eq!(p.decode.arena().stats().leased_pages, 0, "{path}: staging pages back");
    }
    p.prefill
        .producer()
        .faults()
        .send_delay_us
        .store(0, std::sync::atomic::Ordering::Relaxed);
    // The publication still serves a full selected get afterwards.
    let s = sel(Some(vec![15]), Some(vec![(piece / 2, piece / 2)]), None);
    get_and_check(
        &p,
        &[key("r")],
        &src,
        &dst,
        &[(15, 3)],
        s,
        TransferPath::Direct,
        "after cancel",
    )
    .await;
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

/// A producer that lies about its selected stream: `StagedSelected` with a shape or
/// frames that do not match what the consumer asked for, then garbage frames.
struct Liar {
    /// Announce pieces of this many bytes (instead of what was asked).
    pieces: u64,
    /// Announce frames adding up to this many bytes more than the shape says.
    extra: u64,
}

impl kvferry::net::Handler for Liar {
    fn handle<'a>(
        &'a self,
        conn: &'a mut kvferry::net::Connection,
        id: u64,
        msg: Message,
    ) -> futures::future::BoxFuture<'a, Result<(), NetError>> {
        Box::pin(async move {
            match msg {
                Message::GetSelected { keys, select, .. } => {
                    let blocks = select.expect_blocks.unwrap_or(1);
                    let shape = kvferry::wire::SelectedShape {
                        blocks,
                        pieces: vec![self.pieces; PIECES],
                    };
                    let len = shape.total() + self.extra;
                    let frame = kvferry::wire::ChunkMeta {
                        key: keys[0],
                        len,
                        checksum: 0,
                    };
                    let reply = Message::StagedSelected {
                        lease_id: 7,
                        incarnation: conn.peer().incarnation,
                        chunks: vec![frame],
                        ttl_ms: 1000,
                        shape,
                    };
                    conn.send(id, &reply).await?;
                    conn.send_bulk(id, &[&vec![0xEE; len as usize]]).await?;
                    conn.send(id, &Message::PullDone { lease_id: 7 }).await
                }
                Message::Done { .. } => conn.send(id, &Message::DoneAck).await,
                other => {
                    let m = Message::Error {
                        kind: ErrorKind::BadRequest,
                        message: format!("unexpected {}", other.name()),
                    };
                    conn.send(id, &m).await
                }
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_lying_about_its_selected_stream_lands_nothing() {
    let decode = Engine::start(config("decode")).await.unwrap();
    let piece = 1024;
    let dst = Kv::new(&decode, "dst", 8, piece, None);
    for (pieces, extra, want) in [
        (512u64, 0u64, "totals differ in piece 0"),
        (piece as u64, 64, "frames of"),
    ] {
        let server =
            kvferry::net::Server::bind("127.0.0.1:0", NetConfig::new("liar"), Arc::new(Liar { pieces, extra }))
                .await
                .unwrap();
        let addr = server.local_addr().to_string();
        for path in [TransferPath::Direct, TransferPath::Staged] {
            let d = dst.dst(vec![2, 3], path, Selection::all());
            let f = failure(decode.get(&addr, &[key("r")], d, soon()).await);
            assert!(matches!(f.error, PeerError::Selection(_)), "{path}: {f}");
            assert!(f.error.to_string().contains(want), "{path}: {f}");
            assert!(!f.dirty, "{path}: refused before a byte was received");
            f.fence.wait().await;
            assert!(dst.snapshot().iter().all(|b| *b == 0), "{path}: nothing landed");
        }
    }
    assert_eq!(decode.arena().stats().leased_pages, 0);
    close_clean(&decode).await;
}
