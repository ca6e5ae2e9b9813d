//! A get that reaches the producer before the key is published (a disaggregated
//! prefill publishes a step after it answered) waits for the publication instead of
//! being retried on a timer: with `Destination::with_await_published`, the consumer
//! sends `AwaitPublished` after the miss, the producer's publication wakes it, and
//! the get is sent once more — the transfer lands after exactly two gets and one
//! wait, whatever the timing. Without the wait (the default) the same get misses at
//! once, as before; a key that never comes ends the wait with the miss.
//!
//! The assertions count requests on the producer (the mechanism), never elapsed time.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::engines::{pair, Pair};
use common::eventually;
use kvferry::engine::Registered;
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::peer::{Destination, TransferPath};
use kvferry::stats::{RequestKind, RequestOutcome};
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

const BLOCK: usize = 16 << 10;
const BLOCKS: u32 = 8;

fn cache(name: &str, fill: u8) -> (Arc<Region>, KvCache) {
    let region = Arc::new(Region::host(name, BLOCKS as usize * BLOCK).unwrap());
    region.write(0, &vec![fill; BLOCKS as usize * BLOCK]).unwrap();
    (region.clone(), KvCache::contiguous(region, BLOCK).unwrap())
}

/// How many requests of `kind` the prefill engine answered with `outcome`.
fn served(p: &Pair, kind: RequestKind, outcome: RequestOutcome) -> u64 {
    let counts = p.prefill.producer().request_stats().counts();
    counts.iter().find(|c| c.0 == kind && c.1 == outcome).map_or(0, |c| c.2)
}

/// A registered source filled with 7s, a registered zeroed destination and its memory.
fn caches(p: &Pair) -> (Registered, Registered, Arc<Region>) {
    let src = p.prefill.register(cache("src", 7).1).unwrap();
    let (out, dst) = cache("dst", 0);
    (src, p.decode.register(dst).unwrap(), out)
}

