//! The sim backend under fault injection, on tokio's paused clock (timing is exact, no
//! test sleeps in real time): bounded waits, quarantine and late release, failing
//! copies, stalled streams, bandwidth, deadlines measured from submission. The generic
//! device suite (`common/device_suite.rs`) also runs here, in real time.

#[path = "common/device_suite.rs"]
mod device_suite;

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{Device, DeviceBuffer, DeviceError, Fault, FaultRule, SimConfig, SimDevice, Stream, Trigger};
use kvferry::mem::{Arena, ArenaConfig};
use tokio::time::Instant;

const PAGE: usize = 4096;

fn arena(pages: usize) -> Arena {
    Arena::new(ArenaConfig::new(PAGE, pages).unpinned()).unwrap()
}

/// Every page is in exactly one state.
fn check(a: &Arena) {
    let s = a.stats();
    assert_eq!(
        s.free_pages + s.leased_pages + s.quarantined_pages,
        s.total_pages,
        "{s:?}"
    );
}

fn filled(dev: &Arc<SimDevice>, len: usize, seed: u8) -> DeviceBuffer {
    let buf = dev.alloc(len).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect();
    buf.write(0, &data).unwrap();
    buf
}

fn stream(dev: &Arc<SimDevice>, name: &str) -> Stream {
    dev.create_stream(name).unwrap()
}

fn open() -> Option<Arc<SimDevice>> {
    Some(SimDevice::new(SimConfig::new(0)).unwrap())
}

fn other() -> Option<Arc<SimDevice>> {
    Some(SimDevice::new(SimConfig::new(1)).unwrap())
}

fn arena_of(_: &Arc<SimDevice>, page: usize, pages: usize) -> Arena {
    Arena::new(ArenaConfig::new(page, pages).unpinned()).unwrap()
}

mod suite {
    use super::*;

    fn arena(dev: &Arc<SimDevice>, page: usize, pages: usize) -> Arena {
        arena_of(dev, page, pages)
    }

    crate::device_suite::device_suite!();
}

