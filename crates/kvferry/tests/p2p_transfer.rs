//! P2P transfers over real loopback sockets: integrity, partial hits, store chunks
//! served in place, delayed pull,
//! push, lookup, checksum faults, TTL expiry, lease guard, auth, restart.

mod common;

use std::time::Duration;

use common::p2p::*;
use kvferry::peer::PeerError;
use kvferry::wire::{ChunkKey, Limits};
use kvferry::ErrorCode;
use tokio::time::Instant;

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_requests_land_their_own_bytes() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(256, 512);
    let reqs = 24u64;
    let keys: Vec<_> = (0..reqs).map(|r| fill(&node.producer, r, 2, 4)).collect();
    let mut tasks = Vec::new();
    for r in 0..reqs {
        let consumer = c.consumer.clone();
        let dst = c.dst((r * 8) as u32, 2, 4);
        let (addr, k) = (node.addr.clone(), keys[r as usize].clone());
        tasks.push(tokio::spawn(
            async move { consumer.get(&addr, &k, dst, soon(10_000)).await },
        ));
    }
    for (r, t) in tasks.into_iter().enumerate() {
        let landed = t.await.unwrap().unwrap();
        assert_eq!(landed.chunks, 2);
        for ch in 0..2 {
            let blocks: Vec<u32> = (0..4).map(|b| (r * 8 + ch * 4 + b) as u32).collect();
            assert_eq!(c.corrupted_bytes(r as u64, ch, &blocks), 0, "request {r} chunk {ch}");
        }
    }
    assert_eq!(
        c.consumer.arena().stats().free_pages,
        512,
        "consumer staging all returned"
    );
    // Done releases producer staging promptly.
    let t = std::time::Instant::now();
    while node.producer.stats().quota_pages_charged != 0 || node.producer.stats().done != reqs {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "producer pages not released: {:?}",
            node.producer.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(node.producer.stats().done, reqs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_partial_hit_and_miss() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 1, 3, 2);
    let mut asked = keys.clone();
    asked.insert(2, ChunkKey::from_name("absent"));
    assert_eq!(c.consumer.lookup(&node.addr, &asked, soon(2000)).await.unwrap(), 2);
    let landed = c
        .consumer
        .get(&node.addr, &asked, c.dst(0, 4, 2), soon(5000))
        .await
        .unwrap();
    assert_eq!(landed.chunks, 2, "only the held prefix lands");
    assert_eq!(c.corrupted_bytes(1, 1, &[2, 3]), 0);
    let miss = c
        .consumer
        .get(&node.addr, &[ChunkKey::from_name("nope")], c.dst(0, 1, 2), soon(5000))
        .await
        .unwrap();
    assert_eq!(miss.chunks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_chunks_are_served_whole_while_the_arena_is_nearly_full() {
    // 8 pages of 16 KiB = 128 KiB of staging, 5 of them free; each chunk is 64 KiB
    // (4 blocks). Store chunks are sent from the store in place, so a full arena
    // does not cut the stage (a staging copy served only the first chunk).
    let node = producer_node(NodeOpts {
        arena_pages: 8,
        ..NodeOpts::default()
    })
    .await;
    let hog = node.producer.arena().try_alloc(3).unwrap();
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 7, 3, 4);
    let landed = c
        .consumer
        .get(&node.addr, &keys, c.dst(0, 3, 4), soon(5000))
        .await
        .unwrap();
    assert_eq!(landed.chunks, 3, "every chunk, none staged");
    for ch in 0..3 {
        let blocks: Vec<u32> = (0..4).map(|b| (ch * 4 + b) as u32).collect();
        assert_eq!(c.corrupted_bytes(7, ch, &blocks), 0, "chunk {ch}");
    }
    assert_eq!(node.producer.arena().stats().free_pages, 5);
    drop(hog);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_pull_resolves_and_expired_leases_are_refused() {
    let node = producer_node(NodeOpts {
        ttl: Duration::from_millis(300),
        ..NodeOpts::default()
    })
    .await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 3, 2, 2);
    let h = c.consumer.stage(&node.addr, &keys, soon(2000)).await.unwrap();
    assert_eq!(h.chunks.len(), 2);
    assert!(
        node.producer.stats().quota_pages_charged > 0 && node.producer.stats().staged_now == 1,
        "the lease is held (its chunks pinned, charged to the consumer) until resolved"
    );
    let landed = c.consumer.resolve(h, c.dst(10, 2, 2), soon(2000)).await.unwrap();
    assert_eq!(landed.chunks, 2);
    assert_eq!(c.corrupted_bytes(3, 1, &[12, 13]), 0);

    // A slow consumer: the TTL passes before it resolves.
    let h = c.consumer.stage(&node.addr, &keys, soon(2000)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let err = c
        .consumer
        .resolve(h.clone(), c.dst(10, 2, 2), soon(2000))
        .await
        .unwrap_err();
    assert!(matches!(err.error, PeerError::LeaseExpired { .. }), "{}", err.error);
    assert!(node.producer.stats().expired >= 1, "the sweeper released it");
    let t = std::time::Instant::now();
    while node.producer.stats().quota_pages_charged != 0 {
        assert!(t.elapsed() < Duration::from_secs(3));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Bypassing the local guard, the producer itself refuses the expired lease.
    let mut forged = h;
    forged.expires = Instant::now() + Duration::from_secs(5);
    let err = c
        .consumer
        .resolve(forged, c.dst(10, 2, 2), soon(2000))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.error,
            PeerError::Remote {
                kind: kvferry::wire::ErrorKind::LeaseExpired,
                ..
            }
        ),
        "{}",
        err.error
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_guard_refuses_a_handle_about_to_expire() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 4, 1, 2);
    let mut h = c.consumer.stage(&node.addr, &keys, soon(2000)).await.unwrap();
    h.expires = Instant::now() + Duration::from_millis(20); // below the 50 ms guard
    let err = c.consumer.resolve(h, c.dst(0, 1, 2), soon(2000)).await.unwrap_err();
    assert!(matches!(err.error, PeerError::LeaseExpired { .. }));
    assert!(err.fence.is_drained(), "nothing was started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_bytes_on_the_wire_are_caught_and_never_landed() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 5, 1, 2);
    c.region.fill(0, c.layout.region_bytes(), 0xEE).unwrap();
    node.producer
        .faults()
        .corrupt_next_sends
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let err = c
        .consumer
        .get(&node.addr, &keys, c.dst(0, 1, 2), soon(5000))
        .await
        .unwrap_err();
    assert!(matches!(err.error, PeerError::ChecksumMismatch { .. }), "{}", err.error);
    assert_eq!(c.consumer.stats().checksum_failures, 1);
    let untouched = c.region.to_vec(0, c.layout.chunk_bytes(2)).unwrap();
    assert!(
        untouched.iter().all(|b| *b == 0xEE),
        "a corrupted chunk must not be landed"
    );
    assert_eq!(c.consumer.arena().stats().free_pages, 64);
    // The next transfer is clean.
    c.consumer
        .get(&node.addr, &keys, c.dst(0, 1, 2), soon(5000))
        .await
        .unwrap();
    assert_eq!(c.corrupted_bytes(5, 0, &[0, 1]), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_lands_in_the_peer_store() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let data = chunk_bytes(9, 0, 40_000);
    let k = ChunkKey::from_name("pushed");
    c.consumer.put(&node.addr, k, &data, soon(5000)).await.unwrap();
    assert_eq!(node.producer.stats().pushed, 1);
    assert_eq!(c.consumer.lookup(&node.addr, &[k], soon(2000)).await.unwrap(), 1);
    let landed = c
        .consumer
        .get(&node.addr, &[k], c.dst(0, 1, 3), soon(5000))
        .await
        .unwrap();
    assert_eq!(landed.bytes, 40_000);
    assert_eq!(c.corrupted_bytes_prefix(9, 0, &[0, 1, 2], 40_000), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_secret_is_refused_on_both_sides() {
    let node = producer_node(NodeOpts {
        secret: Some(b"s3cret-s3cret-s3cret-s3cret-s3cret".to_vec()),
        ..NodeOpts::default()
    })
    .await;
    let keys = fill(&node.producer, 1, 1, 1);
    for secret in [None, Some(b"wrong-wrong-wrong-wrong-wrong-wrong".to_vec())] {
        let engine = kvferry::copy::CopyEngine::new(kvferry::copy::CopyConfig {
            threads: 1,
            slice_bytes: 1 << 20,
        })
        .unwrap();
        let c = consumer_with_engine(engine, 16, 16, secret);
        let err = c.consumer.lookup(&node.addr, &keys, soon(2000)).await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::AuthFailed, "{err}");
    }
    assert!(node.server.stats().auth_failures >= 1);
    let engine = kvferry::copy::CopyEngine::new(kvferry::copy::CopyConfig {
        threads: 1,
        slice_bytes: 1 << 20,
    })
    .unwrap();
    let good = consumer_with_engine(engine, 16, 16, Some(b"s3cret-s3cret-s3cret-s3cret-s3cret".to_vec()));
    assert_eq!(good.consumer.lookup(&node.addr, &keys, soon(2000)).await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_producer_is_a_new_incarnation() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let keys = fill(&node.producer, 2, 1, 2);
    let h = c.consumer.stage(&node.addr, &keys, soon(2000)).await.unwrap();
    let old = h.incarnation;
    let addr = node.addr.clone();
    node.server.shutdown().await;
    drop(node.producer);
    // Restart on the same address: a new process image, new incarnation, empty store.
    let node2 = producer_node(NodeOpts {
        listen: addr.clone(),
        ..NodeOpts::default()
    })
    .await;
    let keys2 = fill(&node2.producer, 2, 1, 2);
    assert_eq!(keys, keys2);
    // A fresh request reconnects (the idle connection is dead) and sees the new incarnation.
    assert_eq!(c.consumer.lookup(&addr, &keys, soon(3000)).await.unwrap(), 1);
    let err = c.consumer.resolve(h, c.dst(0, 1, 2), soon(2000)).await.unwrap_err();
    assert!(matches!(err.error, PeerError::StaleIncarnation { .. }), "{}", err.error);
    assert_eq!(c.consumer.pool(&addr).unwrap().restarts_seen(), 1);
    // An eager get naming the old incarnation is refused before anything is staged;
    // naming the new one (or none) lands.
    let staged_before = node2.producer.stats().staged;
    let dst = c.dst(0, 1, 2).with_incarnation(Some(old));
    let err = c.consumer.get(&addr, &keys, dst, soon(3000)).await.unwrap_err();
    assert!(matches!(err.error, PeerError::StaleIncarnation { .. }), "{}", err.error);
    assert!(!err.dirty);
    assert_eq!(
        node2.producer.stats().staged,
        staged_before,
        "nothing staged on the new incarnation"
    );
    let new = c.consumer.pool(&addr).unwrap().incarnation();
    assert_ne!(new, old);
    let dst = c.dst(0, 1, 2).with_incarnation(Some(new));
    c.consumer.get(&addr, &keys, dst, soon(3000)).await.unwrap();
    c.consumer.get(&addr, &keys, c.dst(0, 1, 2), soon(3000)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_get_clear_errors() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(16, 16);
    let e = c
        .consumer
        .get(&node.addr, &[], c.dst(0, 1, 1), soon(1000))
        .await
        .unwrap_err();
    assert!(matches!(e.error, PeerError::InvalidArgument(_)));
    let e = c
        .consumer
        .get(&node.addr, &[ChunkKey::from_name("a")], c.dst(100, 1, 1), soon(1000))
        .await
        .unwrap_err();
    assert_eq!(e.error.code(), ErrorCode::InvalidArgument, "{}", e.error);
    assert!(
        e.error.to_string().contains("block 100"),
        "the message names the block: {}",
        e.error
    );
    let e = c
        .consumer
        .lookup("127.0.0.1:1", &[ChunkKey::from_name("a")], soon(1000))
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::PeerLost { .. }), "{e}");
    // More keys than a peer accepts in one request: refused locally, before any I/O,
    // with the numbers; the pooled connection stays usable.
    let many: Vec<ChunkKey> = (0..Limits::DEFAULT_MAX_KEYS + 1)
        .map(|i| ChunkKey::from_name(&format!("k{i}")))
        .collect();
    let e = c.consumer.lookup(&node.addr, &many, soon(1000)).await.unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
    // The message names both numbers: what was asked and the limit.
    assert!(e.to_string().contains("4097 keys"), "{e}");
    assert!(e.to_string().contains("at most 4096"), "{e}");
    let e = c.consumer.stage(&node.addr, &many, soon(1000)).await.unwrap_err();
    assert!(matches!(e, PeerError::InvalidArgument(_)), "{e}");
    assert_eq!(
        c.consumer
            .lookup(&node.addr, &[ChunkKey::from_name("absent")], soon(1000))
            .await
            .unwrap(),
        0
    );
}
