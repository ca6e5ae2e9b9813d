//! The host backend: device memory is host memory, copies run on the copy engine.
//! Round trips verify bytes; gates (manual events) make operations pending without
//! timing assumptions.

use std::sync::Arc;
use std::time::Duration;

use kvferry::copy::{CopyBody, CopyConfig, CopyEngine, MemcpyBody, SliceWork};
use kvferry::device::{Device, DeviceError, Event, GatherSegment, HostDevice};
use kvferry::mem::{Arena, ArenaConfig, Region};
use tokio::time::Instant;

fn engine() -> CopyEngine {
    CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 256 << 10,
    })
    .unwrap()
}

fn check(a: &Arena) {
    let s = a.stats();
    assert_eq!(
        s.free_pages + s.leased_pages + s.quarantined_pages,
        s.total_pages,
        "{s:?}"
    );
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + i / 4096) as u8) ^ seed).collect()
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2h_then_h2d_round_trip_preserves_bytes() {
    let dev = HostDevice::new(engine(), 0).unwrap();
    let len = 3 << 20;
    let page = 64 << 10;
    let a = Arena::new(ArenaConfig::new(page, len / page + 2).unpinned()).unwrap();
    // Scatter the lease: page 0 goes to the back of the free list, page 1 stays held,
    // so the lease is pages 2.. followed by page 0.
    let first = a.try_alloc(1).unwrap();
    let keep = a.try_alloc(1).unwrap();
    drop(first);
    let src = dev.alloc(len).unwrap();
    let data = pattern(len, 0x3C);
    src.write(0, &data).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let lease = s
        .copy_d2h(&src, 0, a.try_alloc(len / page + 1).unwrap(), 0, len, "d2h")
        .unwrap()
        .wait(far())
        .await
        .unwrap();
    assert_eq!(lease.to_vec(0, len).unwrap(), data);
    let dst = dev.alloc(len).unwrap();
    let lease = s
        .copy_h2d(lease, 0, &dst, 0, len, "h2d")
        .unwrap()
        .wait(far())
        .await
        .unwrap();
    assert_eq!(dst.to_vec(0, len).unwrap(), data);
    drop((lease, keep));
    assert_eq!(a.stats().free_pages, a.stats().total_pages);
    check(&a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_from_several_buffers_and_a_registered_region() {
    let dev = HostDevice::new(engine(), 1).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 8).unpinned()).unwrap();
    let b1 = dev.alloc(10_000).unwrap();
    b1.write(0, &pattern(10_000, 1)).unwrap();
    let region = Arc::new(Region::host("engine-kv", 5000).unwrap());
    region.write(0, &pattern(5000, 2)).unwrap();
    let b2 = dev.wrap_region(region.clone());
    let segs = [
        GatherSegment {
            src: b1.slice(100, 3000),
            dst_offset: 0,
        },
        GatherSegment {
            src: b2.slice(0, 5000),
            dst_offset: 3000,
        },
        GatherSegment {
            src: b1.slice(9000, 1000),
            dst_offset: 8000,
        },
    ];
    let s = dev.create_stream("copy").unwrap();
    let lease = s
        .copy_d2h_gather(&segs, a.try_alloc(3).unwrap(), "gather")
        .unwrap()
        .wait(far())
        .await
        .unwrap();
    assert_eq!(lease.to_vec(0, 3000).unwrap(), &pattern(10_000, 1)[100..3100]);
    assert_eq!(lease.to_vec(3000, 5000).unwrap(), region.to_vec(0, 5000).unwrap());
    assert_eq!(lease.to_vec(8000, 1000).unwrap(), &pattern(10_000, 1)[9000..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gated_copy_times_out_quarantined_and_is_released_when_it_completes() {
    let dev = HostDevice::new(engine(), 2).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 4).unpinned()).unwrap();
    let buf = dev.alloc(8192).unwrap();
    buf.write(0, &[0xAB; 8192]).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let (gate, trigger) = Event::manual("main stream", 2);
    s.wait_event(&gate).unwrap();
    let p = s.copy_d2h(&buf, 0, a.try_alloc(2).unwrap(), 0, 8192, "gated").unwrap();
    let ev = p.event().clone();
    let err = p.wait(Instant::now() + Duration::from_millis(50)).await.unwrap_err();
    assert!(
        matches!(&err, DeviceError::Timeout { op, rank: 2, .. } if op == "gated"),
        "{err}"
    );
    assert_eq!(a.stats().quarantined_pages, 2);
    check(&a);
    trigger.complete();
    ev.wait(far()).await.unwrap();
    assert_eq!(a.stats().quarantined_pages, 0);
    assert_eq!(a.stats().free_pages, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_engine_copy_is_typed_and_returns_the_lease() {
    struct FailSecond;
    impl CopyBody for FailSecond {
        fn run(&self, work: &SliceWork<'_>) -> Result<(), String> {
            if work.index == 1 {
                return Err("simulated DMA error".into());
            }
            MemcpyBody.run(work)
        }
    }
    let engine = CopyEngine::with_body(
        CopyConfig {
            threads: 2,
            slice_bytes: 4096,
        },
        Arc::new(FailSecond),
    )
    .unwrap();
    let dev = HostDevice::new(engine, 3).unwrap();
    let len = 4 << 20;
    let a = Arena::new(ArenaConfig::new(1 << 20, 4).unpinned()).unwrap();
    let buf = dev.alloc(len).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let err = s
        .copy_d2h(&buf, 0, a.try_alloc(4).unwrap(), 0, len, "bad dma")
        .unwrap()
        .wait(far())
        .await
        .unwrap_err();
    match err {
        DeviceError::CopyFailed { op, rank: 3, message } => {
            assert_eq!(op, "bad dma");
            assert!(message.contains("simulated DMA error"), "{message}");
        }
        other => panic!("expected CopyFailed, got {other}"),
    }
    let st = a.stats();
    assert_eq!((st.free_pages, st.quarantined_pages), (4, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_waits_from_a_sync_thread() {
    let dev = HostDevice::new(engine(), 4).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 2).unpinned()).unwrap();
    let buf = dev.alloc(4096).unwrap();
    buf.write(0, &[9; 4096]).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let p = s.copy_d2h(&buf, 0, a.try_alloc(1).unwrap(), 0, 4096, "sync").unwrap();
    let lease =
        tokio::task::spawn_blocking(move || p.wait_blocking(std::time::Instant::now() + Duration::from_secs(60)))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(lease.to_vec(0, 4096).unwrap(), vec![9; 4096]);
    let (gate, trigger) = Event::manual("gate", 4);
    s.wait_event(&gate).unwrap();
    let ev = s.record("after gate").unwrap();
    let waiter = {
        let ev = ev.clone();
        tokio::task::spawn_blocking(move || ev.wait_blocking(std::time::Instant::now() + Duration::from_secs(60)))
    };
    let timed = ev.clone();
    let timed_out =
        tokio::task::spawn_blocking(move || timed.wait_blocking(std::time::Instant::now() + Duration::from_millis(20)));
    assert!(matches!(timed_out.await.unwrap(), Err(DeviceError::Timeout { .. })));
    trigger.complete();
    waiter.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_copies_on_many_streams() {
    let dev = HostDevice::new(engine(), 5).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 64).unpinned()).unwrap();
    let mut tasks = Vec::new();
    for i in 0..8u8 {
        let dev = dev.clone();
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            let s = dev.create_stream(&format!("s{i}")).unwrap();
            let buf = dev.alloc(16384).unwrap();
            for round in 0..10u8 {
                let data = pattern(16384, i ^ round);
                buf.write(0, &data).unwrap();
                let lease = a.alloc(4, far()).await.unwrap();
                let lease = s
                    .copy_d2h(&buf, 0, lease, 0, 16384, "c")
                    .unwrap()
                    .wait(far())
                    .await
                    .unwrap();
                assert_eq!(lease.to_vec(0, 16384).unwrap(), data);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(a.stats().free_pages, 64);
}

#[tokio::test]
async fn host_device_rejects_foreign_buffers() {
    let d1 = HostDevice::new(engine(), 0).unwrap();
    let d2 = HostDevice::new(engine(), 1).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 1).unpinned()).unwrap();
    let b2 = d2.alloc(4096).unwrap();
    let s1 = d1.create_stream("s").unwrap();
    let err = s1.copy_d2h(&b2, 0, a.try_alloc(1).unwrap(), 0, 4096, "x").unwrap_err();
    assert!(matches!(err, DeviceError::InvalidArgument(_)), "{err}");
    assert_eq!(a.stats().free_pages, 1);
}
