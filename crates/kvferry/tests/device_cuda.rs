//! The CUDA backend. Built with `--features cuda`; every test that needs a GPU prints
//! "skipped: no CUDA device" and returns where there is none (no driver library, no
//! GPU) — opening a device there must be a clean `NoDevice` error, never a panic.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{
    cuda_device_count, cuda_pinned_arena, cuda_pinned_backing, AsyncOutput, CudaDevice, Device, DeviceError, Event,
};
use kvferry::mem::{Arena, ArenaConfig, BackingKind};
use tokio::time::Instant;

fn open() -> Option<Arc<CudaDevice>> {
    match CudaDevice::open(0, 0) {
        Ok(d) => Some(d),
        Err(DeviceError::NoDevice(why)) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Err(e) => panic!("opening a CUDA device failed with a non-NoDevice error: {e}"),
    }
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

#[test]
fn no_device_is_a_clean_error() {
    match cuda_device_count() {
        Ok(n) => {
            let err = CudaDevice::open(n + 7, 0).unwrap_err();
            assert!(matches!(err, DeviceError::NoDevice(_)), "{err}");
        }
        Err(e) => {
            assert!(matches!(e, DeviceError::NoDevice(_)), "{e}");
            assert!(matches!(CudaDevice::open(0, 0), Err(DeviceError::NoDevice(_))));
            eprintln!("skipped: no CUDA device ({e})");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2h_and_h2d_round_trip_through_pinned_pages() {
    let Some(dev) = open() else { return };
    let len = 8 << 20;
    let arena = cuda_pinned_arena(&dev, 2 << 20, 8).unwrap();
    assert_eq!(arena.backing_kind(), BackingKind::CudaHost);
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    let src = dev.alloc(len).unwrap();
    src.write(0, &data).unwrap();
    let s = dev.create_stream("copy").unwrap();
    let lease = s
        .copy_d2h(&src, 0, arena.try_alloc(4).unwrap(), 0, len, "d2h")
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
    drop(lease);
    assert_eq!(arena.stats().free_pages, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpinned_arena_and_gathered_async_output() {
    let Some(dev) = open() else { return };
    let arena = Arena::new(ArenaConfig::new(4096, 4).unpinned()).unwrap();
    let a = dev.alloc(3000).unwrap();
    a.write(0, &[1; 3000]).unwrap();
    let b = dev.alloc(7000).unwrap();
    b.write(0, &[2; 7000]).unwrap();
    let main = dev.create_stream("main").unwrap();
    let copy = dev.create_stream("output").unwrap();
    let out = AsyncOutput::start(
        &main,
        &copy,
        &[a.whole(), b.slice(1000, 5000)],
        arena.try_alloc(3).unwrap(),
        "output",
    )
    .unwrap();
    let ids = (out.event().id(), out.main_event().id());
    assert_ne!(ids.0, ids.1);
    let bytes = out.get_for(Duration::from_secs(30)).await.unwrap();
    assert_eq!(bytes.part(0).unwrap(), vec![1; 3000]);
    assert_eq!(bytes.part(1).unwrap(), vec![2; 5000]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_wait_bounded_and_blocking() {
    let Some(dev) = open() else { return };
    let s = dev.create_stream("s").unwrap();
    let e1 = s.record("r1").unwrap();
    let e2 = s.record("r2").unwrap();
    assert_ne!(e1.id(), e2.id(), "fresh event per operation");
    e1.wait(far()).await.unwrap();
    let e2b = e2.clone();
    tokio::task::spawn_blocking(move || e2b.wait_blocking(std::time::Instant::now() + Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        e1.wait_for(Duration::ZERO).await,
        Err(DeviceError::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_gate_holds_a_stream_bounded_wait_then_late_release() {
    let Some(dev) = open() else { return };
    let arena = Arena::new(ArenaConfig::new(4096, 2).unpinned()).unwrap();
    let buf = dev.alloc(4096).unwrap();
    buf.write(0, &[0x77; 4096]).unwrap();
    let s = dev.create_stream("gated").unwrap();
    let (gate, trigger) = Event::manual("host gate", 0);
    s.wait_event(&gate).unwrap();
    let p = s
        .copy_d2h(&buf, 0, arena.try_alloc(1).unwrap(), 0, 4096, "gated d2h")
        .unwrap();
    let ev = p.event().clone();
    let err = p.wait(Instant::now() + Duration::from_millis(100)).await.unwrap_err();
    assert!(
        matches!(&err, DeviceError::Timeout { op, rank: 0, .. } if op == "gated d2h"),
        "{err}"
    );
    assert_eq!(arena.stats().quarantined_pages, 1);
    trigger.complete();
    ev.wait(far()).await.unwrap();
    // The reaper thread releases the pages shortly after it sees the completion.
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while arena.stats().quarantined_pages > 0 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(arena.stats().free_pages, 2);
}

#[test]
fn pinned_backing_is_cuda_host_memory() {
    let Some(dev) = open() else { return };
    let b = cuda_pinned_backing(&dev, 1 << 20).unwrap();
    assert_eq!(b.kind(), BackingKind::CudaHost);
    assert!(b.fallback_reason().is_none());
    let arena = Arena::with_backing(b, 64 << 10);
    assert_eq!(arena.page_count(), 16);
    assert!(matches!(
        cuda_pinned_arena(&dev, 1000, 4),
        Err(DeviceError::InvalidArgument(_))
    ));
}
