//! The host backend: device memory is host memory, copies run on the
//! [`CopyEngine`].
//!
//! Each stream is an executor task on the tokio runtime captured when the device was
//! created. It takes queued work in order: a copy is submitted to the copy engine as one
//! [`CopyPlan`] per device buffer, and its event completes only once every plan has
//! been handed back — after every copy thread has left it — so completion means the
//! lease's pages are quiet. A record completes when reached; a wait blocks the stream
//! (not a thread) until the awaited event settles.
//!
//! # Cancellation
//!
//! If the runtime shuts down while a copy runs, the executor's [`CopyJob`]s are dropped,
//! which cancels them without freeing memory under a copy thread (the plans keep the
//! pages held until drained); the copy's event then never completes, so a caller that
//! waits for it times out and the lease stays quarantined.
//!
//! [`CopyJob`]: crate::copy::CopyJob

use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};

use crate::copy::{CopyEngine, CopyPlan, Endpoint};
use crate::mem::{HostMemory, Region};

use super::buffer::{DeviceBuffer, HostBuffer};
use super::event::{Event, EventMeta, PushSignal};
use super::executor::{enqueue, Queued};
use super::stream::{CopyDirection, CopyOp, Stream, StreamBackend};
use super::{next_device_id, Device, DeviceError, DeviceKind};

/// A device whose memory is host memory and whose copies run on a [`CopyEngine`].
pub struct HostDevice {
    id: u64,
    rank: u32,
    engine: CopyEngine,
    rt: Handle,
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .finish()
    }
}

impl HostDevice {
    /// A host device for `rank` using `engine`, running its streams on the current tokio
    /// runtime. Fails with [`DeviceError::InvalidArgument`] outside a runtime.
    pub fn new(engine: CopyEngine, rank: u32) -> Result<Arc<HostDevice>, DeviceError> {
        let rt = Handle::try_current().map_err(|_| {
            DeviceError::InvalidArgument(
                "a host device must be created inside a tokio runtime (or use with_runtime)".into(),
            )
        })?;
        Ok(Self::with_runtime(engine, rank, rt))
    }

    /// A host device whose streams run on `rt`.
    pub fn with_runtime(engine: CopyEngine, rank: u32, rt: Handle) -> Arc<HostDevice> {
        Arc::new(HostDevice {
            id: next_device_id(),
            rank,
            engine,
            rt,
        })
    }

    /// Uses a registered host region as this device's memory (e.g. an engine's KV cache
    /// held in host memory). The region stays alive while any copy targets it.
    pub fn wrap_region(&self, region: Arc<Region>) -> DeviceBuffer {
        DeviceBuffer::new(Arc::new(HostBuffer::new(self.id, region, None)))
    }

    /// The copy engine the device uses.
    pub fn engine(&self) -> &CopyEngine {
        &self.engine
    }
}

impl Device for HostDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Host
    }

    fn rank(&self) -> u32 {
        self.rank
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn name(&self) -> String {
        format!("host device {} (rank {})", self.id, self.rank)
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer, DeviceError> {
        let region = Region::host(format!("host-device-{}", self.id), len)?;
        Ok(self.wrap_region(Arc::new(region)))
    }

    fn create_stream(&self, name: &str) -> Result<Stream, DeviceError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.rt.spawn(run(self.engine.clone(), rx));
        Ok(Stream::new(Arc::new(HostStream {
            name: name.to_string(),
            device: self.id,
            rank: self.rank,
            tx,
        })))
    }
}

#[derive(Debug)]
struct HostStream {
    name: String,
    device: u64,
    rank: u32,
    tx: UnboundedSender<(Queued, ())>,
}

impl StreamBackend for HostStream {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_id(&self) -> u64 {
        self.device
    }

    fn rank(&self) -> u32 {
        self.rank
    }

    fn copy(&self, op: CopyOp) -> Result<Event, DeviceError> {
        if op.parts.iter().any(|p| p.buffer.backend().host_memory().is_none()) {
            return Err(DeviceError::InvalidArgument(
                "host stream given a buffer that is not host memory".into(),
            ));
        }
        let meta = op.meta.clone();
        let item = Queued::Copy {
            op,
            signal: PushSignal::new(),
        };
        Ok(enqueue(&self.tx, &self.name, item, Some(meta), ())?.expect("copies have events"))
    }

