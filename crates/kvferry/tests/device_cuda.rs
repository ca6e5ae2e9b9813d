//! The CUDA backend. Built with `--features cuda`; every test that needs a GPU prints
//! "skipped: no CUDA device" and returns where there is none (no driver library, no
//! GPU) — opening a device there must be a clean `NoDevice` error, never a panic.
//! The generic device suite (`common/device_suite.rs`) runs here with pinned arenas,
//! plus what only CUDA has: pinned backing, the async-output gather.
#![cfg(feature = "cuda")]

#[path = "common/device_suite.rs"]
mod device_suite;

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{
    cuda_device_count, cuda_pinned_arena, cuda_pinned_backing, AsyncOutput, CudaDevice, Device, DeviceError,
};
use kvferry::mem::{Arena, ArenaConfig, BackingKind};

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

/// A second handle (another rank) on the same GPU: its buffers are foreign to `open()`'s.
fn other() -> Option<Arc<CudaDevice>> {
    CudaDevice::open(0, 1).ok()
}

fn arena(dev: &Arc<CudaDevice>, page: usize, pages: usize) -> Arena {
    let a = cuda_pinned_arena(dev, page, pages).unwrap();
    assert_eq!(a.backing_kind(), BackingKind::CudaHost);
    a
}

device_suite::device_suite!();

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
