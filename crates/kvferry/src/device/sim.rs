//! The sim backend: a simulated device with configurable latency and bandwidth, and
//! fault injection, one per rank.
//!
//! Device memory is host memory (optionally under a capacity limit). With
//! [`SimConfig::with_shared_memory`] each allocation is a shared-memory file (`memfd`,
//! see `shm`) that another process of this host may open read-only
//! ([`Device::open_ipc`], device IPC: the analogue of CUDA IPC handles); otherwise (the
//! default), or where shared memory cannot be made, private memory. A device-to-device
//! copy ([`Stream::copy_d2d`]) follows the same model and faults as any copy. A copy takes
//! `latency + bytes / bandwidth` (times a [`Fault::Slow`] factor) on the tokio clock —
//! so tests under paused time are exact — and its bytes land at the end of that time.
//! Records complete when reached; waits block the stream until the awaited event
//! settles. Each stream is an executor task on the runtime captured at creation.
//!
//! # Faults
//!
//! A [`FaultRule`] pairs a [`Fault`] with a [`Trigger`]; rules come from
//! [`SimConfig::with_fault`] or [`SimDevice::inject`] and are evaluated when an
//! operation (a copy or a record) is **submitted**; operations are counted per device,
//! starting at one. [`SimDevice::release_stuck`] is the late completion: every
//! operation submitted before the call that is (or would be) stuck or stalled proceeds,
//! so its event completes and quarantined pages are released.
//!
//! # Cancellation
//!
//! Dropping a stream handle leaves queued work running; the executor ends when every
//! handle is gone and the queue is empty (or, for stuck work, when the runtime shuts
//! down — its events then never complete and its leases stay quarantined).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::Handle;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;

use crate::mem::Region;

use super::buffer::{DeviceBuffer, HostBuffer};
use super::event::{Event, EventMeta, PushSignal};
use super::executor::{copy_inline, copy_inline_d2d, enqueue, Queued};
use super::stream::{CopyOp, D2dOp, Stream, StreamBackend};
use super::{next_device_id, Device, DeviceError, DeviceKind};

/// A fault the sim device injects into one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The operation runs (a copy's bytes land) but its event never completes, and the
    /// stream stays blocked behind it — until [`SimDevice::release_stuck`].
    NeverComplete,
    /// The copy fails: nothing is written and its event fails
    /// ([`DeviceError::CopyFailed`]). Applies to copies only.
    FailCopy,
    /// The stream stalls before the operation (nothing of it happens) until
    /// [`SimDevice::release_stuck`]; work queued behind it waits too.
    Stall,
    /// The copy takes this many times its modelled duration (at least 1). Applies to
    /// copies only.
    Slow(u32),
}

impl Fault {
    fn applies_to_records(self) -> bool {
        matches!(self, Fault::NeverComplete | Fault::Stall)
    }
}

/// Which operations a fault hits. Operations (copies and records) are counted per device
/// from 1 in submission order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// The next operation the fault applies to, once.
    Next,
    /// Every operation the fault applies to.
    Every,
    /// The operation with this number (if the fault applies to it).
    Nth(u64),
}

/// A fault and when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// What happens.
    pub fault: Fault,
    /// To which operations.
    pub trigger: Trigger,
}

/// How to build a [`SimDevice`].
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The rank the device serves (named in errors).
    pub rank: u32,
    /// Fixed time per copy.
    pub latency: Duration,
    /// Bytes per second; `None` is infinitely fast.
    pub bandwidth: Option<u64>,
    /// Device memory capacity; `None` is unlimited.
    pub memory: Option<usize>,
    /// Faults armed from the start.
    pub faults: Vec<FaultRule>,
    /// Allocate in shared memory that other processes of this host may open (device
    /// IPC, [`Device::open_ipc`]). Off by default: the sim then stands in for a
    /// device whose memory is only reachable through staging (the staged device path).
    pub shared_memory: bool,
}

impl SimConfig {
    /// An instant, fault-free device for `rank`.
    pub fn new(rank: u32) -> SimConfig {
        SimConfig {
            rank,
            latency: Duration::ZERO,
            bandwidth: None,
            memory: None,
            faults: Vec::new(),
            shared_memory: false,
        }
    }

    /// Allocates in shared memory exportable to other processes of this host (device
    /// IPC), or not (the default).
    pub fn with_shared_memory(mut self, on: bool) -> Self {
        self.shared_memory = on;
        self
    }

    /// Sets the fixed time per copy.
    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// Sets the bandwidth in bytes per second (must be non-zero).
    pub fn with_bandwidth(mut self, bytes_per_sec: u64) -> Self {
        self.bandwidth = Some(bytes_per_sec);
        self
    }

