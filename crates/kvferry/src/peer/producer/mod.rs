//! The producer: holds chunks in a [`ChunkStore`], stages them into arena pages on
//! request (copy before advertise), serves lookups, pulls, eager gets and pushes, and
//! releases staged pages on `Done` or when their TTL expires.
//!
//! This module does the I/O; who holds what until when is decided by the producer's
//! [ledger](super::ledger), asked under one lock, and the producer acts on what it
//! answers (drops lease payloads, reports released publications). A staged lease waits
//! in the ledger; while its bytes are written to a socket it is *checked out* and owned
//! by that write (a [`Sending`](guards::Sending) guard that checks it back in, or
//! reports its drop), so nothing — TTL, `Done`, `Release`, shutdown — releases pages or
//! blocks a socket is still sending: such an end is accepted at once and takes effect
//! when the send ends. Concurrent staging requests are capped: over the cap, the reply
//! is an immediate `Busy` miss, not a queue. Fault injection lives in [`fault_hooks`].
//!
//! Two kinds of chunks are served: chunks of the store (pinned in the store and sent
//! straight from its blocks with the checksum they were stored with), and **published**
//! blocks of an engine's own registered cache, one
//! [`KvCacheRef`](crate::device::KvCacheRef) of either memory kind (see
//! [`super::publish`]): host blocks ([`KvCache`](crate::layout::KvCache)) are sent
//! straight from the cache with vectored writes — zero copies on this side — and device
//! blocks are gathered into staging pages first. One publish path serves both kinds;
//! only the stage matches on the kind, where the data path differs.
//!
//! A consumer that will not pull sends `Release`: the `once` publications it names
//! leave the table at once (reason `Declined`), with nothing staged, so it works while
//! staging is full. A key is the capability (whoever may pull a `once` publication may
//! end it); other publications and store chunks are never touched. A key whose
//! publication was retired recently (by a `Done` included) answers released again.
//!
//! Leases are bound to the peer they were granted to: ids are random, and a `Done` (or
//! pull) from another peer is refused and counted. A request listing a key twice is
//! refused. Each peer may hold at most `max_staged_pages_per_peer` staging pages at
//! once, and TTLs are capped at `max_ttl`, so one client cannot lock the arena. An
//! eager get's lease is tied to its connection: when the connection closes without
//! `Done`, the lease is released `lease_grace` later (a consumer whose transfer failed
//! sends its `Done` on a fresh connection within that time), not at its TTL. Leases
//! staged for a later pull keep their TTL: they are meant to outlive the connection.
//! (A lease that another connection of its owner is pulling at that instant keeps its
//! TTL: the TTL stays the backstop.)
//!
//! # Files
//!
//! - this file: the [`Producer`] handle, its settings, counters and construction;
//! - `state`: what a staged lease holds, and acting on what the ledger lets go of
//!   (`act`, `Done`, `Release`, expiry by the sweeper, quota charges);
//! - `publishing`: publications of an engine's cache, with their checksums;
//! - `staging`: stages (copy before advertise), of store chunks, publications and
//!   selections;
//! - `serving`: the request handler (the [`Handler`](crate::net::Handler) impl) and the
//!   socket writes;
//! - `puts`: pushes into the store (remote and local);
//! - `awaiting`: requests held until a key arrives (`AwaitPublished`), woken by the
//!   publication or put that brings it;
//! - `mapped`: the same-host offer and mapped gets (the CMA mover: the grant names
//!   where the bytes are, and the consumer reads them itself);
//! - `guards`: the guards that report to the ledger when they drop (`Staging`,
//!   `Sending`, [`Hold`]);
//! - `registrations`: registered caches and their deregistration;
//! - [`store`], `accounting`, [`fault_hooks`]: the chunk store, per-request
//!   accounting and fault injection, used by nothing else.
//!
//! # Cancellation
//!
//! A handler future dropped mid-request (connection torn down, server stopped) drops
//! the staging copy job (its pages return after the drain; its
//! [`Staging`](guards::Staging) guard ends the lease in the ledger) or the checked-out
//! lease (after the socket write stopped, since the write borrows it; its
//! [`Sending`](guards::Sending) guard tells the ledger, which ends the lease and
//! releases what only it held).

