//! The transfer task: one per get or pull, owning everything it touches (the
//! connection, the receiver staging lease or the destination blocks, the landing copy)
//! until it has stopped.
//!
//! # Cancellation
//!
//! The task is cancelled through its [`CancellationToken`] (never by dropping it):
//! a receive in progress is dropped (the connection closes, nothing writes any more), a
//! landing copy is cancelled and awaited until its started slices stopped; only then
//! does the task drop its [`DrainSignal`], firing the caller's fence.
//!
//! # Deadlines
//!
//! The task watches no clock of its own for the transfer's deadline: `run_fenced`
//! (in `client`) is the one place that enforces it, by cancelling this task's token
//! when the deadline passes and answering the caller `Timeout` at once. The deadline
//! reaches the task only as `connect_bound`, the bound the connection pool's checkout
//! needs (the same instant, so it never outlives the transfer). Device landings
//! (`land_device`) are bounded by the cache's own op timeout as well as by
//! cancellation.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::super::error::PeerError;
use super::super::selection::LandingPlan;
use super::client::Consumer;
use super::shared::{check_frames, unexpected, Request, TaskError, OUTCOMES};
use super::types::{Destination, Landed, TransferPath};
use crate::copy::{CopyPlan, DrainFence, DrainSignal, Endpoint};
use crate::device::KvCacheRef;
use crate::layout::KvCache;
use crate::mem::{HostMemory, Lease};
use crate::net::{NetError, Pool, PooledConnection};
use crate::peer::movers::{BulkMover, Carried, Cma, DeviceIpc, Route, Socket};
use crate::wire::{ChunkKey, ChunkMeta, Message, SelectedShape, SelectionError};

/// How long a transfer's drain waits for a device to settle a landing copy that
/// outlived the transfer before declaring it unconfirmed.
const DEVICE_DRAIN_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

fn inner_done_timeout(c: &Consumer) -> std::time::Duration {
    c.inner.cfg.done_timeout
}

/// Where a chunk's received bytes go.
pub(in crate::peer) enum Sink {
    /// Receiver staging pages, chunk `i` at `offsets[i]`.
    Staging { lease: Lease, offsets: Vec<usize> },
    /// Straight into the destination blocks of a host cache (a device cache is
    /// always staged, so only a host cache is ever a direct sink).
    Direct(Arc<KvCache>),
    /// The staging pages are lent to a same-host read (`mapped`) in progress, or a
    /// device-IPC copy landed the chunks in place (nothing to land from staging).
    Lent,
    /// A device destination's staging, not taken yet: a device-IPC copy needs none,
    /// so the pages are taken only when the bytes come by the socket or by CMA
    /// ([`TransferCtx::take_staging`]).
    Deferred,
}

/// Everything one transfer needs, owned by its task.
pub(in crate::peer) struct TransferCtx<'a> {
    pub(in crate::peer) consumer: &'a Consumer,
    pub(in crate::peer) pool: Pool,
    pub(in crate::peer) dst: Destination,
    /// Upper bound for the connection pool's checkout (the transfer's deadline, which
    /// `run_fenced` enforces by cancelling `cancel`).
    connect_bound: Instant,
    pub(in crate::peer) cancel: CancellationToken,
    /// The producer lease to release with `Done` if the transfer did not already.
    pub(in crate::peer) lease_to_release: Option<crate::wire::LeaseId>,
    /// Set once bytes may have been written into the destination blocks.
    pub(in crate::peer) dirty: bool,
    /// A device copy into the destination that had not settled when the transfer
    /// ended: the fence waits for it.
    pub(in crate::peer) unconfirmed: Option<crate::device::Event>,
    /// A selected transfer's landing (set once the producer announced its stream).
    pub(in crate::peer) landing: Option<LandingPlan>,
    /// A same-host read's copy job: started reads may outlive a cancelled receive,
    /// and the transfer's fence waits for this one first.
    pub(in crate::peer) copy_fence: Option<DrainFence>,
}

