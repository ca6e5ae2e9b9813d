//! The engine's front door end to end, over real loopback sockets: two
//! [`Engine`]s per test (a "prefill" producer and a "decode" consumer), published
//! block leases sent zero copy and received on the direct path (straight into the
//! destination blocks) or the staged path, and what the engine promises about them:
//!
//! - bytes land exactly (contiguous and multi-span caches, both paths);
//! - a publication is released — reported by `take_released` — by the consumer's
//!   `Done` (when `once`), its TTL, `unpublish` or a re-publication, and only after
//!   every send of it stopped; a foreign or duplicate `Done` changes nothing;
//! - a cancelled direct transfer reports its destination quiet (the fence) only after
//!   the receive let go of it; a cut-off one fails promptly, dirty, as `PeerLost`;
//! - `close` drains and reports clean, and a closed engine refuses new work;
//!   `deregister` waits for the transfers using a cache.
//!
//! Every test builds its own engines (ephemeral ports, no shared state), so they run
//! in parallel and in any order.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::engines::{config, pair, pattern, Pair};
use common::{eventually, holds_for_every, released_within};
use kvferry::engine::{Engine, EngineError, Registered};
use kvferry::layout::{KvCache, Span};
use kvferry::mem::Region;
use kvferry::peer::{Destination, GetFailure, LeaseRefusal, PeerError, ReleaseReason, Released, TransferPath};
use kvferry::wire::{ChunkKey, ErrorKind};
use tokio::time::Instant;

/// Bytes per block of the contiguous test caches.
/// Strong references to a registered host cache (the handle's and the engine's, plus
/// one per transfer holding it).
fn host_refs(r: &Registered) -> usize {
    Arc::strong_count(r.cache.as_host().expect("a host cache"))
}

const BLOCK: usize = 4096;
/// Blocks per contiguous test cache.
const BLOCKS: u32 = 32;

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

fn in_secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

fn key(name: &str) -> ChunkKey {
    ChunkKey::from_name(name)
}

/// The bytes block `b` of a cache filled with `seed` holds.
fn block_pattern(seed: u64, b: u32) -> Vec<u8> {
    pattern(seed * 1_000 + u64::from(b), BLOCK)
}

/// A contiguous cache of `BLOCKS` blocks; filled with `seed`'s patterns, or zero.
fn contiguous_cache(name: &str, seed: Option<u64>) -> (Arc<Region>, KvCache) {
    let region = Arc::new(Region::host(name, BLOCKS as usize * BLOCK).unwrap());
    if let Some(seed) = seed {
        for b in 0..BLOCKS {
            region.write(b as usize * BLOCK, &block_pattern(seed, b)).unwrap();
        }
    }
    let cache = KvCache::contiguous(region.clone(), BLOCK).unwrap();
    (region, cache)
}

fn read_block(region: &Region, b: u32) -> Vec<u8> {
    region.to_vec(b as usize * BLOCK, BLOCK).unwrap()
}

/// Asserts destination block `dst` holds source block `src` of a cache filled with `seed`.
fn assert_block(region: &Region, dst: u32, seed: u64, src: u32) {
    let got = read_block(region, dst);
    let want = block_pattern(seed, src);
    if got != want {
        let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        panic!("destination block {dst} differs from source block {src} in {bad} bytes");
    }
}

/// crc32c of destination blocks `blocks`, read back in order.
fn crc_of_blocks(region: &Region, blocks: &[u32]) -> u32 {
    let bytes: Vec<u8> = blocks.iter().flat_map(|&b| read_block(region, b)).collect();
    kvferry::checksum::checksum(&bytes)
}

fn assert_zero(region: &Region, blocks: impl IntoIterator<Item = u32>) {
    for b in blocks {
        assert!(
            read_block(region, b).iter().all(|x| *x == 0),
            "block {b} was written but is no destination"
        );
    }
}

/// Asserts `check()` holds every 5 ms for `window` (and was sampled enough).
async fn holds_for(window: Duration, check: impl FnMut() -> Result<(), String>) {
    holds_for_every(window, Duration::from_millis(5), check).await
}

async fn close_clean(e: &Engine) {
    let r = e.close(in_secs(5)).await;
    assert!(r.is_clean(), "{} closed unclean: {r:?}", e.peer_id());
}

/// Closes the decode engine, then the prefill one, each clean.
async fn close_pair(p: &Pair) {
    close_clean(&p.decode).await;
    close_clean(&p.prefill).await;
}

/// A contiguous cache filled with `seed`'s patterns, registered with the prefill engine.
fn register_source(p: &Pair, seed: u64) -> Registered {
    let (_src, cache) = contiguous_cache("prefill-kv", Some(seed));
    p.prefill.register(cache).unwrap()
}

/// A zeroed contiguous cache registered with the decode engine, and its memory.
fn register_destination(p: &Pair) -> (Arc<Region>, Registered) {
    let (out, cache) = contiguous_cache("decode-kv", None);
    (out, p.decode.register(cache).unwrap())
}

