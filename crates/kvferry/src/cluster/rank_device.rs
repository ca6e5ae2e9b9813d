//! One rank's device side of the offload and land steps, on [`crate::device`].
//!
//! # Semantics
//!
//! A rank owns a [`Device`] (sim or host) with two buffers of `blocks × block_bytes`:
//! the KV cache (filled with a rank- and block-specific pattern) and a landing area. An
//! arena holds one page-rounded staging lease per block.
//!
//! - **Offload**: on the copy stream, after the compute stream's work (a stream wait on
//!   a fresh event), one D2H copy per block into a fresh lease; every copy is waited
//!   for with the step's deadline. The staged leases are kept by block until landed.
//! - **Land**: one H2D copy per staged block into the landing area at the block's
//!   offset, each waited for with the deadline; the leases return to the arena.
//!
//! Payload checksums are crc32c over the staged (offload) or landed (land) bytes, in
//! request order, so a leader can check that what landed is what was offloaded.
//!
//! Every device error becomes a [`RankFailure`]: [`DeviceError::Timeout`] →
//! `DeviceTimeout` (naming the operation and how long it waited), a failed copy or a
//! fault → `DeviceFault`, arena exhaustion → `Memory`, an unknown or unstaged block →
//! `BadRequest`. A copy whose wait timed out keeps its lease quarantined until the
//! device completes it (the device layer's guarantee); nothing is freed under it.
//!
//! # Faults
//!
//! - [`WorkerFault::StuckEvent`]: on sim, the step's first device operation gets
//!   [`Fault::NeverComplete`]; on host, the copy stream is made to wait for a manual
//!   event that is never triggered. Either way the copy's event never completes and
//!   the bounded wait reports `DeviceTimeout`.
//! - [`WorkerFault::Slow`]: the copy stream stalls for the given time before the step's
//!   copies (sim: [`Fault::Stall`] then [`SimDevice::release_stuck`]; host: a manual
//!   event triggered after the delay).
//!
//! # Cancellation
//!
//! Dropping an offload or land future stops waiting only: copies in flight keep their
//! leases (quarantined) until the device completes them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::config::{format_duration, DeviceKind, WorkerConfig, WorkerFault};
use super::protocol::{FailureKind, RankFailure, StepPayload};
use super::ClusterError;
use crate::copy::{CopyConfig, CopyEngine};
use crate::device::{
    Device, DeviceBuffer, DeviceError, Event, EventTrigger, Fault, FaultRule, HostDevice, PendingCopy, SimConfig,
    SimDevice, Stream, Trigger,
};
use crate::mem::{Arena, ArenaConfig, Lease};

/// The sim device's modelled copy speed: fast enough that steps take microseconds.
const SIM_LATENCY: Duration = Duration::from_micros(20);
const SIM_BANDWIDTH: u64 = 20 << 30;

/// A rank's device, buffers, streams and staged blocks.
#[derive(Debug)]
pub(crate) struct RankDevice {
    rank: u32,
    block_bytes: usize,
    blocks: u32,
    device: Arc<dyn Device>,
    sim: Option<Arc<SimDevice>>,
    kv: DeviceBuffer,
    landing: DeviceBuffer,
    compute: Stream,
    copy: Stream,
    arena: Arena,
    staged: Mutex<HashMap<u32, Lease>>,
    /// Serialises fault arming with the submissions it targets.
    submit: Mutex<()>,
    /// Triggers of manual events used to inject host faults (never fired when stuck).
    held: Mutex<Vec<EventTrigger>>,
}

/// The byte pattern of `block` on `rank`, at offset `i` of the block.
fn pattern(rank: u32, block: u32, i: usize) -> u8 {
    (i as u32).wrapping_mul(31) as u8 ^ (block as u8).wrapping_mul(7) ^ (rank as u8).wrapping_mul(101)
}