    /// Limits device memory to `bytes`.
    pub fn with_memory(mut self, bytes: usize) -> Self {
        self.memory = Some(bytes);
        self
    }

    /// Arms `fault` for the operations `trigger` selects.
    pub fn with_fault(mut self, fault: Fault, trigger: Trigger) -> Self {
        self.faults.push(FaultRule { fault, trigger });
        self
    }

    fn validate(&self) -> Result<(), DeviceError> {
        if self.bandwidth == Some(0) {
            return Err(DeviceError::InvalidArgument("sim bandwidth must be non-zero".into()));
        }
        self.faults.iter().try_for_each(validate_rule)
    }
}

fn validate_rule(rule: &FaultRule) -> Result<(), DeviceError> {
    match rule {
        FaultRule {
            fault: Fault::Slow(0), ..
        } => Err(DeviceError::InvalidArgument("slow factor must be at least 1".into())),
        FaultRule {
            trigger: Trigger::Nth(0),
            ..
        } => Err(DeviceError::InvalidArgument("operations are counted from 1".into())),
        _ => Ok(()),
    }
}

/// What the faults decided for one operation.
#[derive(Clone, Copy, Debug, Default)]
struct Plan {
    stall: bool,
    never: bool,
    fail: bool,
    slow: u32,
    /// The release generation at submission; `release_stuck` moves past it.
    generation: u64,
}

struct Faults {
    rules: Vec<(FaultRule, bool)>,
    ops: u64,
}

struct Shared {
    id: u64,
    config: SimConfig,
    faults: Mutex<Faults>,
    release: watch::Sender<u64>,
    stuck: AtomicUsize,
    memory_used: Arc<AtomicUsize>,
}

impl Shared {
    fn plan(&self, is_copy: bool) -> Plan {
        let mut f = self.faults.lock();
        f.ops += 1;
        let n = f.ops;
        let mut plan = Plan {
            slow: 1,
            generation: *self.release.borrow(),
            ..Plan::default()
        };
        for (rule, used) in f.rules.iter_mut() {
            if !is_copy && !rule.fault.applies_to_records() {
                continue;
            }
            let hit = match rule.trigger {
                Trigger::Next => !std::mem::replace(used, true),
                Trigger::Every => true,
                Trigger::Nth(k) => k == n,
            };
            if hit {
                match rule.fault {
                    Fault::NeverComplete => plan.never = true,
                    Fault::FailCopy => plan.fail = true,
                    Fault::Stall => plan.stall = true,
                    Fault::Slow(k) => plan.slow = plan.slow.saturating_mul(k),
                }
            }
        }
        plan
    }

    fn copy_time(&self, bytes: usize) -> Duration {
        let transfer = self
            .config
            .bandwidth
            .map_or(Duration::ZERO, |bw| Duration::from_secs_f64(bytes as f64 / bw as f64));
        self.config.latency + transfer
    }

    /// Blocks the stream until `release_stuck` moves past `generation`.
    async fn held(&self, generation: u64) {
        struct Count<'a>(&'a AtomicUsize);
        impl Drop for Count<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.stuck.fetch_add(1, Ordering::AcqRel);
        let _count = Count(&self.stuck);
        let mut rx = self.release.subscribe();
        // The sender lives in `self`, so this only ends by a release.
        let _ = rx.wait_for(|g| *g > generation).await;
    }
}

/// A simulated device for one rank. See the module docs.
pub struct SimDevice {
    shared: Arc<Shared>,
    rt: Handle,
}

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevice")
            .field("id", &self.shared.id)
            .field("config", &self.shared.config)
            .field("stuck", &self.stuck())
            .finish()
    }
}

impl SimDevice {
    /// A sim device running its streams on the current tokio runtime. Fails with
    /// [`DeviceError::InvalidArgument`] outside a runtime or for a bad configuration.
    pub fn new(config: SimConfig) -> Result<Arc<SimDevice>, DeviceError> {
        let rt = Handle::try_current().map_err(|_| {
            DeviceError::InvalidArgument(
                "a sim device must be created inside a tokio runtime (or use with_runtime)".into(),
            )
        })?;
        Self::with_runtime(config, rt)
    }

    /// A sim device whose streams run on `rt`.
    pub fn with_runtime(config: SimConfig, rt: Handle) -> Result<Arc<SimDevice>, DeviceError> {
        config.validate()?;
        let rules = config.faults.iter().map(|r| (*r, false)).collect();
        let (release, _) = watch::channel(0);
        Ok(Arc::new(SimDevice {
            shared: Arc::new(Shared {
                id: next_device_id(),
                config,
                faults: Mutex::new(Faults { rules, ops: 0 }),
                release,
                stuck: AtomicUsize::new(0),
                memory_used: Arc::new(AtomicUsize::new(0)),
            }),
            rt,
        }))
    }