/// Publishes block `i` of `src` as key `{prefix}/{i}`, for `i` in `0..n`; the keys.
fn publish_block_per_key(p: &Pair, src: &Registered, prefix: &str, n: u32) -> Vec<ChunkKey> {
    let keys: Vec<ChunkKey> = (0..n).map(|i| key(&format!("{prefix}/{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        p.prefill.publish(*k, src, &[i as u32], Duration::ZERO, false).unwrap();
    }
    keys
}

/// Delays every chunk the prefill engine sends by `us` microseconds (0: no delay).
fn delay_sends_us(p: &Pair, us: u64) {
    p.prefill.producer().faults().send_delay_us.store(us, Ordering::SeqCst);
}

fn failure(r: Result<kvferry::peer::Landed, GetFailure>) -> GetFailure {
    match r {
        Ok(l) => panic!("expected a failure, landed {l:?}"),
        Err(f) => f,
    }
}

/// Runs `f` on a plain OS thread (outside the runtime, as `get_blocking` requires).
async fn on_plain_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.await.expect("plain thread panicked")
}

// ---------------------------------------------------------------------------------
// Byte-exact transfers
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_get_of_published_blocks_lands_byte_exact() {
    let p = pair().await;
    let src = register_source(&p, 1);
    let (a, b) = (key("direct/a"), key("direct/b"));
    p.prefill.publish(a, &src, &[3, 4, 5], Duration::ZERO, false).unwrap();
    p.prefill.publish(b, &src, &[7], Duration::ZERO, false).unwrap();
    assert_eq!(p.prefill.stats().producer.published_now, 2);

    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![10, 11, 12], vec![0]]);
    assert_eq!(d.path, TransferPath::Direct, "direct is the default path");
    let landed = p.decode.get(&p.addr, &[a, b], d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (2, 4 * BLOCK));
    for (dst_b, src_b) in [(10, 3), (11, 4), (12, 5), (0, 7)] {
        assert_block(&out, dst_b, 1, src_b);
    }
    // The receive path's checksums, combined, are those of the landed bytes.
    assert_eq!(landed.checksum, crc_of_blocks(&out, &[10, 11, 12, 0]));
    assert_zero(&out, (1..10).chain(13..BLOCKS));
    let s = p.decode.stats();
    assert_eq!(s.consumer.chunks_landed, 2);
    assert_eq!(s.consumer.bytes_received, 4 * BLOCK as u64);
    // Direct on both sides: no staging page and no copy on either engine.
    assert_eq!(s.arena.free_pages, s.arena.total_pages);
    assert_eq!(s.copy.bytes_copied, 0);
    assert_eq!(p.prefill.stats().copy.bytes_copied, 0);
    assert_eq!(p.prefill.stats().producer.chunks_sent, 2);

    // A partial hit lands the leading published chunks only.
    let d = Destination::new(dst.cache.clone(), vec![vec![20], vec![21], vec![22]]);
    let landed = p
        .decode
        .get(&p.addr, &[b, key("direct/unknown"), a], d, in_secs(5))
        .await
        .unwrap();
    assert_eq!((landed.chunks, landed.bytes), (1, BLOCK));
    assert_block(&out, 20, 1, 7);
    assert_eq!(landed.checksum, crc_of_blocks(&out, &[20]), "only what landed");
    assert_zero(&out, [21, 22]);

    // Not `once`: both publications are still there, nothing was released.
    assert_eq!(p.prefill.stats().producer.published_now, 2);
    assert!(p.prefill.take_released().is_empty());
    close_pair(&p).await;
    let reasons: Vec<ReleaseReason> = p.prefill.take_released().iter().map(|r| r.reason).collect();
    assert_eq!(
        reasons,
        [ReleaseReason::Shutdown; 2],
        "close releases every publication"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_get_of_published_blocks_lands_byte_exact_and_returns_its_pages() {
    let p = pair().await;
    let src = register_source(&p, 2);
    let (a, b) = (key("staged/a"), key("staged/b"));
    p.prefill.publish(a, &src, &[31, 0], Duration::ZERO, false).unwrap();
    p.prefill
        .publish(b, &src, &[16, 17, 18, 19], Duration::ZERO, false)
        .unwrap();

    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![5, 6], vec![1, 2, 3, 4]]).with_path(TransferPath::Staged);
    let landed = p.decode.get(&p.addr, &[a, b], d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (2, 6 * BLOCK));
    for (dst_b, src_b) in [(5, 31), (6, 0), (1, 16), (2, 17), (3, 18), (4, 19)] {
        assert_block(&out, dst_b, 2, src_b);
    }
    assert_eq!(landed.checksum, crc_of_blocks(&out, &[5, 6, 1, 2, 3, 4]));
    assert_zero(&out, [0].into_iter().chain(7..BLOCKS));
    let s = p.decode.stats();
    assert_eq!(s.consumer.chunks_landed, 2);
    assert_eq!(
        s.copy.bytes_copied,
        6 * BLOCK as u64,
        "the staged path lands with one copy"
    );
    assert_eq!(
        p.prefill.stats().copy.bytes_copied,
        0,
        "publications are sent without copies"
    );
    assert_eq!(s.arena.free_pages, s.arena.total_pages, "staging pages came back");
    close_pair(&p).await;
}

