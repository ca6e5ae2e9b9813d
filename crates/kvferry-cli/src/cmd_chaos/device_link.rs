//! Device KV on the transfer path under faults: an in-process producer engine whose
//! published KV lives in one sim device and a consumer engine landing into another,
//! over real loopback sockets. With `--transport tcp` each transfer gathers device
//! blocks into staging (device-to-host), sends them, and scatters them into the
//! consumer's device blocks (host-to-device). With `--transport auto` the producer's
//! device memory is shared (the sim device's analogue of CUDA IPC) and the consumer
//! copies device to device by the device-IPC mover (no gather, no staging, no
//! socket). A share of the transfers are selected gets (half of one block, as a
//! heterogeneous-TP decode rank takes its heads). Never-completing events and failing
//! copies are injected at random on either side (under device IPC the producer's
//! device runs no copy, so its faults go to the consumer's device-to-device copy), and every
//! landed byte is compared with its pattern. A destination slot is reused only after
//! its transfer's fence fired (the device confirmed); what the devices never confirm
//! stays quarantined and is reported, not counted as leaked.

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{Device, DeviceBuffer, DeviceKvCache, Fault, FaultRule, SimConfig, SimDevice, Trigger};
use kvferry::engine::{Engine, EngineConfig, Selection, StoreConfig};
use kvferry::peer::{Destination, Transport};
use kvferry::wire::ChunkKey;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use tokio::time::Instant;

use super::ledger::{classify, ArenaReport, Ledger, Outcome};

const BLOCK: usize = 8 << 10;
const BLOCKS_PER_CHUNK: u32 = 2;
/// Published chunks on the producer's device.
const CHUNKS: u32 = 32;
/// Destination slots (one chunk each) on the consumer's device.
const SLOTS: u32 = 16;
/// Bound on every device copy's wait.
const OP_TIMEOUT: Duration = Duration::from_millis(150);

/// Which device a fault hits.
#[derive(Clone, Copy, Debug)]
pub enum Side {
    /// The producer's device-to-host gather.
    Producer,
    /// The consumer's host-to-device scatter.
    Consumer,
}

/// One device transfer's fault plan.
#[derive(Clone, Copy, Debug)]
pub struct LinkPlan {
    /// The published chunk fetched.
    pub chunk: u32,
    /// A fault to inject, and where.
    pub fault: Option<(Side, Fault)>,
    /// The transfer's deadline.
    pub timeout: Duration,
    /// Let both devices complete their stuck work first (late completion).
    pub release_stuck: bool,
    /// A selected get: the second half of the chunk's second block, into the first
    /// half of the slot's first block.
    pub selected: bool,
}