    /// The configuration (faults as configured at creation).
    pub fn config(&self) -> &SimConfig {
        &self.shared.config
    }

    /// Arms another fault.
    pub fn inject(&self, rule: FaultRule) -> Result<(), DeviceError> {
        validate_rule(&rule)?;
        self.shared.faults.lock().rules.push((rule, false));
        Ok(())
    }

    /// Disarms every fault (operations already submitted keep theirs).
    pub fn clear_faults(&self) {
        self.shared.faults.lock().rules.clear();
    }

    /// Late completion: lets every operation submitted before this call that is (or
    /// would become) stuck or stalled proceed.
    pub fn release_stuck(&self) {
        self.shared.release.send_modify(|g| *g += 1);
    }

    /// Operations currently blocked by [`Fault::NeverComplete`] or [`Fault::Stall`].
    pub fn stuck(&self) -> usize {
        self.shared.stuck.load(Ordering::Acquire)
    }

    /// Operations (copies and records) submitted so far.
    pub fn operations(&self) -> u64 {
        self.shared.faults.lock().ops
    }

    /// Device memory currently allocated.
    pub fn memory_used(&self) -> usize {
        self.shared.memory_used.load(Ordering::Acquire)
    }

    /// Adopts host memory the caller already has (say, a framework's CPU KV tensors)
    /// as this device's memory, without copying: copies to and from it then go through
    /// the sim device's streams, events and faults, exactly as on allocated sim memory.
    /// This is how the device data path runs over an application's own buffers on a
    /// machine without an accelerator. The memory does not count against
    /// [`SimConfig::with_memory`]; `region` (and whatever keeps its memory alive) is held
    /// until the buffer and every operation targeting it are gone.
    pub fn adopt_host(&self, region: Arc<Region>) -> DeviceBuffer {
        DeviceBuffer::new(Arc::new(HostBuffer::new(self.shared.id, region, None)))
    }
}

impl Device for SimDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Sim
    }

    fn rank(&self) -> u32 {
        self.shared.config.rank
    }

    fn id(&self) -> u64 {
        self.shared.id
    }

    fn name(&self) -> String {
        format!("sim device {} (rank {})", self.shared.id, self.shared.config.rank)
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer, DeviceError> {
        let used = &self.shared.memory_used;
        if let Some(limit) = self.shared.config.memory {
            used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(len).filter(|t| *t <= limit)
            })
            .map_err(|u| DeviceError::OutOfMemory {
                requested: len,
                detail: format!("{u} of {limit} bytes of sim device memory in use"),
            })?;
        } else {
            used.fetch_add(len, Ordering::AcqRel);
        }
        let budget = Some(used.clone());
        // Shared memory when asked for, so that another process of this host may open
        // it (device IPC); private memory otherwise, or when shared memory is not
        // available (the export is then refused with a reason).
        let name = format!("sim-device-{}", self.shared.id);
        if self.shared.config.shared_memory {
            if let Ok((region, handle)) = super::shm::create(&name, len) {
                let buf = HostBuffer::new(self.shared.id, region, budget).exported(handle);
                return Ok(DeviceBuffer::new(Arc::new(buf)));
            }
        }
        let region = match Region::host(name, len) {
            Ok(r) => r,
            Err(e) => {
                used.fetch_sub(len, Ordering::AcqRel);
                return Err(e.into());
            }
        };
        Ok(DeviceBuffer::new(Arc::new(HostBuffer::new(
            self.shared.id,
            Arc::new(region),
            budget,
        ))))
    }

    fn ipc_kind(&self) -> Option<&'static str> {
        Some(SIM_IPC)
    }

    fn open_ipc(&self, handle: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        let shm_err = |e: super::shm::ShmError| DeviceError::Driver(format!("sim device IPC: {e}"));
        let handle = super::shm::ShmHandle::from_bytes(handle).map_err(shm_err)?;
        let region = super::shm::open(&handle).map_err(shm_err)?;
        Ok(DeviceBuffer::new(Arc::new(
            HostBuffer::new(self.shared.id, region, None).imported(),
        )))
    }

    fn create_stream(&self, name: &str) -> Result<Stream, DeviceError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.rt.spawn(run(self.shared.clone(), rx));
        Ok(Stream::new(Arc::new(SimStream {
            name: name.to_string(),
            shared: self.shared.clone(),
            tx,
        })))
    }
}