#[tokio::test(start_paused = true)]
async fn never_completing_event_times_out_at_deadline_then_releases_late() {
    let dev = SimDevice::new(SimConfig::new(3).with_fault(Fault::NeverComplete, Trigger::Next)).unwrap();
    let a = arena(4);
    let buf = filled(&dev, 2 * PAGE, 1);
    let s = stream(&dev, "copy");
    let pending = s
        .copy_d2h(&buf, 0, a.try_alloc(2).unwrap(), 0, 2 * PAGE, "offload step 9")
        .unwrap();
    let event = pending.event().clone();
    let t0 = Instant::now();
    let err = pending.wait(t0 + Duration::from_millis(250)).await.unwrap_err();
    match &err {
        DeviceError::Timeout { op, rank, waited } => {
            assert_eq!(op, "offload step 9");
            assert_eq!(*rank, 3);
            assert_eq!(*waited, Duration::from_millis(250));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(t0.elapsed(), Duration::from_millis(250), "returns at the deadline");
    assert!(
        err.to_string().contains("offload step 9") && err.to_string().contains("rank 3"),
        "{err}"
    );

    // The pages the late copy targets are withheld, not freed.
    let s1 = a.stats();
    assert_eq!(s1.quarantined_pages, 2, "{s1:?}");
    assert_eq!(s1.free_pages, 2);
    check(&a);
    assert!(a.try_alloc(3).is_err(), "quarantined pages are not handed out");
    assert_eq!(dev.stuck(), 1);

    // Late completion: the device confirms, the pages return to the free list.
    dev.release_stuck();
    event.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
    let s2 = a.stats();
    assert_eq!(
        (s2.quarantined_pages, s2.free_pages, s2.leased_pages),
        (0, 4, 0),
        "{s2:?}"
    );
    check(&a);
    assert_eq!(dev.stuck(), 0);
}

#[tokio::test(start_paused = true)]
async fn every_event_of_a_rank_never_completes() {
    // What a rank runtime builds for "rank 7's events never complete".
    let dev = SimDevice::new(SimConfig::new(7).with_fault(Fault::NeverComplete, Trigger::Every)).unwrap();
    let a = arena(4);
    let buf = filled(&dev, PAGE, 2);
    let (s1, s2) = (stream(&dev, "a"), stream(&dev, "b"));
    let p1 = s1.copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "first").unwrap();
    let p2 = s2
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "second")
        .unwrap();
    let rec = s2.record("marker").unwrap();
    let deadline = Instant::now() + Duration::from_millis(100);
    for (p, name) in [(p1, "first"), (p2, "second")] {
        match p.wait(deadline).await {
            Err(DeviceError::Timeout { op, rank: 7, .. }) => assert_eq!(op, name),
            other => panic!("expected timeout, got {other:?}"),
        }
    }
    assert!(matches!(
        rec.wait(deadline).await,
        Err(DeviceError::Timeout { rank: 7, .. })
    ));
    assert_eq!(a.stats().quarantined_pages, 2);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn failing_copy_is_typed_and_returns_its_lease() {
    let dev = SimDevice::new(SimConfig::new(1)).unwrap();
    dev.inject(FaultRule {
        fault: Fault::FailCopy,
        trigger: Trigger::Next,
    })
    .unwrap();
    let a = arena(2);
    let buf = filled(&dev, PAGE, 3);
    let s = stream(&dev, "copy");
    let p = s.copy_d2h(&buf, 0, a.try_alloc(2).unwrap(), 0, PAGE, "doomed").unwrap();
    let err = p.wait(Instant::now() + Duration::from_secs(5)).await.unwrap_err();
    match err {
        DeviceError::CopyFailed { op, rank: 1, message } => {
            assert_eq!(op, "doomed");
            assert!(message.contains("injected"), "{message}");
        }
        other => panic!("expected CopyFailed, got {other}"),
    }
    let st = a.stats();
    assert_eq!(
        (st.free_pages, st.leased_pages, st.quarantined_pages),
        (2, 0, 0),
        "no leak, no quarantine"
    );
    // The fault was one-shot: the next copy on the same stream works.
    let lease = s
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "fine")
        .unwrap()
        .wait(Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(lease.to_vec(0, PAGE).unwrap(), buf.to_vec(0, PAGE).unwrap());
}

#[tokio::test(start_paused = true)]
async fn stalled_stream_blocks_its_queue_but_not_other_streams() {
    let dev = SimDevice::new(SimConfig::new(2).with_latency(Duration::from_millis(5))).unwrap();
    dev.inject(FaultRule {
        fault: Fault::Stall,
        trigger: Trigger::Next,
    })
    .unwrap();
    let a = arena(4);
    let buf = filled(&dev, PAGE, 4);
    let stalled = stream(&dev, "stalled");
    let healthy = stream(&dev, "healthy");
    let mut dst = a.try_alloc(1).unwrap();
    dst.write_at(0, &[0xEE; PAGE]).unwrap();
    let p1 = stalled.copy_d2h(&buf, 0, dst, 0, PAGE, "stalled-1").unwrap();
    let p2 = stalled
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "stalled-2")
        .unwrap();
    let (e1, e2) = (p1.event().clone(), p2.event().clone());
    let ok = healthy
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "healthy")
        .unwrap();
    let deadline = Instant::now() + Duration::from_millis(100);
    let lease = ok.wait(deadline).await.unwrap();
    assert_eq!(lease.to_vec(0, 16).unwrap(), buf.to_vec(0, 16).unwrap());
    assert!(matches!(p1.wait(deadline).await, Err(DeviceError::Timeout { .. })));
    assert!(
        matches!(p2.wait(deadline).await, Err(DeviceError::Timeout { .. })),
        "queued behind the stall"
    );
    assert_eq!(a.stats().quarantined_pages, 2);
    check(&a);
    dev.release_stuck();
    e2.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
    assert!(e1.is_complete(), "stream order");
    assert_eq!(a.stats().quarantined_pages, 0);
    drop(lease);
    assert_eq!(a.stats().free_pages, 4);
}

