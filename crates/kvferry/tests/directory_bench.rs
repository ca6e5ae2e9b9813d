//! Benchmarks of the etcd directory (ignored by default; run with
//! `cargo test --release -p kvferry --features etcd --test directory_bench -- --ignored --nocapture --test-threads 1`):
//! first get to a newly seen peer through etcd vs static, lookup fan-out to 16 peers,
//! and the time from a peer's death (its lease no longer kept alive) to consumers
//! failing its transfers. Prints figures; asserts only the bound on the last.
#![cfg(feature = "etcd")]

mod common;
#[path = "common/etcd.rs"]
mod etcd;

use std::sync::Arc;
use std::time::Duration;

use kvferry::directory::etcd::{EtcdConfig, EtcdDirectory};
use kvferry::directory::{Directory, PeerEvent};
use kvferry::engine::{Engine, EngineConfig, StoreConfig};
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::peer::{Destination, PeerError};
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

const BLOCK: usize = 16 << 10;
const TTL: Duration = Duration::from_secs(2);

async fn dir(e: &etcd::Etcd) -> Arc<EtcdDirectory> {
    let mut c = EtcdConfig::new(vec![e.endpoint()], "bench");
    c.ttl = TTL;
    c.call_timeout = Duration::from_secs(1);
    c.stale_after = Duration::from_secs(1);
    let d = EtcdDirectory::connect(c).await.unwrap();
    d.wait_listed(Duration::from_secs(5)).await.unwrap();
    Arc::new(d)
}

fn engine_cfg(peer_id: &str, dir: Option<Arc<EtcdDirectory>>) -> EngineConfig {
    let mut c = common::engines::small_config(peer_id).arena(1 << 20, 64 << 10);
    c.store = StoreConfig::Bytes {
        bytes: 256 << 10,
        block_bytes: BLOCK,
    };
    c.directory = dir.map(|d| d as Arc<dyn Directory>);
    c
}

