//! Device-resident KV on the transfer path, end to end over real loopback sockets:
//! producer device blocks → D2H gather into staging → socket → staging → H2D scatter
//! into consumer device blocks, with the sim device's faults on both sides (slow
//! copies, events that never complete, failing copies).

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{Device, DeviceKvCache, Fault, FaultRule, SimConfig, SimDevice, Trigger};
use kvferry::engine::{Engine, EngineConfig};
use kvferry::peer::{Destination, PeerError};
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

const BLOCK: usize = 16 << 10;
const BLOCKS: u32 = 32;

async fn engine(listen: bool) -> Engine {
    let cfg = EngineConfig::default()
        .listen(listen.then_some("127.0.0.1:0"))
        .arena(8 << 20, 64 << 10);
    Engine::start(cfg).await.unwrap()
}

fn sim(rank: u32) -> Arc<SimDevice> {
    SimDevice::new(SimConfig::new(rank).with_latency(Duration::from_micros(200))).unwrap()
}

fn cache(dev: &Arc<SimDevice>, name: &str, op_timeout: Duration) -> Arc<DeviceKvCache> {
    let d: Arc<dyn Device> = dev.clone();
    let buf = d.alloc(BLOCK * BLOCKS as usize).unwrap();
    Arc::new(DeviceKvCache::contiguous(name, d, buf, BLOCK, op_timeout).unwrap())
}

fn pattern(block: u32) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u32).wrapping_mul(7).wrapping_add(block * 31) as u8)
        .collect()
}

fn fill(c: &DeviceKvCache) {
    for b in 0..BLOCKS {
        c.buffers()[0].write(b as usize * BLOCK, &pattern(b)).unwrap();
    }
}

