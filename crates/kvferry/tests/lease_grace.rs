//! Leases and their connections, over real loopback sockets against a real engine:
//!
//! - an eager get whose connection closes without `Done` has its staging pages
//!   released after the producer's `lease_grace`, not at the (long) TTL;
//! - a lease staged for a later pull (`Stage`) outlives its connection and is released
//!   at its TTL, not at the grace;
//! - lease ids are 128 bits wide and bound to the peer they were granted to: a `Done`
//!   from another peer is refused and counted, and does not release the lease.
//!
//! Every test builds its own engine (ephemeral port, no shared state).

mod common;

use std::time::Duration;

use kvferry::engine::Engine;
use kvferry::net::{NetConfig, NetError, Pool};
use kvferry::wire::{ChunkKey, ErrorKind, LeaseId, Message};
use tokio::time::Instant;

/// Bytes of the test chunk (4 staging pages of 64 KiB).
const CHUNK: usize = 256 << 10;

/// A producer engine with a short grace and the given TTL (also its cap).
async fn producer(grace: Duration, ttl: Duration) -> Engine {
    let mut cfg = common::engines::small_config("producer");
    cfg.producer.default_ttl = ttl;
    cfg.producer.max_ttl = ttl;
    cfg.producer.lease_grace = grace;
    let e = Engine::start(cfg).await.unwrap();
    e.put(ChunkKey::from_name("k"), &vec![7u8; CHUNK]).unwrap();
    e
}