struct SimStream {
    name: String,
    shared: Arc<Shared>,
    tx: UnboundedSender<(Queued, Plan)>,
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("name", &self.name)
            .field("device", &self.shared.id)
            .finish()
    }
}

impl StreamBackend for SimStream {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_id(&self) -> u64 {
        self.shared.id
    }

    fn rank(&self) -> u32 {
        self.shared.config.rank
    }

    fn copy(&self, op: CopyOp) -> Result<Event, DeviceError> {
        if op.parts.iter().any(|p| p.buffer.backend().host_memory().is_none()) {
            return Err(DeviceError::InvalidArgument(
                "sim stream given a buffer that is not sim memory".into(),
            ));
        }
        let meta = op.meta.clone();
        let plan = self.shared.plan(true);
        let item = Queued::Copy {
            op,
            signal: PushSignal::new(),
        };
        Ok(enqueue(&self.tx, &self.name, item, Some(meta), plan)?.expect("copies have events"))
    }

    fn record(&self, meta: EventMeta) -> Result<Event, DeviceError> {
        let plan = self.shared.plan(false);
        let item = Queued::Record {
            signal: PushSignal::new(),
        };
        Ok(enqueue(&self.tx, &self.name, item, Some(meta), plan)?.expect("records have events"))
    }

    fn wait_event(&self, event: &Event) -> Result<(), DeviceError> {
        enqueue(
            &self.tx,
            &self.name,
            Queued::Wait { event: event.clone() },
            None,
            Plan::default(),
        )?;
        Ok(())
    }

    fn copy_d2d(&self, op: D2dOp) -> Result<Event, DeviceError> {
        let meta = op.meta.clone();
        let plan = self.shared.plan(true);
        let item = Queued::CopyD2d {
            op,
            signal: PushSignal::new(),
        };
        Ok(enqueue(&self.tx, &self.name, item, Some(meta), plan)?.expect("copies have events"))
    }
}

/// The device-IPC kind of sim devices: shared memory of one host.
pub const SIM_IPC: &str = "sim-shm";

/// Runs one queued copy of `bytes` under its plan: the modelled copy time (slowed as
/// planned), then the copy itself or an injected failure; the operation (and the
/// memory it keeps alive) drops before a planned never-settling hold, and `signal`
/// settles last.
async fn run_copy<O>(
    shared: &Shared,
    plan: &Plan,
    op: O,
    bytes: usize,
    copy: fn(&O) -> Result<(), String>,
    signal: &PushSignal,
) {
    let t = shared.copy_time(bytes) * plan.slow.max(1);
    if !t.is_zero() {
        tokio::time::sleep(t).await;
    }
    let result = if plan.fail {
        Err("injected fault: copy failed".to_string())
    } else {
        copy(&op)
    };
    drop(op);
    if plan.never {
        shared.held(plan.generation).await;
    }
    match result {
        Ok(()) => signal.complete(),
        Err(message) => signal.fail(message),
    };
}

