//! The etcd peer directory against a real, private etcd per test: registration, list
//! and watch; duplicate ids; restart and loss failing in-flight transfers at once;
//! etcd going down and coming back; locating keys on live peers.
#![cfg(feature = "etcd")]

mod common;
#[path = "common/etcd.rs"]
mod etcd;

use std::sync::Arc;
use std::time::Duration;

use etcd::next_event;
use kvferry::directory::etcd::{EtcdConfig, EtcdDirectory};
use kvferry::directory::{Directory, DirectoryError, PeerEvent, PeerRecord, RegistrationState, Role};
use kvferry::engine::{Engine, EngineConfig};
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::peer::{Destination, PeerError};
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

const BLOCK: usize = 16 << 10;

fn cfg(e: &etcd::Etcd) -> EtcdConfig {
    let mut c = EtcdConfig::new(vec![e.endpoint()], "test");
    c.ttl = Duration::from_secs(2);
    c.call_timeout = Duration::from_secs(1);
    c.stale_after = Duration::from_secs(1);
    c.backoff_min = Duration::from_millis(50);
    c.backoff_max = Duration::from_millis(400);
    c
}

async fn dir(e: &etcd::Etcd) -> Arc<EtcdDirectory> {
    let d = EtcdDirectory::connect(cfg(e)).await.unwrap();
    d.wait_listed(Duration::from_secs(5)).await.unwrap();
    Arc::new(d)
}

fn engine_cfg(peer_id: &str, dir: Option<Arc<EtcdDirectory>>) -> EngineConfig {
    let mut c = common::engines::small_config(peer_id);
    c.directory = dir.map(|d| d as Arc<dyn Directory>);
    c.role = Role::Prefill;
    c
}

fn dst() -> (Arc<Region>, Destination) {
    let region = Arc::new(Region::host("dst", 8 * BLOCK).unwrap());
    let cache = Arc::new(KvCache::contiguous(region.clone(), BLOCK).unwrap());
    (region, Destination::new(cache, vec![vec![0]]))
}

