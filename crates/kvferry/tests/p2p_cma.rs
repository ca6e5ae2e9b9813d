//! The same-host (CMA) mover through the engine's front door: the consumer reads the
//! producer's granted bytes with `process_vm_readv` (here the two engines share a
//! process, which the kernel treats like any other target; `kvferry-cli`'s
//! `p2p_process` tests use two processes), and what it promises:
//!
//! - chosen by default on one host, named in `stats().movers` with the producer's
//!   pid; no byte of the grant goes on the socket;
//! - the direct path (into the destination blocks) and the staged path land exactly,
//!   for published blocks and store chunks;
//! - a producer that writes its published blocks after publishing is caught by the
//!   checksums, on this mover as on the socket: `ChecksumMismatch`, never wrong bytes
//!   reported landed;
//! - `transport = tcp` on either side keeps every byte on the socket, and a
//!   consumer that was refused says why;
//! - a delayed pull (`stage`, then `resolve`) of whole chunks is read the same way
//!   (`PullMapped`), into the destination or staging pages, a prefix when the
//!   destination takes fewer chunks, and the producer's lease ends with the `Done`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::engines::{config, pair_with, pattern};
use kvferry::engine::EngineConfig;
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::peer::{Destination, Mover, PeerError, TransferPath, Transport};
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

const BLOCK: usize = 8192;
const BLOCKS: u32 = 32;

fn in_secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// A contiguous host cache, block `b` filled with `pattern(seed * 1000 + b)`.
fn cache(name: &str, seed: Option<u64>) -> (Arc<Region>, KvCache) {
    let region = Arc::new(Region::host(name, BLOCKS as usize * BLOCK).unwrap());
    if let Some(seed) = seed {
        for b in 0..BLOCKS {
            region
                .write(b as usize * BLOCK, &pattern(seed * 1000 + u64::from(b), BLOCK))
                .unwrap();
        }
    }
    let cache = KvCache::contiguous(region.clone(), BLOCK).unwrap();
    (region, cache)
}

fn block(region: &Region, b: u32) -> Vec<u8> {
    region.to_vec(b as usize * BLOCK, BLOCK).unwrap()
}

