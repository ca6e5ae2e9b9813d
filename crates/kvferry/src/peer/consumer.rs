//! The consumer: lookup, eager get, delayed pull (stage now, resolve later), push, and
//! a blocking get with a timeout for synchronous callers.
//!
//! Every transfer runs as its own background task that owns everything it touches:
//! the receiver staging lease, the connection, the landing copy job. The caller awaits
//! the task's result under its deadline. When the caller stops waiting (deadline,
//! drop), the task is cancelled and **drains**: a receive in progress is dropped (the
//! connection closes, nothing writes the pages any more), a landing copy is cancelled
//! and awaited until its started slices have stopped, the staging pages return, and
//! `Done` is sent so the producer releases promptly. A [`DrainFence`] returned with
//! every failure fires when that is finished: only then are the destination blocks
//! quiet and may be reused.
//!
//! # Cancellation
//!
//! Dropping any future of this module cancels its transfer as above; nothing is freed
//! under a live writer, nothing leaks, and the fence still fires.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::store::truncate_ranges;
use super::PeerError;
use crate::copy::{CopyEngine, CopyPlan, DrainFence, DrainSignal};
use crate::layout::KvLayout;
use crate::mem::{Arena, Lease, Region};
use crate::metrics::{Histogram, HistogramSnapshot};
use crate::net::{NetConfig, NetError, Pool, PooledConnection};
use crate::wire::{ChunkKey, ChunkMeta, Message};

/// Consumer settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Transport settings (peer id, secret, timeouts, connections per peer).
    pub net: NetConfig,
    /// TTL asked for staged leases.
    pub lease_ttl: Duration,
    /// Resolving a delayed-pull handle is refused when less than this is left.
    pub lease_guard: Duration,
    /// Bound on sending `Done` after a transfer.
    pub done_timeout: Duration,
}

impl ConsumerConfig {
    /// Defaults around a transport config.
    pub fn new(net: NetConfig) -> ConsumerConfig {
        ConsumerConfig {
            net,
            lease_ttl: Duration::from_secs(10),
            lease_guard: Duration::from_millis(100),
            done_timeout: Duration::from_secs(1),
        }
    }
}

/// Where landed chunks go: a region, its layout, and the block ids of each chunk.
#[derive(Clone, Debug)]
pub struct Destination {
    /// The consumer's KV region.
    pub region: Arc<Region>,
    /// Its layout (must be compatible with the producer's).
    pub layout: KvLayout,
    /// For each requested chunk, in key order, the blocks it lands in.
    pub chunks: Vec<Vec<u32>>,
}

impl Destination {
    fn capacity(&self, i: usize) -> usize {
        self.layout.chunk_bytes(self.chunks[i].len())
    }
}

/// What a successful transfer landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    /// Leading chunks landed (fewer than requested on a partial hit; 0 on a miss).
    pub chunks: usize,
    /// Bytes landed.
    pub bytes: usize,
}

/// A failed transfer. The destination blocks may have been partly written and are
/// quiet only once `fence` fires (the background drain finished).
#[derive(Debug)]
pub struct GetFailure {
    /// What went wrong.
    pub error: PeerError,
    /// Fires once the transfer's work has drained and its staging pages are back.
    pub fence: DrainFence,
}

impl std::fmt::Display for GetFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for GetFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A transfer in flight from [`Consumer::start_get`]: a future of its result that also
/// exposes its [`DrainFence`] up front.
///
/// # Cancellation
///
/// Dropping a `Transfer` cancels it; its work drains in the background and the fence
/// (from [`fence`](Self::fence), taken before the drop) fires when the destination
/// blocks are quiet and the staging pages are back.
pub struct Transfer {
    fence: DrainFence,
    fut: std::pin::Pin<Box<dyn std::future::Future<Output = Result<Landed, GetFailure>> + Send>>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer").field("fence", &self.fence).finish()
    }
}

impl Transfer {
    /// The fence that fires when this transfer's work has drained.
    pub fn fence(&self) -> DrainFence {
        self.fence.clone()
    }
}