/// The two engines, their sim devices and caches.
pub struct DeviceLink {
    producer: Engine,
    consumer: Engine,
    pdev: Arc<SimDevice>,
    cdev: Arc<SimDevice>,
    dst: Arc<DeviceKvCache>,
    dst_buf: DeviceBuffer,
    patterns: Vec<Vec<u8>>,
    addr: String,
    free_slots: Arc<Mutex<Vec<u32>>>,
    /// The consumer copies device to device (device IPC): the producer's device runs
    /// no copy.
    ipc: bool,
    background: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

fn key(chunk: u32) -> ChunkKey {
    ChunkKey::from_name(&format!("chaos/device/{chunk}"))
}

async fn engine(listen: bool, transport: Transport) -> anyhow::Result<Engine> {
    let mut cfg = EngineConfig::default()
        .listen(listen.then_some("127.0.0.1:0"))
        .peer_id(if listen {
            "chaos-device-producer"
        } else {
            "chaos-device-consumer"
        })
        .arena(64 * BLOCK * BLOCKS_PER_CHUNK as usize, BLOCK);
    cfg.pinned = false;
    cfg.copy.threads = 1;
    cfg.store = StoreConfig::Bytes {
        bytes: 64 << 10,
        block_bytes: 64 << 10,
    };
    cfg.producer.transport = transport;
    cfg.producer.max_ttl = Duration::from_secs(24 * 3600);
    cfg.producer.default_ttl = Duration::from_secs(24 * 3600);
    Ok(Engine::start(cfg).await?)
}

impl DeviceLink {
    /// Both engines and devices, the producer's chunks published; with `transport`
    /// `auto` the producer's device memory is shared (device IPC). Needs a runtime.
    pub async fn new(seed: u64, transport: Transport) -> anyhow::Result<DeviceLink> {
        let sim = |rank, shared| {
            SimDevice::new(
                SimConfig::new(rank)
                    .with_latency(Duration::from_micros(100))
                    .with_bandwidth(2_000_000_000)
                    .with_shared_memory(shared),
            )
        };
        let (pdev, cdev) = (sim(10, transport == Transport::Auto)?, sim(11, false)?);
        let (producer, consumer) = (engine(true, transport).await?, engine(false, transport).await?);
        let pd: Arc<dyn Device> = pdev.clone();
        let src_buf = pd.alloc(BLOCK * (CHUNKS * BLOCKS_PER_CHUNK) as usize)?;
        let src = producer.register(DeviceKvCache::contiguous(
            "chaos-src",
            pd,
            src_buf.clone(),
            BLOCK,
            OP_TIMEOUT,
        )?)?;
        let cd: Arc<dyn Device> = cdev.clone();
        let dst_buf = cd.alloc(BLOCK * (SLOTS * BLOCKS_PER_CHUNK) as usize)?;
        let dst = Arc::new(DeviceKvCache::contiguous(
            "chaos-dst",
            cd,
            dst_buf.clone(),
            BLOCK,
            OP_TIMEOUT,
        )?);
        let mut rng = StdRng::seed_from_u64(seed);
        let chunk_bytes = BLOCK * BLOCKS_PER_CHUNK as usize;
        let mut patterns = Vec::with_capacity(CHUNKS as usize);
        for c in 0..CHUNKS {
            let mut p = vec![0u8; chunk_bytes];
            rng.fill_bytes(&mut p);
            src_buf.write(c as usize * chunk_bytes, &p)?;
            let blocks: Vec<u32> = (c * BLOCKS_PER_CHUNK..(c + 1) * BLOCKS_PER_CHUNK).collect();
            producer.publish(key(c), &src, &blocks, Duration::ZERO, false)?;
            patterns.push(p);
        }
        let addr = producer.address().expect("the producer listens").to_string();
        Ok(DeviceLink {
            producer,
            consumer,
            pdev,
            cdev,
            dst,
            dst_buf,
            patterns,
            addr,
            free_slots: Arc::new(Mutex::new((0..SLOTS).collect())),
            ipc: transport == Transport::Auto,
            background: Mutex::new(Vec::new()),
        })
    }

    /// Draws one transfer's plan.
    pub fn plan(rng: &mut StdRng, rate: f64) -> LinkPlan {
        let p = (0.06 * rate).min(0.9);
        let fault = if rng.gen_bool(p) {
            let side = if rng.gen_bool(0.5) {
                Side::Producer
            } else {
                Side::Consumer
            };
            let fault = if rng.gen_bool(0.5) {
                Fault::NeverComplete
            } else {
                Fault::FailCopy
            };
            Some((side, fault))
        } else if rng.gen_bool(p) {
            Some((Side::Consumer, Fault::Slow(4)))
        } else {
            None
        };
        LinkPlan {
            chunk: rng.gen_range(0..CHUNKS),
            fault,
            timeout: Duration::from_millis(rng.gen_range(100..=1_000)),
            release_stuck: rng.gen_bool(0.1),
            selected: rng.gen_bool(0.3),
        }
    }

    /// Device-to-device copies by the device-IPC mover so far.
    pub fn device_ipc_transfers(&self) -> u64 {
        self.consumer.stats().consumer.device_ipc_transfers
    }

