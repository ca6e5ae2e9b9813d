//! The same-host device-IPC mover on sim devices, through the engine's front door:
//! the producer's device cache lives in shared memory (`SimConfig::with_shared_memory`),
//! the consumer opens its export once per producer incarnation and copies device to
//! device on its own sim device streams (the two engines share a process here; the
//! kernel checks `/proc/<pid>/fd` opens as for any other process).
//!
//! - bytes land right and the mover is named in stats (`device_ipc_transfers`,
//!   `movers[..].device_ipc`), the export opened once;
//! - a stuck copy (`NeverComplete`) fails on time, and its destination stays reported
//!   busy (fence unfired) until the device confirms;
//! - a failed copy fails only its transfer;
//! - a dropped (cancelled) transfer's fence fires only after its copy settled;
//! - a producer that rewrites its published blocks mid-copy is a checksum error, never
//!   wrong bytes reported landed;
//! - a device-IPC copy takes no staging pages: it lands with the consumer's arena
//!   exhausted, where the staged device path is refused `StagingExhausted`;
//! - a selected get (a subset of blocks, half of every per-layer piece: heterogeneous
//!   TP's head split) lands by device IPC, only the selected ranges copied, the same
//!   bytes as the staged path lands; a selection the producer cannot serve is its
//!   typed `BadSelection`, and the next get still lands;
//! - `transport = tcp` keeps the staged device path;
//! - a producer that restarts (new incarnation, same address) is opened again;
//! - two processes (this test binary re-run as the producer): bytes land from the
//!   other process's shared memory, and a producer SIGKILLed mid-copy is `PeerLost`
//!   at once, its destination busy until the device settles the copy.

mod common;

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use common::child::{line_after, spawn_self_test};
use kvferry::device::{Device, DeviceKvCache, Fault, FaultRule, SimConfig, SimDevice, Trigger};
use kvferry::engine::{Engine, EngineConfig, Selection};
use kvferry::layout::Span;
use kvferry::peer::{Destination, Mover, PeerError, Transport};
use kvferry::wire::{ChunkKey, ErrorKind};
use tokio::time::Instant;

const BLOCK: usize = 16 << 10;
const BLOCKS: u32 = 16;

fn in_secs(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

async fn engine(listen: Option<&str>, transport: Transport) -> Engine {
    let mut cfg = EngineConfig::default().listen(listen).arena(4 << 20, 64 << 10);
    cfg.producer.transport = transport;
    cfg.pinned = false;
    Engine::start(cfg).await.unwrap()
}

fn sim(rank: u32, shared: bool) -> Arc<SimDevice> {
    SimDevice::new(
        SimConfig::new(rank)
            .with_latency(Duration::from_micros(200))
            .with_shared_memory(shared),
    )
    .unwrap()
}

fn cache(dev: &Arc<SimDevice>, name: &str, op_timeout: Duration) -> Arc<DeviceKvCache> {
    let d: Arc<dyn Device> = dev.clone();
    let buf = d.alloc(BLOCK * BLOCKS as usize).unwrap();
    Arc::new(DeviceKvCache::contiguous(name, d, buf, BLOCK, op_timeout).unwrap())
}

fn pattern(seed: u32, block: u32) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u32).wrapping_mul(7).wrapping_add(block * 31 + seed * 101) as u8)
        .collect()
}

fn fill(c: &DeviceKvCache, seed: u32) {
    for b in 0..BLOCKS {
        c.buffers()[0].write(b as usize * BLOCK, &pattern(seed, b)).unwrap();
    }
}

fn read_block(c: &DeviceKvCache, b: u32) -> Vec<u8> {
    c.buffers()[0].to_vec(b as usize * BLOCK, BLOCK).unwrap()
}

/// A cache on `dev` filled with `seed`'s pattern, registered with `prefill`, and
/// `blocks` of it published there as `key`.
fn publish_filled(
    prefill: &Engine,
    dev: &Arc<SimDevice>,
    name: &str,
    seed: u32,
    key: ChunkKey,
    blocks: &[u32],
) -> Arc<DeviceKvCache> {
    let src = cache(dev, name, Duration::from_secs(2));
    fill(&src, seed);
    let reg = prefill.register(src.clone()).unwrap();
    prefill.publish(key, &reg, blocks, Duration::ZERO, false).unwrap();
    src
}

/// A producer engine on a shared-memory sim device with blocks 1..=3 published as
/// `key`, and a consumer engine on its own sim device.
struct Rig {
    prefill: Engine,
    decode: Engine,
    addr: String,
    src: Arc<DeviceKvCache>,
    dst: Arc<DeviceKvCache>,
    ddev: Arc<SimDevice>,
    key: ChunkKey,
}