impl std::future::Future for Transfer {
    type Output = Result<Landed, GetFailure>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        self.fut.as_mut().poll(cx)
    }
}

/// A staged lease on a producer, from [`Consumer::stage`], to resolve later.
#[derive(Clone, Debug)]
pub struct StagedHandle {
    /// The producer's address.
    pub peer: String,
    /// The lease.
    pub lease_id: u64,
    /// The producer incarnation that granted it.
    pub incarnation: u64,
    /// The staged chunks (a prefix of the keys asked for).
    pub chunks: Vec<ChunkMeta>,
    /// When the lease expires, by this side's clock (conservative: measured from
    /// when the request was sent).
    pub expires: Instant,
}

/// Consumer counters.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ConsumerStats {
    /// Transfers that landed.
    pub completed: u64,
    /// Transfers that failed.
    pub failed: u64,
    /// Transfers cancelled by their caller (deadline or drop).
    pub cancelled: u64,
    /// Chunks refused for a checksum mismatch.
    pub checksum_failures: u64,
    /// Bytes landed.
    pub bytes: u64,
    /// Transfers whose background drain is still running.
    pub draining: u64,
    /// Transfers answered with `Timeout` (get, resolve, get_blocking).
    pub timeouts: u64,
    /// Bytes received into staging pages (checksum verified or not).
    pub bytes_received: u64,
    /// Chunks received into staging pages (checksum verified or not).
    pub chunks_received: u64,
    /// Chunks landed.
    pub chunks_landed: u64,
}

#[derive(Default)]
struct Counters {
    completed: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    checksum_failures: AtomicU64,
    bytes: AtomicU64,
    draining: AtomicU64,
    timeouts: AtomicU64,
    bytes_received: AtomicU64,
    chunks_received: AtomicU64,
    chunks_landed: AtomicU64,
}

/// Outcome labels of the latency histograms, indexing `Inner::latency`.
const OUTCOMES: [&str; 3] = ["completed", "failed", "cancelled"];

struct Inner {
    arena: Arena,
    engine: CopyEngine,
    cfg: ConsumerConfig,
    pools: Mutex<HashMap<String, Pool>>,
    runtime: tokio::runtime::Handle,
    counters: Counters,
    /// Transfer latency by outcome (as `OUTCOMES`).
    latency: [Histogram; 3],
    /// Ids of transfers, for tracing.
    next_transfer: AtomicU64,
}

/// A consumer. Cheap to clone.
#[derive(Clone)]
pub struct Consumer {
    inner: Arc<Inner>,
}