/// Two per-layer tensors (`LayerSeparate`-style), each `[K of every block][V of every
/// block]`: a block's canonical bytes are L0.K ++ L0.V ++ L1.K ++ L1.V.
fn layer_separate_cache(name: &str, blocks: u32, piece: usize, seed: Option<u64>) -> (Vec<Arc<Region>>, KvCache) {
    let spans = vec![
        Span {
            offset: 0,
            stride: piece,
            len: piece,
        },
        Span {
            offset: blocks as usize * piece,
            stride: piece,
            len: piece,
        },
    ];
    let regions: Vec<Arc<Region>> = (0..2)
        .map(|l| {
            let r = Arc::new(Region::host(format!("{name}-layer{l}"), 2 * blocks as usize * piece).unwrap());
            if let Some(seed) = seed {
                r.write(0, &pattern(seed * 10 + l, r.len())).unwrap();
            }
            r
        })
        .collect();
    let parts = regions.iter().map(|r| (r.clone(), spans.clone())).collect();
    (regions, KvCache::new(name, parts, blocks).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_span_cache_round_trips_on_both_paths() {
    const PIECE: usize = 512;
    const NB: u32 = 16;
    let p = pair().await;
    let (src_regions, cache) = layer_separate_cache("prefill-kv", NB, PIECE, Some(3));
    assert_eq!(cache.map().block_bytes(), 4 * PIECE);
    let src = p.prefill.register(cache).unwrap();
    let k = key("multi/a");
    p.prefill.publish(k, &src, &[2, 5], Duration::ZERO, false).unwrap();
    // The piece of `block` at span `kv` (0 = K, 1 = V) of a layer tensor.
    let piece = |r: &Region, kv: usize, block: u32| {
        r.to_vec(kv * NB as usize * PIECE + block as usize * PIECE, PIECE)
            .unwrap()
    };

    // Into the same multi-span layout, direct (blocks reordered: 2 -> 9, 5 -> 1).
    let (dst_regions, cache) = layer_separate_cache("decode-kv", NB, PIECE, None);
    let dst = p.decode.register(cache).unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![9, 1]]);
    let landed = p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (1, 2 * 4 * PIECE));
    for (s, d) in [(2u32, 9u32), (5, 1)] {
        for l in 0..2 {
            for kv in 0..2 {
                assert!(
                    piece(&src_regions[l], kv, s) == piece(&dst_regions[l], kv, d),
                    "layer {l} {} of block {s} did not land in block {d}",
                    ["K", "V"][kv]
                );
            }
        }
    }
    // Untouched blocks stay zero in every piece.
    for layer in &dst_regions {
        for kv in 0..2 {
            for b in (0..NB).filter(|b| *b != 9 && *b != 1) {
                assert!(piece(layer, kv, b).iter().all(|x| *x == 0), "block {b} written");
            }
        }
    }

    // Into a contiguous cache of the same block size, staged: the canonical order.
    let flat = Arc::new(Region::host("decode-flat", NB as usize * 4 * PIECE).unwrap());
    let flat_cache = p
        .decode
        .register(KvCache::contiguous(flat.clone(), 4 * PIECE).unwrap())
        .unwrap();
    let d = Destination::new(flat_cache.cache.clone(), vec![vec![0, 1]]).with_path(TransferPath::Staged);
    let landed = p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap();
    assert_eq!(landed.chunks, 1);
    for (i, s) in [2u32, 5].into_iter().enumerate() {
        let want = [
            piece(&src_regions[0], 0, s),
            piece(&src_regions[0], 1, s),
            piece(&src_regions[1], 0, s),
            piece(&src_regions[1], 1, s),
        ]
        .concat();
        assert!(
            flat.to_vec(i * 4 * PIECE, 4 * PIECE).unwrap() == want,
            "block {s} is not L0.K ++ L0.V ++ L1.K ++ L1.V in flat block {i}"
        );
    }
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_blocking_from_a_plain_thread_lands_and_times_out_on_time() {
    let p = pair().await;
    let src = register_source(&p, 4);
    let k = key("blocking/a");
    p.prefill.publish(k, &src, &[8, 9], Duration::ZERO, false).unwrap();
    let (out, dst) = register_destination(&p);

    let (decode, addr, d) = (
        p.decode.clone(),
        p.addr.clone(),
        Destination::new(dst.cache.clone(), vec![vec![0, 1]]),
    );
    let r = on_plain_thread(move || decode.get_blocking(&addr, &[k], d, Duration::from_secs(5))).await;
    assert_eq!(r.unwrap().chunks, 1);
    assert_block(&out, 0, 4, 8);
    assert_block(&out, 1, 4, 9);

    // A slow producer: the blocking get returns on time with `Timeout`; the fence
    // fires once the cancelled receive let go of the destination.
    delay_sends_us(&p, 600_000);
    let (decode, addr, d) = (
        p.decode.clone(),
        p.addr.clone(),
        Destination::new(dst.cache.clone(), vec![vec![2, 3]]),
    );
    let timeout = Duration::from_millis(150);
    let (r, took) = on_plain_thread(move || {
        let t = std::time::Instant::now();
        let r = decode.get_blocking(&addr, &[k], d, timeout);
        (r, t.elapsed())
    })
    .await;
    let f = failure(r);
    assert!(matches!(f.error, PeerError::Timeout { .. }), "{}", f.error);
    assert!(
        took >= timeout && took < timeout + Duration::from_millis(100),
        "returned after {took:?}"
    );
    assert!(f.fence.wait_until(in_secs(2)).await, "fence did not fire");
    eventually("the transfer released the destination", || host_refs(&dst) == 2).await;
    delay_sends_us(&p, 0);
    close_pair(&p).await;
}