fn read_block(c: &DeviceKvCache, b: u32) -> Vec<u8> {
    c.buffers()[0].to_vec(b as usize * BLOCK, BLOCK).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_to_device_lands_every_byte() {
    let (p, d) = (engine(true).await, engine(false).await);
    let (pdev, ddev) = (sim(0), sim(1));
    let src = cache(&pdev, "prefill-kv", Duration::from_secs(2));
    let dst = cache(&ddev, "decode-kv", Duration::from_secs(2));
    fill(&src);
    let key = ChunkKey::from_name("req-1");
    let reg = p.register(src.clone()).unwrap();
    p.publish(key, &reg, &[3, 4, 5], Duration::ZERO, true).unwrap();
    let addr = p.address().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    let landed = d
        .get(
            &addr,
            &[key],
            Destination::new(dst.clone(), vec![vec![10, 11, 12]]),
            deadline,
        )
        .await
        .unwrap();
    assert_eq!(landed.chunks, 1);
    for (i, b) in [3u32, 4, 5].iter().enumerate() {
        assert_eq!(read_block(&dst, 10 + i as u32), pattern(*b), "block {b}");
    }
    assert!(read_block(&dst, 13).iter().all(|x| *x == 0), "nothing beyond the chunk");
    // The Done released the publication (once).
    p.wait_released(Instant::now() + Duration::from_secs(2)).await;
    assert_eq!(p.take_released().len(), 1);
    // Host publications land into device caches, and device ones into host caches.
    let host_dst = Arc::new(
        kvferry::layout::KvCache::contiguous(Arc::new(kvferry::mem::Region::host("h", BLOCK * 4).unwrap()), BLOCK)
            .unwrap(),
    );
    p.publish(key, &reg, &[7], Duration::ZERO, false).unwrap();
    d.get(
        &addr,
        &[key],
        Destination::new(host_dst.clone(), vec![vec![2]]),
        deadline,
    )
    .await
    .unwrap();
    assert_eq!(host_dst.io_slices(&[(2 * BLOCK, BLOCK)]).unwrap().concat(), pattern(7));
    for e in [p, d] {
        assert!(e.close(Instant::now() + Duration::from_secs(5)).await.is_clean());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_device_faults_are_typed_and_leak_nothing() {
    let (p, d) = (engine(true).await, engine(false).await);
    let pdev = sim(0);
    let src = cache(&pdev, "prefill-kv", Duration::from_millis(200));
    fill(&src);
    let dst = cache(&sim(1), "decode-kv", Duration::from_secs(2));
    let addr = p.address().unwrap().to_string();
    let key = ChunkKey::from_name("k");
    let reg = p.register(src.clone()).unwrap();
    p.publish(key, &reg, &[1], Duration::ZERO, false).unwrap();
    let get = |dl: Duration| {
        let (d, addr, dst) = (d.clone(), addr.clone(), dst.clone());
        async move {
            d.get(&addr, &[key], Destination::new(dst, vec![vec![0]]), Instant::now() + dl)
                .await
        }
    };

    // A failing D2H copy: the consumer gets a typed refusal naming the device copy.
    pdev.inject(FaultRule {
        fault: Fault::FailCopy,
        trigger: Trigger::Next,
    })
    .unwrap();
    let f = get(Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(&f.error, PeerError::Remote { message, .. } if message.contains("device-to-host")),
        "{}",
        f.error
    );

    // An event that never completes: refused at the op timeout (200 ms), not a hang;
    // the staging pages are quarantined until the device confirms.
    pdev.inject(FaultRule {
        fault: Fault::NeverComplete,
        trigger: Trigger::Next,
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    let f = get(Duration::from_secs(5)).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(
        matches!(&f.error, PeerError::Remote { message, .. } if message.contains("timed out")),
        "{}",
        f.error
    );
    assert!(
        p.arena().stats().quarantined_pages > 0,
        "pages the device may still write are quarantined"
    );
    pdev.release_stuck();
    let t = Instant::now() + Duration::from_secs(2);
    while p.arena().stats().quarantined_pages > 0 && Instant::now() < t {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        p.arena().stats().quarantined_pages,
        0,
        "released once the device confirmed"
    );

    // Slow copies still land, byte for byte.
    pdev.inject(FaultRule {
        fault: Fault::Slow(20),
        trigger: Trigger::Next,
    })
    .unwrap();
    assert_eq!(get(Duration::from_secs(5)).await.unwrap().chunks, 1);
    assert_eq!(read_block(&dst, 0), pattern(1));
    for e in [p, d] {
        assert!(e.close(Instant::now() + Duration::from_secs(5)).await.is_clean());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_device_faults_never_report_live_blocks_quiet() {
    let (p, d) = (engine(true).await, engine(false).await);
    let src = cache(&sim(0), "prefill-kv", Duration::from_secs(2));
    fill(&src);
    let ddev = sim(1);
    let dst = cache(&ddev, "decode-kv", Duration::from_millis(200));
    let addr = p.address().unwrap().to_string();
    let key = ChunkKey::from_name("k");
    let reg = p.register(src.clone()).unwrap();
    p.publish(key, &reg, &[2, 3], Duration::ZERO, false).unwrap();
    let start = |dl: Duration| {
        d.start_get(
            &addr,
            &[key],
            Destination::new(dst.clone(), vec![vec![8, 9]]),
            Instant::now() + dl,
        )
    };

    // A failing H2D: typed error naming the landing copy; the device no longer touches
    // the blocks, so the fence fires.
    ddev.inject(FaultRule {
        fault: Fault::FailCopy,
        trigger: Trigger::Next,
    })
    .unwrap();
    let f = start(Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(&f.error, PeerError::Device { error, .. } if error.to_string().contains("host-to-device")),
        "{}",
        f.error
    );
    assert!(f.dirty);
    assert!(f.fence.wait_until(Instant::now() + Duration::from_secs(2)).await);

    // An H2D whose event never completes: the caller gets a timeout at the op timeout,
    // but the fence does NOT fire while the device may still write the blocks — only
    // after the device confirms.
    ddev.inject(FaultRule {
        fault: Fault::NeverComplete,
        trigger: Trigger::Next,
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    let transfer = start(Duration::from_secs(5));
    let fence = transfer.fence();
    let f = transfer.await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(matches!(&f.error, PeerError::Device { .. }), "{}", f.error);
    assert!(f.dirty);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !fence.is_drained(),
            "blocks reported quiet while the device may still write them"
        );
        assert!(d.arena().stats().quarantined_pages > 0);
    }
    ddev.release_stuck();
    assert!(
        fence.wait_until(Instant::now() + Duration::from_secs(2)).await,
        "fires once the device confirmed"
    );
    let t = Instant::now() + Duration::from_secs(2);
    while d.arena().stats().quarantined_pages > 0 && Instant::now() < t {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(d.arena().stats().quarantined_pages, 0);

    // And the next transfer lands intact.
    assert_eq!(start(Duration::from_secs(5)).await.unwrap().chunks, 1);
    assert_eq!(read_block(&dst, 8), pattern(2));
    assert_eq!(read_block(&dst, 9), pattern(3));
    for e in [p, d] {
        assert!(e.close(Instant::now() + Duration::from_secs(5)).await.is_clean());
    }
}

/// Delayed pulls cancelled (dropped) while their landing copy is stalled on the
/// device: the fence taken up front stays unfired until the device confirms, for
/// `start_pull` (both steps under one fence) and `start_resolve` alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_delayed_pulls_fire_their_fence_only_after_the_device_stopped() {
    let (p, d) = (engine(true).await, engine(false).await);
    let src = cache(&sim(0), "prefill-kv", Duration::from_secs(2));
    fill(&src);
    let ddev = sim(1);
    let dst = cache(&ddev, "decode-kv", Duration::from_secs(30));
    let addr = p.address().unwrap().to_string();
    let key = ChunkKey::from_name("k");
    let reg = p.register(src.clone()).unwrap();
    p.publish(key, &reg, &[2, 3], Duration::ZERO, false).unwrap();
    let deadline = || Instant::now() + Duration::from_secs(30);
    for step in ["pull", "resolve"] {
        ddev.inject(FaultRule {
            fault: Fault::Stall,
            trigger: Trigger::Next,
        })
        .unwrap();
        let to = Destination::new(dst.clone(), vec![vec![8, 9]]);
        let transfer = match step {
            "pull" => d.start_pull(&addr, &[key], to, deadline()),
            _ => {
                let h = d.stage(&addr, &[key], deadline()).await.unwrap();
                d.start_resolve(h, to, deadline())
            }
        };
        let fence = transfer.fence();
        let running = tokio::spawn(transfer);
        let t = Instant::now() + Duration::from_secs(10);
        while ddev.stuck() == 0 {
            assert!(Instant::now() < t, "{step}: the landing copy never reached the device");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        running.abort(); // the caller gives up: the transfer future is dropped
        let _ = running.await;
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(ddev.stuck() > 0);
            assert!(
                !fence.is_drained(),
                "{step}: blocks reported quiet while the device may write them"
            );
        }
        ddev.release_stuck();
        assert!(
            fence.wait_until(Instant::now() + Duration::from_secs(5)).await,
            "{step}: fires once the device confirmed"
        );
    }
    let t = Instant::now() + Duration::from_secs(5);
    while (d.arena().stats().leased_pages > 0 || d.arena().stats().quarantined_pages > 0) && Instant::now() < t {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(d.arena().stats().leased_pages + d.arena().stats().quarantined_pages, 0);
    assert_eq!(
        d.start_pull(
            &addr,
            &[key],
            Destination::new(dst.clone(), vec![vec![10, 11]]),
            deadline()
        )
        .await
        .unwrap()
        .chunks,
        1
    );
    assert_eq!(read_block(&dst, 10), pattern(2));
    for e in [p, d] {
        assert!(e.close(Instant::now() + Duration::from_secs(5)).await.is_clean());
    }
}
