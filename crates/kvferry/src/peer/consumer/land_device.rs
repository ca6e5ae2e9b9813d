//! Landing a transfer's verified chunks into a device cache: the scatter plan (each
//! chunk from its offset in the receiver's staging pages into its destination ranges)
//! and the one host-to-device scatter, waited for until the transfer is cancelled or
//! the cache's op timeout passes. A scatter that may still be writing when the wait
//! ends is left to the transfer's drain (`unconfirmed`): the caller's fence fires only
//! once the device settled it.

use std::sync::Arc;

use super::super::error::PeerError;
use super::transfer::TransferCtx;
use super::types::Landed;
use crate::device::{DeviceError, DeviceKvCache};
use crate::mem::Lease;
use crate::wire::ChunkMeta;

/// A host-to-device scatter: `(offset in the staging lease, destination ranges)`.
pub(super) type ScatterPlan = Vec<(usize, Vec<(usize, usize)>)>;

impl TransferCtx<'_> {
    /// The scatter plan of whole chunks: chunk `i` from `offsets[i]` into its blocks.
    pub(super) fn device_plan(
        &self,
        cache: &DeviceKvCache,
        offsets: &[usize],
        chunks: &[ChunkMeta],
    ) -> Result<ScatterPlan, PeerError> {
        let mut plan = Vec::with_capacity(chunks.len());
        for (i, meta) in chunks.iter().enumerate() {
            plan.push((offsets[i], cache.chunk_ranges(&self.dst.chunks[i], meta.len as usize)?));
        }
        Ok(plan)
    }

    /// Lands verified chunks from staging pages into a device cache: one host-to-device
    /// scatter on the cache's copy stream, waited for until the transfer is cancelled
    /// (the caller, or its deadline) or the cache's op timeout. If the wait ends early
    /// (cancel, failure), the pages stay quarantined until the device confirms, and the
    /// task keeps waiting for that confirmation (bounded) before it lets the caller's
    /// fence fire: destination blocks are reported quiet only after the scatter drained.
    pub(super) async fn land_on_device(
        &mut self,
        cache: &Arc<DeviceKvCache>,
        lease: Lease,
        plan: ScatterPlan,
        landed: Landed,
    ) -> Result<Landed, PeerError> {
        let device_err = |error| PeerError::Device {
            cache: cache.name().to_string(),
            error,
        };
        self.dirty = true;
        let pending = cache
            .scatter(lease, &plan, "land: host-to-device scatter")
            .map_err(device_err)?;
        let event = pending.event().clone();
        let deadline = event.meta().submitted() + cache.op_timeout();
        let cancel = self.cancel.clone();
        let waited = tokio::select! {
            r = pending.wait(deadline) => r.map(drop),
            _ = cancel.cancelled() => Err(DeviceError::Timeout {
                op: "land: host-to-device scatter (cancelled)".into(),
                rank: cache.device().rank(),
                waited: event.meta().submitted().elapsed(),
            }),
        };
        match waited {
            Ok(()) => {
                self.dirty = false;
                Ok(landed)
            }
            Err(e) => {
                // The scatter may still be writing the destination: wait (bounded) for
                // the device to settle it before the fence may fire.
                self.unconfirmed = Some(event);
                if self.cancel.is_cancelled() {
                    return Err(PeerError::Cancelled);
                }
                Err(device_err(e))
            }
        }
    }
}
