//! The [`Consumer`] API: what a caller asks for, and how each call is bounded.
//!
//! Every method takes a `deadline` (an [`Instant`](tokio::time::Instant) on tokio's
//! clock). Requests that move no KV bytes (`lookup`, `stage`, `release`, `put`) are one
//! exchange on a pooled connection, awaited under that deadline. Requests that land
//! bytes (`get`, `resolve` and the delayed pull in one call) start a transfer task (see
//! `transfer`) and come in two forms: `start_*`, which returns a
//! [`Transfer`](super::Transfer) whose [`DrainFence`](crate::copy::DrainFence) exists
//! before the transfer completes, and an `async fn` built on it.
//! [`Consumer::get_blocking`] waits for `start_get`'s transfer from a plain thread
//! (through `Consumer::blocking`, the one blocking wait).
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
//!
//! The calls live in three files: this one (the consumer, its pools, counters and peer
//! watches), `exchange` (the single-exchange requests) and `get` (the requests that
//! land bytes, and `run_fenced`, which runs their transfer task under the deadline).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::super::error::PeerError;
use super::super::movers::PeerMover;
use super::peer_watch::{PeerGone, PeerWatch};
use super::shared::{Request, OUTCOMES};
use super::types::{ConsumerConfig, ConsumerStats};
use crate::copy::CopyEngine;
use crate::mem::Arena;
use crate::net::{Pool, PoolStats};
use crate::stats::{Histogram, HistogramSnapshot};

#[derive(Default)]
pub(in crate::peer) struct Counters {
    pub(in crate::peer) completed: AtomicU64,
    pub(in crate::peer) failed: AtomicU64,
    pub(in crate::peer) cancelled: AtomicU64,
    pub(in crate::peer) checksum_failures: AtomicU64,
    pub(in crate::peer) bytes: AtomicU64,
    pub(in crate::peer) draining: AtomicU64,
    pub(in crate::peer) timeouts: AtomicU64,
    pub(in crate::peer) bytes_received: AtomicU64,
    pub(in crate::peer) chunks_received: AtomicU64,
    pub(in crate::peer) chunks_landed: AtomicU64,
    pub(in crate::peer) device_unconfirmed: AtomicU64,
    pub(in crate::peer) cma_transfers: AtomicU64,
    pub(in crate::peer) cma_bytes: AtomicU64,
    pub(in crate::peer) mover_fallbacks: AtomicU64,
    pub(in crate::peer) device_ipc_transfers: AtomicU64,
    pub(in crate::peer) device_ipc_bytes: AtomicU64,
    pub(in crate::peer) device_ipc_fallbacks: AtomicU64,
}

pub(in crate::peer) struct Inner {
    pub(in crate::peer) arena: Arena,
    pub(in crate::peer) engine: CopyEngine,
    pub(in crate::peer) cfg: ConsumerConfig,
    pub(in crate::peer) pools: Mutex<HashMap<String, Pool>>,
    pub(in crate::peer) runtime: tokio::runtime::Handle,
    pub(in crate::peer) counters: Counters,
    /// Transfer latency by outcome (as `OUTCOMES`).
    pub(in crate::peer) latency: [Histogram; 3],
    /// Ids of transfers, for tracing.
    pub(in crate::peer) next_transfer: AtomicU64,
    /// Per peer address: the token that fails its transfers when the directory says
    /// it restarted or left.
    pub(in crate::peer) watches: Mutex<HashMap<String, Arc<PeerWatch>>>,
    /// The mover chosen per peer address, for the incarnation it names (see `mapped`).
    pub(in crate::peer) movers: Mutex<HashMap<String, PeerMover>>,
}

/// A consumer. Cheap to clone.
#[derive(Clone)]
pub struct Consumer {
    pub(in crate::peer) inner: Arc<Inner>,
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
                movers: Mutex::new(HashMap::new()),
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
            cma_transfers: c.cma_transfers.load(Ordering::Relaxed),
            cma_bytes: c.cma_bytes.load(Ordering::Relaxed),
            mover_fallbacks: c.mover_fallbacks.load(Ordering::Relaxed),
            device_ipc_transfers: c.device_ipc_transfers.load(Ordering::Relaxed),
            device_ipc_bytes: c.device_ipc_bytes.load(Ordering::Relaxed),
            device_ipc_fallbacks: c.device_ipc_fallbacks.load(Ordering::Relaxed),
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
    pub(in crate::peer) fn transfer_span(&self, peer: &str, req: &Request) -> tracing::Span {
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
    pub(in crate::peer) fn max_keys(&self) -> usize {
        self.inner.cfg.net.limits.max_keys
    }
}

/// Watches of the peers (see `peer_watch`).
impl Consumer {
    /// The current watch of the peer at `addr`.
    pub(in crate::peer) fn peer_watch(&self, addr: &str) -> Arc<PeerWatch> {
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