fn pool(e: &Engine, peer_id: &str) -> Pool {
    Pool::new(e.address().unwrap().to_string(), NetConfig::new(peer_id)).unwrap()
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn leased(e: &Engine) -> usize {
    e.producer().stats().quota_pages_charged
}

/// Waits until `e` holds no staging page, or `limit` passes; returns how long it took.
async fn until_free(e: &Engine, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if leased(e) == 0 {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// An eager get read to its end (`Staged`, the bulk frame, `PullDone`) on a fresh
/// connection that is then dropped without `Done`.
async fn eager_get_without_done(p: &Pool) -> LeaseId {
    let mut conn = p.checkout(deadline()).await.unwrap();
    let id = conn.next_request_id();
    let keys = vec![ChunkKey::from_name("k")];
    conn.send(id, &Message::Get { keys, ttl_ms: 0 }).await.unwrap();
    let (lease_id, chunks) = match conn.recv_reply(id).await.unwrap() {
        Message::Staged { lease_id, chunks, .. } => (lease_id, chunks),
        other => panic!("expected Staged, got {}", other.name()),
    };
    assert_eq!(chunks.len(), 1);
    let mut buf = vec![0u8; chunks[0].len as usize];
    conn.recv_bulk(id, &mut [&mut buf[..]]).await.unwrap();
    assert!(buf.iter().all(|&b| b == 7));
    assert!(matches!(conn.recv_reply(id).await.unwrap(), Message::PullDone { .. }));
    drop(conn); // closed, no Done
    lease_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_get_without_done_is_released_after_the_grace_not_the_ttl() {
    let grace = Duration::from_millis(300);
    let e = producer(grace, Duration::from_secs(30)).await;
    let p = pool(&e, "consumer");
    eager_get_without_done(&p).await;
    let closed = Instant::now();
    assert_eq!(leased(&e), 4, "the eager lease holds its pages until the grace passed");
    // Well before the grace the pages are still held (a late `Done` could come).
    tokio::time::sleep(grace / 3).await;
    assert_eq!(leased(&e), 4, "released before the grace");
    until_free(&e, Duration::from_secs(5))
        .await
        .expect("not released within 5 s");
    let at = closed.elapsed();
    assert!(
        at >= grace - Duration::from_millis(20),
        "released {at:?} after the close, grace {grace:?}"
    );
    assert!(
        at < grace + Duration::from_secs(1),
        "released {at:?} after the close, grace {grace:?}"
    );
    assert_eq!(e.producer().stats().orphaned, 1);
    assert_eq!(e.producer().stats().done, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_done_on_a_fresh_connection_within_the_grace_still_releases() {
    let e = producer(Duration::from_secs(5), Duration::from_secs(30)).await;
    let p = pool(&e, "consumer");
    let lease_id = eager_get_without_done(&p).await;
    let mut conn = p.checkout(deadline()).await.unwrap();
    assert!(matches!(
        conn.request(&Message::Done { lease_id }).await.unwrap(),
        Message::DoneAck
    ));
    conn.finish();
    assert!(until_free(&e, Duration::from_secs(1)).await.is_some());
    assert_eq!(e.producer().stats().done, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_staged_for_later_outlives_its_connection_until_its_ttl() {
    let grace = Duration::from_millis(100);
    let ttl = Duration::from_millis(1500);
    let e = producer(grace, ttl).await;
    let p = pool(&e, "consumer");
    let started = Instant::now();
    let lease_id = {
        let mut conn = p.checkout(deadline()).await.unwrap();
        let keys = vec![ChunkKey::from_name("k")];
        let m = conn.request(&Message::Stage { keys, ttl_ms: 0 }).await.unwrap();
        let Message::Staged { lease_id, .. } = m else {
            panic!("expected Staged, got {}", m.name())
        };
        lease_id // the connection is dropped here, without Done
    };
    // Many graces later the lease is still there, and can be pulled on a new connection.
    tokio::time::sleep(grace * 5).await;
    assert_eq!(leased(&e), 4, "a delayed-pull lease was released with its connection");
    {
        let mut conn = p.checkout(deadline()).await.unwrap();
        let id = conn.next_request_id();
        let incarnation = e.incarnation();
        conn.send(id, &Message::Pull { lease_id, incarnation }).await.unwrap();
        let mut buf = vec![0u8; CHUNK];
        conn.recv_bulk(id, &mut [&mut buf[..]]).await.unwrap();
        assert!(matches!(conn.recv_reply(id).await.unwrap(), Message::PullDone { .. }));
        // ...and dropped again without Done.
    }
    tokio::time::sleep(grace * 3).await;
    assert_eq!(leased(&e), 4, "a pulled delayed lease was released with its connection");
    until_free(&e, Duration::from_secs(5))
        .await
        .expect("released at its TTL");
    let at = started.elapsed();
    assert!(at >= ttl - Duration::from_millis(50), "released at {at:?}, TTL {ttl:?}");
    assert!(at < ttl + Duration::from_secs(1), "released at {at:?}, TTL {ttl:?}");
    assert_eq!(e.producer().stats().expired, 1);
    assert_eq!(e.producer().stats().orphaned, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ids_are_128_bit_and_a_foreign_done_is_refused_and_counted() {
    let e = producer(Duration::from_secs(1), Duration::from_secs(30)).await;
    let owner = pool(&e, "owner");
    let other = pool(&e, "intruder");
    let mut ids = Vec::new();
    for _ in 0..8 {
        let mut conn = owner.checkout(deadline()).await.unwrap();
        let keys = vec![ChunkKey::from_name("k")];
        let m = conn.request(&Message::Stage { keys, ttl_ms: 0 }).await.unwrap();
        conn.finish();
        let Message::Staged { lease_id, .. } = m else {
            panic!("expected Staged, got {}", m.name())
        };
        let mut conn = owner.checkout(deadline()).await.unwrap();
        assert!(matches!(
            conn.request(&Message::Done { lease_id }).await.unwrap(),
            Message::DoneAck
        ));
        conn.finish();
        ids.push(lease_id);
    }
    // 8 random 128-bit ids all below 2^64 would happen with probability 2^-512.
    assert!(ids.iter().any(|&id| id > u64::MAX as LeaseId), "{ids:x?}");
    let mut conn = owner.checkout(deadline()).await.unwrap();
    let keys = vec![ChunkKey::from_name("k")];
    let Message::Staged { lease_id, .. } = conn.request(&Message::Stage { keys, ttl_ms: 0 }).await.unwrap() else {
        panic!("expected Staged")
    };
    conn.finish();
    let mut conn = other.checkout(deadline()).await.unwrap();
    match conn.request(&Message::Done { lease_id }).await {
        Err(NetError::Remote {
            kind: ErrorKind::UnknownLease,
            ..
        }) => {}
        other => panic!("a foreign Done was not refused: {other:?}"),
    }
    conn.finish();
    assert_eq!(e.producer().stats().foreign_lease_refused, 1);
    assert_eq!(leased(&e), 4, "a foreign Done released the lease");
}