#[tokio::test(start_paused = true)]
async fn slow_device_follows_latency_and_bandwidth() {
    // 1 MiB/s and 10 ms latency: 512 KiB takes 510 ms on the (paused) tokio clock.
    let dev = SimDevice::new(
        SimConfig::new(0)
            .with_latency(Duration::from_millis(10))
            .with_bandwidth(1 << 20),
    )
    .unwrap();
    let a = Arena::new(ArenaConfig::new(64 << 10, 8).unpinned()).unwrap();
    let buf = filled(&dev, 512 << 10, 5);
    let s = stream(&dev, "copy");
    let t0 = Instant::now();
    let lease = s
        .copy_d2h(&buf, 0, a.try_alloc(8).unwrap(), 0, 512 << 10, "timed")
        .unwrap()
        .wait(t0 + Duration::from_secs(60))
        .await
        .unwrap();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(510) && took < Duration::from_millis(520),
        "{took:?}"
    );
    assert_eq!(lease.to_vec(0, 512 << 10).unwrap(), buf.to_vec(0, 512 << 10).unwrap());

    // A slow operation takes its factor times longer.
    dev.inject(FaultRule {
        fault: Fault::Slow(4),
        trigger: Trigger::Next,
    })
    .unwrap();
    let t1 = Instant::now();
    let _ = s
        .copy_d2h(&buf, 0, lease, 0, 512 << 10, "slowed")
        .unwrap()
        .wait(t1 + Duration::from_secs(60))
        .await
        .unwrap();
    let took = t1.elapsed();
    assert!(
        took >= Duration::from_millis(2040) && took < Duration::from_millis(2060),
        "{took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn deadline_is_measured_from_the_operation_submission() {
    let dev = SimDevice::new(SimConfig::new(5).with_latency(Duration::from_millis(800))).unwrap();
    let a = arena(2);
    let buf = filled(&dev, PAGE, 6);
    let s = stream(&dev, "copy");
    // A long earlier step does not eat the budget of a later operation.
    let step_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = s
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "late-op")
        .unwrap();
    let lease = p.wait_for(Duration::from_secs(1)).await.unwrap();
    assert!(step_start.elapsed() > Duration::from_secs(3));
    drop(lease);

    // Nor does waiting later extend it: the deadline stays submission + timeout.
    let dev = SimDevice::new(SimConfig::new(5).with_latency(Duration::from_secs(2))).unwrap();
    let buf = filled(&dev, PAGE, 7);
    let s = stream(&dev, "copy");
    let p = s
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "slow-op")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let called = Instant::now();
    match p.wait_for(Duration::from_secs(1)).await {
        Err(DeviceError::Timeout { waited, rank: 5, .. }) => assert_eq!(waited, Duration::from_secs(1)),
        other => panic!("expected timeout, got {other:?}"),
    }
    assert_eq!(called.elapsed(), Duration::from_millis(500));
}

#[tokio::test(start_paused = true)]
async fn dropped_wait_quarantines_until_the_device_completes() {
    let dev = SimDevice::new(SimConfig::new(4).with_fault(Fault::NeverComplete, Trigger::Next)).unwrap();
    let a = arena(2);
    let buf = filled(&dev, PAGE, 10);
    let s = stream(&dev, "copy");
    let p = s
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "abandoned")
        .unwrap();
    let ev = p.event().clone();
    // The caller gives up by dropping the wait (an outer timeout cancels it).
    let outer = tokio::time::timeout(
        Duration::from_millis(10),
        p.wait(Instant::now() + Duration::from_secs(60)),
    )
    .await;
    assert!(outer.is_err());
    assert_eq!(a.stats().quarantined_pages, 1);
    check(&a);
    // Dropping an un-awaited handle does the same.
    let p2 = s
        .copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "never awaited")
        .unwrap();
    drop(p2);
    assert_eq!(a.stats().quarantined_pages, 2);
    dev.release_stuck();
    s.record("after")
        .unwrap()
        .wait(Instant::now() + Duration::from_secs(1))
        .await
        .unwrap();
    assert!(ev.is_complete());
    assert_eq!(a.stats().free_pages, 2);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn h2d_lands_bytes_and_stream_waits_order_work() {
    let dev = SimDevice::new(SimConfig::new(0).with_latency(Duration::from_millis(3))).unwrap();
    let a = arena(2);
    let dst = dev.alloc(PAGE).unwrap();
    let mut lease = a.try_alloc(1).unwrap();
    lease.write_at(0, &[0x5A; PAGE]).unwrap();
    let main = stream(&dev, "main");
    let copy = stream(&dev, "copy");
    // The copy stream waits for the main stream, which is stalled.
    dev.inject(FaultRule {
        fault: Fault::Stall,
        trigger: Trigger::Next,
    })
    .unwrap();
    let gate = copy.wait_stream(&main, "main done").unwrap();
    let p = copy.copy_h2d(lease, 0, &dst, 0, PAGE, "land").unwrap();
    let ev = p.event().clone();
    assert!(matches!(
        ev.wait(Instant::now() + Duration::from_millis(50)).await,
        Err(DeviceError::Timeout { .. })
    ));
    assert_eq!(
        dst.to_vec(0, 4).unwrap(),
        vec![0; 4],
        "nothing landed before the main stream finished"
    );
    dev.release_stuck();
    let lease = p.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
    assert!(gate.is_complete());
    assert_eq!(dst.to_vec(0, PAGE).unwrap(), vec![0x5A; PAGE]);
    drop(lease);
    assert_eq!(a.stats().free_pages, 2);
}