async fn rig(consumer_transport: Transport, op_timeout: Duration) -> Rig {
    let prefill = engine(Some("127.0.0.1:0"), Transport::Auto).await;
    let decode = engine(None, consumer_transport).await;
    let key = ChunkKey::from_name("ipc/k");
    let src = publish_filled(&prefill, &sim(0, true), "prefill-kv", 1, key, &[1, 2, 3]);
    let ddev = sim(1, false);
    let dst = cache(&ddev, "decode-kv", op_timeout);
    let addr = prefill.address().unwrap().to_string();
    Rig {
        prefill,
        decode,
        addr,
        src,
        dst,
        ddev,
        key,
    }
}

impl Rig {
    /// Makes the consumer's device meet `fault` at its next operation.
    fn fault_next(&self, fault: Fault) {
        self.ddev
            .inject(FaultRule {
                fault,
                trigger: Trigger::Next,
            })
            .unwrap();
    }

    fn get(&self, blocks: Vec<u32>, within: Duration) -> kvferry::peer::Transfer {
        self.decode.start_get(
            &self.addr,
            &[self.key],
            Destination::new(self.dst.clone(), vec![blocks]),
            Instant::now() + within,
        )
    }

    async fn close(self) {
        for e in [self.prefill, self.decode] {
            assert!(e.close(in_secs(5)).await.is_clean());
        }
    }
}