impl RankDevice {
    /// Opens the device of `config.setup.device` for `config.rank` and fills its KV
    /// buffer. Needs a tokio runtime (the device's streams run on it).
    pub(crate) fn open(config: &WorkerConfig) -> Result<RankDevice, ClusterError> {
        let setup = &config.setup;
        let rank = config.rank;
        let bad = |e: String| ClusterError::InvalidConfig {
            field: "device",
            reason: format!("rank {rank}: {e}"),
        };
        let (device, sim): (Arc<dyn Device>, _) = match setup.device {
            DeviceKind::Sim => {
                let sim = SimDevice::new(
                    SimConfig::new(rank)
                        .with_latency(SIM_LATENCY)
                        .with_bandwidth(SIM_BANDWIDTH),
                )
                .map_err(|e| bad(e.to_string()))?;
                (sim.clone(), Some(sim))
            }
            DeviceKind::Host => {
                let engine = CopyEngine::new(CopyConfig {
                    threads: 1,
                    ..CopyConfig::default()
                })
                .map_err(|e| bad(e.to_string()))?;
                (HostDevice::new(engine, rank).map_err(|e| bad(e.to_string()))?, None)
            }
        };
        let len = setup.block_bytes * setup.blocks as usize;
        let kv = device.alloc(len).map_err(|e| bad(e.to_string()))?;
        let landing = device.alloc(len).map_err(|e| bad(e.to_string()))?;
        let mut block = vec![0u8; setup.block_bytes];
        for b in 0..setup.blocks {
            for (i, byte) in block.iter_mut().enumerate() {
                *byte = pattern(rank, b, i);
            }
            kv.write(b as usize * setup.block_bytes, &block)
                .map_err(|e| bad(e.to_string()))?;
        }
        let compute = device.create_stream("compute").map_err(|e| bad(e.to_string()))?;
        let copy = device.create_stream("kv-copy").map_err(|e| bad(e.to_string()))?;
        let page = setup.block_bytes.div_ceil(4096) * 4096;
        let arena =
            Arena::new(ArenaConfig::new(page, setup.blocks as usize).unpinned()).map_err(|e| bad(e.to_string()))?;
        Ok(RankDevice {
            rank,
            block_bytes: setup.block_bytes,
            blocks: setup.blocks,
            device,
            sim,
            kv,
            landing,
            compute,
            copy,
            arena,
            staged: Mutex::new(HashMap::new()),
            submit: Mutex::new(()),
            held: Mutex::new(Vec::new()),
        })
    }

    fn failure(&self, kind: FailureKind, message: impl Into<String>) -> RankFailure {
        RankFailure {
            kind,
            rank: self.rank,
            message: message.into(),
        }
    }

    fn device_failure(&self, e: DeviceError) -> RankFailure {
        let kind = match &e {
            DeviceError::Timeout { .. } => FailureKind::DeviceTimeout,
            DeviceError::Mem(_) | DeviceError::OutOfMemory { .. } => FailureKind::Memory,
            DeviceError::InvalidArgument(_) => FailureKind::BadRequest,
            _ => FailureKind::DeviceFault,
        };
        let message = match &e {
            DeviceError::Timeout { op, waited, .. } => format!(
                "device event for {op:?} did not complete within {} (bounded wait)",
                format_duration(*waited)
            ),
            other => other.to_string(),
        };
        self.failure(kind, message)
    }

    fn check_blocks(&self, blocks: &[u32]) -> Result<(), RankFailure> {
        let mut seen = std::collections::HashSet::new();
        for &b in blocks {
            if b >= self.blocks {
                return Err(self.failure(
                    FailureKind::BadRequest,
                    format!("no block {b} (the rank has {})", self.blocks),
                ));
            }
            if !seen.insert(b) {
                return Err(self.failure(FailureKind::BadRequest, format!("block {b} listed twice")));
            }
        }
        Ok(())
    }

