//! Store chunks are served in place, over real loopback sockets: a get sends a chunk
//! straight from the store's blocks with the checksum it was stored with (no staging
//! copy, no second pass), and a push lands straight into fresh store blocks.
//!
//! - A store chunk larger than the whole staging arena is served (a staging copy could
//!   not hold it: the request was `Busy`).
//! - The checksum is end to end: bytes that change in the store after a push (memory
//!   corruption) are caught by the consumer, never landed (a server that recomputed
//!   the checksum when staging would have sent the bad bytes under a matching one).
//! - A push cut mid-frame leaves no chunk and returns its blocks.
//!
//! Every test builds its own nodes (ephemeral ports, no shared state).

mod common;

use std::time::Duration;

use common::p2p::*;
use kvferry::peer::PeerError;
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_chunk_larger_than_the_arena_is_served_in_place() {
    // 4 staging pages of 16 KiB; the chunk is 8 blocks, several times the arena.
    let node = producer_node(NodeOpts {
        arena_pages: 4,
        ..NodeOpts::default()
    })
    .await;
    let len = node.producer.store().layout().chunk_bytes(8);
    assert!(len > 4 * (16 << 10), "the chunk must not fit the arena ({len} bytes)");
    let keys = fill(&node.producer, 21, 2, 8);
    let c = consumer_node(64, 512);
    let landed = c
        .consumer
        .get(&node.addr, &keys, c.dst(0, 2, 8), soon(10_000))
        .await
        .unwrap();
    assert_eq!(landed.chunks, 2);
    for ch in 0..2 {
        let blocks: Vec<u32> = (0..8).map(|b| (ch * 8 + b) as u32).collect();
        assert_eq!(c.corrupted_bytes(21, ch, &blocks), 0, "chunk {ch}");
    }
    let st = node.producer.arena().stats();
    assert_eq!(st.free_pages, st.total_pages, "no staging page was used");
    let t = std::time::Instant::now();
    while node.producer.stats().quota_pages_charged != 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the lease's charge never returned"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_changed_in_the_store_after_a_push_are_caught_by_the_consumer() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let data = chunk_bytes(31, 0, 40_000);
    let k = ChunkKey::from_name("pushed-then-corrupted");
    c.consumer.put(&node.addr, k, &data, soon(5000)).await.unwrap();
    // Flip one byte of the stored chunk in the store's region (what a bad DIMM or a
    // stray write would do).
    let store = node.producer.store();
    let (locs, pins) = store.pin_prefix(&[k], 1);
    assert_eq!(locs.len(), 1);
    let (off, n) = store.ranges(&locs[0]).unwrap()[0];
    drop(pins);
    let mut b = [0u8; 1];
    store.region().read(off + n / 2, &mut b).unwrap();
    store.region().write(off + n / 2, &[b[0] ^ 0x5A]).unwrap();

    c.region.fill(0, c.layout.region_bytes(), 0xEE).unwrap();
    let err = c
        .consumer
        .get(&node.addr, &[k], c.dst(0, 1, 3), soon(5000))
        .await
        .unwrap_err();
    assert!(matches!(err.error, PeerError::ChecksumMismatch { .. }), "{}", err.error);
    assert!(
        c.region.to_vec(0, 40_000).unwrap().iter().all(|b| *b == 0xEE),
        "a chunk that does not match its stored checksum must not be landed"
    );
    // Put back, it is served again.
    store.region().write(off + n / 2, &b).unwrap();
    c.consumer
        .get(&node.addr, &[k], c.dst(0, 1, 3), soon(5000))
        .await
        .unwrap();
    assert_eq!(c.corrupted_bytes_prefix(31, 0, &[0, 1, 2], 40_000), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_land_in_place_and_a_failed_one_returns_its_blocks() {
    let node = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let free0 = node.producer.store().stats().free_blocks;
    // A clean push: its blocks are the chunk's.
    let data = chunk_bytes(41, 0, 40_000);
    let k = ChunkKey::from_name("in-place");
    c.consumer.put(&node.addr, k, &data, soon(5000)).await.unwrap();
    let used = free0 - node.producer.store().stats().free_blocks;
    assert!(used >= 1, "the pushed chunk holds store blocks");
    // A push whose frame is corrupted on the way: refused, nothing stored, no block
    // kept (the frame's checksum is the writer's; the bytes that arrive differ).
    let bad = ChunkKey::from_name("corrupted-on-the-wire");
    let err = raw_put_with_wrong_checksum(&node.addr, bad, &data).await;
    assert!(err, "the corrupted push was acknowledged");
    assert_eq!(c.consumer.lookup(&node.addr, &[bad], soon(2000)).await.unwrap(), 0);
    let t = std::time::Instant::now();
    while node.producer.store().stats().free_blocks != free0 - used {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the failed push kept blocks: {:?}",
            node.producer.store().stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The good chunk is intact.
    c.consumer
        .get(&node.addr, &[k], c.dst(0, 1, 3), soon(5000))
        .await
        .unwrap();
    assert_eq!(c.corrupted_bytes_prefix(41, 0, &[0, 1, 2], 40_000), 0);
}

/// Sends `Put` and a bulk frame whose header checksum does not match its bytes;
/// true when the server did not acknowledge it.
async fn raw_put_with_wrong_checksum(addr: &str, key: ChunkKey, data: &[u8]) -> bool {
    use kvferry::net::{NetConfig, Pool};
    use kvferry::wire::Message;
    let pool = Pool::new(addr.to_string(), NetConfig::new("raw-pusher")).unwrap();
    let mut conn = pool.checkout(soon(5000)).await.unwrap();
    let id = conn.next_request_id();
    conn.send(
        id,
        &Message::Put {
            key,
            len: data.len() as u64,
        },
    )
    .await
    .unwrap();
    let right = kvferry::checksum::checksum(data);
    let _ = conn.send_bulk_with_checksum(id, &[data], right ^ 1).await;
    !matches!(conn.recv_reply(id).await, Ok(Message::PutAck { .. }))
}
