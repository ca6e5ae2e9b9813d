//! GPU → peer → GPU through the engine, over loopback, on a CUDA device: device blocks
//! gathered into CUDA-pinned staging pages, sent, received into pinned pages, and
//! scattered into another device buffer, every byte compared; and the same through
//! external device memory (`CudaDevice::wrap_external`: memory another library
//! allocated, kept alive by an owner), with host memory and out-of-range pointers
//! refused. Built with
//! `--features cuda`; prints "skipped: no CUDA device" and returns where there is none.
//! `scripts/gpu-check.sh` runs it with the other CUDA tests.
#![cfg(feature = "cuda")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{
    cuda_pinned_arena, cuda_pinned_backing, CudaDevice, Device, DeviceBuffer, DeviceError, DeviceKvCache,
};
use kvferry::engine::{Engine, EngineConfig};
use kvferry::peer::Destination;
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

fn open(rank: u32) -> Option<Arc<CudaDevice>> {
    match CudaDevice::open(0, rank) {
        Ok(d) => Some(d),
        Err(DeviceError::NoDevice(why)) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Err(e) => panic!("opening a CUDA device failed with a non-NoDevice error: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_to_peer_to_gpu_over_loopback() {
    let Some(dev) = open(0) else { return };
    const BLOCK: usize = 2 << 20; // llama3-8b: 2 MiB per block across layers
    const BLOCKS: u32 = 256; // 512 MiB on each side
    const PER_CHUNK: u32 = 4;
    let staging = |pages| cuda_pinned_arena(&dev, 2 << 20, pages).unwrap();
    let mut pc = EngineConfig::default().listen(Some("127.0.0.1:0"));
    pc.staging = Some(staging(64));
    let mut cc = EngineConfig::default().listen(None);
    cc.staging = Some(staging(64));
    let (p, c) = (Engine::start(pc).await.unwrap(), Engine::start(cc).await.unwrap());
    let d: Arc<dyn Device> = dev.clone();
    let src_buf = d.alloc(BLOCK * BLOCKS as usize).unwrap();
    let dst_buf = d.alloc(BLOCK * BLOCKS as usize).unwrap();
    let data: Vec<u8> = (0..BLOCK * BLOCKS as usize)
        .map(|i| (i * 13 + i / 4093) as u8)
        .collect();
    src_buf.write(0, &data).unwrap();
    let t = Duration::from_secs(10);
    let src = Arc::new(DeviceKvCache::contiguous("src", d.clone(), src_buf, BLOCK, t).unwrap());
    let dst = Arc::new(DeviceKvCache::contiguous("dst", d.clone(), dst_buf.clone(), BLOCK, t).unwrap());
    let addr = p.address().unwrap().to_string();
    let chunks = BLOCKS / PER_CHUNK;
    let reg = p.register(src.clone()).unwrap();
    for i in 0..chunks {
        let blocks: Vec<u32> = (i * PER_CHUNK..(i + 1) * PER_CHUNK).collect();
        p.publish(
            ChunkKey::from_name(&format!("c{i}")),
            &reg,
            &blocks,
            Duration::ZERO,
            true,
        )
        .unwrap();
    }
    let started = std::time::Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..chunks {
        let (c, addr, dst) = (c.clone(), addr.clone(), dst.clone());
        // Chunk i lands in the mirrored position: last chunk first.
        let first = (chunks - 1 - i) * PER_CHUNK;
        set.spawn(async move {
            let blocks: Vec<u32> = (first..first + PER_CHUNK).collect();
            let key = ChunkKey::from_name(&format!("c{i}"));
            c.get(
                &addr,
                &[key],
                Destination::new(dst, vec![blocks]),
                Instant::now() + Duration::from_secs(60),
            )
            .await
            .map_err(|f| f.error.to_string())
        });
        if set.len() >= 8 {
            assert_eq!(set.join_next().await.unwrap().unwrap().unwrap().chunks, 1);
        }
    }
    while let Some(r) = set.join_next().await {
        assert_eq!(r.unwrap().unwrap().chunks, 1);
    }
    let secs = started.elapsed().as_secs_f64();
    let bytes = BLOCK as f64 * BLOCKS as f64;
    println!(
        "gpu -> peer -> gpu over loopback: {:.2} GB/s ({} MiB in {:.3} s, device {})",
        bytes / secs / 1e9,
        (bytes as usize) >> 20,
        secs,
        dev.name()
    );
    let chunk_bytes = BLOCK * PER_CHUNK as usize;
    let got = dst_buf.to_vec(0, data.len()).unwrap();
    for i in 0..chunks as usize {
        let want = &data[i * chunk_bytes..(i + 1) * chunk_bytes];
        let at = (chunks as usize - 1 - i) * chunk_bytes;
        assert!(got[at..at + chunk_bytes] == *want, "chunk {i} differs");
    }
    for e in [p, c] {
        let r = e.close(Instant::now() + Duration::from_secs(10)).await;
        assert!(r.is_clean(), "{r:?}");
    }
}

/// Stands for another library's tensor: holds its allocation, notes when it is dropped.
struct Owner {
    _alloc: DeviceBuffer,
    dropped: Arc<AtomicBool>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

/// Wraps `len` bytes at `offset` of a fresh allocation as external memory; the flag turns
/// true when the owner (and with it the allocation) is dropped.
fn external(dev: &Arc<CudaDevice>, offset: usize, len: usize) -> (DeviceBuffer, Arc<AtomicBool>) {
    let alloc = dev.alloc(offset + len).unwrap();
    let ptr = dev.device_ptr(&alloc).expect("a buffer of this device") + offset as u64;
    let dropped = Arc::new(AtomicBool::new(false));
    let owner = Owner {
        _alloc: alloc,
        dropped: dropped.clone(),
    };
    // SAFETY: `ptr..ptr+len` lies in `alloc`, which the owner holds until it is dropped.
    let buf = unsafe { dev.wrap_external(ptr, len, Box::new(owner)) }.unwrap();
    (buf, dropped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_device_memory_to_peer_to_external_device_memory() {
    let Some(dev) = open(0) else { return };
    const BLOCK: usize = 64 << 10;
    const BLOCKS: usize = 32;
    let bytes = BLOCK * BLOCKS;
    let staging = |pages| cuda_pinned_arena(&dev, 1 << 20, pages).unwrap();
    let mut pc = EngineConfig::default().listen(Some("127.0.0.1:0"));
    pc.staging = Some(staging(16));
    let mut cc = EngineConfig::default().listen(None);
    cc.staging = Some(staging(16));
    let (p, c) = (Engine::start(pc).await.unwrap(), Engine::start(cc).await.unwrap());
    // The source starts 4 KiB into its allocation: a tensor view at an offset.
    let (src_buf, src_dropped) = external(&dev, 4096, bytes);
    let (dst_buf, dst_dropped) = external(&dev, 0, bytes);
    assert!(dev.device_ptr(&src_buf).is_some());
    let data: Vec<u8> = (0..bytes).map(|i| (i * 7 + i / 4099) as u8).collect();
    src_buf.write(0, &data).unwrap();
    dst_buf.write(0, &vec![0xee; bytes]).unwrap();
    let d: Arc<dyn Device> = dev.clone();
    let t = Duration::from_secs(10);
    let src = Arc::new(DeviceKvCache::contiguous("src", d.clone(), src_buf.clone(), BLOCK, t).unwrap());
    let dst = Arc::new(DeviceKvCache::contiguous("dst", d.clone(), dst_buf.clone(), BLOCK, t).unwrap());
    let key = ChunkKey::from_name("ext-1");
    let reg = p.register(src.clone()).unwrap();
    p.publish(key, &reg, &[3, 4, 5], Duration::ZERO, true).unwrap();
    let landed = c
        .get(
            &p.address().unwrap().to_string(),
            &[key],
            Destination::new(dst.clone(), vec![vec![10, 11, 12]]),
            Instant::now() + Duration::from_secs(10),
        )
        .await
        .map_err(|f| f.error.to_string())
        .unwrap();
    assert_eq!(landed.chunks, 1);
    let got = dst_buf.to_vec(0, bytes).unwrap();
    assert!(
        got[10 * BLOCK..13 * BLOCK] == data[3 * BLOCK..6 * BLOCK],
        "landed blocks differ"
    );
    assert!(
        got[..10 * BLOCK].iter().all(|&b| b == 0xee),
        "bytes before the blocks were written"
    );
    assert!(
        got[13 * BLOCK..].iter().all(|&b| b == 0xee),
        "bytes after the blocks were written"
    );
    // The `once` publication is released by the Done: the registration lets go.
    p.deregister(&reg, Duration::from_secs(10)).await.unwrap();
    for e in [p, c] {
        let r = e.close(Instant::now() + Duration::from_secs(10)).await;
        assert!(r.is_clean(), "{r:?}");
    }
    // The owners live exactly as long as the buffers and what holds them.
    assert!(!src_dropped.load(Ordering::SeqCst) && !dst_dropped.load(Ordering::SeqCst));
    drop((src, dst, src_buf, dst_buf, reg));
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while !(src_dropped.load(Ordering::SeqCst) && dst_dropped.load(Ordering::SeqCst)) {
        assert!(std::time::Instant::now() < until, "an owner outlived its buffer by 5 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn wrapping_memory_that_is_not_device_memory_is_refused() {
    let Some(dev) = open(0) else { return };
    let refused = |ptr: u64, len: usize, what: &str| {
        // SAFETY: every call below is refused before the buffer could be used.
        match unsafe { dev.wrap_external(ptr, len, Box::new(())) } {
            Err(DeviceError::InvalidArgument(m)) => eprintln!("{what}: refused: {m}"),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    };
    let host = vec![0u8; 1 << 16];
    refused(host.as_ptr() as u64, host.len(), "pageable host memory");
    let pinned = cuda_pinned_backing(&dev, 1 << 16).unwrap();
    refused(pinned.as_ptr() as u64, pinned.len(), "pinned host memory");
    let alloc = dev.alloc(1 << 16).unwrap();
    let ptr = dev.device_ptr(&alloc).unwrap();
    refused(ptr, 0, "zero length");
    refused(0, 4096, "null pointer");
    refused(ptr, 1 << 40, "a range running past the allocation");
    refused(u64::MAX - 10, 4096, "an overflowing range");
    // The allocation itself (and a range inside it) is accepted.
    // SAFETY: `alloc` outlives both wrappers (they are dropped at once).
    assert!(unsafe { dev.wrap_external(ptr, 1 << 16, Box::new(())) }.is_ok());
    // SAFETY: as above.
    assert!(unsafe { dev.wrap_external(ptr + 4096, 4096, Box::new(())) }.is_ok());
}
