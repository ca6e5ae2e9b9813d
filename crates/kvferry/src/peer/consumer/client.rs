//! The [`Consumer`] API: what a caller asks for, and how each call is bounded.
//!
//! Every method takes a `deadline` (an [`Instant`] on tokio's clock). Requests that move
//! no KV bytes (`lookup`, `stage`, `release`, `put`) are one exchange on a pooled
//! connection, awaited under that deadline. Requests that land bytes (`get`, `resolve`
//! and the delayed pull in one call) start a transfer task (see `transfer`) and come in
//! two forms: `start_*`, which returns a [`Transfer`] whose [`DrainFence`] exists before
//! the transfer completes, and an `async fn` built on it. [`Consumer::get_blocking`]
//! waits for `start_get`'s transfer from a plain thread.
//!
//! One clock: every `Timeout` reports the time waited since the caller's call began
//! (`run_fenced` measures it once), whichever step — connect, stage, receive, land —
//! used the time up.
//!
//! Per peer address the consumer keeps a connection [`Pool`] and a `PeerWatch` (the
//! directory's view of that peer), and it counts bytes, chunks, outcomes and latency
//! for [`Consumer::stats`] and [`Consumer::transfer_latency`].
//!
//! # Cancellation
//!
//! Dropping an `async fn` future that started a transfer cancels the transfer; its
//! task drains in the background (receive dropped, landing copy stopped, staging
//! returned, `Done` sent) and its fence fires when nothing writes the destination any
//! more. A caller that may drop the future and must reuse the destination uses the
//! `start_*` form and waits on the fence. Dropping one of the single-exchange futures
//! closes the connection it held (it is taken back only through an explicit finish)
//! and leaves nothing behind on this side; a `stage` dropped after the producer
//! granted the lease leaves that lease to end by its TTL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
use tracing::Instrument;

use super::super::error::PeerError;
use super::super::selection::{LandingPlan, Selection};
use super::peer_watch::{PeerGone, PeerWatch};
use super::shared::{check_frames, unexpected, Request, TaskError, OUTCOMES};
use super::types::{
    ConsumerConfig, ConsumerStats, Destination, GetFailure, Landed, StagedHandle, StagedSelection, Transfer,
};
use crate::copy::{CopyEngine, DrainFence, DrainSignal};
use crate::mem::Arena;
use crate::net::{NetError, Pool, PoolStats};
use crate::stats::{Histogram, HistogramSnapshot};
use crate::wire::{ChunkKey, Message, SelectionError, WireSelection};

/// How much later than its deadline [`Consumer::get_blocking`] gives up waiting for a
/// transfer's own answer (which normally arrives at the deadline).
const BLOCKING_SLACK: Duration = Duration::from_millis(500);

#[derive(Default)]
pub(super) struct Counters {
    pub(super) completed: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) cancelled: AtomicU64,
    pub(super) checksum_failures: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) draining: AtomicU64,
    pub(super) timeouts: AtomicU64,
    pub(super) bytes_received: AtomicU64,
    pub(super) chunks_received: AtomicU64,
    pub(super) chunks_landed: AtomicU64,
    pub(super) device_unconfirmed: AtomicU64,
}

pub(super) struct Inner {
    pub(super) arena: Arena,
    pub(super) engine: CopyEngine,
    pub(super) cfg: ConsumerConfig,
    pub(super) pools: Mutex<HashMap<String, Pool>>,
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) counters: Counters,
    /// Transfer latency by outcome (as `OUTCOMES`).
    pub(super) latency: [Histogram; 3],
    /// Ids of transfers, for tracing.
    pub(super) next_transfer: AtomicU64,
    /// Per peer address: the token that fails its transfers when the directory says
    /// it restarted or left.
    pub(super) watches: Mutex<HashMap<String, Arc<PeerWatch>>>,
}

/// A consumer. Cheap to clone.
#[derive(Clone)]
pub struct Consumer {
    pub(super) inner: Arc<Inner>,
}