/// Waits (bounded) until `dev` has a stuck operation.
async fn until_stuck(dev: &SimDevice) {
    let t = in_secs(5);
    while dev.stuck() == 0 {
        assert!(Instant::now() < t, "the copy never reached the device");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_ipc_lands_every_byte_and_is_named_in_stats() {
    let r = rig(Transport::Auto, Duration::from_secs(2)).await;
    let landed = r.get(vec![10, 11, 12], Duration::from_secs(5)).await.unwrap();
    assert_eq!(landed.chunks, 1);
    for (i, b) in [1u32, 2, 3].iter().enumerate() {
        assert_eq!(read_block(&r.dst, 10 + i as u32), pattern(1, *b), "block {b}");
    }
    assert!(
        read_block(&r.dst, 13).iter().all(|x| *x == 0),
        "nothing beyond the chunk"
    );
    let stats = r.decode.stats();
    assert_eq!(stats.consumer.device_ipc_transfers, 1, "{:?}", stats.consumer);
    assert_eq!(stats.consumer.device_ipc_bytes, 3 * BLOCK as u64);
    assert_eq!(stats.consumer.cma_transfers, 0, "not read through staging");
    assert_eq!(stats.movers.len(), 1);
    assert_eq!(stats.movers[0].mover, Mover::Cma);
    assert_eq!(
        stats.movers[0].device_ipc,
        vec!["sim-shm".to_string()],
        "{:?}",
        stats.movers[0]
    );
    assert_eq!(r.prefill.stats().producer.bytes_sent, 0, "nothing on the socket");
    // Again: the export is opened once per incarnation.
    r.get(vec![4, 5, 6], Duration::from_secs(5)).await.unwrap();
    assert_eq!(read_block(&r.dst, 5), pattern(1, 2));
    assert_eq!(r.dst.imports_open(), (1, 1));
    assert_eq!(r.decode.stats().consumer.device_ipc_transfers, 2);
    // Both grants ended with their Done: no lease left on the producer.
    let t = in_secs(5);
    while r.prefill.stats().producer.staged_now > 0 {
        assert!(Instant::now() < t, "the producer's leases were never released");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(r.decode.stats().arena.free_pages, r.decode.stats().arena.total_pages);
    r.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_ipc_needs_no_staging_pages() {
    for transport in [Transport::Auto, Transport::Tcp] {
        let r = rig(transport, Duration::from_secs(2)).await;
        // Every staging page of the consumer is held elsewhere.
        let arena = r.decode.arena();
        let held = arena.try_alloc(arena.stats().free_pages).unwrap();
        assert_eq!(arena.stats().free_pages, 0);
        let got = r.get(vec![10, 11, 12], Duration::from_secs(5)).await;
        match transport {
            Transport::Auto => {
                let landed = got.unwrap();
                assert_eq!(landed.chunks, 1);
                assert_eq!(read_block(&r.dst, 11), pattern(1, 2));
                assert_eq!(r.decode.stats().consumer.device_ipc_transfers, 1);
            }
            _ => {
                let failure = got.unwrap_err();
                assert!(
                    matches!(failure.error, PeerError::StagingExhausted { .. }),
                    "{}",
                    failure.error
                );
            }
        }
        drop(held);
        assert_eq!(arena.stats().free_pages, arena.stats().total_pages, "{transport}");
        r.close().await;
    }
}

/// Pieces per block of the layered caches (2 layers, K and V).
const PIECES: usize = 4;

/// A layered device cache on `dev`: piece `p` of block `b` at `(p * BLOCKS + b) *
/// piece` of one buffer.
fn layered(dev: &Arc<SimDevice>, name: &str, piece: usize) -> Arc<DeviceKvCache> {
    let d: Arc<dyn Device> = dev.clone();
    let buf = d.alloc(PIECES * BLOCKS as usize * piece).unwrap();
    let spans = (0..PIECES)
        .map(|p| Span {
            offset: p * BLOCKS as usize * piece,
            stride: piece,
            len: piece,
        })
        .collect();
    Arc::new(DeviceKvCache::new(name, d, vec![(buf, spans)], BLOCKS, Duration::from_secs(2)).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selected_get_lands_by_device_ipc_only_the_selected_ranges() {
    let piece = 4 << 10;
    let half = piece / 2;
    let key = ChunkKey::from_name("ipc/selected");
    // Source blocks 5, 6, 7 published; the decode wants positions 2 and 0 (blocks 7
    // and 5), the second half of every piece (its share of the heads), into its
    // blocks 1 and 4 of half-size pieces.
    let select = Selection::new(Some(vec![2, 0]), Some(vec![(half, half)]), None).unwrap();
    let mut landed_by = Vec::new();
    for transport in [Transport::Auto, Transport::Tcp] {
        let prefill = engine(Some("127.0.0.1:0"), Transport::Auto).await;
        let decode = engine(None, transport).await;
        let src = layered(&sim(0, true), "prefill-kv", piece);
        let src_bytes: Vec<u8> = (0..PIECES * BLOCKS as usize * piece)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
            .collect();
        src.buffers()[0].write(0, &src_bytes).unwrap();
        let reg = prefill.register(src.clone()).unwrap();
        prefill.publish(key, &reg, &[5, 6, 7], Duration::ZERO, false).unwrap();
        let addr = prefill.address().unwrap().to_string();
        let dst = layered(&sim(1, false), "decode-kv", half);
        let keys = [key];
        let get = |blocks: Vec<u32>, select: Selection| {
            decode.get(
                &addr,
                &keys,
                Destination::new(dst.clone(), vec![blocks]).with_selection(Some(select)),
                in_secs(5),
            )
        };
        // A selection the producer cannot serve (position 9 of 3 blocks): its typed
        // refusal, nothing staged, nothing written.
        let bad = Selection::new(Some(vec![9]), None, None).unwrap();
        let f = get(vec![2], bad).await.unwrap_err();
        match &f.error {
            PeerError::Remote {
                kind: ErrorKind::BadSelection,
                message,
            } => assert!(message.contains("block position 9 of 3"), "{message}"),
            other => panic!("{transport}: expected the producer's BadSelection, got {other:?}"),
        }
        assert!(!f.dirty, "{transport}: nothing was written");
        // The selected get.
        let landed = get(vec![1, 4], select.clone()).await.unwrap();
        let selected = 2 * PIECES * half;
        assert_eq!((landed.chunks, landed.bytes), (1, selected), "{transport}");
        let got = dst.buffers()[0].to_vec(0, PIECES * BLOCKS as usize * half).unwrap();
        common::halves::assert_second_halves_landed(
            &got,
            &src_bytes,
            &[(7, 1), (5, 4)],
            PIECES,
            BLOCKS as usize,
            piece,
            &transport.to_string(),
        );
        let stats = decode.stats().consumer;
        match transport {
            Transport::Auto => {
                assert_eq!(stats.device_ipc_transfers, 1, "{stats:?}");
                assert_eq!(stats.device_ipc_bytes, selected as u64, "only the selection copied");
                assert_eq!(stats.cma_transfers, 0, "not read through staging");
                assert_eq!(prefill.stats().producer.bytes_sent, 0, "nothing on the socket");
            }
            _ => {
                assert_eq!(stats.device_ipc_transfers, 0, "{stats:?}");
                assert_eq!(prefill.stats().producer.bytes_sent, selected as u64);
            }
        }
        landed_by.push(got);
        let t = in_secs(5);
        while prefill.stats().producer.staged_now > 0 {
            assert!(
                Instant::now() < t,
                "{transport}: the producer's leases were never released"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for e in [prefill, decode] {
            assert!(e.close(in_secs(5)).await.is_clean());
        }
    }
    assert!(
        landed_by[0] == landed_by[1],
        "device IPC and the staged path land the same bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_copy_fails_on_time_and_keeps_the_destination_busy_until_confirmed() {
    let r = rig(Transport::Auto, Duration::from_millis(200)).await;
    r.fault_next(Fault::NeverComplete);
    let t0 = std::time::Instant::now();
    let transfer = r.get(vec![8, 9, 10], Duration::from_secs(5));
    let fence = transfer.fence();
    let f = transfer.await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(
        matches!(&f.error, PeerError::Device { error, .. } if error.to_string().contains("device-to-device")),
        "{}",
        f.error
    );
    assert!(f.dirty);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(
            !fence.is_drained(),
            "blocks reported quiet while the device may write them"
        );
    }
    assert_eq!(r.decode.stats().consumer.device_ipc_transfers, 0);
    r.ddev.release_stuck();
    assert!(fence.wait_until(in_secs(3)).await, "fires once the device confirmed");
    // And the next transfer lands intact on the same mover.
    r.get(vec![8, 9, 10], Duration::from_secs(5)).await.unwrap();
    assert_eq!(read_block(&r.dst, 9), pattern(1, 2));
    assert_eq!(r.decode.stats().consumer.device_ipc_transfers, 1);
    r.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_fails_only_its_transfer() {
    let r = rig(Transport::Auto, Duration::from_secs(2)).await;
    r.fault_next(Fault::FailCopy);
    let f = r.get(vec![0, 1, 2], Duration::from_secs(5)).await.unwrap_err();
    assert!(
        matches!(&f.error, PeerError::Device { error, .. } if error.to_string().contains("failed")),
        "{}",
        f.error
    );
    assert!(
        f.fence.wait_until(in_secs(2)).await,
        "a failed copy no longer touches the blocks"
    );
    r.get(vec![0, 1, 2], Duration::from_secs(5)).await.unwrap();
    assert_eq!(read_block(&r.dst, 0), pattern(1, 1));
    assert_eq!(read_block(&r.dst, 2), pattern(1, 3));
    r.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transfer_drains_only_after_its_copy_settled() {
    let r = rig(Transport::Auto, Duration::from_secs(30)).await;
    r.fault_next(Fault::Stall);
    let transfer = r.get(vec![3, 4, 5], Duration::from_secs(30));
    let fence = transfer.fence();
    let handle = tokio::spawn(transfer);
    until_stuck(&r.ddev).await;
    handle.abort(); // the caller gives up: the future is dropped
    let _ = handle.await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(!fence.is_drained(), "drained while the copy is queued on the device");
    }
    r.ddev.release_stuck();
    assert!(fence.wait_until(in_secs(5)).await, "drains once the copy settled");
    r.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_rewriting_published_blocks_mid_copy_is_a_checksum_error() {
    let r = rig(Transport::Auto, Duration::from_secs(30)).await;
    r.fault_next(Fault::Stall);
    let handle = tokio::spawn(r.get(vec![12, 13, 14], Duration::from_secs(30)));
    until_stuck(&r.ddev).await;
    // The grant's checksums were taken; the engine breaks its promise now.
    r.src.buffers()[0].write(2 * BLOCK + 100, &[0xAB; 64]).unwrap();
    r.ddev.release_stuck();
    let f = handle.await.unwrap().unwrap_err();
    assert!(matches!(f.error, PeerError::ChecksumMismatch { .. }), "{}", f.error);
    assert!(f.dirty, "the destination is reported written, not landed");
    assert_eq!(r.decode.stats().consumer.checksum_failures, 1);
    assert_eq!(r.decode.stats().consumer.device_ipc_transfers, 0);
    r.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_tcp_keeps_the_staged_device_path() {
    let r = rig(Transport::Tcp, Duration::from_secs(2)).await;
    r.get(vec![7, 8, 9], Duration::from_secs(5)).await.unwrap();
    assert_eq!(read_block(&r.dst, 8), pattern(1, 2));
    let stats = r.decode.stats();
    assert_eq!(stats.consumer.device_ipc_transfers, 0);
    assert_eq!(stats.consumer.cma_transfers, 0);
    assert!(r.prefill.stats().producer.bytes_sent >= 3 * BLOCK as u64);
    assert_eq!(r.dst.imports_open(), (0, 0));
    r.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_producer_device_is_read_over_cma_instead() {
    let prefill = engine(Some("127.0.0.1:0"), Transport::Auto).await;
    let decode = engine(None, Transport::Auto).await;
    let key = ChunkKey::from_name("ipc/private");
    publish_filled(&prefill, &sim(0, false), "prefill-kv", 4, key, &[6]);
    let dst = cache(&sim(1, false), "decode-kv", Duration::from_secs(2));
    let addr = prefill.address().unwrap().to_string();
    decode
        .get(&addr, &[key], Destination::new(dst.clone(), vec![vec![1]]), in_secs(5))
        .await
        .unwrap();
    assert_eq!(read_block(&dst, 1), pattern(4, 6));
    let stats = decode.stats();
    assert_eq!(stats.consumer.device_ipc_transfers, 0);
    assert_eq!(stats.consumer.cma_transfers, 1, "staged and read by CMA");
    for e in [prefill, decode] {
        assert!(e.close(in_secs(5)).await.is_clean());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_producer_is_opened_again() {
    let r = rig(Transport::Auto, Duration::from_secs(2)).await;
    r.get(vec![0, 1, 2], Duration::from_secs(5)).await.unwrap();
    assert_eq!(r.dst.imports_open(), (1, 1));
    let Rig {
        prefill,
        decode,
        addr,
        dst,
        key,
        ..
    } = r;
    assert!(prefill.close(in_secs(5)).await.is_clean());
    // A new incarnation on the same address, with other bytes.
    let prefill = engine(Some(&addr), Transport::Auto).await;
    publish_filled(&prefill, &sim(2, true), "prefill-kv-2", 9, key, &[1, 2, 3]);
    decode
        .get(
            &addr,
            &[key],
            Destination::new(dst.clone(), vec![vec![5, 6, 7]]),
            in_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(read_block(&dst, 6), pattern(9, 2));
    assert_eq!(
        dst.imports_open(),
        (1, 2),
        "the old incarnation's import closed, the new one opened"
    );
    assert_eq!(decode.stats().consumer.device_ipc_transfers, 2);
    for e in [prefill, decode] {
        assert!(e.close(in_secs(5)).await.is_clean());
    }
}

const CHILD: &str = "KVFERRY_DEVICE_IPC_CHILD";

/// The producer half of the two-process test, run only as its child process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_ipc_producer_child() {
    if std::env::var(CHILD).is_err() {
        return; // only meaningful as the child of `two_processes_...`
    }
    let prefill = engine(Some("127.0.0.1:0"), Transport::Auto).await;
    let src = cache(&sim(0, true), "prefill-kv", Duration::from_secs(2));
    fill(&src, 7);
    let reg = prefill.register(src.clone()).unwrap();
    prefill
        .publish(ChunkKey::from_name("ipc/child"), &reg, &[4, 5], Duration::ZERO, false)
        .unwrap();
    println!("ADDR {}", prefill.address().unwrap());
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
    })
    .await
    .unwrap();
    assert!(prefill.close(in_secs(5)).await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_land_by_device_ipc_and_a_killed_producer_is_peer_lost() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let (mut child, mut lines) = spawn_self_test("device_ipc_producer_child", CHILD);
    let addr = line_after(&mut lines, "ADDR ", "its address");
    let decode = engine(None, Transport::Auto).await;
    let ddev = sim(1, false);
    let dst = cache(&ddev, "decode-kv", Duration::from_secs(30));
    let key = ChunkKey::from_name("ipc/child");
    let get =
        |blocks: Vec<u32>| decode.start_get(&addr, &[key], Destination::new(dst.clone(), vec![blocks]), in_secs(20));
    get(vec![0, 1]).await.unwrap();
    assert_eq!(read_block(&dst, 0), pattern(7, 4));
    assert_eq!(read_block(&dst, 1), pattern(7, 5));
    let stats = decode.stats();
    assert_eq!(stats.consumer.device_ipc_transfers, 1, "{:?}", stats.movers);
    assert_eq!(stats.movers[0].pid, Some(child.id()));

    // The producer dies while the copy is queued on the consumer's device.
    ddev.inject(FaultRule {
        fault: Fault::Stall,
        trigger: Trigger::Next,
    })
    .unwrap();
    let transfer = get(vec![6, 7]);
    let fence = transfer.fence();
    let pending = tokio::spawn(transfer);
    until_stuck(&ddev).await;
    let t0 = std::time::Instant::now();
    child.kill().unwrap();
    let f = pending.await.unwrap().unwrap_err();
    assert!(matches!(f.error, PeerError::PeerLost { .. }), "{}", f.error);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let _ = child.wait();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!fence.is_drained(), "reported quiet while the copy is queued");
    }
    ddev.release_stuck();
    assert!(
        fence.wait_until(in_secs(5)).await,
        "drains once the device settled the copy"
    );
    assert!(decode.close(in_secs(5)).await.is_clean());
}