    fn record(&self, meta: EventMeta) -> Result<Event, DeviceError> {
        let item = Queued::Record {
            signal: PushSignal::new(),
        };
        Ok(enqueue(&self.tx, &self.name, item, Some(meta), ())?.expect("records have events"))
    }

    fn wait_event(&self, event: &Event) -> Result<(), DeviceError> {
        enqueue(&self.tx, &self.name, Queued::Wait { event: event.clone() }, None, ())?;
        Ok(())
    }
}

/// The stream's executor: runs queued work in order.
async fn run(engine: CopyEngine, mut rx: UnboundedReceiver<(Queued, ())>) {
    while let Some((item, ())) = rx.recv().await {
        match item {
            Queued::Copy { op, signal } => {
                match copy(&engine, op).await {
                    Ok(()) => signal.complete(),
                    Err(message) => signal.fail(message),
                };
            }
            Queued::Record { signal } => {
                signal.complete();
            }
            // Host streams refuse device-to-device copies at submission.
            Queued::CopyD2d { signal, .. } => {
                signal.fail("host streams do not copy device to device");
            }
            Queued::Wait { event } => event.signal().settled().await,
        }
    }
}

/// Runs one copy on the engine; returns once every plan is back (memory quiet).
async fn copy(engine: &CopyEngine, op: CopyOp) -> Result<(), String> {
    let CopyOp {
        host, parts, direction, ..
    } = op;
    let host: Arc<dyn HostMemory> = host;
    // Build every plan before submitting any, so an error here leaves nothing running.
    let mut plans = Vec::with_capacity(parts.len());
    for part in parts {
        let dev = part
            .buffer
            .backend()
            .host_memory()
            .ok_or("device buffer is not host memory")?;
        let (src, dst) = match direction {
            CopyDirection::DeviceToHost => (dev, host.clone()),
            CopyDirection::HostToDevice => (host.clone(), dev),
        };
        let mut plan = CopyPlan::new(Endpoint::Memory(src), Endpoint::Memory(dst));
        for s in &part.segments {
            plan.push(s.src, s.dst, s.len);
        }
        plans.push(plan);
    }
    let jobs: Vec<_> = plans.into_iter().map(|p| engine.copy(p)).collect();
    let mut first_error = None;
    // Await every job, even after one failed: each resolves only after it drained.
    for job in jobs {
        if let Err(failure) = job.await {
            first_error.get_or_insert_with(|| failure.error.to_string());
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::CopyConfig;
    use crate::mem::{Arena, ArenaConfig};
    use std::time::Duration;

    #[tokio::test]
    async fn stream_order_and_cross_stream_wait() {
        let engine = CopyEngine::new(CopyConfig {
            threads: 2,
            ..CopyConfig::default()
        })
        .unwrap();
        let dev = HostDevice::new(engine, 0).unwrap();
        let arena = Arena::new(ArenaConfig::new(4096, 4).unpinned()).unwrap();
        let a = dev.create_stream("a").unwrap();
        let b = dev.create_stream("b").unwrap();
        let (gate, trigger) = Event::manual("gate", 0);
        a.wait_event(&gate).unwrap();
        let on_a = a.record("after-gate").unwrap();
        b.wait_stream(&a, "a-done").unwrap();
        let buf = dev.alloc(4096).unwrap();
        buf.write(0, &[7; 4096]).unwrap();
        let pending = b
            .copy_d2h(&buf, 0, arena.try_alloc(1).unwrap(), 0, 4096, "d2h")
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!on_a.is_complete(), "a waits on the gate");
        assert!(!pending.event().is_complete(), "b waits on a");
        trigger.complete();
        let lease = pending
            .wait(tokio::time::Instant::now() + Duration::from_secs(30))
            .await
            .unwrap();
        assert!(on_a.is_complete());
        assert_eq!(lease.to_vec(0, 4096).unwrap(), vec![7; 4096]);
    }
}