impl Consumer {
    /// A consumer receiving into `arena` and landing with `engine`. Must be called
    /// inside a tokio runtime (transfers run as tasks on it).
    pub fn new(arena: Arena, engine: CopyEngine, cfg: ConsumerConfig) -> Result<Consumer, PeerError> {
        cfg.net.validate()?;
        for (name, d) in [("lease ttl", cfg.lease_ttl), ("done timeout", cfg.done_timeout)] {
            if d.is_zero() {
                return Err(PeerError::InvalidArgument(format!("{name} must be greater than zero")));
            }
        }
        if cfg.lease_guard >= cfg.lease_ttl {
            return Err(PeerError::InvalidArgument(
                "lease guard must be shorter than the lease ttl".into(),
            ));
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| PeerError::InvalidArgument("Consumer::new must be called inside a tokio runtime".into()))?;
        Ok(Consumer {
            inner: Arc::new(Inner {
                arena,
                engine,
                cfg,
                pools: Mutex::new(HashMap::new()),
                runtime,
                counters: Counters::default(),
                latency: Default::default(),
                next_transfer: AtomicU64::new(1),
                watches: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The receiver staging arena.
    pub fn arena(&self) -> &Arena {
        &self.inner.arena
    }

    /// Counters.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.inner.counters;
        ConsumerStats {
            completed: c.completed.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            checksum_failures: c.checksum_failures.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            draining: c.draining.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            chunks_received: c.chunks_received.load(Ordering::Relaxed),
            chunks_landed: c.chunks_landed.load(Ordering::Relaxed),
            device_unconfirmed: c.device_unconfirmed.load(Ordering::Relaxed),
        }
    }

    /// The copy engine landing runs on.
    pub fn engine(&self) -> &CopyEngine {
        &self.inner.engine
    }

    /// Latency of transfers (start of the transfer task to landed or failed, before
    /// `Done`), by outcome: `completed`, `failed`, `cancelled`.
    pub fn transfer_latency(&self) -> Vec<(&'static str, HistogramSnapshot)> {
        OUTCOMES
            .iter()
            .zip(&self.inner.latency)
            .map(|(o, h)| (*o, h.snapshot()))
            .collect()
    }

    /// A tracing span for one transfer (fields `outcome` and `bytes` are recorded at
    /// its end).
    pub(super) fn transfer_span(&self, peer: &str, req: &Request) -> tracing::Span {
        let id = self.inner.next_transfer.fetch_add(1, Ordering::Relaxed);
        let (kind, chunks) = match req {
            Request::Get { keys, .. } => ("get", keys.len()),
            Request::Pull { handle } => ("pull", handle.chunks.len()),
        };
        tracing::info_span!(target: "kvferry::peer", "transfer", request = id, peer = %peer, kind, chunks,
            outcome = tracing::field::Empty, bytes = tracing::field::Empty)
    }

    /// The connection pool for `peer`.
    pub fn pool(&self, peer: &str) -> Result<Pool, PeerError> {
        let mut pools = self.inner.pools.lock();
        if let Some(p) = pools.get(peer) {
            return Ok(p.clone());
        }
        let p = Pool::new(peer, self.inner.cfg.net.clone())?;
        pools.insert(peer.to_string(), p.clone());
        Ok(p)
    }

    /// The connection pool for `peer`, if one was made (none is made here).
    pub fn existing_pool(&self, peer: &str) -> Option<Pool> {
        self.inner.pools.lock().get(peer).cloned()
    }

    /// Client connections to every peer: in use and idle now, opened so far (the sum
    /// over this consumer's pools).
    pub fn connection_stats(&self) -> PoolStats {
        let pools: Vec<Pool> = self.inner.pools.lock().values().cloned().collect();
        pools
            .iter()
            .map(Pool::stats)
            .fold(PoolStats::default(), |a, s| PoolStats {
                in_use: a.in_use + s.in_use,
                idle: a.idle + s.idle,
                opened: a.opened + s.opened,
            })
    }

    /// Keys a peer accepts in one request (the transport's limit).
    fn max_keys(&self) -> usize {
        self.inner.cfg.net.limits.max_keys
    }

    /// How many leading `keys` the peer holds.
    pub async fn lookup(&self, peer: &str, keys: &[ChunkKey], deadline: Instant) -> Result<usize, PeerError> {
        check_keys(keys, self.max_keys())?;
        let msg = Message::Lookup { keys: keys.to_vec() };
        match self.simple_request(peer, &msg, deadline).await? {
            Message::LookupReply { hits } => Ok(hits as usize),
            other => Err(unexpected("LookupReply", &other)),
        }
    }

    /// Pushes `data` to `peer` under `key` (the peer allocates staging pages, receives,
    /// lands into its store).
    pub async fn put(&self, peer: &str, key: ChunkKey, data: &[u8], deadline: Instant) -> Result<(), PeerError> {
        let pool = self.pool(peer)?;
        let fut = async {
            let mut conn = pool.checkout(deadline).await?;
            let id = conn.next_request_id();
            conn.send(
                id,
                &Message::Put {
                    key,
                    len: data.len() as u64,
                },
            )
            .await?;
            conn.send_bulk(id, &[data]).await?;
            let reply = conn.recv_reply(id).await?;
            conn.finish();
            match reply {
                Message::PutAck { .. } => Ok(()),
                other => Err(unexpected("PutAck", &other)),
            }
        };
        let started = Instant::now();
        let fut = self.peer_watch(peer).race(fut);
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "put",
                waited: started.elapsed(),
            }),
        }
    }

    pub(super) async fn simple_request(
        &self,
        peer: &str,
        msg: &Message,
        deadline: Instant,
    ) -> Result<Message, PeerError> {
        let pool = self.pool(peer)?;
        let start = Instant::now();
        let fut = async {
            for attempt in 0..2 {
                let mut conn = pool.checkout(deadline).await?;
                match conn.request(msg).await {
                    Ok(reply) => {
                        conn.finish();
                        return Ok(reply);
                    }
                    // A reused idle connection may have died with an old incarnation.
                    Err(NetError::Lost { .. }) if conn.reused() && attempt == 0 => continue,
                    Err(e) => return Err(PeerError::from(e)),
                }
            }
            unreachable!("the second attempt returns")
        };
        let fut = self.peer_watch(peer).race(fut);
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "request",
                waited: start.elapsed(),
            }),
        }
    }

    /// Delayed pull, step one: asks `peer` to stage `keys` and returns a handle.
    pub async fn stage(&self, peer: &str, keys: &[ChunkKey], deadline: Instant) -> Result<StagedHandle, PeerError> {
        self.stage_with(peer, keys, None, deadline).await
    }

    /// [`stage`](Self::stage) of the `select`ed part of published keys: the producer
    /// stages (device caches) or pins (host caches) only the selected bytes. The
    /// handle records the selection and the stream's shape; [`resolve`](Self::resolve)
    /// lands it by the selection's destination ranges, or by those of its
    /// destination's own selection (same blocks and source ranges). A miss (not every
    /// key published) is a handle with no chunks.
    pub async fn stage_selected(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        select: &Selection,
        deadline: Instant,
    ) -> Result<StagedHandle, PeerError> {
        self.stage_with(peer, keys, Some((select.clone(), select.wire(None, None))), deadline)
            .await
    }

    async fn stage_with(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        select: Option<(Selection, WireSelection)>,
        deadline: Instant,
    ) -> Result<StagedHandle, PeerError> {
        check_keys(keys, self.max_keys())?;
        let sent = Instant::now();
        let ttl_ms = self.inner.cfg.lease_ttl.as_millis() as u32;
        let keys_v = keys.to_vec();
        let msg = match &select {
            None => Message::Stage { keys: keys_v, ttl_ms },
            Some((_, wire)) => Message::StageSelected {
                keys: keys_v,
                ttl_ms,
                select: wire.clone(),
            },
        };
        let handle = |lease_id, incarnation, chunks, ttl_ms: u32, selection| StagedHandle {
            peer: peer.to_string(),
            lease_id,
            incarnation,
            chunks,
            expires: sent + Duration::from_millis(ttl_ms as u64),
            selection,
        };
        match (self.simple_request(peer, &msg, deadline).await?, select) {
            (
                Message::Staged {
                    lease_id,
                    incarnation,
                    chunks,
                    ttl_ms,
                },
                None,
            ) => Ok(handle(lease_id, incarnation, chunks, ttl_ms, None)),
            (
                Message::StagedSelected {
                    lease_id,
                    incarnation,
                    chunks,
                    ttl_ms,
                    shape,
                },
                Some((select, _)),
            ) => {
                if chunks.is_empty() {
                    return Ok(handle(lease_id, incarnation, chunks, ttl_ms, None));
                }
                check_frames(&chunks, shape.total())?;
                let selection = StagedSelection {
                    select,
                    shape,
                    keys: keys.len(),
                };
                Ok(handle(lease_id, incarnation, chunks, ttl_ms, Some(selection)))
            }
            (other, None) => Err(unexpected("Staged", &other)),
            (other, Some(_)) => Err(unexpected("StagedSelected", &other)),
        }
    }

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
            match this.stage_with(&peer, &keys, select, deadline).await {
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

    /// Releases a staged lease without pulling it.
    pub async fn release(&self, handle: &StagedHandle, deadline: Instant) -> Result<(), PeerError> {
        self.simple_request(
            &handle.peer,
            &Message::Done {
                lease_id: handle.lease_id,
            },
            deadline,
        )
        .await
        .map(|_| ())
    }

    /// Tells `peer` that `keys` will not be pulled: it frees those of them that are
    /// `once` publications at once, staging nothing (so it works when its staging is
    /// full). Returns, per key, whether it is released — by this call, or recently
    /// (by a `Done` or an earlier release: a retry answers true again); false: not
    /// published (yet), not a `once` publication, or released long ago. With
    /// `incarnation`, a peer that is another incarnation (it restarted) is refused
    /// with `StaleIncarnation`; without, the incarnation the connection reached.
    ///
    /// More keys than one message carries (`max_keys`) go as several `Release`
    /// messages, in order, all to the incarnation the first one reached: a release
    /// is per key, so nothing is lost by cutting it (a step of a vLLM decode may
    /// release thousands of reader slots of one prefill rank at once). An error in
    /// a later message returns that error; the keys of the messages before it are
    /// released.
    pub async fn release_keys(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        incarnation: Option<u64>,
        deadline: Instant,
    ) -> Result<Vec<bool>, PeerError> {
        if keys.is_empty() {
            return Err(PeerError::InvalidArgument("empty key list".into()));
        }
        let pool = self.pool(peer)?;
        let start = Instant::now();
        let max_keys = self.max_keys().max(1);
        let fut = async {
            let mut pinned = incarnation;
            let mut out = Vec::with_capacity(keys.len());
            for part in keys.chunks(max_keys) {
                let (released, reached) = release_message(&pool, part, pinned, deadline).await?;
                pinned = Some(reached);
                out.extend(released);
            }
            Ok(out)
        };
        let fut = self.peer_watch(peer).race(fut);
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "release",
                waited: start.elapsed(),
            }),
        }
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

    /// The synchronous get: returns within `timeout` (plus scheduling slack) with the
    /// result or `Timeout`. It is [`start_get`](Self::start_get) run on the consumer's
    /// runtime and waited for from this thread: on timeout the transfer is cancelled
    /// and drained in the background, and the returned failure's fence fires when the
    /// destination is quiet. Must not be called from inside an async task (it blocks
    /// the thread).
    pub fn get_blocking(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        timeout: Duration,
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
            self.start_get(peer, keys, dst, Instant::now() + timeout)
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
    async fn run_fenced(
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

/// One `Release` message of at most `max_keys` keys: per key whether it is released,
/// and the incarnation it reached (refused with `StaleIncarnation` when that is not
/// `incarnation`). A reused idle connection that died with an old incarnation is
/// retried once on a fresh one.
async fn release_message(
    pool: &Pool,
    keys: &[ChunkKey],
    incarnation: Option<u64>,
    deadline: Instant,
) -> Result<(Vec<bool>, u64), PeerError> {
    for attempt in 0..2 {
        let mut conn = pool.checkout(deadline).await?;
        let current = conn.peer().incarnation;
        if let Some(expected) = incarnation.filter(|&e| e != current) {
            conn.finish();
            return Err(PeerError::StaleIncarnation {
                handle: expected,
                current,
            });
        }
        let msg = Message::Release {
            keys: keys.to_vec(),
            incarnation: current,
        };
        match conn.request(&msg).await {
            Ok(Message::ReleaseAck { released }) if released.len() == keys.len() => {
                conn.finish();
                return Ok((released, current));
            }
            Ok(other) => return Err(unexpected("ReleaseAck", &other)),
            Err(NetError::Lost { .. }) if conn.reused() && attempt == 0 => continue,
            Err(e) => return Err(PeerError::from(e)),
        }
    }
    unreachable!("the second attempt returns")
}

/// A request's keys: at least one, and no more than a peer accepts in one request
/// (`max_keys`, the transport's limit, which peers share by default): refused here with
/// a clear error rather than by the peer closing the connection.
fn check_keys(keys: &[ChunkKey], max_keys: usize) -> Result<(), PeerError> {
    if keys.is_empty() {
        return Err(PeerError::InvalidArgument("empty key list".into()));
    }
    if keys.len() > max_keys {
        return Err(PeerError::InvalidArgument(format!(
            "{} keys in one request; at most {max_keys} (split the request or raise the limit)",
            keys.len()
        )));
    }
    Ok(())
}

/// Watches of the peers (see `peer_watch`).
impl Consumer {
    /// The current watch of the peer at `addr`.
    pub(super) fn peer_watch(&self, addr: &str) -> Arc<PeerWatch> {
        self.inner
            .watches
            .lock()
            .entry(addr.to_string())
            .or_insert_with(|| Arc::new(PeerWatch::new(addr)))
            .clone()
    }

    /// Fails every transfer and request in flight to `addr` at once with `gone`'s
    /// error (they drain as on cancellation), and drops the pool's idle connections.
    /// Transfers started afterwards are not affected.
    pub fn fail_peer(&self, addr: &str, gone: PeerGone) {
        let old = self.inner.watches.lock().remove(addr);
        if let Some(w) = old {
            w.declare_gone(gone.clone());
        }
        if let Some(p) = self.inner.pools.lock().get(addr) {
            p.clear_idle();
        }
        tracing::info!(target: "kvferry::peer", peer = addr, ?gone, "peer gone: its transfers fail now");
    }
}