/// Waits (bounded) until `f` holds.
async fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_listed_then_watched() {
    let Some(e) = etcd::Etcd::start() else { return };
    let a = dir(&e).await;
    a.register(PeerRecord::new("a", "127.0.0.1:1001", 11)).await.unwrap();
    // A second view lists what is there…
    let b = dir(&e).await;
    let live = b.live_peers();
    assert!(!live.stale);
    assert_eq!(live.peers.len(), 1);
    assert_eq!(live.peers[0].record.address, "127.0.0.1:1001");
    assert_eq!(b.resolve("a").as_deref(), Some("127.0.0.1:1001"));
    // …and then watches joins and departures.
    let mut rx = b.subscribe();
    let c = dir(&e).await;
    c.register(PeerRecord::new("c", "127.0.0.1:1002", 12)).await.unwrap();
    match next_event(&mut rx, "c", Duration::from_secs(3)).await {
        PeerEvent::Joined(r) => assert_eq!(r.incarnation, 12),
        other => panic!("{other:?}"),
    }
    a.deregister().await.unwrap();
    assert!(matches!(
        next_event(&mut rx, "a", Duration::from_secs(3)).await,
        PeerEvent::Lost(_)
    ));
    assert_eq!(b.resolve("a"), None);
    assert_eq!(c.registration().unwrap().peer_id, "c");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_process_with_the_same_id_is_refused_naming_the_holder() {
    let Some(e) = etcd::Etcd::start() else { return };
    let a = dir(&e).await;
    a.register(PeerRecord::new("dup", "127.0.0.1:2001", 0x21))
        .await
        .unwrap();
    let b = dir(&e).await;
    let err = b
        .register(PeerRecord::new("dup", "127.0.0.1:2002", 0x22))
        .await
        .unwrap_err();
    match &err {
        DirectoryError::DuplicatePeerId {
            peer_id,
            address,
            incarnation,
        } => assert_eq!(
            (peer_id.as_str(), address.as_str(), *incarnation),
            ("dup", "127.0.0.1:2001", 0x21)
        ),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("127.0.0.1:2001"), "{err}");
    assert!(b.registration().is_none());
    // The holder is untouched; once it leaves, the id is free.
    assert_eq!(b.resolve("dup").as_deref(), Some("127.0.0.1:2001"));
    a.deregister().await.unwrap();
    b.register(PeerRecord::new("dup", "127.0.0.1:2002", 0x22))
        .await
        .unwrap();
}

/// A producer whose every sent chunk is delayed 3 s, registered as `p`, holding one
/// chunk; a consumer engine following the same directory.
async fn slow_producer_and_consumer(e: &etcd::Etcd) -> (Engine, Engine, ChunkKey) {
    let p = Engine::start(engine_cfg("p", Some(dir(e).await))).await.unwrap();
    {
        use std::sync::atomic::Ordering::Relaxed;
        let f = p.producer().faults();
        f.slow_delay_us.store(3_000_000, Relaxed);
        f.slow_ppm.store(1_000_000, Relaxed);
    }
    let k = ChunkKey::from_name("slow");
    p.put(k, &vec![7u8; BLOCK]).unwrap();
    let c = Engine::start(engine_cfg("c", Some(dir(e).await)).listen(None))
        .await
        .unwrap();
    let cd = c.config().directory.clone().unwrap();
    until("consumer sees p", Duration::from_secs(5), || cd.resolve("p").is_some()).await;
    (p, c, k)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_fails_in_flight_transfers_with_peer_restarted() {
    let Some(e) = etcd::Etcd::start() else { return };
    let (p, c, k) = slow_producer_and_consumer(&e).await;
    let (_region, d) = dst();
    let c2 = c.clone();
    let started = Instant::now();
    let get = tokio::spawn(async move { c2.get("p", &[k], d, Instant::now() + Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A new incarnation at p's address, written straight into etcd (a registering
    // directory refuses it: p answers at that address, alive).
    let addr = p.address().unwrap().to_string();
    let mut raw = etcd_client::Client::connect([e.endpoint()], None).await.unwrap();
    raw.put(
        "test/peers/p",
        serde_json::to_vec(&PeerRecord::new("p", addr, 0xabc1)).unwrap(),
        None,
    )
    .await
    .unwrap();
    let f = get.await.unwrap().unwrap_err();
    let waited = started.elapsed();
    match &f.error {
        PeerError::PeerRestarted { old, new, .. } => {
            assert_eq!((*old, *new), (p.incarnation(), 0xabc1));
        }
        other => panic!("expected PeerRestarted, got {other}"),
    }
    assert!(waited < Duration::from_secs(2), "failed after {waited:?}, not at once");
    f.fence.wait().await;
    // Nothing left on the consumer side.
    until("consumer drained", Duration::from_secs(5), || {
        c.stats().consumer.draining == 0
    })
    .await;
    assert!(c.close(Instant::now() + Duration::from_secs(5)).await.is_clean());
    p.close(Instant::now() + Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_peer_fails_in_flight_transfers_with_peer_lost() {
    let Some(e) = etcd::Etcd::start() else { return };
    let (p, c, k) = slow_producer_and_consumer(&e).await;
    let (_region, d) = dst();
    let c2 = c.clone();
    let started = Instant::now();
    let get = tokio::spawn(async move { c2.get("p", &[k], d, Instant::now() + Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    p.config().directory.clone().unwrap().deregister().await.unwrap();
    let f = get.await.unwrap().unwrap_err();
    assert!(matches!(f.error, PeerError::PeerLost { .. }), "{}", f.error);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "failed after {:?}",
        started.elapsed()
    );
    f.fence.wait().await;
    assert!(c.close(Instant::now() + Duration::from_secs(5)).await.is_clean());
    p.close(Instant::now() + Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_keeps_known_peers_working_and_the_view_recovers() {
    let Some(mut e) = etcd::Etcd::start() else { return };
    let p = Engine::start(engine_cfg("p", Some(dir(&e).await))).await.unwrap();
    let c = Engine::start(engine_cfg("c", Some(dir(&e).await)).listen(None))
        .await
        .unwrap();
    let cd = c.config().directory.clone().unwrap();
    until("consumer sees p", Duration::from_secs(5), || cd.resolve("p").is_some()).await;
    let k = ChunkKey::from_name("k");
    p.put(k, &vec![3u8; BLOCK]).unwrap();

    e.kill();
    until("view flagged stale", Duration::from_secs(5), || cd.live_peers().stale).await;
    // Known peers keep working, by name, while etcd is down.
    for _ in 0..3 {
        let (region, d) = dst();
        let landed = c
            .get("p", &[k], d, Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(landed.bytes, BLOCK);
        assert_eq!(region.to_vec(0, BLOCK).unwrap(), vec![3u8; BLOCK]);
    }
    assert_eq!(cd.live_peers().peers.len(), 1);
    // A directory call fails within its deadline instead of hanging.
    let t = Instant::now();
    let other = EtcdDirectory::connect(cfg(&e)).await.unwrap();
    let err = other
        .register(PeerRecord::new("x", "127.0.0.1:1", 1))
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(4), "{err} after {:?}", t.elapsed());

    e.restart();
    until("view recovers", Duration::from_secs(15), || !cd.live_peers().stale).await;
    assert_eq!(
        cd.resolve("p").as_deref(),
        Some(p.address().unwrap().to_string().as_str())
    );
    // p's registration survived (or was renewed): it is still listed after a TTL.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(cd.resolve("p").is_some(), "p dropped out after etcd came back");
    assert!(!cd.live_peers().stale);
    c.close(Instant::now() + Duration::from_secs(5)).await;
    p.close(Instant::now() + Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locate_finds_the_peer_holding_a_key_and_caches_misses() {
    let Some(e) = etcd::Etcd::start() else { return };
    let mut producers = Vec::new();
    for i in 0..3 {
        producers.push(
            Engine::start(engine_cfg(&format!("p{i}"), Some(dir(&e).await)))
                .await
                .unwrap(),
        );
    }
    let k = ChunkKey::from_name("only-on-p1");
    producers[1].put(k, &vec![1u8; BLOCK]).unwrap();
    let c = Engine::start(engine_cfg("c", Some(dir(&e).await)).listen(None))
        .await
        .unwrap();
    let cd = c.config().directory.clone().unwrap();
    until("consumer sees 3 peers", Duration::from_secs(5), || {
        cd.live_peers().peers.len() == 3
    })
    .await;
    let found = c.locate(&[k], Instant::now() + Duration::from_secs(3)).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].peer_id, "p1");
    assert_eq!(found[0].hits, 1);
    let missing = ChunkKey::from_name("nowhere");
    assert!(c
        .locate(&[missing], Instant::now() + Duration::from_secs(3))
        .await
        .unwrap()
        .is_empty());
    // Now put it on p2: the miss is remembered for a short while, then found.
    producers[2].put(missing, &vec![2u8; BLOCK]).unwrap();
    assert!(c
        .locate(&[missing], Instant::now() + Duration::from_secs(3))
        .await
        .unwrap()
        .is_empty());
    tokio::time::sleep(kvferry::engine::MISS_TTL).await;
    let found = c
        .locate(&[missing], Instant::now() + Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(found.iter().map(|l| l.peer_id.as_str()).collect::<Vec<_>>(), vec!["p2"]);
    c.close(Instant::now() + Duration::from_secs(5)).await;
    for p in producers {
        p.close(Instant::now() + Duration::from_secs(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_renewed_with_the_same_incarnation() {
    let Some(e) = etcd::Etcd::start() else { return };
    let pd = dir(&e).await;
    let p = Engine::start(engine_cfg("p", Some(pd.clone()))).await.unwrap();
    let mut state = pd.registration_state().unwrap();
    let first = pd.registration().unwrap();
    assert_eq!(first.incarnation, p.incarnation());
    let w = dir(&e).await;
    let mut rx = w.subscribe();
    // Revoke p's lease behind its back (what an expiry during an etcd outage does).
    let mut client = etcd_client::Client::connect([e.endpoint()], None).await.unwrap();
    let got = client.get("test/peers/p", None).await.unwrap();
    let lease = got.kvs()[0].lease();
    client.lease_revoke(lease).await.unwrap();
    assert!(matches!(
        next_event(&mut rx, "p", Duration::from_secs(3)).await,
        PeerEvent::Lost(_)
    ));
    // The keep-alive task notices (within TTL/3), says so, and registers again.
    tokio::time::timeout(
        Duration::from_secs(3),
        state.wait_for(|s| *s == RegistrationState::Lost),
    )
    .await
    .ok();
    let back = tokio::time::timeout(
        Duration::from_secs(5),
        state.wait_for(|s| matches!(s, RegistrationState::Registered(_))),
    )
    .await
    .expect("registered again")
    .unwrap()
    .clone();
    let RegistrationState::Registered(renewed) = back else {
        unreachable!()
    };
    assert_eq!(
        renewed.incarnation,
        p.incarnation(),
        "a renewed registration keeps the process's incarnation (its connections present it)"
    );
    match next_event(&mut rx, "p", Duration::from_secs(3)).await {
        PeerEvent::Joined(r) => assert_eq!(r.incarnation, renewed.incarnation),
        other => panic!("{other:?}"),
    }
    // Serving again: a get through the directory works.
    let k = ChunkKey::from_name("after");
    p.put(k, &vec![5u8; BLOCK]).unwrap();
    let c = Engine::start(engine_cfg("c", Some(w)).listen(None)).await.unwrap();
    let (_r, d) = dst();
    c.get("p", &[k], d, Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    c.close(Instant::now() + Duration::from_secs(5)).await;
    p.close(Instant::now() + Duration::from_secs(5)).await;
}

/// The view against the real etcd: a seeded random run of single puts and deletes,
/// transactions with several changes, range deletes, compactions and an etcd restart;
/// at every checkpoint the view equals a fresh list and the events it emitted add up
/// to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_equals_a_fresh_list_after_random_etcd_operations() {
    use etcd_client::{DeleteOptions, GetOptions, Txn, TxnOp};
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;
    let Some(mut e) = etcd::Etcd::start() else { return };
    let seed: u64 = std::env::var("KVFERRY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed {seed} (KVFERRY_SEED to replay)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let d = dir(&e).await;
    let mut rx = d.subscribe();
    let mut mirror: BTreeMap<String, u64> = BTreeMap::new();
    let key = |k: usize| format!("test/peers/k{k}");
    let rec = |k: usize, inc: u64| serde_json::to_vec(&PeerRecord::new(format!("k{k}"), "127.0.0.1:9", inc)).unwrap();
    let mut client = etcd_client::Client::connect([e.endpoint()], None).await.unwrap();
    for round in 0..12 {
        if round == 6 {
            // A restart, changes and a compaction while the watch reconnects.
            e.restart();
            client = etcd_client::Client::connect([e.endpoint()], None).await.unwrap();
        }
        for _ in 0..12 {
            match rng.gen_range(0..10) {
                0..=3 => {
                    let k = rng.gen_range(0..8);
                    client.put(key(k), rec(k, rng.gen_range(1..4)), None).await.unwrap();
                }
                4 | 5 => {
                    client.delete(key(rng.gen_range(0..8)), None).await.unwrap();
                }
                6 | 7 => {
                    let mut keys: Vec<usize> = (0..8).collect();
                    keys.retain(|_| rng.gen_bool(0.5));
                    let ops: Vec<TxnOp> = keys
                        .iter()
                        .map(|&k| match rng.gen_bool(0.7) {
                            true => TxnOp::put(key(k), rec(k, rng.gen_range(1..4)), None),
                            false => TxnOp::delete(key(k), None),
                        })
                        .collect();
                    client.txn(Txn::new().and_then(ops)).await.unwrap();
                }
                8 => {
                    // All of them, or those whose id starts with k1 (k1 only).
                    let prefix = if rng.gen_bool(0.5) {
                        "test/peers/"
                    } else {
                        "test/peers/k1"
                    };
                    client
                        .delete(prefix, Some(DeleteOptions::new().with_prefix()))
                        .await
                        .unwrap();
                }
                _ => {
                    let rev = client.get("x", None).await.unwrap().header().unwrap().revision();
                    // Compacted at this revision already: etcd says so, nothing changes.
                    let _ = client.compact(rev, None).await;
                }
            }
        }
        // Checkpoint: the view converges to a fresh list.
        let fresh: BTreeMap<String, u64> = client
            .get("test/peers/", Some(GetOptions::new().with_prefix()))
            .await
            .unwrap()
            .kvs()
            .iter()
            .map(|kv| {
                let r: PeerRecord = serde_json::from_slice(kv.value()).unwrap();
                (r.peer_id, r.incarnation)
            })
            .collect();
        let start = Instant::now();
        loop {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    PeerEvent::Joined(r) => assert!(mirror.insert(r.peer_id.clone(), r.incarnation).is_none(), "{r:?}"),
                    PeerEvent::Restarted { old, new } => {
                        assert_eq!(
                            mirror.insert(new.peer_id.clone(), new.incarnation),
                            Some(old.incarnation)
                        )
                    }
                    PeerEvent::Lost(r) => assert!(mirror.remove(&r.peer_id).is_some(), "{r:?}"),
                }
            }
            let seen: BTreeMap<String, u64> = d
                .live_peers()
                .peers
                .into_iter()
                .map(|p| (p.record.peer_id, p.record.incarnation))
                .collect();
            if seen == fresh && mirror == fresh {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "round {round} (seed {seed}): view {seen:?}, events {mirror:?}, fresh list {fresh:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