mod accounting;
mod awaiting;
mod fault_hooks;
mod guards;
mod mapped;
mod publishing;
mod puts;
mod registrations;
mod same_host;
mod serving;
mod staged;
mod staging;
mod state;
mod store;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub use self::fault_hooks::ProducerFaults;
pub use self::guards::Hold;
pub(crate) use self::registrations::DeregisterError;
use self::staged::ProducerLedger;
pub use self::store::{ChunkLocation, ChunkPins, ChunkStore, PinnedRegion, StoreStats};
use super::error::PeerError;
use super::ledger::{Ledger, LedgerLimits};
use super::movers::Transport;
use super::publish::{Publication, ReleaseQueue};
use super::quota::{QuotaLimits, Quotas};
use crate::copy::CopyEngine;
use crate::mem::Arena;
use crate::stats::RequestStats;

/// Producer settings.
#[derive(Clone, Debug)]
pub struct ProducerConfig {
    /// TTL granted when a request asks for 0.
    pub default_ttl: Duration,
    /// Longest TTL granted.
    pub max_ttl: Duration,
    /// Staging requests (stage, get) served at once; more get an immediate `Busy`.
    pub max_concurrent_gets: usize,
    /// Staging pages one peer (authenticated identity) may hold at once (`None`: half
    /// the arena).
    pub max_staged_pages_per_peer: Option<usize>,
    /// Staging pages the requests of one connection may hold at once (`None`: the
    /// per-peer quota). Leases staged for a later pull stay charged to their connection
    /// until they end.
    pub max_staged_pages_per_connection: Option<usize>,
    /// Staging pages peers of unproven identity (no TLS certificate) from one source
    /// address (IPv6: a /64) may hold at once, however many peer ids they claim
    /// (`None`: three quarters of the arena, or the per-peer quota if larger).
    pub max_staged_pages_per_source: Option<usize>,
    /// Staging pages all peers of unproven identity may hold together, so that some
    /// staging is always left for certificate-holding peers and local work (`None`:
    /// seven eighths of the arena, or the per-peer quota if larger).
    pub max_unproven_staged_pages: Option<usize>,
    /// How long an eager get's lease outlives its connection when the connection closes
    /// without `Done` (then it is released, however long its TTL). Leases staged for a
    /// later pull (`Stage`) are meant to outlive their connection and keep their TTL.
    pub lease_grace: Duration,
    /// Which movers this producer offers: with [`Transport::Auto`] (the default), a
    /// consumer on the same host may read granted bytes from this process with
    /// `process_vm_readv` (see [`super::mover`]); with [`Transport::Tcp`], every byte
    /// goes on the connection.
    pub transport: Transport,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        ProducerConfig {
            default_ttl: Duration::from_secs(10),
            max_ttl: Duration::from_secs(10),
            max_concurrent_gets: 64,
            max_staged_pages_per_peer: None,
            max_staged_pages_per_connection: None,
            max_staged_pages_per_source: None,
            max_unproven_staged_pages: None,
            lease_grace: Duration::from_secs(2),
            transport: Transport::Auto,
        }
    }
}

