//! The host backend: device memory is host memory, copies run on the copy engine.
//! The generic device suite (`common/device_suite.rs`) runs here, plus what only the
//! host backend has: registered regions as device buffers, copy-engine failures.

#[path = "common/device_suite.rs"]
mod device_suite;

use std::sync::Arc;
use std::time::Duration;

use kvferry::copy::{CopyBody, CopyConfig, CopyEngine, MemcpyBody, SliceWork};
use kvferry::device::{Device, DeviceError, HostDevice};
use kvferry::mem::{Arena, ArenaConfig, Region};
use tokio::time::Instant;

fn engine() -> CopyEngine {
    CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 256 << 10,
    })
    .unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + i / 4096) as u8) ^ seed).collect()
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

fn open() -> Option<Arc<HostDevice>> {
    Some(HostDevice::new(engine(), 0).unwrap())
}

fn other() -> Option<Arc<HostDevice>> {
    Some(HostDevice::new(engine(), 1).unwrap())
}

fn arena(_: &Arc<HostDevice>, page: usize, pages: usize) -> Arena {
    Arena::new(ArenaConfig::new(page, pages).unpinned()).unwrap()
}

device_suite::device_suite!();

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_from_several_buffers_and_a_registered_region() {
    let dev = HostDevice::new(engine(), 1).unwrap();
    let a = Arena::new(ArenaConfig::new(4096, 8).unpinned()).unwrap();
    let b1 = dev.alloc(10_000).unwrap();
    b1.write(0, &pattern(10_000, 1)).unwrap();
    let region = Arc::new(Region::host("engine-kv", 5000).unwrap());
    region.write(0, &pattern(5000, 2)).unwrap();
    let b2 = dev.wrap_region(region.clone());
    let lease = device_suite::gather_three_segments(dev.as_ref(), &a, &b1, &b2).await;
    assert_eq!(lease.to_vec(0, 3000).unwrap(), &pattern(10_000, 1)[100..3100]);
    assert_eq!(lease.to_vec(3000, 5000).unwrap(), region.to_vec(0, 5000).unwrap());
    assert_eq!(lease.to_vec(8000, 1000).unwrap(), &pattern(10_000, 1)[9000..]);
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