impl Consumer {
    /// The transfer task body. `signal` drops (firing the caller's fence) only after
    /// everything that touched the destination or staging pages has stopped.
    pub(in crate::peer) async fn transfer(
        &self,
        peer: &str,
        req: Request,
        dst: Destination,
        deadline: Instant,
        cancel: CancellationToken,
        signal: DrainSignal,
    ) -> Result<Landed, TaskError> {
        let inner = &self.inner;
        let counters = &inner.counters;
        let started = Instant::now();
        counters.draining.fetch_add(1, Ordering::Relaxed);
        let pool = match self.pool(peer) {
            Ok(p) => p,
            Err(error) => {
                counters.draining.fetch_sub(1, Ordering::Relaxed);
                return Err(TaskError { error, dirty: false });
            }
        };
        let mut ctx = TransferCtx {
            consumer: self,
            pool,
            dst,
            connect_bound: deadline,
            cancel,
            lease_to_release: None,
            dirty: false,
            unconfirmed: None,
            landing: None,
            copy_fence: None,
        };
        let result = ctx.run_awaiting(req).await;
        let outcome = match &result {
            Ok(l) => {
                counters.completed.fetch_add(1, Ordering::Relaxed);
                counters.bytes.fetch_add(l.bytes as u64, Ordering::Relaxed);
                counters.chunks_landed.fetch_add(l.chunks as u64, Ordering::Relaxed);
                0
            }
            Err(PeerError::Cancelled) => {
                counters.cancelled.fetch_add(1, Ordering::Relaxed);
                2
            }
            Err(e) => {
                if matches!(e, PeerError::ChecksumMismatch { .. }) {
                    counters.checksum_failures.fetch_add(1, Ordering::Relaxed);
                }
                counters.failed.fetch_add(1, Ordering::Relaxed);
                1
            }
        };
        let elapsed = started.elapsed();
        inner.latency[outcome].observe(elapsed);
        let span = tracing::Span::current();
        span.record("outcome", OUTCOMES[outcome]);
        match &result {
            Ok(l) => {
                span.record("bytes", l.bytes);
                tracing::debug!(target: "kvferry::peer", outcome = OUTCOMES[outcome], bytes = l.bytes,
                    landed = l.chunks, ?elapsed, path = %ctx.dst.path, "transfer ended");
            }
            Err(PeerError::Cancelled) => {
                tracing::debug!(target: "kvferry::peer", outcome = OUTCOMES[outcome], ?elapsed, "transfer ended")
            }
            Err(e) => {
                tracing::info!(target: "kvferry::peer", outcome = OUTCOMES[outcome], error = %e, ?elapsed,
                    dirty = ctx.dirty, "transfer ended")
            }
        }
        let (dirty, lease_to_release, unconfirmed) = (ctx.dirty, ctx.lease_to_release.take(), ctx.unconfirmed.take());
        let copy_fence = ctx.copy_fence.take();
        // The destination's registration stays held until the fence fires.
        let hold = ctx.dst.hold.take();
        // Everything that touched the destination or the staging pages has finished:
        // the connection, the staging lease and the landing job are gone with `ctx`.
        drop(ctx);
        // A same-host read dropped mid-way: its started slices end first (each is one
        // bounded system call).
        if let Some(fence) = copy_fence {
            fence.wait().await;
        }
        if let Some(event) = unconfirmed {
            // Destination blocks are quiet only once the device settled the copy: a
            // background task (so the caller has its result now) waits for that,
            // bounded, before letting the fence fire. A device that never confirms
            // keeps the fence unfired (reported, like a quarantined page) rather than
            // letting the engine reuse blocks it may still write.
            let inner = self.inner.clone();
            tokio::spawn(async move {
                let bound = tokio::time::Instant::now() + DEVICE_DRAIN_BOUND;
                if event.wait(bound).await.is_err() && !event.query().is_settled() {
                    inner.counters.device_unconfirmed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(target: "kvferry::peer", op = event.op(), rank = event.rank(),
                        "device never confirmed a landing copy: its destination blocks stay reported busy");
                    inner.counters.draining.fetch_sub(1, Ordering::Relaxed);
                    std::mem::forget(signal);
                    std::mem::forget(hold);
                } else {
                    // Counted out before the fence fires: whoever waited on the fence
                    // then sees nothing draining.
                    inner.counters.draining.fetch_sub(1, Ordering::Relaxed);
                    drop(hold);
                    drop(signal);
                }
            });
            if let Some(lease_id) = lease_to_release {
                let done_deadline = Instant::now() + inner_done_timeout(self);
                let _ = self
                    .simple_request(peer, &Message::Done { lease_id }, done_deadline)
                    .await;
            }
            return result.map_err(|error| TaskError { error, dirty });
        }
        // Counted out before the fence fires: whoever waited on the fence then sees
        // nothing draining.
        counters.draining.fetch_sub(1, Ordering::Relaxed);
        drop(hold);
        drop(signal);
        // Tell the producer to release its pages (best effort, bounded).
        if let Some(lease_id) = lease_to_release {
            let done_deadline = Instant::now() + inner.cfg.done_timeout;
            let _ = self
                .simple_request(peer, &Message::Done { lease_id }, done_deadline)
                .await;
        }
        result.map_err(|error| TaskError { error, dirty })
    }
}