    /// Arms the step's fault just before its first submission.
    fn arm(&self, fault: Option<WorkerFault>, step: u64) -> Result<(), DeviceError> {
        match (fault, &self.sim) {
            (Some(WorkerFault::StuckEvent), Some(sim)) => sim.inject(FaultRule {
                fault: Fault::NeverComplete,
                trigger: Trigger::Next,
            }),
            (Some(WorkerFault::Slow(delay)), Some(sim)) => {
                sim.inject(FaultRule {
                    fault: Fault::Stall,
                    trigger: Trigger::Next,
                })?;
                let sim = sim.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    sim.release_stuck();
                });
                Ok(())
            }
            (Some(WorkerFault::StuckEvent), None) => {
                let (event, trigger) = Event::manual(format!("injected stuck event (step {step})"), self.rank);
                self.copy.wait_event(&event)?;
                self.held.lock().push(trigger);
                Ok(())
            }
            (Some(WorkerFault::Slow(delay)), None) => {
                let (event, trigger) = Event::manual(format!("injected slow device (step {step})"), self.rank);
                self.copy.wait_event(&event)?;
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    trigger.complete();
                });
                Ok(())
            }
            (Some(WorkerFault::Hang) | None, _) => Ok(()),
        }
    }

    /// Offloads `blocks` to staging (see the module docs).
    pub(crate) async fn offload(
        &self,
        step: u64,
        blocks: &[u32],
        fault: Option<WorkerFault>,
        deadline: Instant,
    ) -> Result<StepPayload, RankFailure> {
        self.check_blocks(blocks)?;
        {
            let staged = self.staged.lock();
            if let Some(b) = blocks.iter().find(|b| staged.contains_key(b)) {
                return Err(self.failure(FailureKind::BadRequest, format!("block {b} is already staged")));
            }
        }
        let pages = self.arena.pages_for(self.block_bytes);
        let mut leases = Vec::with_capacity(blocks.len());
        for _ in blocks {
            let lease = self
                .arena
                .alloc(pages, deadline)
                .await
                .map_err(|e| self.failure(FailureKind::Memory, e.to_string()))?;
            leases.push(lease);
        }
        let pending: Vec<PendingCopy> = {
            let _submit = self.submit.lock();
            self.arm(fault, step).map_err(|e| self.device_failure(e))?;
            // Offload after the compute stream's work.
            self.copy
                .wait_stream(&self.compute, &format!("step {step}: compute done"))
                .map_err(|e| self.device_failure(e))?;
            let mut pending = Vec::with_capacity(blocks.len());
            for (&b, lease) in blocks.iter().zip(leases) {
                let op = format!("d2h block {b} (step {step})");
                let copy = self
                    .copy
                    .copy_d2h(&self.kv, b as usize * self.block_bytes, lease, 0, self.block_bytes, &op)
                    .map_err(|e| self.device_failure(e))?;
                pending.push(copy);
            }
            pending
        };
        let mut crc = 0;
        let mut staged = Vec::with_capacity(blocks.len());
        for (&b, copy) in blocks.iter().zip(pending) {
            let lease = copy.wait(deadline).await.map_err(|e| self.device_failure(e))?;
            let bytes = lease
                .to_vec(0, self.block_bytes)
                .map_err(|e| self.failure(FailureKind::Memory, e.to_string()))?;
            crc = crate::checksum::append(crc, &bytes);
            staged.push((b, lease));
        }
        self.staged.lock().extend(staged);
        Ok(StepPayload::Offloaded {
            blocks: blocks.len() as u32,
            bytes: (blocks.len() * self.block_bytes) as u64,
            checksum: crc,
        })
    }

    /// Lands staged `blocks` on the device (see the module docs).
    pub(crate) async fn land(
        &self,
        step: u64,
        blocks: &[u32],
        fault: Option<WorkerFault>,
        deadline: Instant,
    ) -> Result<StepPayload, RankFailure> {
        self.check_blocks(blocks)?;
        let leases: Vec<Lease> = {
            let mut staged = self.staged.lock();
            if let Some(b) = blocks.iter().find(|b| !staged.contains_key(b)) {
                return Err(self.failure(FailureKind::BadRequest, format!("block {b} is not staged")));
            }
            blocks.iter().filter_map(|b| staged.remove(b)).collect()
        };
        let pending: Vec<PendingCopy> = {
            let _submit = self.submit.lock();
            self.arm(fault, step).map_err(|e| self.device_failure(e))?;
            let mut pending = Vec::with_capacity(blocks.len());
            for (&b, lease) in blocks.iter().zip(leases) {
                let op = format!("h2d block {b} (step {step})");
                let copy = self
                    .copy
                    .copy_h2d(
                        lease,
                        0,
                        &self.landing,
                        b as usize * self.block_bytes,
                        self.block_bytes,
                        &op,
                    )
                    .map_err(|e| self.device_failure(e))?;
                pending.push(copy);
            }
            pending
        };
        for copy in pending {
            // The lease comes back once the device has read it; it returns to the arena.
            drop(copy.wait(deadline).await.map_err(|e| self.device_failure(e))?);
        }
        let mut crc = 0;
        for &b in blocks {
            let bytes = self
                .landing
                .to_vec(b as usize * self.block_bytes, self.block_bytes)
                .map_err(|e| self.device_failure(e))?;
            crc = crate::checksum::append(crc, &bytes);
        }
        Ok(StepPayload::Landed {
            blocks: blocks.len() as u32,
            bytes: (blocks.len() * self.block_bytes) as u64,
            checksum: crc,
        })
    }

    /// The device's name.
    pub(crate) fn name(&self) -> String {
        self.device.name()
    }
}
