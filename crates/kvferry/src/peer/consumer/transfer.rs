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

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::super::error::PeerError;
use super::super::selection::LandingPlan;
use super::client::Consumer;
use super::shared::{check_frames, check_granted_keys, unexpected, verify_landed, Request, TaskError, OUTCOMES};
use super::types::{Destination, Landed, TransferPath};
use crate::copy::{CopyPlan, DrainFence, DrainSignal, Endpoint};
use crate::device::KvCacheRef;
use crate::layout::KvCache;
use crate::mem::{HostMemory, Lease};
use crate::net::{NetError, Pool, PooledConnection};
use crate::wire::{ChunkKey, ChunkMeta, Message, SelectedShape, SelectionError};

/// How a mapped get ended.
pub(super) enum Mapped {
    /// Landed and verified; `reuse`: the connection is at a frame boundary and may go
    /// back to the pool.
    Landed { chunks: Vec<ChunkMeta>, reuse: bool },
    /// The producer could not grant these bytes by memory (`TooLarge`: more runs than
    /// a reply may name); nothing was staged or written: get them over the socket.
    Socket,
}

impl Mapped {
    /// `Break` with the landed chunks (the connection back to the pool when it may be
    /// reused), or `Continue` with the connection to get the bytes over the socket.
    fn settle(self, conn: PooledConnection) -> ControlFlow<Vec<ChunkMeta>, PooledConnection> {
        match self {
            Mapped::Landed { chunks, reuse } => {
                if reuse {
                    conn.finish();
                }
                ControlFlow::Break(chunks)
            }
            Mapped::Socket => ControlFlow::Continue(conn),
        }
    }
}

/// How long a transfer's drain waits for a device to settle a landing copy that
/// outlived the transfer before declaring it unconfirmed.
const DEVICE_DRAIN_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

fn inner_done_timeout(c: &Consumer) -> std::time::Duration {
    c.inner.cfg.done_timeout
}

/// Where a chunk's received bytes go.
pub(super) enum Sink {
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
pub(super) struct TransferCtx<'a> {
    pub(super) consumer: &'a Consumer,
    pub(super) pool: Pool,
    pub(super) dst: Destination,
    /// Upper bound for the connection pool's checkout (the transfer's deadline, which
    /// `run_fenced` enforces by cancelling `cancel`).
    connect_bound: Instant,
    pub(super) cancel: CancellationToken,
    /// The producer lease to release with `Done` if the transfer did not already.
    pub(super) lease_to_release: Option<crate::wire::LeaseId>,
    /// Set once bytes may have been written into the destination blocks.
    pub(super) dirty: bool,
    /// A device copy into the destination that had not settled when the transfer
    /// ended: the fence waits for it.
    pub(super) unconfirmed: Option<crate::device::Event>,
    /// A selected transfer's landing (set once the producer announced its stream).
    pub(super) landing: Option<LandingPlan>,
    /// A same-host read's copy job: started reads may outlive a cancelled receive,
    /// and the transfer's fence waits for this one first.
    pub(super) copy_fence: Option<DrainFence>,
}