    /// Runs one device transfer and books it.
    pub async fn transfer(&self, ledger: &Ledger, p: LinkPlan) {
        if p.release_stuck {
            self.pdev.release_stuck();
            self.cdev.release_stuck();
        }
        let Some(slot) = self.free_slots.lock().pop() else {
            // Every slot waits for its device to confirm: nothing may land there yet.
            ledger.error_class("device_link_no_quiet_slot", "every destination slot awaits a device");
            ledger.outcome(Outcome::Failed);
            return;
        };
        if let Some((side, fault)) = p.fault {
            let side = match side {
                Side::Producer if self.ipc => Side::Consumer,
                other => other,
            };
            let dev = match side {
                Side::Producer => &self.pdev,
                Side::Consumer => &self.cdev,
            };
            let name = match (side, fault) {
                (Side::Producer, Fault::NeverComplete) => "device_link_producer_never_complete",
                (Side::Producer, _) => "device_link_producer_copy_failures",
                (Side::Consumer, Fault::NeverComplete) => "device_link_consumer_never_complete",
                (Side::Consumer, Fault::FailCopy) => "device_link_consumer_copy_failures",
                (Side::Consumer, _) => "device_link_slow_copies",
            };
            // One-shot: it hits the next copy of that device (this transfer's, or a
            // concurrent one's — the count is the same).
            if dev
                .inject(FaultRule {
                    fault,
                    trigger: Trigger::Next,
                })
                .is_ok()
            {
                ledger.fault(name, 1);
            }
        }
        let blocks: Vec<u32> = (slot * BLOCKS_PER_CHUNK..(slot + 1) * BLOCKS_PER_CHUNK).collect();
        let deadline = Instant::now() + p.timeout;
        let half = BLOCK / 2;
        let (dst, want_at, len) = match p.selected {
            true => {
                let select = Selection::new(Some(vec![1]), Some(vec![(half, half)]), Some(vec![(0, half)]))
                    .expect("a valid selection");
                let dst = Destination::new(&self.dst, vec![vec![blocks[0]]]).with_selection(Some(select));
                (dst, BLOCK + half, half)
            }
            false => (
                Destination::new(&self.dst, vec![blocks]),
                0,
                BLOCK * BLOCKS_PER_CHUNK as usize,
            ),
        };
        let transfer = self.consumer.start_get(&self.addr, &[key(p.chunk)], dst, deadline);
        let fence = transfer.fence();
        let r = transfer.await;
        ledger.returned("device transfer", deadline, Instant::now());
        match r {
            Ok(l) if l.chunks == 1 => {
                let slot_bytes = BLOCK * BLOCKS_PER_CHUNK as usize;
                let got = self.dst_buf.to_vec(slot as usize * slot_bytes, len).unwrap_or_default();
                let want = &self.patterns[p.chunk as usize][want_at..want_at + len];
                let bad = got.iter().zip(want).filter(|(a, b)| a != b).count() + want.len().saturating_sub(got.len());
                ledger.verified(len, bad);
                if bad > 0 {
                    ledger.anomaly(format!("device transfer of chunk {}: {bad} bytes differ", p.chunk));
                }
                ledger.outcome(Outcome::Completed);
                self.free_slots.lock().push(slot);
            }
            Ok(_) => {
                ledger.anomaly(format!("device chunk {} missed although published", p.chunk));
                ledger.outcome(Outcome::Failed);
                self.free_slots.lock().push(slot);
            }
            Err(f) => {
                let (class, outcome) = classify(&f.error);
                ledger.error_class(&format!("device_link_{class}"), &f.error.to_string());
                ledger.outcome(outcome);
                // The slot is quiet only once the fence fired (the device settled the
                // scatter); until then nothing else may land there.
                let free = self.free_slots.clone();
                let h = tokio::spawn(async move {
                    if fence.wait_until(Instant::now() + Duration::from_secs(120)).await {
                        free.lock().push(slot);
                    }
                });
                self.background.lock().push(h);
            }
        }
    }

    /// Lets the devices complete their stuck work, waits for every slot's drain, and
    /// accounts both engines' arenas and the slots; then closes the engines.
    pub async fn finish(&self, ledger: &Ledger) -> Vec<ArenaReport> {
        self.pdev.release_stuck();
        self.cdev.release_stuck();
        let handles: Vec<_> = std::mem::take(&mut *self.background.lock());
        for h in handles {
            let _ = tokio::time::timeout(Duration::from_secs(10), h).await;
        }
        let until = Instant::now() + Duration::from_secs(10);
        let quiet = |e: &Engine| {
            let s = e.arena().stats();
            s.free_pages + s.quarantined_pages == s.total_pages && e.consumer().stats().draining == 0
        };
        while !(quiet(&self.producer) && quiet(&self.consumer)) && Instant::now() < until {
            self.pdev.release_stuck();
            self.cdev.release_stuck();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let held = SLOTS as usize - self.free_slots.lock().len();
        if held > 0 {
            ledger.anomaly(format!("{held} device destination slots never reported quiet"));
        }
        let mut reports = Vec::new();
        for (name, e) in [
            ("device-link-producer", &self.producer),
            ("device-link-consumer", &self.consumer),
        ] {
            let s = e.arena().stats();
            reports.push(ArenaReport {
                name: name.into(),
                total_pages: s.total_pages as u64,
                free_pages: s.free_pages as u64,
                quarantined_pages: s.quarantined_pages as u64,
                leaked_pages: (s.total_pages - s.free_pages - s.quarantined_pages) as u64,
            });
        }
        for e in [&self.producer, &self.consumer] {
            e.close(Instant::now() + Duration::from_secs(5)).await;
        }
        reports
    }
}
