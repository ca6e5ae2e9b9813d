//! The consumer's requests that land bytes in a destination: the eager `get` (and
//! `get_blocking`, which waits for it from a plain thread through
//! `Consumer::blocking`, the one blocking wait), the delayed pull's second
//! step `resolve`, and the delayed pull in one call (`start_pull`). Each comes as
//! `start_*`, a [`Transfer`] whose [`DrainFence`] exists before the transfer completes,
//! and as an `async fn` built on it. All of them run their transfer task (see
//! `transfer`) through [`Consumer::run_fenced`], the one place a transfer's deadline is
//! enforced; every `Timeout` reports the time waited since the caller's call began.
//!
//! # Cancellation
//!
//! Dropping an `async fn` future that started a transfer cancels the transfer; its
//! task drains in the background (receive dropped, landing copy stopped, staging
//! returned, `Done` sent) and its fence fires when nothing writes the destination any
//! more. A caller that may drop the future and must reuse the destination uses the
//! `start_*` form and waits on the fence. A `start_pull` dropped while staging wrote
//! nothing; the producer's lease then ends by its TTL.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::super::error::PeerError;
use super::super::selection::LandingPlan;
use super::client::Consumer;
use super::shared::{check_keys, Request, TaskError};
use super::types::{Destination, GetFailure, Landed, StagedHandle, Transfer};
use crate::copy::{DrainFence, DrainSignal};
use crate::net::NetError;
use crate::wire::{ChunkKey, SelectionError};

/// How much later than its deadline [`Consumer::blocking`] gives up waiting for a
/// transfer's own answer (which normally arrives at the deadline).
const BLOCKING_SLACK: Duration = Duration::from_millis(500);

impl Consumer {
    /// Delayed pull, step two: moves the staged bytes into `dst`. Refused with
    /// `LeaseExpired` when less than the guard margin is left on the lease, and with
    /// `StaleIncarnation` when the producer has restarted since.
    ///
    /// # Cancellation
    ///
    /// Dropping the future cancels the transfer; its work drains in the background.
    /// A caller that may drop it and must know when the destination is quiet uses
    /// [`start_resolve`](Self::start_resolve), whose fence is known up front.
    pub async fn resolve(
        &self,
        handle: StagedHandle,
        dst: Destination,
        deadline: Instant,
    ) -> Result<Landed, GetFailure> {
        self.start_resolve(handle, dst, deadline).await
    }

    /// [`resolve`](Self::resolve) as a [`Transfer`]: its [`DrainFence`] is available
    /// before it completes and fires only once nothing writes `dst` any more, also
    /// when the transfer is dropped (cancelled) half-way.
    pub fn start_resolve(&self, handle: StagedHandle, dst: Destination, deadline: Instant) -> Transfer {
        let (signal, fence) = DrainFence::pair();
        let (this, f) = (self.clone(), fence.clone());
        // The call's own instant, not the first poll's: a runtime on a busy host may
        // poll the transfer late, and `waited` runs on the deadline's clock.
        let started = Instant::now();
        // Dropped before its first poll, the future drops `signal` and the fence fires.
        let fut = async move { this.resolve_fenced(handle, dst, deadline, started, signal, f).await };
        Transfer {
            fence,
            fut: Box::pin(fut),
        }
    }

    /// Delayed pull in one call: asks `peer` to stage `keys`, then moves the staged
    /// chunks into `dst` under the same `deadline`, as one [`Transfer`] with one fence
    /// (it fires once nothing writes `dst`, whichever step a cancel interrupts). A
    /// stage that fails, or a transfer dropped while staging, wrote nothing; the
    /// producer's lease then ends by its TTL. With a selection on `dst`, only the
    /// selected bytes are staged (the destination's expectation travels with the
    /// stage, so a mismatch is refused before anything is staged).
    pub fn start_pull(&self, peer: &str, keys: &[ChunkKey], dst: Destination, deadline: Instant) -> Transfer {
        let select = match &dst.select {
            None => None,
            Some(sel) => match dst.check_selected(sel) {
                Ok(wire) => Some((sel.clone(), wire)),
                Err(error) => return Transfer::failed(error),
            },
        };
        let (signal, fence) = DrainFence::pair();
        let (this, peer, keys, f) = (self.clone(), peer.to_string(), keys.to_vec(), fence.clone());
        // The call's instant (see `start_resolve`).
        let started = Instant::now();
        let fut = async move {
            let wait = dst.await_published;
            match this.stage_awaiting(&peer, &keys, select, wait, deadline).await {
                Ok(handle) => this.resolve_fenced(handle, dst, deadline, started, signal, f).await,
                Err(error) => {
                    drop(signal);
                    Err(GetFailure::clean(error, f))
                }
            }
        };
        Transfer {
            fence,
            fut: Box::pin(fut),
        }
    }