/// The stream's executor: runs queued work in order, applying each item's plan.
async fn run(shared: Arc<Shared>, mut rx: UnboundedReceiver<(Queued, Plan)>) {
    while let Some((item, plan)) = rx.recv().await {
        if plan.stall {
            shared.held(plan.generation).await;
        }
        debug_assert!(item.is_copy() || !plan.fail);
        match item {
            Queued::Copy { op, signal } => {
                let bytes = op.bytes();
                run_copy(&shared, &plan, op, bytes, copy_inline, &signal).await;
            }
            Queued::CopyD2d { op, signal } => {
                let bytes = op.bytes();
                run_copy(&shared, &plan, op, bytes, copy_inline_d2d, &signal).await;
            }
            Queued::Record { signal } => {
                if plan.never {
                    shared.held(plan.generation).await;
                }
                signal.complete();
            }
            Queued::Wait { event } => event.signal().settled().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Arena, ArenaConfig};
    use tokio::time::Instant;

    #[tokio::test(start_paused = true)]
    async fn faults_fire_by_trigger() {
        let dev = SimDevice::new(SimConfig::new(2).with_fault(Fault::NeverComplete, Trigger::Nth(2))).unwrap();
        let s = dev.create_stream("s").unwrap();
        let e1 = s.record("one").unwrap();
        let e2 = s.record("two").unwrap();
        let e3 = s.record("three").unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        e1.wait(deadline).await.unwrap();
        assert!(matches!(
            e2.wait(deadline).await,
            Err(DeviceError::Timeout { rank: 2, .. })
        ));
        assert!(!e3.is_complete(), "stream order: three waits behind two");
        assert_eq!(dev.stuck(), 1);
        dev.release_stuck();
        e3.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
        assert!(e2.is_complete());
        assert_eq!(dev.operations(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn memory_limit_is_enforced_and_returned() {
        let dev = SimDevice::new(SimConfig::new(0).with_memory(8192)).unwrap();
        let a = dev.alloc(8192).unwrap();
        assert!(matches!(
            dev.alloc(1),
            Err(DeviceError::OutOfMemory { requested: 1, .. })
        ));
        drop(a);
        assert_eq!(dev.memory_used(), 0);
        let _b = dev.alloc(4096).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn invalid_configs_are_rejected() {
        assert!(matches!(
            SimDevice::new(SimConfig::new(0).with_bandwidth(0)),
            Err(DeviceError::InvalidArgument(_))
        ));
        assert!(matches!(
            SimDevice::new(SimConfig::new(0).with_fault(Fault::Slow(0), Trigger::Every)),
            Err(DeviceError::InvalidArgument(_))
        ));
        let dev = SimDevice::new(SimConfig::new(0)).unwrap();
        assert!(dev
            .inject(FaultRule {
                fault: Fault::Stall,
                trigger: Trigger::Nth(0)
            })
            .is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn stall_holds_bytes_back_until_release() {
        let dev = SimDevice::new(SimConfig::new(1)).unwrap();
        dev.inject(FaultRule {
            fault: Fault::Stall,
            trigger: Trigger::Next,
        })
        .unwrap();
        let arena = Arena::new(ArenaConfig::new(4096, 2).unpinned()).unwrap();
        let buf = dev.alloc(100).unwrap();
        buf.write(0, &[9; 100]).unwrap();
        let s = dev.create_stream("s").unwrap();
        let mut lease = arena.try_alloc(1).unwrap();
        lease.write_at(0, &[0; 100]).unwrap();
        let p = s.copy_d2h(&buf, 0, lease, 0, 100, "stalled").unwrap();
        let ev = p.event().clone();
        let err = p.wait(Instant::now() + Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(err, DeviceError::Timeout { .. }));
        assert_eq!(arena.stats().quarantined_pages, 1);
        dev.release_stuck();
        ev.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
        assert_eq!(arena.stats().quarantined_pages, 0);
        assert_eq!(arena.stats().free_pages, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn exported_memory_copies_device_to_device_on_the_importer_stream() {
        use crate::device::D2dSegment;
        let producer = SimDevice::new(SimConfig::new(0).with_shared_memory(true)).unwrap();
        let consumer = SimDevice::new(SimConfig::new(1)).unwrap();
        assert!(
            consumer.alloc(10).unwrap().export_handle().is_err(),
            "private by default"
        );
        let src = producer.alloc(4096).unwrap();
        src.write(0, &[7; 4096]).unwrap();
        let imported = consumer.open_ipc(&src.export_handle().unwrap()).unwrap();
        assert!(imported.is_read_only());
        assert!(imported.write(0, &[1]).is_err(), "imports are never written");
        let dst = consumer.alloc(4096).unwrap();
        let s = consumer.create_stream("d2d").unwrap();
        let seg = D2dSegment {
            src: imported.slice(0, 4096),
            dst: dst.slice(0, 4096),
        };
        // A read-only destination is refused before anything is queued.
        let back = D2dSegment {
            src: dst.slice(0, 10),
            dst: imported.slice(0, 10),
        };
        assert!(matches!(
            s.copy_d2d(&[back], "bad"),
            Err(DeviceError::InvalidArgument(_))
        ));
        let ev = s.copy_d2d(std::slice::from_ref(&seg), "d2d").unwrap();
        ev.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
        assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![7; 4096]);
        // A stuck copy times out; its bytes may land, its event settles on release.
        consumer
            .inject(FaultRule {
                fault: Fault::NeverComplete,
                trigger: Trigger::Next,
            })
            .unwrap();
        let ev = s.copy_d2d(&[seg], "stuck").unwrap();
        assert!(matches!(
            ev.wait(Instant::now() + Duration::from_millis(100)).await,
            Err(DeviceError::Timeout { rank: 1, .. })
        ));
        consumer.release_stuck();
        ev.wait(Instant::now() + Duration::from_secs(1)).await.unwrap();
        // A host device refuses to open another process's memory.
        let engine = crate::copy::CopyEngine::new(crate::copy::CopyConfig::default()).unwrap();
        let host = crate::device::HostDevice::new(engine, 0).unwrap();
        assert!(host.open_ipc(&src.export_handle().unwrap()).is_err());
    }
}