async fn lands_once_published(path: TransferPath) {
    let p = pair().await;
    let (src, dst, out) = caches(&p);
    let k = ChunkKey::from_name("published-later");
    let d = Destination::new(dst.cache.clone(), vec![vec![4, 5]])
        .with_path(path)
        .with_await_published(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(30);
    let get = tokio::spawn({
        let (decode, addr) = (p.decode.clone(), p.addr.clone());
        async move { decode.get(&addr, &[k], d, deadline).await }
    });
    // The first get missed: the consumer now waits on the producer (or is about to).
    eventually("the first get missed", || {
        served(&p, RequestKind::Get, RequestOutcome::Miss) == 1
    })
    .await;
    p.prefill
        .publish(k, &src, &[1, 2], Duration::from_secs(30), true)
        .unwrap();
    let landed = get.await.unwrap().unwrap();
    assert_eq!(landed.chunks, 1);
    assert_eq!(landed.bytes, 2 * BLOCK);
    // The mechanism: one miss, one wait woken by the publication, one hit. A retry
    // timer would show as more gets; a wait ended by its own timer (30 s) as a
    // waited lookup that missed.
    assert_eq!(served(&p, RequestKind::Get, RequestOutcome::Miss), 1, "one miss");
    assert_eq!(
        served(&p, RequestKind::Get, RequestOutcome::Hit),
        1,
        "one get after the wait"
    );
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Hit),
        1,
        "one wait, ended by the key"
    );
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Miss),
        0,
        "no wait ended by its timer"
    );
    let mut got = vec![0u8; 2 * BLOCK];
    out.read(4 * BLOCK, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7), "the published bytes landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_get_before_the_publication_lands_when_it_comes() {
    lands_once_published(TransferPath::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_get_before_the_publication_lands_when_it_comes() {
    lands_once_published(TransferPath::Staged).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_pull_before_the_publication_lands_when_it_comes() {
    let p = pair().await;
    let (src, dst, out) = caches(&p);
    let k = ChunkKey::from_name("staged-later");
    let d = Destination::new(dst.cache.clone(), vec![vec![6]])
        .with_path(TransferPath::Staged)
        .with_await_published(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(30);
    let pull = p.decode.start_pull(&p.addr, &[k], d, deadline);
    let pull = tokio::spawn(pull);
    eventually("the first stage missed", || {
        served(&p, RequestKind::Stage, RequestOutcome::Miss) == 1
    })
    .await;
    p.prefill.publish(k, &src, &[3], Duration::from_secs(30), true).unwrap();
    assert_eq!(pull.await.unwrap().unwrap().chunks, 1);
    assert_eq!(served(&p, RequestKind::Stage, RequestOutcome::Miss), 1, "one miss");
    assert_eq!(
        served(&p, RequestKind::Stage, RequestOutcome::Hit),
        1,
        "one stage after the wait"
    );
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Hit),
        1,
        "one wait, ended by the key"
    );
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Miss),
        0,
        "no wait ended by its timer"
    );
    assert!(out.to_vec(6 * BLOCK, BLOCK).unwrap().iter().all(|&b| b == 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_wait_a_get_before_the_publication_misses_at_once() {
    let p = pair().await;
    let (_src, dst, _out) = caches(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![0]]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let landed = p
        .decode
        .get(&p.addr, &[ChunkKey::from_name("not-yet")], d, deadline)
        .await
        .unwrap();
    assert_eq!(landed.chunks, 0);
    assert_eq!(served(&p, RequestKind::Get, RequestOutcome::Miss), 1);
    assert_eq!(served(&p, RequestKind::Lookup, RequestOutcome::Hit), 0);
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Miss),
        0,
        "no wait asked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_arrives_unannounced_is_found_when_the_wait_ends() {
    // Written into the store behind the producer's back (`ChunkStore::insert_blocks`
    // wakes no one): the wait ends by its bound, finds the key there, and the get
    // goes on — counted as a wait ended by its timer.
    let p = pair().await;
    let (_src, dst, _out) = caches(&p);
    let k = ChunkKey::from_name("unannounced");
    let d = Destination::new(dst.cache.clone(), vec![vec![0]]).with_await_published(Duration::from_millis(600));
    let deadline = Instant::now() + Duration::from_secs(30);
    let get = tokio::spawn({
        let (decode, addr) = (p.decode.clone(), p.addr.clone());
        async move { decode.get(&addr, &[k], d, deadline).await }
    });
    eventually("the first get missed", || {
        served(&p, RequestKind::Get, RequestOutcome::Miss) == 1
    })
    .await;
    let store = p.prefill.producer().store();
    let blocks = store.alloc_blocks(1).unwrap();
    store.insert_blocks(k, blocks, 100).unwrap();
    assert_eq!(get.await.unwrap().unwrap().chunks, 1, "found when the wait ended");
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Miss),
        1,
        "the wait ended by its bound"
    );
    assert_eq!(served(&p, RequestKind::Get, RequestOutcome::Hit), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_never_comes_ends_the_wait_with_the_miss() {
    let p = pair().await;
    let (_src, dst, _out) = caches(&p);
    let d = Destination::new(dst.cache.clone(), vec![vec![0]]).with_await_published(Duration::from_millis(300));
    let deadline = Instant::now() + Duration::from_secs(30);
    let landed = p
        .decode
        .get(&p.addr, &[ChunkKey::from_name("never")], d, deadline)
        .await
        .unwrap();
    assert_eq!(landed.chunks, 0, "a miss, once the wait passed");
    assert_eq!(
        served(&p, RequestKind::Lookup, RequestOutcome::Miss),
        1,
        "the wait ended by its own bound"
    );
    assert!(served(&p, RequestKind::Get, RequestOutcome::Miss) <= 2);
    assert_eq!(
        p.decode
            .close(Instant::now() + Duration::from_secs(5))
            .await
            .draining_transfers,
        0
    );
}
