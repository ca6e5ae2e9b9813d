//! The staging quota is a guard owned by each lease: whatever ends a transfer — a
//! connection task aborted in the middle of a send (server shut down), a client that
//! closes mid-transfer, a client that closes after the bytes but before `PullDone` —
//! every peer's charge returns to zero and the peer can stage its whole quota again.
//!
//! Real loopback sockets, a real producer and server; sends are slowed by the
//! producer's send-delay fault so that aborts land in the middle of `send_lease`.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::p2p::{chunk_bytes, key, producer_node, NodeOpts};
use kvferry::net::{NetConfig, NetError, Pool, Server};
use kvferry::peer::{Producer, ProducerConfig};
use kvferry::wire::{ChunkKey, Message};
use tokio::time::Instant;

/// 16 KiB blocks; a chunk of 4 blocks is 64 KiB: 4 staging pages of 16 KiB.
const CHUNK: usize = 64 << 10;

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Starts a get of `keys` as `pool`'s peer and reads until `read_frames` bulk frames
/// arrived, then drops the connection (or, with `None`, reads to the end and returns
/// the lease id without `Done`).
async fn get_then_close(pool: &Pool, keys: Vec<ChunkKey>, read_frames: Option<usize>) -> Result<(), NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let id = conn.next_request_id();
    conn.send(id, &Message::Get { keys, ttl_ms: 0 }).await?;
    let chunks = match conn.recv_reply(id).await? {
        Message::Staged { chunks, .. } => chunks,
        other => panic!("expected Staged, got {}", other.name()),
    };
    let n = read_frames.unwrap_or(chunks.len()).min(chunks.len());
    for c in &chunks[..n] {
        let mut buf = vec![0u8; c.len as usize];
        conn.recv_bulk(id, &mut [&mut buf[..]]).await?;
    }
    Ok(()) // the connection drops here, without Done
}

/// A full, honest get (with `Done`) of `keys`: proves the peer may use its quota.
async fn full_get(pool: &Pool, keys: Vec<ChunkKey>) -> Result<usize, NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let id = conn.next_request_id();
    conn.send(id, &Message::Get { keys, ttl_ms: 0 }).await?;
    let (lease_id, chunks) = match conn.recv_reply(id).await? {
        Message::Staged { lease_id, chunks, .. } => (lease_id, chunks),
        other => panic!("expected Staged, got {}", other.name()),
    };
    for c in &chunks {
        let mut buf = vec![0u8; c.len as usize];
        conn.recv_bulk(id, &mut [&mut buf[..]]).await?;
    }
    assert!(matches!(conn.recv_reply(id).await?, Message::PullDone { .. }));
    assert!(matches!(
        conn.request(&Message::Done { lease_id }).await?,
        Message::DoneAck
    ));
    conn.finish();
    Ok(chunks.len())
}

async fn eventually_uncharged(p: &Producer, what: &str) {
    let t = Instant::now();
    loop {
        let charged = p.stats().quota_pages_charged;
        if charged == 0 && p.arena().stats().leased_pages == 0 {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{what}: {charged} pages still charged, {} leased",
            p.arena().stats().leased_pages
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_and_broken_sends_return_every_quota_charge() {
    let node = producer_node(NodeOpts {
        blocks: 256,
        arena_pages: 128,
        page_size: 16 << 10,
        ..NodeOpts::default()
    })
    .await;
    // Re-create the producer with a quota of exactly one get of two chunks (8 pages).
    let producer = Producer::new(
        node.producer.store().clone(),
        node.producer.arena().clone(),
        node.producer.engine().clone(),
        ProducerConfig {
            max_staged_pages_per_peer: Some(8),
            lease_grace: Duration::from_millis(100),
            ..ProducerConfig::default()
        },
        node.producer.incarnation(),
    )
    .unwrap();
    drop(node.server);
    let keys: Vec<ChunkKey> = (0..2).map(|c| key(1, c)).collect();
    for (c, k) in keys.iter().enumerate() {
        producer.put_local(*k, &chunk_bytes(1, c, CHUNK)).unwrap();
    }
    producer.faults().send_delay_us.store(30_000, Ordering::Relaxed);
    let peers: Vec<String> = (0..6).map(|i| format!("peer-{i}")).collect();

    for round in 0..4 {
        let server = Server::bind("127.0.0.1:0", NetConfig::new("producer"), Arc::new(producer.clone()))
            .await
            .unwrap();
        let addr = server.local_addr().to_string();
        let mut clients = Vec::new();
        for (i, p) in peers.iter().enumerate() {
            let pool = Pool::new(addr.clone(), NetConfig::new(p.clone())).unwrap();
            let keys = keys.clone();
            // Some never finish reading (aborted with the server), some close after the
            // first frame, some after the bytes (before PullDone).
            let read = match i % 3 {
                0 => Some(usize::MAX),
                1 => Some(1),
                _ => None,
            };
            clients.push(tokio::spawn(async move {
                if read == Some(usize::MAX) {
                    // Reads nothing after Staged; the server task is aborted mid-send.
                    let _ = get_then_close(&pool, keys, Some(0)).await.map(|_| ());
                    tokio::time::sleep(Duration::from_secs(1)).await;
                } else {
                    let _ = get_then_close(&pool, keys, read).await;
                }
            }));
        }
        // Let the sends start, then tear every connection task down mid-send.
        let t = Instant::now();
        while producer.stats().quota_pages_charged == 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "round {round}: nothing staged");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        server.shutdown().await;
        for c in clients {
            c.await.unwrap();
        }
        eventually_uncharged(&producer, &format!("round {round}")).await;
        for p in &peers {
            assert_eq!(producer.quota_charged_to(p), 0, "round {round}: {p} still charged");
        }
    }

    // Every peer can still use its whole quota.
    producer.faults().send_delay_us.store(0, Ordering::Relaxed);
    let server = Server::bind("127.0.0.1:0", NetConfig::new("producer"), Arc::new(producer.clone()))
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    for p in &peers {
        let pool = Pool::new(addr.clone(), NetConfig::new(p.clone())).unwrap();
        let n = full_get(&pool, keys.clone())
            .await
            .unwrap_or_else(|e| panic!("{p} cannot get its quota's worth: {e}"));
        assert_eq!(n, 2, "{p} got a partial stage: its quota is still charged");
    }
    eventually_uncharged(&producer, "after the honest gets").await;
}