    async fn resolve_fenced(
        &self,
        handle: StagedHandle,
        dst: Destination,
        deadline: Instant,
        started: Instant,
        signal: DrainSignal,
        fence: DrainFence,
    ) -> Result<Landed, GetFailure> {
        let refuse = |error, signal: DrainSignal, fence| {
            drop(signal); // nothing was started: the destination is untouched
            Err(GetFailure::clean(error, fence))
        };
        let now = Instant::now();
        let remaining = handle.expires.saturating_duration_since(now);
        if remaining < self.inner.cfg.lease_guard {
            let error = PeerError::LeaseExpired {
                lease_id: handle.lease_id,
                remaining,
            };
            return refuse(error, signal, fence);
        }
        let current = self.pool(&handle.peer).map(|p| p.incarnation()).unwrap_or(0);
        if current != 0 && current != handle.incarnation {
            let error = PeerError::StaleIncarnation {
                handle: handle.incarnation,
                current,
            };
            return refuse(error, signal, fence);
        }
        if handle.chunks.is_empty() {
            drop(signal);
            return Ok(Landed {
                chunks: 0,
                bytes: 0,
                checksum: 0,
            });
        }
        let mut dst = dst;
        if let Err(error) = check_resolve(&handle, &mut dst) {
            return refuse(error, signal, fence);
        }
        let peer = handle.peer.clone();
        let deadline = deadline.min(now + remaining);
        self.run_fenced(&peer, Request::Pull { handle }, dst, deadline, started, signal, fence)
            .await
    }

    /// Eager get: the peer stages `keys` and sends them at once; they land in `dst`.
    ///
    /// # Cancellation
    ///
    /// Dropping the future cancels the transfer; its work drains in the background
    /// (use [`start_get`](Self::start_get) to hold the fence that says when).
    pub async fn get(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        deadline: Instant,
    ) -> Result<Landed, GetFailure> {
        self.start_get(peer, keys, dst, deadline).await
    }

    /// The synchronous get: [`start_get`](Self::start_get) waited for by
    /// `blocking`, the one blocking wait (see there).
    pub fn get_blocking(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        timeout: Duration,
    ) -> Result<Landed, GetFailure> {
        self.blocking(timeout, |deadline| self.start_get(peer, keys, dst, deadline))
    }

    /// The one blocking wait of a transfer (this consumer's and the engine's
    /// `get_blocking`): `start` makes the transfer, given its deadline `timeout` from
    /// now, on the consumer's runtime; this thread waits for its answer and returns
    /// within `timeout` (plus scheduling slack) with the result or `Timeout`. On
    /// timeout the transfer was cancelled by its own deadline and drains in the
    /// background; the returned failure's fence fires when the destination is quiet.
    /// Must not be called from inside an async task (it blocks the thread).
    pub(crate) fn blocking(
        &self,
        timeout: Duration,
        start: impl FnOnce(Instant) -> Transfer,
    ) -> Result<Landed, GetFailure> {
        let fail = |error| Err(GetFailure::clean(error, DrainFence::ready()));
        if timeout.is_zero() {
            return fail(PeerError::InvalidArgument("timeout must be greater than zero".into()));
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            return fail(PeerError::InvalidArgument(
                "get_blocking called from inside an async runtime; use get() there".into(),
            ));
        }
        let transfer = {
            let _entered = self.inner.runtime.enter();
            start(Instant::now() + timeout)
        };
        let fence = transfer.fence();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        // The transfer enforces its own deadline (`run_fenced`); this thread only waits
        // for its answer. Dropping the task (runtime shutdown) cancels the transfer.
        self.inner.runtime.spawn(async move {
            let _ = tx.send(transfer.await);
        });
        // A little slack over the deadline: the answer normally arrives at it.
        match rx.recv_timeout(timeout + BLOCKING_SLACK) {
            Ok(r) => r,
            Err(_) => Err(GetFailure {
                error: PeerError::Net(NetError::Protocol(
                    "transfer task gave no answer by its deadline (runtime shut down?)".into(),
                )),
                fence,
                dirty: true,
            }),
        }
    }