impl Consumer {
    /// The transfer task body. `signal` drops (firing the caller's fence) only after
    /// everything that touched the destination or staging pages has stopped.
    pub(super) async fn transfer(
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

    /// Sends the request and receives the chunks' bytes into `sink`; returns the chunk
    /// metadata (a prefix of what was asked; empty on a miss).
    async fn receive(&mut self, req: Request, sink: &mut Sink, caps: &[usize]) -> Result<Vec<ChunkMeta>, PeerError> {
        let mut conn: PooledConnection = self.pool.checkout(self.connect_bound).await?;
        let mut id = conn.next_request_id();
        let chunks = match req {
            Request::Get { keys, select } => {
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
                // Same host: the bytes may be read from the producer's memory
                // (`mapped`); chosen once per incarnation, on this connection.
                let peer = self.pool.addr().to_string();
                let cma = self.consumer.cma_on(&peer, &mut conn).await?;
                id = conn.next_request_id(); // past the probe's, if one was sent
                if let Some(pid) = cma {
                    let mapped = self
                        .receive_mapped(&mut conn, id, &keys, select.clone(), sink, caps, pid)
                        .await?;
                    // The producer cannot grant this one by memory: the socket, on the
                    // same connection.
                    conn = match mapped.settle(conn) {
                        ControlFlow::Break(chunks) => return Ok(chunks),
                        ControlFlow::Continue(conn) => conn,
                    };
                    id = conn.next_request_id();
                }
                self.take_staging(sink, caps)?;
                let ttl_ms = self.consumer.inner.cfg.lease_ttl.as_millis() as u32;
                let selected = select.is_some();
                let msg = match select {
                    None => Message::Get {
                        keys: keys.clone(),
                        ttl_ms,
                    },
                    Some(select) => Message::GetSelected {
                        keys: keys.clone(),
                        ttl_ms,
                        select,
                    },
                };
                conn.send(id, &msg).await?;
                match conn.recv_reply(id).await? {
                    Message::StagedSelected {
                        lease_id,
                        chunks,
                        shape,
                        ..
                    } if selected => {
                        if lease_id != 0 {
                            self.lease_to_release = Some(lease_id);
                        }
                        if !chunks.is_empty() {
                            self.plan_landing(&chunks, &shape)?;
                        }
                        chunks
                    }
                    Message::Staged { lease_id, chunks, .. } if !selected => {
                        if lease_id != 0 {
                            self.lease_to_release = Some(lease_id);
                        }
                        check_granted_keys(&chunks, &keys)?;
                        chunks
                    }
                    other => {
                        let expected = if selected { "StagedSelected" } else { "Staged" };
                        return Err(unexpected(expected, &other));
                    }
                }
            }
            Request::Pull { handle } => {
                self.lease_to_release = Some(handle.lease_id);
                // Same host: whole staged chunks may be read from the producer's
                // memory (a staged selection is pulled over the socket).
                if handle.selection.is_none() {
                    let peer = self.pool.addr().to_string();
                    if let Some(pid) = self.consumer.cma_on(&peer, &mut conn).await? {
                        id = conn.next_request_id(); // past the probe's, if one was sent
                        let mapped = self.pull_mapped(&mut conn, id, &handle, sink, caps, pid).await?;
                        conn = match mapped.settle(conn) {
                            ControlFlow::Break(chunks) => return Ok(chunks),
                            ControlFlow::Continue(conn) => conn,
                        };
                        id = conn.next_request_id();
                    }
                }
                self.take_staging(sink, caps)?;
                if let Some(s) = &handle.selection {
                    self.plan_landing(&handle.chunks, &s.shape)?;
                }
                conn.send(
                    id,
                    &Message::Pull {
                        lease_id: handle.lease_id,
                        incarnation: handle.incarnation,
                    },
                )
                .await?;
                if handle.selection.is_some() {
                    handle.chunks
                } else {
                    handle.chunks.into_iter().take(caps.len()).collect()
                }
            }
        };
        if chunks.is_empty() {
            conn.finish();
            return Ok(chunks);
        }
        let landing = self.landing.take();
        let mut cursor = landing.as_ref().map(|l| l.cursor());
        let mut at = 0; // a selected stream's offset in the staging lease
        for (i, meta) in chunks.iter().enumerate() {
            if let Some(cur) = cursor.as_mut() {
                // A selected stream: frame `i` fills the next `len` bytes.
                let len = meta.len as usize;
                let received = match sink {
                    Sink::Staging { lease, .. } => {
                        let mut parts = lease.io_slices_mut(at, len)?;
                        at += len;
                        conn.recv_bulk(id, &mut parts).await
                    }
                    Sink::Direct(cache) => {
                        let ranges = cur.take(len)?;
                        self.dirty = true;
                        // SAFETY: the destination's blocks were checked distinct and
                        // the selection's destination ranges disjoint and inside each
                        // piece (`Destination::check_selected`, `LandingPlan::new`),
                        // so the slices do not overlap; the task owns `dst` until it
                        // has stopped, and the engine leaves the blocks alone until
                        // the fence fires.
                        let mut parts = unsafe { cache.io_slices_mut(&ranges)? };
                        conn.recv_bulk(id, &mut parts).await
                    }
                    Sink::Lent | Sink::Deferred => return Err(lent()),
                };
                self.verify(meta, received)?;
                continue;
            }
            if meta.len as usize > caps[i] {
                return Err(PeerError::InvalidArgument(format!(
                    "chunk {} is {} bytes but its destination blocks hold {}",
                    meta.key, meta.len, caps[i]
                )));
            }
            let len = meta.len as usize;
            let received = match sink {
                Sink::Staging { lease, offsets } => {
                    let mut parts = lease.io_slices_mut(offsets[i], len)?;
                    conn.recv_bulk(id, &mut parts).await
                }
                Sink::Direct(cache) => {
                    let ranges = cache.chunk_ranges(&self.dst.chunks[i], len)?;
                    self.dirty = true;
                    // SAFETY: the destination's blocks were checked distinct
                    // (`Destination::check`), so the slices do not overlap; the task
                    // owns `dst` (and through it the memory) until it has stopped, and
                    // the engine leaves the blocks alone until the transfer reports
                    // them quiet (the fence).
                    let mut parts = unsafe { cache.io_slices_mut(&ranges)? };
                    conn.recv_bulk(id, &mut parts).await
                }
                Sink::Lent | Sink::Deferred => return Err(lent()),
            };
            self.verify(meta, received)?;
        }
        // Kept for the landing copy of a staged selected stream.
        self.landing = landing;
        match conn.recv_reply(id).await? {
            Message::PullDone { .. } => {}
            other => return Err(unexpected("PullDone", &other)),
        }
        // Every byte is here: the producer's copy is no longer needed.
        if self.release_on(&mut conn).await? {
            conn.finish();
        }
        Ok(chunks)
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
    pub(super) fn take_staging(&self, sink: &mut Sink, caps: &[usize]) -> Result<(), PeerError> {
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
    pub(super) async fn release_on(&mut self, conn: &mut PooledConnection) -> Result<bool, PeerError> {
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

    /// Counts a received frame and checks its checksum against the announced one.
    fn verify(&self, meta: &ChunkMeta, received: Result<u32, NetError>) -> Result<(), PeerError> {
        let actual = match received {
            Ok(crc) => crc,
            // The frame's checksum is the one computed at staging: a mismatch
            // means the bytes changed between staging and here.
            Err(NetError::Wire(crate::wire::WireError::ChecksumMismatch { actual, .. })) => actual,
            Err(e) => return Err(e.into()),
        };
        let counters = &self.consumer.inner.counters;
        counters.bytes_received.fetch_add(meta.len, Ordering::Relaxed);
        counters.chunks_received.fetch_add(1, Ordering::Relaxed);
        verify_landed(meta, actual)
    }

    /// Checks a selected stream the producer announced against the destination and
    /// its selection, and keeps the landing plan.
    pub(super) fn plan_landing(&mut self, chunks: &[ChunkMeta], shape: &SelectedShape) -> Result<(), PeerError> {
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

/// A receive found its staging pages lent to a same-host read (never expected).
fn lent() -> PeerError {
    PeerError::Net(NetError::Protocol("staging pages are lent to a same-host read".into()))
}