// ---------------------------------------------------------------------------------
// Published block leases
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_publication_is_released_by_the_consumers_done() {
    let p = pair().await;
    let src = register_source(&p, 5);
    let k = key("once/a");
    p.prefill.publish(k, &src, &[1, 2], Duration::ZERO, true).unwrap();
    assert!(p.prefill.take_released().is_empty());

    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![4, 5]]);
    assert_eq!(p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap().chunks, 1);
    assert_block(&out, 4, 5, 1);
    assert_block(&out, 5, 5, 2);

    let released = released_within(&p.prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Done
        }]
    );
    let s = p.prefill.stats().producer;
    assert_eq!((s.published_now, s.done), (0, 1));
    // Gone: a second get is a miss and writes nothing.
    let d = Destination::new(dst.cache.clone(), vec![vec![10, 11]]);
    let landed = p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (0, 0));
    assert_zero(&out, [10, 11]);
    assert!(released_within(&p.prefill, Duration::from_millis(100)).await.is_empty());
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expiry_releases_and_a_later_get_misses() {
    let p = pair().await;
    let src = register_source(&p, 6);
    let k = key("ttl/a");
    let ttl = Duration::from_millis(300);
    let published = Instant::now();
    p.prefill.publish(k, &src, &[0], ttl, false).unwrap();

    // Before expiry it is served (and, not `once`, stays published after the Done).
    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![3]]);
    assert_eq!(p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap().chunks, 1);
    assert_block(&out, 3, 6, 0);
    assert!(p.prefill.take_released().is_empty(), "released before its TTL");

    let released = released_within(&p.prefill, Duration::from_secs(3)).await;
    assert!(published.elapsed() >= ttl, "released after {:?}", published.elapsed());
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Expired
        }]
    );
    assert_eq!(p.prefill.stats().producer.published_now, 0);
    let d = Destination::new(dst.cache.clone(), vec![vec![4]]);
    let landed = p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap();
    assert_eq!(
        (landed.chunks, landed.bytes),
        (0, 0),
        "an expired publication is a miss"
    );
    assert_zero(&out, [4]);
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_releases_once_and_the_key_then_misses() {
    let p = pair().await;
    let src = register_source(&p, 7);
    let k = key("unpublish/a");
    p.prefill.publish(k, &src, &[1], Duration::ZERO, false).unwrap();
    assert!(p.prefill.unpublish(&k));
    let released = released_within(&p.prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Released
        }]
    );
    assert!(!p.prefill.unpublish(&k), "a second unpublish finds nothing");
    assert!(released_within(&p.prefill, Duration::from_millis(100)).await.is_empty());

    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![0]]);
    assert_eq!(p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap().chunks, 0);
    assert_zero(&out, [0]);
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republishing_a_key_replaces_and_releases_the_old_publication() {
    let p = pair().await;
    let src = register_source(&p, 8);
    let k = key("replace/a");
    p.prefill.publish(k, &src, &[2], Duration::ZERO, false).unwrap();
    p.prefill.publish(k, &src, &[6], Duration::ZERO, false).unwrap();
    let released = released_within(&p.prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Replaced
        }]
    );
    assert_eq!(p.prefill.stats().producer.published_now, 1);

    // The new publication is what is served.
    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![0]]);
    assert_eq!(p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap().chunks, 1);
    assert_block(&out, 0, 8, 6);
    assert!(p.prefill.unpublish(&k));
    let released = released_within(&p.prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Released
        }]
    );
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_is_reported_only_after_the_in_flight_send_finished() {
    let p = pair().await;
    let src = register_source(&p, 9);
    let keys = [key("inflight/a"), key("inflight/b")];
    p.prefill
        .publish(keys[0], &src, &[10, 11], Duration::ZERO, false)
        .unwrap();
    p.prefill.publish(keys[1], &src, &[12], Duration::ZERO, false).unwrap();
    // 250 ms before each chunk's frame: the send takes ~500 ms.
    delay_sends_us(&p, 250_000);

    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![0, 1], vec![2]]);
    let transfer = tokio::spawn(p.decode.start_get(&p.addr, &keys, d, in_secs(10)));
    // The producer granted the lease (it now holds both publications) and is sending.
    eventually("lease granted", || p.prefill.stats().producer.staged == 1).await;
    assert!(p.prefill.unpublish(&keys[0]));
    assert!(p.prefill.unpublish(&keys[1]));
    assert_eq!(p.prefill.stats().producer.published_now, 0);

    // While the consumer has not received every chunk, the send is still running from
    // the published blocks: nothing may be reported released. Read the releases
    // first, then the receive counter: a release seen implies the send had finished.
    let mut samples_mid_send = 0;
    let mut released = Vec::new();
    while !transfer.is_finished() {
        let r = p.prefill.take_released();
        let received = p.decode.stats().consumer.chunks_received;
        assert!(
            r.is_empty() || received == 2,
            "released {r:?} while only {received} of 2 chunks were received"
        );
        if received < 2 {
            samples_mid_send += 1;
        }
        released.extend(r);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        samples_mid_send >= 20,
        "only {samples_mid_send} samples during the send"
    );
    // The send finished from live blocks: the transfer is intact.
    let landed = transfer.await.unwrap().unwrap();
    assert_eq!(landed.chunks, 2);
    for (d, s) in [(0, 10), (1, 11), (2, 12)] {
        assert_block(&out, d, 9, s);
    }
    // And now both releases appear (after the Done let the lease go).
    while released.len() < 2 {
        let more = released_within(&p.prefill, Duration::from_secs(2)).await;
        assert!(!more.is_empty(), "releases missing; got {released:?}");
        released.extend(more);
    }
    released.sort_by_key(|r| keys.iter().position(|k| *k == r.key));
    assert_eq!(
        released,
        keys.map(|key| Released {
            key,
            reason: ReleaseReason::Released
        })
    );
    delay_sends_us(&p, 0);
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_or_duplicate_done_changes_nothing() {
    let p = pair().await;
    let intruder = Engine::start(config("intruder").listen(None)).await.unwrap();
    let src = register_source(&p, 10);
    let k = key("foreign/a");
    p.prefill.publish(k, &src, &[20, 21], Duration::ZERO, true).unwrap();

    let handle = p.decode.stage(&p.addr, &[k], in_secs(5)).await.unwrap();
    assert_ne!(handle.lease_id, 0);
    assert_eq!(handle.chunks.len(), 1);

    // Another peer's Done over the wire: refused, counted, nothing released.
    let e = intruder.release_staged(&handle, in_secs(5)).await.unwrap_err();
    assert!(
        matches!(
            e,
            PeerError::Remote {
                kind: ErrorKind::UnknownLease,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(p.prefill.stats().producer.foreign_lease_refused, 1);
    // The same, straight to the producer.
    assert_eq!(
        p.prefill.producer().release(handle.lease_id, "intruder"),
        Err(LeaseRefusal::Foreign)
    );
    let s = p.prefill.stats().producer;
    assert_eq!((s.foreign_lease_refused, s.done, s.published_now), (2, 0, 1));
    assert!(released_within(&p.prefill, Duration::from_millis(100)).await.is_empty());

    // The lease still works for its owner.
    let (out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![0, 1]]);
    let landed = p.decode.resolve(handle.clone(), d, in_secs(5)).await.unwrap();
    assert_eq!(landed.chunks, 1);
    assert_block(&out, 0, 10, 20);
    assert_block(&out, 1, 10, 21);
    let released = released_within(&p.prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Done
        }]
    );
    assert_eq!(p.prefill.stats().producer.done, 1);

    // Duplicate Dones from the owner: acknowledged (or unknown), and change nothing.
    p.decode.release_staged(&handle, in_secs(5)).await.unwrap();
    assert_eq!(
        p.prefill.producer().release(handle.lease_id, p.decode.peer_id()),
        Err(LeaseRefusal::Unknown)
    );
    let s = p.prefill.stats().producer;
    assert_eq!((s.done, s.foreign_lease_refused), (1, 2));
    assert!(released_within(&p.prefill, Duration::from_millis(100)).await.is_empty());
    close_clean(&intruder).await;
    close_pair(&p).await;
}

