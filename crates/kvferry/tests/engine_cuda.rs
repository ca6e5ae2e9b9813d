//! GPU → peer → GPU through the engine, over loopback, on a CUDA device: device blocks
//! gathered into CUDA-pinned staging pages, sent, received into pinned pages, and
//! scattered into another device buffer, every byte compared. Built with
//! `--features cuda`; prints "skipped: no CUDA device" and returns where there is none.
//! `scripts/gpu-check.sh` runs it with the other CUDA tests.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{cuda_pinned_arena, CudaDevice, Device, DeviceError, DeviceKvCache};
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
    for i in 0..chunks {
        let blocks: Vec<u32> = (i * PER_CHUNK..(i + 1) * PER_CHUNK).collect();
        p.publish_device(
            ChunkKey::from_name(&format!("c{i}")),
            &src,
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
                Destination::device(dst, vec![blocks]),
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