#[test]
fn sim_device_outside_a_runtime_is_an_error_and_blocking_waits_work() {
    assert!(matches!(
        SimDevice::new(SimConfig::new(0)),
        Err(DeviceError::InvalidArgument(_))
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dev = SimDevice::with_runtime(
        SimConfig::new(6).with_latency(Duration::from_millis(20)),
        rt.handle().clone(),
    )
    .unwrap();
    let a = arena(2);
    let buf = filled(&dev, PAGE, 13);
    let s = stream(&dev, "copy");
    // A synchronous caller (no runtime on this thread) waits with a std deadline.
    let p = s.copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, PAGE, "sync").unwrap();
    let lease = p
        .wait_blocking(std::time::Instant::now() + Duration::from_secs(30))
        .unwrap();
    assert_eq!(lease.to_vec(0, PAGE).unwrap(), buf.to_vec(0, PAGE).unwrap());
    dev.inject(FaultRule {
        fault: Fault::NeverComplete,
        trigger: Trigger::Next,
    })
    .unwrap();
    let p = s.copy_d2h(&buf, 0, lease, 0, PAGE, "sync stuck").unwrap();
    let t0 = std::time::Instant::now();
    let err = p.wait_blocking(t0 + Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, DeviceError::Timeout { rank: 6, .. }), "{err}");
    assert!(t0.elapsed() >= Duration::from_millis(50));
    assert_eq!(a.stats().quarantined_pages, 1);
    dev.release_stuck();
    s.record("flush")
        .unwrap()
        .wait_blocking(std::time::Instant::now() + Duration::from_secs(30))
        .unwrap();
    assert_eq!(a.stats().free_pages, 2);
}

/// A device KV cache keeps copying when one of its copies never completes: later
/// scatters go to other streams of its pool (at most `MAX_STREAMS`) instead of queueing
/// behind the stuck one, and only the stuck one's wait times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_copy_does_not_hold_the_caches_other_copies() {
    use kvferry::device::DeviceKvCache;
    let dev = SimDevice::new(SimConfig::new(0).with_latency(Duration::from_micros(100))).unwrap();
    let d: Arc<dyn Device> = dev.clone();
    let buf = d.alloc(PAGE * 16).unwrap();
    let cache = DeviceKvCache::contiguous("kv", d, buf.clone(), PAGE, Duration::from_millis(300)).unwrap();
    let a = arena(16);
    dev.inject(FaultRule {
        fault: Fault::NeverComplete,
        trigger: Trigger::Next,
    })
    .unwrap();
    let scatter = |block: usize, byte: u8| {
        let mut lease = a.try_alloc(1).unwrap();
        lease.write_at(0, &[byte; PAGE]).unwrap();
        cache
            .scatter(lease, &[(0, vec![(block * PAGE, PAGE)])], "land")
            .unwrap()
    };
    let stuck = scatter(0, 1);
    let mut later = Vec::new();
    for i in 1..(2 * kvferry::device::KV_CACHE_MAX_STREAMS + 1) {
        later.push(scatter(i, i as u8 + 1));
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    for (i, p) in later.into_iter().enumerate() {
        let lease = p
            .wait(deadline)
            .await
            .unwrap_or_else(|e| panic!("copy {} behind the stuck one: {e}", i + 1));
        drop(lease);
        assert_eq!(buf.to_vec((i + 1) * PAGE, 4).unwrap(), vec![i as u8 + 2; 4]);
    }
    assert!(cache.streams() >= 2 && cache.streams() <= kvferry::device::KV_CACHE_MAX_STREAMS);
    assert!(matches!(
        stuck.wait(Instant::now() + Duration::from_millis(400)).await,
        Err(DeviceError::Timeout { .. })
    ));
    check(&a);
    dev.release_stuck();
}