// ---------------------------------------------------------------------------------
// Cancellation and cut-off transfers on the direct path
// ---------------------------------------------------------------------------------

/// What this proves. On the direct path the socket reads straight into the
/// destination blocks; the only thing that may write them is the transfer task, which
/// owns the `Destination` (and so a strong reference to the `KvCache`) for as long as
/// it can read. So "the receive can still write" is observable as
/// `strong_count(cache) > base` (base = the references this test and the engine's
/// registration hold).
///
/// 1. For 500 ms while chunks are still arriving (the producer is slowed), the fence
///    has not fired and the transfer holds the destination, at every sample.
/// 2. After the `Transfer` is dropped, at every sample the fence is read *first* and
///    the count second: whenever the fence reads fired, the count is already back to
///    base — the destination is never reported quiet while the receive still holds it
///    (a fence firing early would be caught at the first sample after it fired, since
///    the count can only drop). The fence fires within a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_direct_transfer_fires_its_fence_only_after_the_receive_let_go() {
    let p = pair().await;
    let src = register_source(&p, 11);
    let keys = publish_block_per_key(&p, &src, "cancel", 6);
    // 250 ms before each chunk: the whole transfer would take ~1.5 s.
    delay_sends_us(&p, 250_000);

    let (_out, dst) = register_destination(&p);
    let base = host_refs(&dst);
    let d = Destination::new(dst.cache.clone(), (0..6).map(|b| vec![b]).collect());
    let mut transfer = p.decode.start_get(&p.addr, &keys, d, in_secs(10));
    let fence = transfer.fence();
    assert!(!fence.is_drained());

    // 1. The transfer runs (polled here); once the first chunk landed in place, hold
    //    the invariant for 500 ms while the socket read is in progress.
    let consumer = p.decode.clone();
    let window = async {
        eventually("first chunk received", || {
            consumer.stats().consumer.chunks_received >= 1
        })
        .await;
        holds_for(Duration::from_millis(500), || {
            let drained = fence.is_drained();
            let held = host_refs(&dst) > base;
            let received = consumer.stats().consumer.chunks_received;
            if !drained && held && received < 6 {
                Ok(())
            } else {
                Err(format!(
                    "fence drained={drained} destination held={held} chunks received={received}"
                ))
            }
        })
        .await;
    };
    tokio::select! {
        r = &mut transfer => panic!("the transfer ended during the window: {r:?}"),
        _ = window => {}
    }
    assert!(p.decode.stats().consumer.chunks_received < 6);

    // 2. Cancel: drop the transfer, then watch the fence and the count.
    drop(transfer);
    let dropped = Instant::now();
    loop {
        let drained = fence.is_drained(); // first
        let count = host_refs(&dst); // second
        if drained {
            assert_eq!(
                count, base,
                "the fence fired while the receive still held the destination"
            );
            break;
        }
        assert!(
            dropped.elapsed() < Duration::from_secs(1),
            "fence did not fire within 1 s (count {count}, base {base})"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(host_refs(&dst), base);
    eventually("cancel counted", || {
        let s = p.decode.stats().consumer;
        s.cancelled == 1 && s.draining == 0
    })
    .await;
    assert!(p.decode.stats().consumer.chunks_received < 6);
    delay_sends_us(&p, 0);
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_reset_mid_direct_transfer_is_dirty_peer_lost_promptly() {
    let p = pair().await;
    let src = register_source(&p, 12);
    let k = key("reset/a");
    p.prefill.publish(k, &src, &[4, 5], Duration::ZERO, false).unwrap();
    let (out, dst) = register_destination(&p);

    p.prefill
        .producer()
        .faults()
        .reset_ppm
        .store(1_000_000, Ordering::SeqCst);
    let t = Instant::now();
    let d = Destination::new(dst.cache.clone(), vec![vec![0, 1]]);
    let f = failure(p.decode.get(&p.addr, &[k], d, in_secs(10)).await);
    assert!(t.elapsed() < Duration::from_secs(1), "failed after {:?}", t.elapsed());
    assert!(matches!(f.error, PeerError::PeerLost { .. }), "{}", f.error);
    assert!(f.dirty, "a failed direct receive reports its blocks dirty");
    assert!(f.fence.wait_until(in_secs(1)).await);
    assert_eq!(p.decode.stats().consumer.failed, 1);

    // Without the fault the same publication is served intact.
    p.prefill.producer().faults().reset_ppm.store(0, Ordering::SeqCst);
    let d = Destination::new(dst.cache.clone(), vec![vec![0, 1]]);
    assert_eq!(p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap().chunks, 1);
    assert_block(&out, 0, 12, 4);
    assert_block(&out, 1, 12, 5);
    close_pair(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_closed_mid_direct_transfer_is_dirty_peer_lost_promptly() {
    let p = pair().await;
    let src = register_source(&p, 13);
    let keys = publish_block_per_key(&p, &src, "closed", 4);
    delay_sends_us(&p, 200_000);
    let (_out, dst) = register_destination(&p);
    let d = Destination::new(dst.cache.clone(), (0..4).map(|b| vec![b]).collect());
    let get = tokio::spawn({
        let (decode, addr, keys) = (p.decode.clone(), p.addr.clone(), keys.clone());
        async move { decode.get(&addr, &keys, d, in_secs(30)).await }
    });
    // Bytes already landed in place when the producer goes away.
    eventually("first chunk received", || {
        p.decode.stats().consumer.chunks_received >= 1
    })
    .await;
    let t = Instant::now();
    let report = p.prefill.close(in_secs(2)).await;
    let f = failure(get.await.unwrap());
    assert!(t.elapsed() < Duration::from_secs(1), "failed after {:?}", t.elapsed());
    assert!(matches!(f.error, PeerError::PeerLost { .. }), "{}", f.error);
    assert!(f.dirty, "chunks had landed in place: the destination is dirty");
    assert!(f.fence.wait_until(in_secs(1)).await);
    assert!(report.is_clean(), "{report:?}");
    // Every publication was released by the shutdown, once.
    let released = released_within(&p.prefill, Duration::from_secs(1)).await;
    assert_eq!(released.len(), 4, "{released:?}");
    assert!(
        released.iter().all(|r| r.reason == ReleaseReason::Shutdown),
        "{released:?}"
    );
    eventually("destination let go", || host_refs(&dst) == 2).await;

    // A closed producer is simply gone for new gets.
    let d = Destination::new(dst.cache.clone(), vec![vec![9]]);
    let t = Instant::now();
    let f = failure(p.decode.get(&p.addr, &keys[..1], d, in_secs(5)).await);
    assert!(matches!(f.error, PeerError::PeerLost { .. }), "{}", f.error);
    assert!(t.elapsed() < Duration::from_secs(1), "failed after {:?}", t.elapsed());
    close_clean(&p.decode).await;
}

// ---------------------------------------------------------------------------------
// Close and deregister
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_is_clean_after_traffic_and_a_closed_engine_refuses_new_work() {
    let p = pair().await;
    let src = register_source(&p, 14);
    let (a, b) = (key("close/a"), key("close/b"));
    p.prefill.publish(a, &src, &[1, 2], Duration::ZERO, false).unwrap();
    p.prefill.publish(b, &src, &[3], Duration::ZERO, true).unwrap();
    let (out, dst) = register_destination(&p);

    // Traffic of every kind: direct, staged, delayed pull, push, lookup, copy-in put.
    let d = Destination::new(dst.cache.clone(), vec![vec![0, 1]]);
    assert_eq!(p.decode.get(&p.addr, &[a], d, in_secs(5)).await.unwrap().chunks, 1);
    let d = Destination::new(dst.cache.clone(), vec![vec![2, 3]]).with_path(TransferPath::Staged);
    assert_eq!(p.decode.get(&p.addr, &[a], d, in_secs(5)).await.unwrap().chunks, 1);
    let h = p.decode.stage(&p.addr, &[b], in_secs(5)).await.unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![4]]);
    assert_eq!(p.decode.resolve(h, d, in_secs(5)).await.unwrap().chunks, 1);
    for (d, s) in [(0, 1), (1, 2), (2, 1), (3, 2), (4, 3)] {
        assert_block(&out, d, 14, s);
    }
    let pushed = pattern(99, 3 * BLOCK);
    p.decode
        .push(&p.addr, key("close/pushed"), &pushed, in_secs(5))
        .await
        .unwrap();
    p.prefill.put(key("close/put"), &pattern(98, BLOCK)).unwrap();
    let hits = p
        .decode
        .lookup(
            &p.addr,
            &[key("close/put"), key("close/pushed"), key("close/none")],
            in_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(hits, 2);
    // The pushed chunk comes back byte-exact through the producer's store.
    let d = Destination::new(dst.cache.clone(), vec![vec![10, 11, 12]]);
    let landed = p
        .decode
        .get(&p.addr, &[key("close/pushed")], d, in_secs(5))
        .await
        .unwrap();
    assert_eq!((landed.chunks, landed.bytes), (1, 3 * BLOCK));
    assert!(out.to_vec(10 * BLOCK, 3 * BLOCK).unwrap() == pushed);

    let s = p.decode.stats();
    assert_eq!(
        (s.consumer.completed, s.consumer.failed, s.consumer.cancelled),
        (4, 0, 0)
    );
    close_pair(&p).await;
    close_clean(&p.decode).await; // idempotent

    // Closed: every new piece of work is refused at once.
    let d = Destination::new(dst.cache.clone(), vec![vec![20]]);
    let f = failure(p.decode.get(&p.addr, &[a], d, in_secs(5)).await);
    assert!(matches!(f.error, PeerError::ShuttingDown), "{}", f.error);
    assert!(!f.dirty && f.fence.is_drained());
    let (decode, addr, d) = (
        p.decode.clone(),
        p.addr.clone(),
        Destination::new(dst.cache.clone(), vec![vec![20]]),
    );
    let f = failure(on_plain_thread(move || decode.get_blocking(&addr, &[a], d, Duration::from_secs(1))).await);
    assert!(matches!(f.error, PeerError::ShuttingDown), "{}", f.error);
    assert!(matches!(
        p.decode.stage(&p.addr, &[a], in_secs(1)).await,
        Err(PeerError::ShuttingDown)
    ));
    assert!(matches!(
        p.decode.lookup(&p.addr, &[a], in_secs(1)).await,
        Err(PeerError::ShuttingDown)
    ));
    assert!(matches!(
        p.decode.push(&p.addr, a, &[1; 16], in_secs(1)).await,
        Err(PeerError::ShuttingDown)
    ));
    let (_r, cache) = contiguous_cache("late", None);
    assert!(matches!(p.decode.register(cache), Err(EngineError::Closed)));
    assert!(matches!(
        p.prefill.publish(a, &src, &[1], Duration::ZERO, false),
        Err(EngineError::Closed)
    ));
    assert!(matches!(p.prefill.put(a, &[1; 16]), Err(EngineError::Closed)));
    assert_zero(&out, [20]);
}

/// `Engine::start_get` refuses work on a closed engine like `get`, `get_blocking`,
/// `stage`, `resolve`, `push` and `lookup` do (it once ran the transfer anyway).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_get_on_a_closed_engine_is_refused() {
    let p = pair().await;
    let src = register_source(&p, 15);
    let k = key("closed-start/a");
    p.prefill.publish(k, &src, &[1], Duration::ZERO, false).unwrap();
    let (out, dst) = register_destination(&p);
    close_clean(&p.decode).await;

    let d = Destination::new(dst.cache.clone(), vec![vec![0]]);
    let r = p.decode.start_get(&p.addr, &[k], d, in_secs(5)).await;
    let f = failure(r);
    assert!(matches!(f.error, PeerError::ShuttingDown), "{}", f.error);
    assert_zero(&out, [0]);
    close_clean(&p.prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_waits_for_the_transfers_and_publications_using_a_cache() {
    let p = pair().await;
    let src = register_source(&p, 16);
    let keys = [key("dereg/a"), key("dereg/b")];
    p.prefill.publish(keys[0], &src, &[0], Duration::ZERO, false).unwrap();
    p.prefill.publish(keys[1], &src, &[1], Duration::ZERO, false).unwrap();
    delay_sends_us(&p, 250_000);

    let (out, dst) = register_destination(&p);
    assert_eq!(p.decode.stats().registered, 1);
    let d = Destination::new(dst.cache.clone(), vec![vec![5], vec![6]]);
    let transfer = tokio::spawn(p.decode.start_get(&p.addr, &keys, d, in_secs(10)));
    eventually("lease granted", || p.prefill.stats().producer.staged == 1).await;

    // The slow transfer holds the destination cache: deregistration times out.
    let t = Instant::now();
    match p.decode.deregister(&dst, Duration::from_millis(50)).await {
        Err(EngineError::InUse { holders, waited, .. }) => {
            assert_eq!(holders, 1);
            assert!(waited >= Duration::from_millis(50), "{waited:?}");
        }
        other => panic!("expected InUse, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(300), "{:?}", t.elapsed());
    assert!(!transfer.is_finished(), "the transfer must still be running");
    assert_eq!(p.decode.stats().registered, 1, "still registered after InUse");

    // Publications hold the source cache the same way.
    assert!(matches!(
        p.prefill.deregister(&src, Duration::from_millis(20)).await,
        Err(EngineError::InUse { .. })
    ));

    // Once the transfer finished, deregistration succeeds (waiting as needed).
    assert_eq!(transfer.await.unwrap().unwrap().chunks, 2);
    assert_block(&out, 5, 16, 0);
    assert_block(&out, 6, 16, 1);
    p.decode.deregister(&dst, Duration::from_secs(2)).await.unwrap();
    assert_eq!(p.decode.stats().registered, 0);
    assert!(matches!(
        p.decode.deregister(&dst, Duration::from_millis(10)).await,
        Err(EngineError::NotRegistered(_))
    ));

    delay_sends_us(&p, 0);
    for k in &keys {
        assert!(p.prefill.unpublish(k));
    }
    p.prefill.deregister(&src, Duration::from_secs(2)).await.unwrap();
    // A deregistered cache can no longer be published.
    assert!(matches!(
        p.prefill.publish(keys[0], &src, &[0], Duration::ZERO, false),
        Err(EngineError::NotRegistered(_))
    ));
    close_pair(&p).await;
}

/// Holders are counted explicitly by the ledger: a cloned `Registered` handle is not
/// a holder (before the ledger, deregistration counted `Arc` references, so a clone
/// held it up), a publication is, and the release of the last one wakes a waiting
/// deregistration at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_are_counted_and_the_last_one_wakes_deregistration() {
    let e = Engine::start(config("solo").listen(None)).await.unwrap();
    let (_r, cache) = contiguous_cache("kv", None);
    let reg: Registered = e.register(cache).unwrap();
    let extra = reg.clone();
    assert_eq!(e.holders(reg.id), Some(0), "a handle is not a holder");
    let k = key("held");
    e.publish(k, &reg, &[1], Duration::ZERO, false).unwrap();
    assert_eq!(e.holders(reg.id), Some(1));
    assert!(matches!(
        e.deregister(&reg, Duration::from_millis(10)).await,
        Err(EngineError::InUse { holders: 1, .. })
    ));
    // Still registered after the failed wait: publishing works.
    e.publish(key("held-2"), &reg, &[2], Duration::ZERO, false).unwrap();
    assert!(e.unpublish(&key("held-2")));
    let waiter = {
        let (e, reg) = (e.clone(), reg.clone());
        tokio::spawn(async move {
            let r = e.deregister(&reg, Duration::from_secs(5)).await;
            (r, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "deregistered while a publication held it");
    // While it waits, the cache takes no new holder.
    assert!(e.publish(key("late"), &reg, &[3], Duration::ZERO, false).is_err());
    let unpublished = Instant::now();
    assert!(e.unpublish(&k));
    let (r, done_at) = waiter.await.unwrap();
    r.unwrap();
    let woke = done_at - unpublished;
    assert!(
        woke < Duration::from_millis(50),
        "deregistration woke {woke:?} after the last release"
    );
    eprintln!("deregistration completed {woke:?} after the last holder let go");
    assert_eq!(e.holders(reg.id), None);
    drop(extra);
    close_clean(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_counts_published_chunks_as_a_stage_would_serve_them() {
    let p = pair().await;
    let src = register_source(&p, 9);
    let (a, b, c) = (key("lookup/a"), key("lookup/b"), key("lookup/c"));
    assert_eq!(p.decode.lookup(&p.addr, &[a, b], in_secs(5)).await.unwrap(), 0);
    p.prefill
        .publish(a, &src, &[0], Duration::from_secs(30), false)
        .unwrap();
    p.prefill
        .publish(b, &src, &[1], Duration::from_secs(30), false)
        .unwrap();
    // The leading published keys count; a key after a gap does not.
    assert_eq!(p.decode.lookup(&p.addr, &[a, b, c], in_secs(5)).await.unwrap(), 2);
    assert_eq!(p.decode.lookup(&p.addr, &[c, a], in_secs(5)).await.unwrap(), 0);
    // Put chunks (the store) still count when the first key is not published.
    p.prefill.put(c, &pattern(3, 1000)).unwrap();
    assert_eq!(p.decode.lookup(&p.addr, &[c], in_secs(5)).await.unwrap(), 1);
    assert!(p.prefill.unpublish(&a));
    assert_eq!(p.decode.lookup(&p.addr, &[a, b], in_secs(5)).await.unwrap(), 0);
    close_pair(&p).await;
}

/// A timeout's `waited` runs from the call that started the transfer, on the clock of
/// its deadline, not from the transfer's first poll: a `Transfer` awaited late (as a
/// runtime on a busy host may first poll it) still reports the whole time since
/// `start_get`. (It reported only the time since the first poll, so a Python
/// `get_blocking(timeout=0.2)` once said it waited 196.7 ms.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_reports_the_time_since_the_call_not_since_the_first_poll() {
    let p = pair().await;
    let src = register_source(&p, 21);
    let k = key("clock/a");
    p.prefill.publish(k, &src, &[0], Duration::ZERO, false).unwrap();
    delay_sends_us(&p, 2_000_000);
    let (_out, dst) = register_destination(&p);

    let timeout = Duration::from_millis(300);
    let called = Instant::now();
    let d = Destination::new(dst.cache.clone(), vec![vec![0]]);
    let transfer = p.decode.start_get(&p.addr, &[k], d, called + timeout);
    tokio::time::sleep(Duration::from_millis(150)).await; // first polled late
    let f = failure(transfer.await);
    let returned = called.elapsed();
    match &f.error {
        PeerError::Timeout { waited, .. } => {
            assert!(*waited >= timeout, "waited {waited:?} of a {timeout:?} timeout");
            assert!(*waited <= returned, "waited {waited:?}, returned after {returned:?}");
        }
        e => panic!("expected a timeout, got {e}"),
    }
    delay_sends_us(&p, 0);
    assert!(f.fence.wait_until(in_secs(5)).await, "the cancelled get drains");
    close_pair(&p).await;
}