enum Request {
    Get { keys: Vec<ChunkKey> },
    Pull { handle: StagedHandle },
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
    fn transfer_span(&self, peer: &str, req: &Request) -> tracing::Span {
        let id = self.inner.next_transfer.fetch_add(1, Ordering::Relaxed);
        let (kind, chunks) = match req {
            Request::Get { keys } => ("get", keys.len()),
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
            other => Err(PeerError::Net(NetError::Protocol(format!(
                "expected LookupReply, got {other:?}"
            )))),
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
                other => Err(PeerError::Net(NetError::Protocol(format!(
                    "expected PutAck, got {other:?}"
                )))),
            }
        };
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PeerError::Timeout {
                op: "put",
                waited: Duration::ZERO,
            }),
        }
    }

    async fn simple_request(&self, peer: &str, msg: &Message, deadline: Instant) -> Result<Message, PeerError> {
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
        check_keys(keys, self.max_keys())?;
        let sent = Instant::now();
        let msg = Message::Stage {
            keys: keys.to_vec(),
            ttl_ms: self.inner.cfg.lease_ttl.as_millis() as u32,
        };
        match self.simple_request(peer, &msg, deadline).await? {
            Message::Staged {
                lease_id,
                incarnation,
                chunks,
                ttl_ms,
            } => Ok(StagedHandle {
                peer: peer.to_string(),
                lease_id,
                incarnation,
                chunks,
                expires: sent + Duration::from_millis(ttl_ms as u64),
            }),
            other => Err(PeerError::Net(NetError::Protocol(format!(
                "expected Staged, got {other:?}"
            )))),
        }
    }

    /// Delayed pull, step two: moves the staged bytes into `dst`. Refused with
    /// `LeaseExpired` when less than the guard margin is left on the lease, and with
    /// `StaleIncarnation` when the producer has restarted since.
    pub async fn resolve(
        &self,
        handle: StagedHandle,
        dst: Destination,
        deadline: Instant,
    ) -> Result<Landed, GetFailure> {
        let now = Instant::now();
        let remaining = handle.expires.saturating_duration_since(now);
        if remaining < self.inner.cfg.lease_guard {
            let error = PeerError::LeaseExpired {
                lease_id: handle.lease_id,
                remaining,
            };
            return Err(GetFailure {
                error,
                fence: DrainFence::ready(),
            });
        }
        let current = self.pool(&handle.peer).map(|p| p.incarnation()).unwrap_or(0);
        if current != 0 && current != handle.incarnation {
            let error = PeerError::StaleIncarnation {
                handle: handle.incarnation,
                current,
            };
            return Err(GetFailure {
                error,
                fence: DrainFence::ready(),
            });
        }
        if handle.chunks.is_empty() {
            return Ok(Landed { chunks: 0, bytes: 0 });
        }
        let peer = handle.peer.clone();
        self.run(&peer, Request::Pull { handle }, dst, deadline.min(now + remaining))
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

    /// Eager get: the peer stages `keys` and sends them at once; they land in `dst`.
    pub async fn get(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        deadline: Instant,
    ) -> Result<Landed, GetFailure> {
        if let Err(error) = check_keys(keys, self.max_keys()).and_then(|_| check_dst(keys.len(), &dst)) {
            return Err(GetFailure {
                error,
                fence: DrainFence::ready(),
            });
        }
        self.run(peer, Request::Get { keys: keys.to_vec() }, dst, deadline)
            .await
    }

    /// The synchronous get: returns within `timeout` (plus scheduling slack) with the
    /// result or `Timeout`. On timeout the transfer is cancelled and drained in the
    /// background; the returned failure's fence fires when the destination is quiet.
    /// Must not be called from inside an async task (it blocks the thread).
    pub fn get_blocking(
        &self,
        peer: &str,
        keys: &[ChunkKey],
        dst: Destination,
        timeout: Duration,
    ) -> Result<Landed, GetFailure> {
        let fail = |error| {
            Err(GetFailure {
                error,
                fence: DrainFence::ready(),
            })
        };
        if timeout.is_zero() {
            return fail(PeerError::InvalidArgument("timeout must be greater than zero".into()));
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            return fail(PeerError::InvalidArgument(
                "get_blocking called from inside an async runtime; use get() there".into(),
            ));
        }
        if let Err(error) = check_keys(keys, self.max_keys()).and_then(|_| check_dst(keys.len(), &dst)) {
            return fail(error);
        }
        let started = std::time::Instant::now();
        let deadline = Instant::now() + timeout;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (signal, fence) = DrainFence::pair();
        let cancel = CancellationToken::new();
        let this = self.clone();
        let (peer, req, c2) = (peer.to_string(), Request::Get { keys: keys.to_vec() }, cancel.clone());
        let span = self.transfer_span(&peer, &req);
        self.inner.runtime.spawn(
            async move {
                let r = this.transfer(&peer, req, dst, deadline, c2, signal).await;
                let _ = tx.send(r);
            }
            .instrument(span),
        );
        match rx.recv_timeout(timeout) {
            Ok(r) => {
                if matches!(r, Err(PeerError::Timeout { .. })) {
                    self.inner.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                }
                r.map_err(|error| GetFailure { error, fence })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                cancel.cancel();
                self.inner.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(GetFailure {
                    error: PeerError::Timeout {
                        op: "get",
                        waited: started.elapsed(),
                    },
                    fence,
                })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(GetFailure {
                error: PeerError::Net(NetError::Protocol("transfer task ended without a result".into())),
                fence,
            }),
        }
    }

    /// Runs a transfer task and awaits it under `deadline`; cancels it (drain in the
    /// background) when the deadline passes or this future is dropped.
    async fn run(&self, peer: &str, req: Request, dst: Destination, deadline: Instant) -> Result<Landed, GetFailure> {
        let (signal, fence) = DrainFence::pair();
        self.run_fenced(peer, req, dst, deadline, signal, fence).await
    }

    /// Starts an eager get whose [`DrainFence`] is available *before* it completes:
    /// a caller that may drop the transfer (cancel it) keeps the fence and waits on it
    /// before reusing the destination blocks.
    pub fn start_get(&self, peer: &str, keys: &[ChunkKey], dst: Destination, deadline: Instant) -> Transfer {
        let (signal, fence) = DrainFence::pair();
        if let Err(error) = check_keys(keys, self.max_keys()).and_then(|_| check_dst(keys.len(), &dst)) {
            drop(signal);
            let f = fence.clone();
            return Transfer {
                fence,
                fut: Box::pin(async move { Err(GetFailure { error, fence: f }) }),
            };
        }
        let (this, peer, keys, f) = (self.clone(), peer.to_string(), keys.to_vec(), fence.clone());
        // Dropped before its first poll, the future drops `signal` and the fence fires.
        let fut = async move {
            this.run_fenced(&peer, Request::Get { keys }, dst, deadline, signal, f)
                .await
        };
        Transfer {
            fence,
            fut: Box::pin(fut),
        }
    }

    async fn run_fenced(
        &self,
        peer: &str,
        req: Request,
        dst: Destination,
        deadline: Instant,
        signal: DrainSignal,
        fence: DrainFence,
    ) -> Result<Landed, GetFailure> {
        let started = Instant::now();
        let cancel = CancellationToken::new();
        // If this future is dropped, the guard cancels the transfer.
        let guard = cancel.clone().drop_guard();
        let this = self.clone();
        let span = self.transfer_span(peer, &req);
        let (peer, c2) = (peer.to_string(), cancel.clone());
        let task = self
            .inner
            .runtime
            .spawn(async move { this.transfer(&peer, req, dst, deadline, c2, signal).await }.instrument(span));
        let out = tokio::time::timeout_at(deadline, task).await;
        let timed_out = matches!(out, Err(_) | Ok(Ok(Err(PeerError::Timeout { .. }))));
        if timed_out {
            self.inner.counters.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        match out {
            Ok(Ok(r)) => {
                guard.disarm();
                r.map_err(|error| GetFailure { error, fence })
            }
            Ok(Err(join)) => Err(GetFailure {
                error: PeerError::Net(NetError::Protocol(format!("transfer task failed: {join}"))),
                fence,
            }),
            Err(_) => {
                drop(guard); // cancels
                Err(GetFailure {
                    error: PeerError::Timeout {
                        op: "get",
                        waited: started.elapsed(),
                    },
                    fence,
                })
            }
        }
    }

    /// The transfer task body. Owns the staging lease, the connection and the landing
    /// job; `signal` drops (firing the caller's fence) only after all of them are done.
    async fn transfer(
        &self,
        peer: &str,
        req: Request,
        dst: Destination,
        deadline: Instant,
        cancel: CancellationToken,
        signal: DrainSignal,
    ) -> Result<Landed, PeerError> {
        let inner = &self.inner;
        let counters = &inner.counters;
        let started = Instant::now();
        counters.draining.fetch_add(1, Ordering::Relaxed);
        let pool = match self.pool(peer) {
            Ok(p) => p,
            Err(e) => {
                counters.draining.fetch_sub(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let mut lease_to_release = None;
        let result = self
            .transfer_inner(&pool, req, &dst, deadline, &cancel, &mut lease_to_release)
            .await;
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
                    landed = l.chunks, ?elapsed, "transfer ended");
            }
            Err(PeerError::Cancelled) => {
                tracing::debug!(target: "kvferry::peer", outcome = OUTCOMES[outcome], ?elapsed, "transfer ended")
            }
            Err(e) => {
                tracing::info!(target: "kvferry::peer", outcome = OUTCOMES[outcome], error = %e, ?elapsed,
                    "transfer ended")
            }
        }
        // Everything that touched the destination or the staging pages has finished.
        drop(signal);
        counters.draining.fetch_sub(1, Ordering::Relaxed);
        // Tell the producer to release its pages (best effort, bounded).
        if let Some(lease_id) = lease_to_release {
            let done_deadline = Instant::now() + inner.cfg.done_timeout;
            let _ = self
                .simple_request(peer, &Message::Done { lease_id }, done_deadline)
                .await;
        }
        result
    }

    async fn transfer_inner(
        &self,
        pool: &Pool,
        req: Request,
        dst: &Destination,
        deadline: Instant,
        cancel: &CancellationToken,
        lease_to_release: &mut Option<u64>,
    ) -> Result<Landed, PeerError> {
        let inner = &self.inner;
        // 1. Receiver staging for every chunk first, or the request is a miss.
        let nchunks = match &req {
            Request::Get { keys } => keys.len(),
            Request::Pull { handle } => handle.chunks.len().min(dst.chunks.len()),
        };
        let caps: Vec<usize> = (0..nchunks).map(|i| dst.capacity(i)).collect();
        let offsets: Vec<usize> = caps
            .iter()
            .scan(0, |at, c| Some(std::mem::replace(at, *at + c)))
            .collect();
        let total: usize = caps.iter().sum();
        let pages = inner.arena.pages_for(total);
        let mut lease = inner.arena.try_alloc(pages).map_err(|_| PeerError::StagingExhausted {
            needed: pages,
            free: inner.arena.stats().free_pages,
        })?;

        // 2. Receive into the staging pages (cancel or deadline drops the connection).
        let receive = self.receive(pool, req, &mut lease, &offsets, &caps, deadline, lease_to_release);
        let chunks = tokio::select! {
            r = receive => r?,
            _ = cancel.cancelled() => return Err(PeerError::Cancelled),
            _ = tokio::time::sleep_until(deadline) => return Err(PeerError::Timeout { op: "receive", waited: Duration::ZERO }),
        };
        if chunks.is_empty() {
            return Ok(Landed { chunks: 0, bytes: 0 });
        }

        // 3. Land: scatter each chunk into its destination blocks.
        let mut plan = CopyPlan::new(lease, dst.region.clone());
        let mut bytes = 0;
        for (i, meta) in chunks.iter().enumerate() {
            let mut ranges = dst.layout.chunk_ranges(&dst.chunks[i])?;
            truncate_ranges(&mut ranges, meta.len as usize);
            let mut at = offsets[i];
            for (off, n) in ranges {
                plan.push(at, off, n);
                at += n;
            }
            bytes += meta.len as usize;
        }
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
        Ok(Landed {
            chunks: chunks.len(),
            bytes,
        })
    }

    /// Sends the request and receives the chunks' bytes into `lease`; returns the
    /// chunk metadata (a prefix of what was asked; empty on a miss).
    #[allow(clippy::too_many_arguments)]
    async fn receive(
        &self,
        pool: &Pool,
        req: Request,
        lease: &mut Lease,
        offsets: &[usize],
        caps: &[usize],
        deadline: Instant,
        lease_to_release: &mut Option<u64>,
    ) -> Result<Vec<ChunkMeta>, PeerError> {
        let mut conn: PooledConnection = pool.checkout(deadline).await?;
        let id = conn.next_request_id();
        let chunks = match req {
            Request::Get { keys } => {
                let ttl_ms = self.inner.cfg.lease_ttl.as_millis() as u32;
                conn.send(
                    id,
                    &Message::Get {
                        keys: keys.clone(),
                        ttl_ms,
                    },
                )
                .await?;
                match conn.recv_reply(id).await? {
                    Message::Staged { lease_id, chunks, .. } => {
                        if lease_id != 0 {
                            *lease_to_release = Some(lease_id);
                        }
                        if chunks.len() > keys.len() || chunks.iter().zip(&keys).any(|(c, k)| c.key != *k) {
                            return Err(PeerError::Net(NetError::Protocol(
                                "staged chunks do not match the keys".into(),
                            )));
                        }
                        chunks
                    }
                    other => {
                        return Err(PeerError::Net(NetError::Protocol(format!(
                            "expected Staged, got {other:?}"
                        ))))
                    }
                }
            }
            Request::Pull { handle } => {
                *lease_to_release = Some(handle.lease_id);
                conn.send(
                    id,
                    &Message::Pull {
                        lease_id: handle.lease_id,
                        incarnation: handle.incarnation,
                    },
                )
                .await?;
                handle.chunks.into_iter().take(caps.len()).collect()
            }
        };
        if chunks.is_empty() {
            conn.finish();
            return Ok(chunks);
        }
        for (i, meta) in chunks.iter().enumerate() {
            if meta.len as usize > caps[i] {
                return Err(PeerError::InvalidArgument(format!(
                    "chunk {} is {} bytes but its destination blocks hold {}",
                    meta.key, meta.len, caps[i]
                )));
            }
            let actual = {
                let mut parts = lease.io_slices_mut(offsets[i], meta.len as usize)?;
                match conn.recv_bulk(id, &mut parts).await {
                    Ok(crc) => crc,
                    // The frame's checksum is the one computed at staging: a mismatch
                    // means the bytes changed between staging and here.
                    Err(NetError::Wire(crate::wire::WireError::ChecksumMismatch { actual, .. })) => actual,
                    Err(e) => return Err(e.into()),
                }
            };
            let counters = &self.inner.counters;
            counters.bytes_received.fetch_add(meta.len, Ordering::Relaxed);
            counters.chunks_received.fetch_add(1, Ordering::Relaxed);
            if actual != meta.checksum {
                return Err(PeerError::ChecksumMismatch {
                    key: meta.key,
                    expected: meta.checksum,
                    actual,
                });
            }
        }
        match conn.recv_reply(id).await? {
            Message::PullDone { .. } => {}
            other => {
                return Err(PeerError::Net(NetError::Protocol(format!(
                    "expected PullDone, got {other:?}"
                ))))
            }
        }
        // Every byte is in our staging pages: the producer's copy is no longer needed.
        // Release it on the same connection (no second checkout on the hot path).
        if let Some(lease_id) = lease_to_release.take() {
            match conn.request(&Message::Done { lease_id }).await {
                Ok(Message::DoneAck) => {}
                Ok(other) => {
                    return Err(PeerError::Net(NetError::Protocol(format!(
                        "expected DoneAck, got {other:?}"
                    ))))
                }
                // Not fatal for this transfer: the bytes are here; the producer's TTL
                // releases its pages.
                Err(e) => {
                    tracing::debug!(target: "kvferry::peer", "Done failed, producer TTL will release: {e}");
                    return Ok(chunks);
                }
            }
        }
        conn.finish();
        Ok(chunks)
    }
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

fn check_dst(nkeys: usize, dst: &Destination) -> Result<(), PeerError> {
    if dst.chunks.len() < nkeys {
        return Err(PeerError::InvalidArgument(format!(
            "{nkeys} keys but destination blocks for only {} chunks",
            dst.chunks.len()
        )));
    }
    if dst.region.len() < dst.layout.region_bytes() {
        return Err(PeerError::InvalidArgument(
            "destination region is smaller than its layout".into(),
        ));
    }
    for blocks in &dst.chunks {
        if blocks.is_empty() {
            return Err(PeerError::InvalidArgument("a destination chunk has no blocks".into()));
        }
        if let Some(b) = blocks.iter().find(|b| **b >= dst.layout.blocks) {
            return Err(PeerError::InvalidArgument(format!(
                "destination block {b} out of range"
            )));
        }
    }
    Ok(())
}
