//! `Release`: a consumer that will not pull tells the producer to free its `once`
//! publications, without staging anything.
//!
//! - Only `once` publications are released (reason `Declined`); a publication many
//!   may read, a store chunk and an unknown key are left alone and answered `false`.
//!   A key released recently answers `true` again (a retry is idempotent).
//! - A release naming another incarnation of the producer is refused, and releases
//!   nothing.
//! - It needs no staging: with the consumer's staging quota on the producer used up
//!   (every `Stage` refused `Busy`), a release still frees the publication.

mod common;

use std::sync::Arc;

use common::released_within;
use std::time::Duration;

use kvferry::engine::{Engine, EngineConfig};
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::peer::{Destination, PeerError, ReleaseReason, Released};
use kvferry::wire::{ChunkKey, ErrorKind};
use tokio::time::Instant;

const BLOCK: usize = 4096;
const BLOCKS: u32 = 16;

fn config(peer_id: &str, quota_pages: Option<usize>) -> EngineConfig {
    let mut cfg = common::engines::config(peer_id);
    cfg.producer.max_staged_pages_per_peer = quota_pages;
    cfg
}

fn in_secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

fn key(name: &str) -> ChunkKey {
    ChunkKey::from_name(name)
}

fn cache(name: &str) -> KvCache {
    let region = Arc::new(Region::host(name, BLOCKS as usize * BLOCK).unwrap());
    region.write(0, &vec![7u8; BLOCKS as usize * BLOCK]).unwrap();
    KvCache::contiguous(region, BLOCK).unwrap()
}