    /// Starts an eager get whose [`DrainFence`] is available *before* it completes:
    /// a caller that may drop the transfer (cancel it) keeps the fence and waits on it
    /// before reusing the destination blocks.
    pub fn start_get(&self, peer: &str, keys: &[ChunkKey], dst: Destination, deadline: Instant) -> Transfer {
        let (signal, fence) = DrainFence::pair();
        let checked = check_keys(keys, self.max_keys()).and_then(|_| match &dst.select {
            None => dst.check(keys.len()).map(|_| None),
            Some(sel) => dst.check_selected(sel).map(Some),
        });
        let select = match checked {
            Ok(s) => s,
            Err(error) => {
                drop(signal);
                let f = fence.clone();
                return Transfer {
                    fence,
                    fut: Box::pin(async move { Err(GetFailure::clean(error, f)) }),
                };
            }
        };
        let (this, peer, keys, f) = (self.clone(), peer.to_string(), keys.to_vec(), fence.clone());
        // The call's instant (see `start_resolve`).
        let started = Instant::now();
        // Dropped before its first poll, the future drops `signal` and the fence fires.
        let fut = async move {
            this.run_fenced(&peer, Request::Get { keys, select }, dst, deadline, started, signal, f)
                .await
        };
        Transfer {
            fence,
            fut: Box::pin(fut),
        }
    }

    /// Runs a transfer task and awaits it under `deadline`; cancels it (drain in the
    /// background, `signal` moves into the task) when the deadline passes or this
    /// future is dropped. This is the one place a transfer's deadline is enforced: the
    /// task itself only obeys its cancellation token (see `transfer`'s "Deadlines").
    /// `started` is when the caller's operation began: every `Timeout` it returns
    /// reports the time waited since then, one clock for all.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_fenced(
        &self,
        peer: &str,
        req: Request,
        dst: Destination,
        deadline: Instant,
        started: Instant,
        signal: DrainSignal,
        fence: DrainFence,
    ) -> Result<Landed, GetFailure> {
        // A child of the peer's watch: the directory declaring the peer restarted or
        // lost cancels it, and `explain` turns that cancellation into the reason.
        let watch = self.peer_watch(peer);
        let cancel = watch.child_token();
        // If this future is dropped, the guard cancels the transfer.
        let guard = cancel.clone().drop_guard();
        let this = self.clone();
        let span = self.transfer_span(peer, &req);
        let (peer, c2) = (peer.to_string(), cancel.clone());
        let task = self.inner.runtime.spawn(
            async move {
                let r = this.transfer(&peer, req, dst, deadline, c2, signal).await;
                r.map_err(|e| watch.explain(e))
            }
            .instrument(span),
        );
        let out = tokio::time::timeout_at(deadline, task).await;
        let timed_out = matches!(
            out,
            Err(_)
                | Ok(Ok(Err(TaskError {
                    error: PeerError::Timeout { .. },
                    ..
                })))
        );
        if timed_out {
            self.inner.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        match out {
            Ok(Ok(r)) => {
                guard.disarm();
                r.map_err(|mut e| {
                    // Whichever inner step hit its bound (a checkout, a reply, the
                    // receive), the caller waited since it started.
                    if let PeerError::Timeout { waited, .. } = &mut e.error {
                        *waited = started.elapsed();
                    }
                    e.with_fence(fence)
                })
            }
            Ok(Err(join)) => Err(GetFailure {
                error: PeerError::Net(NetError::Protocol(format!("transfer task failed: {join}"))),
                fence,
                dirty: true,
            }),
            Err(_) => {
                drop(guard); // cancels
                Err(GetFailure {
                    error: PeerError::Timeout {
                        op: "get",
                        waited: started.elapsed(),
                    },
                    fence,
                    dirty: true,
                })
            }
        }
    }
}

/// Checks a destination for resolving `handle`: without a selection as for `get`
/// (the staged chunks land in the leading destination chunks); with one, the
/// destination lands the staged stream by its own selection (same blocks and source
/// ranges as staged) or by the staged one's destination ranges, and must fit the
/// stream's shape.
fn check_resolve(handle: &StagedHandle, dst: &mut Destination) -> Result<(), PeerError> {
    let Some(staged) = &handle.selection else {
        if dst.select.is_some() {
            let why = "the handle was staged without a selection; stage with one to resolve with one";
            return Err(SelectionError::Unsupported(why.into()).into());
        }
        return dst.check(handle.chunks.len().min(dst.chunks.len()).max(1));
    };
    let select = match dst.select.take() {
        None => staged.select.clone(),
        Some(s) if s.blocks() == staged.select.blocks() && s.src_ranges() == staged.select.src_ranges() => s,
        Some(_) => {
            let why = "the resolve's selection names other blocks or source ranges than were staged";
            return Err(SelectionError::Unsupported(why.into()).into());
        }
    };
    let blocks = dst.flat_blocks();
    dst.map()
        .check_blocks(&blocks)
        .map_err(|e| PeerError::InvalidArgument(format!("destination blocks: {e}")))?;
    LandingPlan::new(dst.map(), &blocks, &select, &staged.shape)?;
    dst.select = Some(select);
    Ok(())
}