/// Producer counters.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ProducerStats {
    /// Leases staged.
    pub staged: u64,
    /// Leases waiting for a pull or `Done` right now (not counting checked-out ones).
    pub staged_now: usize,
    /// Leases released by `Done`.
    pub done: u64,
    /// Leases released by TTL expiry.
    pub expired: u64,
    /// Requests refused as busy.
    pub busy: u64,
    /// Bytes sent in bulk frames.
    pub bytes_sent: u64,
    /// Chunks sent in bulk frames.
    pub chunks_sent: u64,
    /// Chunks received by push.
    pub pushed: u64,
    /// Bytes received by push.
    pub bytes_received: u64,
    /// Chunks published (pinned blocks of an engine's cache) right now.
    pub published_now: usize,
    /// `Done`s or pulls refused because the lease belongs to another peer.
    pub foreign_lease_refused: u64,
    /// Requests refused because the peer holds its whole staging quota.
    pub quota_refused: u64,
    /// Eager-get leases whose connection closed without `Done` (released after the
    /// grace instead of at their TTL).
    pub orphaned: u64,
    /// Staging pages charged to peers' quotas right now (staged leases, checked-out
    /// ones and puts being received); zero once nothing is held.
    pub quota_pages_charged: usize,
}

#[derive(Default)]
struct Counters {
    busy: AtomicU64,
    bytes_sent: AtomicU64,
    chunks_sent: AtomicU64,
    pushed: AtomicU64,
    bytes_received: AtomicU64,
    quota_refused: AtomicU64,
}

struct Inner {
    store: ChunkStore,
    arena: Arena,
    engine: CopyEngine,
    cfg: ProducerConfig,
    incarnation: u64,
    /// Who holds what until when: leases, publications, registrations.
    ledger: Mutex<ProducerLedger>,
    releases: ReleaseQueue,
    /// Woken when a deregistration completes (the last holder let go).
    deregistered: tokio::sync::Notify,
    /// Woken when a key is published or put into the store: requests waiting for a
    /// key (`AwaitPublished`, see `awaiting`) look again.
    arrivals: tokio::sync::Notify,
    /// Staging pages charged per peer, connection and source (staged and checked-out
    /// leases, puts being received).
    quotas: Arc<Quotas>,
    gets: Semaphore,
    /// Refusing new stages and gets (with `Busy`): set while this process is not
    /// registered in its peer directory (its lease was lost).
    refusing: std::sync::atomic::AtomicBool,
    counters: Counters,
    requests: RequestStats,
    faults: ProducerFaults,
    stop: CancellationToken,
    /// The last host publication, whose checksums the next publication of the same
    /// blocks may share while it is live ([`Producer::live_sums_of`]). Weak: it keeps
    /// neither the publication nor its cache alive.
    last_host_pub: Mutex<std::sync::Weak<Publication>>,
    /// The same-host offer: this host's boot id and the probe pattern a consumer
    /// reads through the kernel to prove it can (see `mapped`).
    same_host: same_host::SameHost,
}