async fn close_clean(e: &Engine) {
    let r = e.close(in_secs(5)).await;
    assert!(r.is_clean(), "{} closed unclean: {r:?}", e.peer_id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_once_publications_only() {
    let prefill = Engine::start(config("prefill", None)).await.unwrap();
    let decode = Engine::start(config("decode", None)).await.unwrap();
    let addr = prefill.address().unwrap().to_string();
    let src = prefill.register(cache("prefill-kv")).unwrap();
    let (once, shared, stored, unknown) = (key("once"), key("shared"), key("stored"), key("unknown"));
    prefill.publish(once, &src, &[1, 2], Duration::ZERO, true).unwrap();
    prefill.publish(shared, &src, &[3], Duration::ZERO, false).unwrap();
    prefill.put(stored, &[5u8; 1000]).unwrap();

    let t0 = Instant::now();
    let got = decode
        .release_keys(&addr, &[once, shared, stored, unknown], None, in_secs(5))
        .await
        .unwrap();
    assert_eq!(got, [true, false, false, false]);
    let released = released_within(&prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: once,
            reason: ReleaseReason::Declined
        }]
    );
    eprintln!("released within {:?} of the request", t0.elapsed());
    // Released: a second release answers released again (idempotent: the key was
    // retired recently), and releases nothing more; a get misses; the others are
    // still served.
    assert_eq!(
        decode.release_keys(&addr, &[once], None, in_secs(5)).await.unwrap(),
        [true]
    );
    assert!(released_within(&prefill, Duration::from_millis(100)).await.is_empty());
    let dst = decode.register(cache("decode-kv")).unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![4, 5]]);
    assert_eq!(decode.get(&addr, &[once], d, in_secs(5)).await.unwrap().chunks, 0);
    let d = Destination::new(dst.cache.clone(), vec![vec![6]]);
    assert_eq!(decode.get(&addr, &[shared], d, in_secs(5)).await.unwrap().chunks, 1);
    assert_eq!(
        prefill.stats().producer.published_now,
        1,
        "the shared publication stays"
    );
    close_clean(&decode).await;
    close_clean(&prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_for_another_incarnation_is_refused() {
    let prefill = Engine::start(config("prefill", None)).await.unwrap();
    let decode = Engine::start(config("decode", None)).await.unwrap();
    let addr = prefill.address().unwrap().to_string();
    let src = prefill.register(cache("prefill-kv")).unwrap();
    let k = key("once");
    prefill.publish(k, &src, &[1], Duration::ZERO, true).unwrap();
    let stale = prefill.incarnation() ^ 1;
    match decode.release_keys(&addr, &[k], Some(stale), in_secs(5)).await {
        Err(PeerError::StaleIncarnation { handle, current }) => {
            assert_eq!((handle, current), (stale, prefill.incarnation()))
        }
        other => panic!("expected StaleIncarnation, got {other:?}"),
    }
    assert!(released_within(&prefill, Duration::from_millis(200)).await.is_empty());
    // The right incarnation releases it.
    let got = decode
        .release_keys(&addr, &[k], Some(prefill.incarnation()), in_secs(5))
        .await
        .unwrap();
    assert_eq!(got, [true]);
    assert_eq!(released_within(&prefill, Duration::from_secs(2)).await.len(), 1);
    close_clean(&decode).await;
    close_clean(&prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_needs_no_staging() {
    // One staging page per peer: once the decode holds it, every Stage is Busy.
    let prefill = Engine::start(config("prefill", Some(1))).await.unwrap();
    let decode = Engine::start(config("decode", None)).await.unwrap();
    let addr = prefill.address().unwrap().to_string();
    let src = prefill.register(cache("prefill-kv")).unwrap();
    let (a, b) = (key("stored-a"), key("stored-b"));
    prefill.put(a, &[1u8; 1000]).unwrap();
    prefill.put(b, &[2u8; 1000]).unwrap();
    let held = decode.stage(&addr, &[a], in_secs(5)).await.unwrap();
    assert_eq!(held.chunks.len(), 1);
    match decode.stage(&addr, &[b], in_secs(5)).await {
        Err(PeerError::Remote {
            kind: ErrorKind::Busy, ..
        }) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    let k = key("once");
    prefill.publish(k, &src, &[1, 2, 3], Duration::ZERO, true).unwrap();
    let t0 = Instant::now();
    assert_eq!(
        decode.release_keys(&addr, &[k], None, in_secs(5)).await.unwrap(),
        [true]
    );
    let released = released_within(&prefill, Duration::from_secs(2)).await;
    let took = t0.elapsed();
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Declined
        }]
    );
    assert!(took < Duration::from_secs(1), "released after {took:?}");
    eprintln!("released under staging pressure within {took:?}");
    decode.release_staged(&held, in_secs(5)).await.unwrap();
    close_clean(&decode).await;
    close_clean(&prefill).await;
}

/// The decided semantics of a `Done` (the consumer gave up on a pull) that arrives
/// while the producer is still sending the lease:
///
/// - it is accepted at once: acknowledged, counted, and a following `Release` of the
///   lease's `once` key answers released (the connector's give-up path);
/// - it takes effect only when that send ends: nothing is reported released, and the
///   lease's quota stays charged, while a socket may still read the blocks;
/// - then the publication is released (reason `Done`) at once, not at the lease's TTL.
///
/// Before the ledger, such a `Done` was ignored: the publication stayed pinned until
/// the lease's TTL, released as `Declined` by the `Release`, and `done` stayed 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn done_mid_send_is_accepted_now_and_takes_effect_when_the_send_ends() {
    let prefill = Engine::start(config("prefill", None)).await.unwrap();
    let decode = Engine::start(config("decode", None)).await.unwrap();
    let addr = prefill.address().unwrap().to_string();
    let src = prefill.register(cache("prefill-kv")).unwrap();
    let k = key("once");
    prefill.publish(k, &src, &[1, 2], Duration::ZERO, true).unwrap();
    // The delay before each frame keeps the pull's send running for ~400 ms.
    let handle = decode.stage(&addr, &[k], in_secs(5)).await.unwrap();
    assert_ne!(handle.lease_id, 0);
    prefill
        .producer()
        .faults()
        .send_delay_us
        .store(400_000, std::sync::atomic::Ordering::SeqCst);
    let dst = decode.register(cache("decode-kv")).unwrap();
    let d = Destination::new(dst.cache.clone(), vec![vec![4, 5]]);
    let spawned = Instant::now();
    let pull = tokio::spawn(decode.start_resolve(handle.clone(), d, in_secs(10)));
    // The lease is checked out for the send.
    let t0 = Instant::now();
    while prefill.stats().producer.staged_now != 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "the pull never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The consumer's Done, on its own connection, mid-send: accepted at once.
    let asked = Instant::now();
    decode.release_staged(&handle, in_secs(5)).await.unwrap();
    assert!(
        asked.elapsed() < Duration::from_millis(300),
        "Done took {:?}",
        asked.elapsed()
    );
    assert_eq!(
        prefill.stats().producer.done,
        1,
        "the Done is accepted (counted) at once"
    );
    // The connector's Release of the key answers released (not "not released").
    assert_eq!(
        decode.release_keys(&addr, &[k], None, in_secs(5)).await.unwrap(),
        [true]
    );
    assert_eq!(prefill.stats().producer.published_now, 0, "no new lease can take it");
    // Not in effect while the send runs: nothing released. The send cannot end before
    // `spawned` + 400 ms (the delay before its first frame), so up to 350 ms after the
    // spawn no release may show. (Watching the pull task instead raced: the producer
    // ends its send, and releases, a moment before the consumer's task completes.)
    let quiet_until = spawned + Duration::from_millis(350);
    let mut mid_send = 0;
    while Instant::now() < quiet_until && !pull.is_finished() {
        let r = prefill.take_released();
        assert!(r.is_empty(), "released {r:?} while the send was still running");
        mid_send += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        mid_send > 2,
        "the send could not be observed after the Done ({mid_send} samples)"
    );
    let landed = pull.await.unwrap().map_err(|f| f.error).unwrap();
    assert_eq!(landed.chunks, 1);
    // In effect once the send ended: released as Done, long before the lease's TTL.
    let released = released_within(&prefill, Duration::from_secs(2)).await;
    assert_eq!(
        released,
        [Released {
            key: k,
            reason: ReleaseReason::Done
        }]
    );
    let s = prefill.stats().producer;
    assert_eq!((s.staged_now, s.quota_pages_charged, s.done), (0, 0, 1));
    // Idempotent: releasing again still answers released.
    assert_eq!(
        decode.release_keys(&addr, &[k], None, in_secs(5)).await.unwrap(),
        [true]
    );
    prefill
        .producer()
        .faults()
        .send_delay_us
        .store(0, std::sync::atomic::Ordering::SeqCst);
    close_clean(&decode).await;
    close_clean(&prefill).await;
}