fn with_transport(t: Transport) -> impl Fn(&str) -> EngineConfig {
    move |id| {
        let mut c = config(id);
        c.producer.transport = t;
        c
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_host_get_is_read_from_the_producers_memory_and_lands_exact() {
    let p = pair_with(with_transport(Transport::Auto)).await;
    let (_src, c) = cache("prefill-kv", Some(3));
    let src = p.prefill.register(c).unwrap();
    let (a, b) = (ChunkKey::from_name("cma/a"), ChunkKey::from_name("cma/b"));
    p.prefill.publish(a, &src, &[1, 2, 9], Duration::ZERO, false).unwrap();
    p.prefill.publish(b, &src, &[20], Duration::ZERO, false).unwrap();
    let (out, c) = cache("decode-kv", None);
    let dst = p.decode.register(c).unwrap();

    // Direct path.
    let d = Destination::new(dst.cache.clone(), vec![vec![4, 5, 6], vec![30]]);
    let landed = p.decode.get(&p.addr, &[a, b], d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (2, 4 * BLOCK));
    for (d, s) in [(4, 1), (5, 2), (6, 9), (30, 20)] {
        assert!(
            block(&out, d) == pattern(3000 + s, BLOCK),
            "block {d} differs from source {s}"
        );
    }
    let stats = p.decode.stats();
    assert_eq!(stats.consumer.cma_transfers, 1);
    assert_eq!(stats.consumer.cma_bytes, 4 * BLOCK as u64);
    assert_eq!(stats.movers.len(), 1);
    assert_eq!(stats.movers[0].mover, Mover::Cma, "{:?}", stats.movers[0]);
    assert_eq!(stats.movers[0].pid, Some(std::process::id()));
    // Nothing of the grant went on the socket.
    assert_eq!(p.prefill.stats().producer.bytes_sent, 0);

    // Staged path: into staging pages first, then landed.
    let d = Destination::new(dst.cache.clone(), vec![vec![10, 11, 12]]).with_path(TransferPath::Staged);
    p.decode.get(&p.addr, &[a], d, in_secs(5)).await.unwrap();
    for (d, s) in [(10, 1), (11, 2), (12, 9)] {
        assert!(block(&out, d) == pattern(3000 + s, BLOCK), "staged block {d} differs");
    }
    assert_eq!(p.decode.stats().consumer.cma_transfers, 2);
    // Everything released on both sides.
    let arena = p.decode.stats().arena;
    assert_eq!(arena.free_pages, arena.total_pages);
    leases_released(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_chunks_go_by_cma_too() {
    let p = pair_with(with_transport(Transport::Auto)).await;
    let k = ChunkKey::from_name("cma/store");
    let bytes = pattern(77, 3 * BLOCK);
    p.prefill.put(k, &bytes).unwrap();
    let (out, c) = cache("decode-kv", None);
    let dst = p.decode.register(c).unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![7, 8, 9]]);
    let landed = p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap();
    assert_eq!(landed.bytes, 3 * BLOCK);
    assert!(out.to_vec(7 * BLOCK, 3 * BLOCK).unwrap() == bytes);
    assert_eq!(p.decode.stats().consumer.cma_transfers, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_writing_published_blocks_is_caught_on_both_movers() {
    for transport in [Transport::Auto, Transport::Tcp] {
        let p = pair_with(with_transport(transport)).await;
        let (src_region, c) = cache("prefill-kv", Some(5));
        let src = p.prefill.register(c).unwrap();
        let k = ChunkKey::from_name("cma/rewritten");
        p.prefill.publish(k, &src, &[2, 3], Duration::ZERO, false).unwrap();
        // A buggy producer writes a published block (the checksums were taken at
        // publish time).
        src_region.write(3 * BLOCK + 100, b"overwritten after publish").unwrap();
        let (_out, c) = cache("decode-kv", None);
        let dst = p.decode.register(c).unwrap();
        let d = Destination::new(dst.cache.clone(), vec![vec![0, 1]]);
        let failure = p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap_err();
        assert!(
            matches!(failure.error, PeerError::ChecksumMismatch { .. }),
            "{transport}: {}",
            failure.error
        );
        assert!(failure.dirty, "{transport}: the destination was written");
        let movers = p.decode.stats().movers;
        match transport {
            Transport::Auto => assert_eq!(movers[0].mover, Mover::Cma),
            Transport::Tcp => assert!(movers.is_empty(), "a tcp consumer asks nobody"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_tcp_keeps_every_byte_on_the_socket_and_says_why() {
    // The producer refuses: the consumer records why and uses the socket.
    let producer_tcp = |id: &str| {
        let mut c = config(id);
        c.producer.transport = Transport::Auto;
        if id == "prefill" {
            c.producer.transport = Transport::Tcp;
        }
        c
    };
    // The consumer refuses: it never asks.
    let consumer_tcp = |id: &str| {
        let mut c = config(id);
        c.producer.transport = Transport::Auto;
        if id == "decode" {
            c.producer.transport = Transport::Tcp;
        }
        c
    };
    for (side, p) in [
        ("producer", pair_with(producer_tcp).await),
        ("consumer", pair_with(consumer_tcp).await),
    ] {
        let (_src, c) = cache("prefill-kv", Some(9));
        let src = p.prefill.register(c).unwrap();
        let k = ChunkKey::from_name("cma/tcp");
        p.prefill.publish(k, &src, &[0, 1], Duration::ZERO, false).unwrap();
        let (out, c) = cache("decode-kv", None);
        let dst = p.decode.register(c).unwrap();
        let d = Destination::new(dst.cache.clone(), vec![vec![2, 3]]);
        p.decode.get(&p.addr, &[k], d, in_secs(5)).await.unwrap();
        assert!(block(&out, 3) == pattern(9001, BLOCK), "{side}");
        let stats = p.decode.stats();
        assert_eq!(stats.consumer.cma_transfers, 0, "{side}");
        assert_eq!(p.prefill.stats().producer.bytes_sent, 2 * BLOCK as u64, "{side}");
        match side {
            "producer" => {
                assert_eq!(stats.movers.len(), 1);
                let why = stats.movers[0].fallback.clone().unwrap_or_default();
                assert!(why.contains("transport is tcp"), "{why}");
                assert_eq!(stats.consumer.mover_fallbacks, 1);
            }
            _ => assert!(stats.movers.is_empty(), "a tcp consumer asks nobody"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_with_too_many_runs_to_name_goes_over_the_socket() {
    // 33,000 scattered 64-byte blocks: more memory runs than one reply may name
    // (`MAX_MAPPED_RUNS`). The producer refuses the mapped grant; the consumer gets the
    // same bytes over the socket in the same transfer.
    const SMALL: usize = 64;
    const N: u32 = 33_000;
    assert!(N as usize > kvferry::wire::MAX_MAPPED_RUNS);
    let p = pair_with(|id: &str| {
        let mut c = config(id);
        c.producer.transport = Transport::Auto;
        c.arena_bytes = 8 << 20;
        c
    })
    .await;
    let src_region = Arc::new(Region::host("prefill-small", 2 * N as usize * SMALL).unwrap());
    let src_bytes = pattern(41, 2 * N as usize * SMALL);
    src_region.write(0, &src_bytes).unwrap();
    let src = p
        .prefill
        .register(KvCache::contiguous(src_region.clone(), SMALL).unwrap())
        .unwrap();
    let k = ChunkKey::from_name("cma/scattered");
    let blocks: Vec<u32> = (0..N).map(|b| 2 * b).collect();
    p.prefill.publish(k, &src, &blocks, Duration::ZERO, false).unwrap();
    let out = Arc::new(Region::host("decode-small", N as usize * SMALL).unwrap());
    let dst = p
        .decode
        .register(KvCache::contiguous(out.clone(), SMALL).unwrap())
        .unwrap();
    let d = Destination::new(dst.cache.clone(), vec![(0..N).collect()]);
    let landed = p.decode.get(&p.addr, &[k], d, in_secs(20)).await.unwrap();
    assert_eq!(landed.bytes, N as usize * SMALL);
    let got = out.to_vec(0, N as usize * SMALL).unwrap();
    for b in 0..N as usize {
        let want = &src_bytes[2 * b * SMALL..(2 * b + 1) * SMALL];
        assert!(&got[b * SMALL..(b + 1) * SMALL] == want, "block {b}");
    }
    let stats = p.decode.stats();
    assert_eq!(stats.consumer.cma_transfers, 0);
    assert_eq!(stats.movers[0].mover, Mover::Cma, "the pair still qualifies");
    assert_eq!(p.prefill.stats().producer.bytes_sent, (N as usize * SMALL) as u64);
}

/// Waits until the producer holds no staged lease.
async fn leases_released(p: &common::engines::Pair) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while p.prefill.stats().producer.staged_now > 0 {
        assert!(Instant::now() < deadline, "the producer's leases were never released");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_pull_is_read_from_the_producers_memory_too() {
    let p = pair_with(with_transport(Transport::Auto)).await;
    let (_src, c) = cache("prefill-kv", Some(4));
    let src = p.prefill.register(c).unwrap();
    let (a, b) = (ChunkKey::from_name("pull/a"), ChunkKey::from_name("pull/b"));
    p.prefill.publish(a, &src, &[3, 4], Duration::ZERO, false).unwrap();
    p.prefill.publish(b, &src, &[7], Duration::ZERO, false).unwrap();
    let store = ChunkKey::from_name("pull/store");
    let stored = pattern(55, 2 * BLOCK);
    p.prefill.put(store, &stored).unwrap();
    let (out, c) = cache("decode-kv", None);
    let dst = p.decode.register(c).unwrap();

    // Published blocks, direct path.
    let h = p.decode.stage(&p.addr, &[a, b], in_secs(5)).await.unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![10, 11], vec![12]]);
    let landed = p.decode.resolve(h, d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (2, 3 * BLOCK));
    for (d, s) in [(10, 3), (11, 4), (12, 7)] {
        assert!(
            block(&out, d) == pattern(4000 + s, BLOCK),
            "block {d} differs from source {s}"
        );
    }
    let stats = p.decode.stats();
    assert_eq!(stats.consumer.cma_transfers, 1, "read by the same-host mover");
    assert_eq!(stats.consumer.cma_bytes, 3 * BLOCK as u64);
    assert_eq!(p.prefill.stats().producer.bytes_sent, 0, "nothing on the socket");
    leases_released(&p).await;

    // A prefix: the destination takes the first chunk only; the lease still ends.
    let h = p.decode.stage(&p.addr, &[b, a], in_secs(5)).await.unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![20]]);
    let landed = p.decode.resolve(h, d, in_secs(5)).await.unwrap();
    assert_eq!((landed.chunks, landed.bytes), (1, BLOCK));
    assert!(block(&out, 20) == pattern(4007, BLOCK));
    assert!(block(&out, 21) == vec![0u8; BLOCK], "nothing past the prefix written");
    leases_released(&p).await;

    // Store chunks (staged into the producer's pages), staged path on this side.
    let h = p.decode.stage(&p.addr, &[store], in_secs(5)).await.unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![25, 26]]).with_path(TransferPath::Staged);
    p.decode.resolve(h, d, in_secs(5)).await.unwrap();
    assert!(out.to_vec(25 * BLOCK, 2 * BLOCK).unwrap() == stored);
    assert_eq!(p.decode.stats().consumer.cma_transfers, 3);
    assert_eq!(p.prefill.stats().producer.bytes_sent, 0, "nothing on the socket");
    leases_released(&p).await;
    let arena = p.decode.stats().arena;
    assert_eq!(arena.free_pages, arena.total_pages);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_pull_catches_a_producer_writing_staged_blocks_and_tcp_keeps_it_on_the_socket() {
    for transport in [Transport::Auto, Transport::Tcp] {
        let p = pair_with(with_transport(transport)).await;
        let (src_region, c) = cache("prefill-kv", Some(6));
        let src = p.prefill.register(c).unwrap();
        let (k, ok) = (ChunkKey::from_name("pull/rewritten"), ChunkKey::from_name("pull/ok"));
        p.prefill.publish(k, &src, &[2, 3], Duration::ZERO, false).unwrap();
        p.prefill.publish(ok, &src, &[5], Duration::ZERO, false).unwrap();
        let (out, c) = cache("decode-kv", None);
        let dst = p.decode.register(c).unwrap();
        let h = p.decode.stage(&p.addr, &[k], in_secs(5)).await.unwrap();
        // A buggy producer writes a staged (published) block before the pull.
        src_region.write(2 * BLOCK + 7, b"overwritten after stage").unwrap();
        let d = Destination::new(dst.cache.clone(), vec![vec![0, 1]]);
        let failure = p.decode.resolve(h, d, in_secs(5)).await.unwrap_err();
        assert!(
            matches!(failure.error, PeerError::ChecksumMismatch { .. }),
            "{transport}: {}",
            failure.error
        );
        // A clean pull lands, by the mover the transport allows.
        let h = p.decode.stage(&p.addr, &[ok], in_secs(5)).await.unwrap();
        let d = Destination::new(dst.cache.clone(), vec![vec![8]]);
        p.decode.resolve(h, d, in_secs(5)).await.unwrap();
        assert!(block(&out, 8) == pattern(6005, BLOCK), "{transport}");
        let (cma, sent) = (
            p.decode.stats().consumer.cma_transfers,
            p.prefill.stats().producer.bytes_sent,
        );
        match transport {
            // The failed read counted too: it read, then failed verification.
            Transport::Auto => assert_eq!((cma, sent), (2, 0), "{transport}"),
            // The clean pull's block went on the socket (the failed pull's bytes
            // count only as far as its send got before the consumer hung up).
            Transport::Tcp => assert!(cma == 0 && sent >= BLOCK as u64, "{transport}: {cma}, {sent}"),
        }
    }
}