impl TransferCtx<'_> {
    /// [`run`](Self::run), and for an eager get whose destination waits for
    /// publication (`Destination::await_published`): a miss of the first key is
    /// followed by `AwaitPublished` on a pooled connection, and the get is sent again
    /// the moment the producer says the key arrived — not after a retry timer. Ends
    /// with the miss once the wait (or the deadline) passed without it.
    async fn run_awaiting(&mut self, req: Request) -> Result<Landed, PeerError> {
        let (keys, select) = match req {
            Request::Get { keys, select } if !self.dst.await_published.is_zero() && !keys.is_empty() => (keys, select),
            req => return self.run(req).await,
        };
        let until = (Instant::now() + self.dst.await_published).min(self.connect_bound);
        loop {
            let get = Request::Get {
                keys: keys.clone(),
                select: select.clone(),
            };
            let landed = self.run(get).await?;
            // A hit, or a miss holding a lease to release (never expected): as is.
            if landed.chunks > 0 || self.lease_to_release.is_some() {
                return Ok(landed);
            }
            let now = Instant::now();
            if now >= until || !self.await_published(&keys[0], until - now).await? {
                return Ok(landed);
            }
        }
    }

    /// Asks the producer to answer once `key` is published, waiting at most `wait`:
    /// true when it is there now. A producer that does not know the request (an older
    /// build) answers `BadRequest`: false, as if the wait passed.
    ///
    /// # Cancellation
    ///
    /// Watches the transfer's token; cancelled, the connection is dropped (closed).
    async fn await_published(&mut self, key: &ChunkKey, wait: std::time::Duration) -> Result<bool, PeerError> {
        let mut conn = self.pool.checkout(self.connect_bound).await?;
        // The reply comes when the key does: the first byte may take the wait, then
        // the usual progress bound applies.
        let io = conn.io_timeout();
        conn.set_io_timeout(io + wait);
        let wait_ms = wait.as_millis().clamp(1, u32::MAX as u128) as u32;
        let msg = Message::AwaitPublished { key: *key, wait_ms };
        let cancel = self.cancel.clone();
        let reply = tokio::select! {
            r = conn.request(&msg) => r,
            _ = cancel.cancelled() => return Err(PeerError::Cancelled),
        };
        conn.set_io_timeout(io);
        match reply {
            Ok(Message::LookupReply { hits }) => {
                conn.finish();
                Ok(hits > 0)
            }
            Ok(other) => Err(unexpected("LookupReply", &other)),
            Err(NetError::Remote {
                kind: crate::wire::ErrorKind::BadRequest,
                ..
            }) => {
                conn.finish();
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn run(&mut self, req: Request) -> Result<Landed, PeerError> {
        let inner = &self.consumer.inner;
        // A selected transfer is one stream into the destination's selected ranges:
        // `caps` is then that stream's size, and `keys` what a success reports.
        let selected = match &req {
            Request::Get { keys, select: Some(w) } => Some((self.dst.selected_bytes(w), keys.len())),
            Request::Pull { handle } => handle.selection.as_ref().map(|s| (s.shape.total() as usize, s.keys)),
            Request::Get { select: None, .. } => None,
        };
        let nchunks = match &req {
            Request::Get { keys, .. } => keys.len(),
            Request::Pull { handle } => handle.chunks.len().min(self.dst.chunks.len()),
        };
        let caps: Vec<usize> = match selected {
            Some((total, _)) => vec![total],
            None => (0..nchunks).map(|i| self.dst.capacity(i)).collect(),
        };
        // 1. Staged path: receiver staging for every chunk first, or the request is a
        // miss. A device destination takes its staging only when the bytes do not come
        // by device IPC (which copies in place), still before the request that sends
        // them.
        let mut sink = match (&self.dst.target, self.dst.effective_path()) {
            (KvCacheRef::Host(cache), TransferPath::Direct) => Sink::Direct(cache.clone()),
            (KvCacheRef::Device(_), _) => Sink::Deferred,
            _ => self.staging_sink(&caps)?,
        };

        // 2. Receive (a cancel — the caller's, or `run_fenced` at the deadline — drops
        // the connection: nothing writes after).
        let cancel = self.cancel.clone();
        let chunks = tokio::select! {
            r = self.receive(req, &mut sink, &caps) => r?,
            _ = cancel.cancelled() => return Err(PeerError::Cancelled),
        };
        let bytes: usize = chunks.iter().map(|m| m.len as usize).sum();
        let landed = Landed {
            chunks: match selected {
                Some((_, keys)) if !chunks.is_empty() => keys,
                _ => chunks.len(),
            },
            bytes,
            // Every frame's checksum was verified against what arrived (`verify`).
            checksum: chunks
                .iter()
                .fold(0, |crc, m| crate::checksum::combine(crc, m.checksum, m.len as usize)),
        };
        let Sink::Staging { lease, offsets } = sink else {
            return Ok(landed); // direct: the bytes are already in place, verified
        };
        if chunks.is_empty() {
            return Ok(landed);
        }

        // 3. Land: scatter each chunk into its destination blocks (a selected
        // stream: into the destination's selected ranges, in order).
        let selected_ranges = match &self.landing {
            Some(l) => Some(l.all_ranges()?),
            None => None,
        };
        let cache = match &self.dst.target {
            KvCacheRef::Host(c) => c.clone(),
            KvCacheRef::Device(c) => {
                let c = c.clone();
                let plan = match selected_ranges {
                    Some(r) => vec![(0, r)],
                    None => self.device_plan(&c, &offsets, &chunks)?,
                };
                return self.land_on_device(&c, lease, plan, landed).await;
            }
        };
        let memory: Arc<dyn HostMemory> = cache.memory().clone();
        let mut plan = CopyPlan::new(lease, Endpoint::Memory(memory));
        match selected_ranges {
            Some(ranges) => {
                let mut at = 0;
                for (off, n) in ranges {
                    plan.push(at, off, n);
                    at += n;
                }
            }
            None => {
                for (i, meta) in chunks.iter().enumerate() {
                    let ranges = cache.chunk_ranges(&self.dst.chunks[i], meta.len as usize)?;
                    let mut at = offsets[i];
                    for (off, n) in ranges {
                        plan.push(at, off, n);
                        at += n;
                    }
                }
            }
        }
        self.dirty = true;
        let mut job = inner.engine.copy(plan);
        tokio::select! {
            r = &mut job => {
                // The plan (and the staging lease) drops here, after the copy completed.
                r.map_err(|f| PeerError::Copy(f.error))?;
            }
            _ = cancel.cancelled() => {
                // The caller gave up during the landing copy: cancel it and wait until
                // every started slice has stopped before releasing anything.
                let _ = job.cancel().await;
                return Err(PeerError::Cancelled);
            }
        }
        Ok(landed)
    }

    /// Sends the request and carries the chunks' bytes into `sink`, by the mover
    /// [`choose_mover`](Self::choose_mover) picks (the one choice, gets and pulls
    /// alike); returns the chunk metadata (a prefix of what was asked; empty on a
    /// miss).
    async fn receive(&mut self, req: Request, sink: &mut Sink, caps: &[usize]) -> Result<Vec<ChunkMeta>, PeerError> {
        let mut conn: PooledConnection = self.pool.checkout(self.connect_bound).await?;
        match &req {
            Request::Get { .. } => {
                // A connection's handshake names the incarnation it reached: a restarted
                // peer is refused before anything is staged on it.
                let current = conn.peer().incarnation;
                if let Some(expected) = self.dst.incarnation.filter(|&e| e != current) {
                    conn.finish();
                    return Err(PeerError::StaleIncarnation {
                        handle: expected,
                        current,
                    });
                }
            }
            Request::Pull { handle } => self.lease_to_release = Some(handle.lease_id),
        }
        let route = self.choose_mover(&mut conn, &req).await?;
        let id = conn.next_request_id(); // past the choice's requests, if any were sent
        let carried = match route {
            Route::Socket => Socket.carry(self, &mut conn, id, &req, sink, caps).await?,
            Route::Cma { pid } => Cma { pid }.carry(self, &mut conn, id, &req, sink, caps).await?,
            Route::DeviceIpc { pid, kind } => {
                DeviceIpc { pid, kind }
                    .carry(self, &mut conn, id, &req, sink, caps)
                    .await?
            }
        };
        // A one-sided mover handed it back, nothing read: the socket, on the same
        // connection.
        let carried = match carried {
            Carried::Refused if route != Route::Socket => {
                let id = conn.next_request_id();
                Socket.carry(self, &mut conn, id, &req, sink, caps).await?
            }
            c => c,
        };
        match carried {
            Carried::Landed { chunks, reuse } => {
                if reuse {
                    conn.finish();
                }
                Ok(chunks)
            }
            Carried::Refused => Err(PeerError::Net(NetError::Protocol(
                "the socket mover refused a transfer".into(),
            ))),
        }
    }
}

impl TransferCtx<'_> {
    /// Staging pages for every chunk (chunk `i` at `offsets[i]`, `caps[i]` bytes), or
    /// `StagingExhausted`.
    fn staging_sink(&self, caps: &[usize]) -> Result<Sink, PeerError> {
        let arena = &self.consumer.inner.arena;
        let offsets: Vec<usize> = caps
            .iter()
            .scan(0, |at, c| Some(std::mem::replace(at, *at + c)))
            .collect();
        let pages = arena.pages_for(caps.iter().sum());
        let lease = arena.try_alloc(pages).map_err(|_| PeerError::StagingExhausted {
            needed: pages,
            free: arena.stats().free_pages,
        })?;
        Ok(Sink::Staging { lease, offsets })
    }

    /// Takes a deferred sink's staging pages (any other sink is left as it is): called
    /// before a request whose bytes land through staging.
    pub(in crate::peer) fn take_staging(&self, sink: &mut Sink, caps: &[usize]) -> Result<(), PeerError> {
        if matches!(sink, Sink::Deferred) {
            *sink = self.staging_sink(caps)?;
        }
        Ok(())
    }

    /// Every byte is in place and verified: releases the producer's lease (if the
    /// transfer holds one) with `Done` on `conn`, the transfer's own connection (no
    /// second checkout on the hot path). Returns whether `conn` may go back to the
    /// pool: a `Done` that could not be sent or answered is not fatal (the bytes are
    /// here; the producer's grace or TTL releases its pages) but the connection is not
    /// reused; an unexpected reply is a protocol error.
    ///
    /// # Cancellation
    ///
    /// Awaits one request. Dropped mid-request, the lease is already released or is
    /// left to the producer's grace or TTL; every byte has landed before this is
    /// called, so nothing writes the destination after.
    pub(in crate::peer) async fn release_on(&mut self, conn: &mut PooledConnection) -> Result<bool, PeerError> {
        if let Some(lease_id) = self.lease_to_release.take() {
            match conn.request(&Message::Done { lease_id }).await {
                Ok(Message::DoneAck) => {}
                Ok(other) => return Err(unexpected("DoneAck", &other)),
                Err(e) => {
                    tracing::debug!(target: "kvferry::peer", "Done failed, producer grace or TTL will release: {e}");
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Checks a selected stream the producer announced against the destination and
    /// its selection, and keeps the landing plan.
    pub(in crate::peer) fn plan_landing(
        &mut self,
        chunks: &[ChunkMeta],
        shape: &SelectedShape,
    ) -> Result<(), PeerError> {
        let select =
            self.dst.select.as_ref().ok_or_else(|| {
                SelectionError::Stream("a selected stream for a destination without a selection".into())
            })?;
        let plan = LandingPlan::new(self.dst.map(), &self.dst.flat_blocks(), select, shape)?;
        check_frames(chunks, plan.total() as u64)?;
        self.landing = Some(plan);
        Ok(())
    }
}
