//! The device-IPC mover over real CUDA IPC: two processes, one GPU. The parent spawns
//! this test binary again as the producer (`cuda_ipc_producer_child`), which publishes
//! a device cache of cuda:0 and prints its address; the parent pulls the chunk into
//! its own device cache of cuda:0, by `cuIpcOpenMemHandle` + `cuMemcpyDtoDAsync` on
//! its own stream, and compares every byte read back from the device; then a selected
//! get (half of one block, as heterogeneous TP takes a head slice) by the same mover,
//! only the selected bytes written.
//!
//! **Never run on a GPU yet.** It skips, saying why, without a CUDA device or without
//! `KVFERRY_CUDA_IPC=1` (the consumer offers CUDA IPC only then; `scripts/gpu-check.sh`
//! sets it).
#![cfg(feature = "cuda")]

mod common;

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use common::child::{line_after, spawn_self_test};
use kvferry::device::{CudaDevice, Device, DeviceError, DeviceKvCache};
use kvferry::engine::{Engine, EngineConfig, Selection};
use kvferry::peer::Destination;
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

const BLOCK: usize = 1 << 20;
const BLOCKS: u32 = 16;
const CHILD: &str = "KVFERRY_CUDA_IPC_CHILD";

fn open() -> Result<Arc<CudaDevice>, String> {
    match CudaDevice::open(0, 0) {
        Ok(d) => Ok(d),
        Err(DeviceError::NoDevice(why)) => Err(format!("no CUDA device ({why})")),
        Err(e) => panic!("opening a CUDA device failed with a non-NoDevice error: {e}"),
    }
}

fn pattern(b: u32) -> Vec<u8> {
    (0..BLOCK).map(|i| (i as u32 * 13 + b * 101 + 7) as u8).collect()
}

fn cache(dev: &Arc<CudaDevice>, name: &str) -> Arc<DeviceKvCache> {
    let d: Arc<dyn Device> = dev.clone();
    let buf = d.alloc(BLOCK * BLOCKS as usize).unwrap();
    Arc::new(DeviceKvCache::contiguous(name, d, buf, BLOCK, Duration::from_secs(10)).unwrap())
}

/// The producer half, run only as the parent's child process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_producer_child() {
    if std::env::var(CHILD).is_err() {
        return; // only meaningful as the child of `cuda_ipc_two_processes_one_gpu`
    }
    let dev = open().expect("the parent saw a CUDA device");
    let src = cache(&dev, "prefill-kv");
    for b in 0..BLOCKS {
        src.buffers()[0].write(b as usize * BLOCK, &pattern(b)).unwrap();
    }
    let engine = Engine::start(EngineConfig::default().listen(Some("127.0.0.1:0")))
        .await
        .unwrap();
    let reg = engine.register(src.clone()).unwrap();
    engine
        .publish(
            ChunkKey::from_name("cuda-ipc"),
            &reg,
            &[2, 3, 4, 5],
            Duration::ZERO,
            false,
        )
        .unwrap();
    println!("ADDR {}", engine.address().unwrap());
    // Serve until the parent closes our stdin.
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
    })
    .await
    .unwrap();
    assert!(engine.close(Instant::now() + Duration::from_secs(10)).await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_two_processes_one_gpu() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let dev = match open() {
        Ok(d) => d,
        Err(why) => return eprintln!("skipped: {why}"),
    };
    if std::env::var("KVFERRY_CUDA_IPC").as_deref() != Ok("1") {
        return eprintln!("skipped: KVFERRY_CUDA_IPC=1 is not set (scripts/gpu-check.sh sets it)");
    }
    let (mut child, mut lines) = spawn_self_test("cuda_ipc_producer_child", CHILD);
    let addr = line_after(&mut lines, "ADDR ", "its address");
    let dst = cache(&dev, "decode-kv");
    let engine = Engine::start(EngineConfig::default().listen(None)).await.unwrap();
    let landed = engine
        .get(
            &addr,
            &[ChunkKey::from_name("cuda-ipc")],
            Destination::new(dst.clone(), vec![vec![8, 9, 10, 11]]),
            Instant::now() + Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(landed.bytes, 4 * BLOCK);
    for (i, b) in [2u32, 3, 4, 5].iter().enumerate() {
        let got = dst.buffers()[0].to_vec((8 + i) * BLOCK, BLOCK).unwrap();
        assert!(got == pattern(*b), "block {b} differs after the device-to-device copy");
    }
    let stats = engine.stats();
    assert_eq!(
        stats.consumer.device_ipc_transfers, 1,
        "{:?} {:?}",
        stats.consumer, stats.movers
    );
    assert_eq!(dst.imports_open(), (1, 1));
    // A selected get: the second half of the publication's second block (block 3)
    // into the first half of block 12; the rest of block 12 untouched.
    let before = dst.buffers()[0].to_vec(12 * BLOCK, BLOCK).unwrap();
    let half = BLOCK / 2;
    let select = Selection::new(Some(vec![1]), Some(vec![(half, half)]), Some(vec![(0, half)])).unwrap();
    let landed = engine
        .get(
            &addr,
            &[ChunkKey::from_name("cuda-ipc")],
            Destination::new(dst.clone(), vec![vec![12]]).with_selection(Some(select)),
            Instant::now() + Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(landed.bytes, half);
    let got = dst.buffers()[0].to_vec(12 * BLOCK, BLOCK).unwrap();
    assert!(got[..half] == pattern(3)[half..], "the selected half differs");
    assert!(
        got[half..] == before[half..],
        "bytes outside the selection were written"
    );
    assert_eq!(
        engine.stats().consumer.device_ipc_transfers,
        2,
        "the selected get went another way"
    );
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success(), "the producer failed");
    assert!(engine.close(Instant::now() + Duration::from_secs(10)).await.is_clean());
}