fn dst() -> Destination {
    let region = Arc::new(Region::host("dst", 4 * BLOCK).unwrap());
    Destination::new(Arc::new(KvCache::contiguous(region, BLOCK).unwrap()), vec![vec![0]])
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn show(name: &str, v: &mut [Duration]) {
    println!(
        "{name}: n={} p50={:.2?} p99={:.2?} max={:.2?}",
        v.len(),
        pct(v, 0.5),
        pct(v, 0.99),
        pct(v, 1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn bench_first_get_to_a_newly_seen_peer() {
    let Some(e) = etcd::Etcd::start() else { return };
    let via_etcd = Engine::start(engine_cfg("c-etcd", Some(dir(&e).await)).listen(None))
        .await
        .unwrap();
    let via_static = Engine::start(engine_cfg("c-static", None).listen(None)).await.unwrap();
    let mut rx = via_etcd.config().directory.as_ref().unwrap().subscribe();
    let (mut seen, mut first_etcd, mut first_static) = (Vec::new(), Vec::new(), Vec::new());
    let k = ChunkKey::from_name("k");
    for i in 0..40 {
        let id = format!("p{i}");
        let pd = dir(&e).await;
        let t = Instant::now();
        let p = Engine::start(engine_cfg(&id, Some(pd))).await.unwrap();
        p.put(k, &vec![i as u8; BLOCK]).unwrap();
        loop {
            let ev = rx.recv().await.unwrap();
            if matches!(&ev, PeerEvent::Joined(r) if r.peer_id == id) {
                break;
            }
        }
        seen.push(t.elapsed());
        let t1 = Instant::now();
        via_etcd
            .get(&id, &[k], dst(), t1 + Duration::from_secs(5))
            .await
            .unwrap();
        first_etcd.push(t1.elapsed());
        let addr = p.address().unwrap().to_string();
        let t2 = Instant::now();
        via_static
            .get(&addr, &[k], dst(), t2 + Duration::from_secs(5))
            .await
            .unwrap();
        first_static.push(t2.elapsed());
        p.close(Instant::now() + Duration::from_secs(2)).await;
    }
    show("engine start with registration -> Joined at a consumer", &mut seen);
    show("first get to a newly seen peer, by id through etcd", &mut first_etcd);
    show("first get to a newly seen peer, by address (static)", &mut first_static);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn bench_locate_fan_out_to_16_peers() {
    let Some(e) = etcd::Etcd::start() else { return };
    let shared = dir(&e).await;
    let mut peers = Vec::new();
    for i in 0..16 {
        let mut cfg = engine_cfg(&format!("p{i}"), Some(dir(&e).await));
        cfg.copy.threads = 1;
        let p = Engine::start(cfg).await.unwrap();
        for j in 0..8 {
            p.put(ChunkKey::from_name(&format!("k{}", i * 8 + j)), &[1u8; 64])
                .unwrap();
        }
        peers.push(p);
    }
    let c = Engine::start(engine_cfg("c", Some(shared)).listen(None)).await.unwrap();
    let cd = c.config().directory.clone().unwrap();
    while cd.live_peers().peers.len() < 16 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Warm the 16 pools, then measure.
    c.locate(&[ChunkKey::from_name("k0")], Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    let mut lat = Vec::new();
    for r in 0..500 {
        let k = ChunkKey::from_name(&format!("k{}", r % 128));
        let t = Instant::now();
        let found = c.locate(&[k], t + Duration::from_secs(5)).await.unwrap();
        lat.push(t.elapsed());
        assert_eq!(found.len(), 1);
    }
    show("locate: batched Lookup fanned out to 16 live peers", &mut lat);
    let t = Instant::now();
    let mut cached = Vec::new();
    let missing = ChunkKey::from_name("absent");
    c.locate(&[missing], t + Duration::from_secs(5)).await.unwrap();
    for _ in 0..100 {
        let t = Instant::now();
        assert!(c
            .locate(&[missing], t + Duration::from_secs(5))
            .await
            .unwrap()
            .is_empty());
        cached.push(t.elapsed());
    }
    show("locate: a key in the miss cache", &mut cached);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn bench_death_to_failed_transfers() {
    let Some(e) = etcd::Etcd::start() else { return };
    let c = Engine::start(engine_cfg("c", Some(dir(&e).await)).listen(None))
        .await
        .unwrap();
    let mut lat = Vec::new();
    for i in 0..5 {
        let id = format!("victim{i}");
        let pd = dir(&e).await;
        let p = Engine::start(engine_cfg(&id, Some(pd.clone()))).await.unwrap();
        {
            use std::sync::atomic::Ordering::Relaxed;
            let f = p.producer().faults();
            f.slow_delay_us.store(30_000_000, Relaxed);
            f.slow_ppm.store(1_000_000, Relaxed);
        }
        let k = ChunkKey::from_name("k");
        p.put(k, &vec![9u8; BLOCK]).unwrap();
        let cd = c.config().directory.clone().unwrap();
        while cd.resolve(&id).is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let c2 = c.clone();
        let idc = id.clone();
        let get = tokio::spawn(async move {
            c2.get(&idc, &[k], dst(), Instant::now() + Duration::from_secs(20))
                .await
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        // The peer "dies" as far as etcd can tell: nobody keeps its lease alive and its
        // connection stays open but silent (a hung host, not a reset).
        let died = Instant::now();
        pd.close();
        let f = get.await.unwrap().unwrap_err();
        let took = died.elapsed();
        assert!(matches!(f.error, PeerError::PeerLost { .. }), "{}", f.error);
        lat.push(took);
        drop(p);
    }
    show("peer death (lease TTL 2 s) -> its in-flight transfer fails", &mut lat);
    assert!(pct(&mut lat, 1.0) <= TTL + Duration::from_secs(1), "over TTL + 1 s");
}