/// A producer. Cheap to clone; serve it with [`crate::net::Server`] (it implements
/// [`Handler`](crate::net::Handler)). Dropping the last handle stops its TTL sweeper
/// and releases staged pages.
#[derive(Clone)]
pub struct Producer {
    inner: Arc<Inner>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Producer {
    /// A producer over `store`, staging into `arena` with `engine`. `incarnation` must
    /// match the one its server announces in handshakes. Must be called inside a tokio
    /// runtime (it spawns the TTL sweeper).
    pub fn new(
        store: ChunkStore,
        arena: Arena,
        engine: CopyEngine,
        cfg: ProducerConfig,
        incarnation: u64,
    ) -> Result<Producer, PeerError> {
        if cfg.default_ttl.is_zero() || cfg.max_ttl.is_zero() || cfg.default_ttl > cfg.max_ttl {
            return Err(PeerError::InvalidArgument(format!(
                "TTLs must be > 0 and the default TTL ({:?}; Python `ttl`, `--ttl`) at most the longest ({:?}; `max_ttl`, `--max-ttl`)",
                cfg.default_ttl, cfg.max_ttl
            )));
        }
        if cfg.max_concurrent_gets == 0 {
            return Err(PeerError::InvalidArgument(
                "max concurrent gets must be at least 1".into(),
            ));
        }
        let arena_pages = arena.page_count();
        let per_peer = cfg.max_staged_pages_per_peer.unwrap_or(arena_pages / 2).max(1);
        let limits = QuotaLimits {
            per_peer,
            per_connection: cfg.max_staged_pages_per_connection.unwrap_or(per_peer).max(1),
            per_source: cfg
                .max_staged_pages_per_source
                .unwrap_or(per_peer.max(arena_pages * 3 / 4))
                .max(1),
            unproven: cfg
                .max_unproven_staged_pages
                .unwrap_or(per_peer.max(arena_pages * 7 / 8))
                .max(1),
        };
        let inner = Arc::new(Inner {
            quotas: Quotas::new(limits),
            store,
            arena,
            engine,
            gets: Semaphore::new(cfg.max_concurrent_gets),
            refusing: std::sync::atomic::AtomicBool::new(false),
            cfg,
            incarnation,
            ledger: Mutex::new(Ledger::new(LedgerLimits::default())),
            releases: ReleaseQueue::default(),
            deregistered: tokio::sync::Notify::new(),
            arrivals: tokio::sync::Notify::new(),
            counters: Counters::default(),
            requests: RequestStats::default(),
            faults: ProducerFaults::default(),
            stop: CancellationToken::new(),
            last_host_pub: Mutex::new(std::sync::Weak::new()),
            same_host: same_host::SameHost::new(),
        });
        inner.spawn_sweeper();
        Ok(Producer { inner })
    }

    /// The store.
    pub fn store(&self) -> &ChunkStore {
        &self.inner.store
    }

    /// The staging arena.
    pub fn arena(&self) -> &Arena {
        &self.inner.arena
    }

    /// This producer's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// Fault injection switches.
    pub fn faults(&self) -> &ProducerFaults {
        &self.inner.faults
    }

    /// Requests handled, by kind and outcome, and their handling latency by kind.
    pub fn request_stats(&self) -> &RequestStats {
        &self.inner.requests
    }

    /// Counters.
    pub fn stats(&self) -> ProducerStats {
        let c = &self.inner.counters;
        let (counts, staged_now, published_now) = {
            let l = self.inner.ledger.lock();
            (l.counts(), l.staged_now(), l.published_now())
        };
        ProducerStats {
            staged: counts.granted,
            staged_now,
            done: counts.done,
            expired: counts.expired,
            busy: c.busy.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            chunks_sent: c.chunks_sent.load(Ordering::Relaxed),
            pushed: c.pushed.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            published_now,
            foreign_lease_refused: counts.foreign_refused,
            quota_refused: c.quota_refused.load(Ordering::Relaxed),
            orphaned: counts.orphaned,
            quota_pages_charged: self.inner.quotas.charged(),
        }
    }

    /// The copy engine staging and landing run on.
    pub fn engine(&self) -> &CopyEngine {
        &self.inner.engine
    }

    /// Refuses (with `Busy`) or accepts again new stages and gets; lookups, pulls of
    /// leases already staged, `Done` and pushes are unaffected. The engine refuses
    /// while its directory registration is lost.
    pub fn set_refusing(&self, refusing: bool) {
        self.inner.refusing.store(refusing, Ordering::Release);
    }

    /// Pages charged to peer `identity`'s staging quota now.
    pub fn quota_charged_to(&self, identity: &str) -> usize {
        self.inner.quotas.charged_to(identity)
    }

    /// Staging pages of the leases granted to `identity` (waiting or being sent), as
    /// the ledger records them; puts being received are not leases (see
    /// [`quota_charged_to`](Self::quota_charged_to), which counts them too).
    pub fn lease_pages_held_by(&self, identity: &str) -> usize {
        self.inner.ledger.lock().pages_held_by(identity)
    }

    /// The staging quotas in effect, in pages.
    pub fn quota_limits(&self) -> QuotaLimits {
        self.inner.quotas.limits()
    }
}
