//! The producer: holds chunks in a [`ChunkStore`], stages them into arena pages on
//! request (copy before advertise), serves lookups, pulls, eager gets and pushes, and
//! releases staged pages on `Done` or when their TTL expires.
//!
//! This file does the I/O; who holds what until when is decided by the producer's
//! [ledger](super::ledger), asked under one lock, and the producer acts on what it
//! answers (drops lease payloads, reports released publications). A staged lease
//! waits in the ledger; while its bytes are written to a socket it is *checked out*
//! and owned by that write (a [`Sending`] guard that checks it back in, or reports its
//! drop), so nothing — TTL, `Done`, `Release`, shutdown — releases pages or blocks a
//! socket is still sending: such an end is accepted at once and takes effect when the
//! send ends. Concurrent staging requests are capped: over the cap, the reply is an
//! immediate `Busy` miss, not a queue. Fault injection lives in
//! [`fault_hooks`].
//!
//! Two kinds of chunks are served: chunks of the store (pinned in the store and sent
//! straight from its blocks with the checksum they were stored with), and **published**
//! blocks of an engine's own registered cache, one [`KvCacheRef`] of either memory
//! kind (see [`super::publish`]): host blocks ([`KvCache`]) are sent straight from the
//! cache with vectored writes — zero copies on this side — and device blocks are
//! gathered into staging pages first. One publish path serves both kinds; only the
//! stage matches on the kind, where the data path differs.
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
//! # Cancellation
//!
//! A handler future dropped mid-request (connection torn down, server stopped) drops
//! the staging copy job (its pages return after the drain; its [`Staging`] guard ends
//! the lease in the ledger) or the checked-out lease (after the socket write stopped,
//! since the write borrows it; its [`Sending`] guard tells the ledger, which ends the
//! lease and releases what only it held).

mod accounting;
mod fault_hooks;
mod store;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use self::fault_hooks::corrupted;
pub use self::fault_hooks::ProducerFaults;
use self::store::{truncate_ranges, PinnedChunks};
pub use self::store::{ChunkLocation, ChunkPins, ChunkStore, PinnedRegion, StoreStats};
use super::error::PeerError;
use super::ledger::{
    CheckOut, Deregistration, EndReason, LeaseRefusal, LeaseTerms, Ledger, LedgerLimits, Outcome, PubId, RegError,
    RegId, Who,
};
use super::publish::{HostSums, PubSource, Publication, ReleaseQueue, Released};
use super::quota::{Charge, Holder, QuotaLimits, Quotas};
use super::selection::{plan_source, SourcePlan};
use super::unit_crcs::{selected_checksum, UnitCrcs};
use crate::copy::CopyEngine;
use crate::device::{DeviceKvCache, KvCacheRef};
use crate::layout::KvCache;
use crate::mem::{Arena, Lease};
use crate::net::{Connection, Handler, NetError};
use crate::stats::RequestStats;
use crate::wire::{
    ChunkKey, ChunkMeta, ErrorKind, FrameKind, LeaseId, Limits, Message, SelectedShape, SelectionError, WireSelection,
};

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

/// A stage's outcome: lease id, staged chunks, granted TTL in milliseconds, and for a
/// selection the shape of the selected stream.
type StageResult = Result<(LeaseId, Vec<ChunkMeta>, u32, Option<SelectedShape>), PeerError>;

/// One staged chunk gathered from a device cache: its key, length and ranges.
type GatherFrame = (ChunkKey, usize, Vec<(usize, usize)>);

/// What a stage of published keys serves, decided under the ledger's lock from the
/// first key's publication.
enum Leading<'a> {
    /// The selected part of every key (one cache, either kind).
    Selected(&'a WireSelection),
    /// The leading host publications: their chunks (checksums from publication) and
    /// caches, in key order.
    Host {
        chunks: Vec<ChunkMeta>,
        caches: Vec<Arc<KvCache>>,
    },
    /// The leading publications of one device cache, to be gathered.
    Device(Arc<DeviceKvCache>),
}

/// What a staged lease sends from.
enum StagedData {
    /// Store chunks, pinned in the store until the lease ends and sent from its blocks.
    Store { chunks: PinnedChunks },
    /// Staging pages holding copies of store chunks, chunk `i` at `offsets[i]`.
    Pages { lease: Lease, offsets: Vec<usize> },
    /// Published host blocks (the lease's `publications`, publication `i` in
    /// `caches[i]`), sent straight from the engine's caches.
    Pinned { caches: Vec<Arc<KvCache>> },
    /// The selected part of published host blocks of one `cache`, sent straight from
    /// it frame by frame.
    Selected { plan: Arc<SourcePlan>, cache: Arc<KvCache> },
}

/// A staged lease's payload: what it sends from and the quota charge of its pages.
/// Who owns it and until when is the ledger's.
struct StagedLease {
    data: StagedData,
    chunks: Vec<ChunkMeta>,
    /// Its staging pages' quota charge (uncharged when the payload drops, on every
    /// path: `Done`, expiry, release, a failed or aborted send, shutdown).
    _charge: Option<Charge>,
    /// The publications it sends (what `data` reads from for pinned and selected
    /// leases; empty for store chunks).
    publications: Vec<Arc<Publication>>,
}

/// The ledger of a producer.
type ProducerLedger = Ledger<StagedLease, Arc<Publication>>;

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
}

/// A producer. Cheap to clone; serve it with [`crate::net::Server`] (it implements
/// [`Handler`]). Dropping the last handle stops its TTL sweeper and releases staged
/// pages.
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
                "TTLs must be > 0 and default ({:?}) <= max ({:?})",
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
            counters: Counters::default(),
            requests: RequestStats::default(),
            faults: ProducerFaults::default(),
            stop: CancellationToken::new(),
            last_host_pub: Mutex::new(std::sync::Weak::new()),
        });
        tokio::spawn(sweeper(Arc::downgrade(&inner), inner.stop.clone()));
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

    /// Releases every lease of peer `owner` (e.g. when the directory says the peer
    /// is gone); returns how many. Leases waiting for a pull end now; leases being
    /// staged or sent end when their staging or send ends.
    pub fn release_peer(&self, owner: &str) -> usize {
        let (n, out) = self.inner.ledger.lock().release_peer(owner, Instant::now());
        self.act(out); // their pages and quota charges return here
        n
    }

    /// Releases every staged lease and publication now (e.g. at shutdown); leases
    /// being sent are released when their send ends.
    pub fn release_all(&self) {
        let out = self.inner.ledger.lock().release_all(Instant::now());
        self.act(out);
    }

    /// Acts on what the ledger let go of: lease payloads drop first (staging pages and
    /// quota charges return), then released publications are reported and completed
    /// deregistrations woken. Called with the ledger unlocked.
    fn act(&self, out: Outcome<StagedLease, Arc<Publication>>) {
        if out.is_empty() {
            return;
        }
        let Outcome {
            ended,
            released,
            deregistered,
        } = out;
        let expired = ended.iter().filter(|e| e.reason == EndReason::Expired).count();
        if expired > 0 {
            tracing::debug!(target: "kvferry::peer", n = expired, "released expired staged leases");
        }
        for e in ended {
            tracing::trace!(target: "kvferry::peer", lease = e.id, reason = ?e.reason, pages = e.pages,
                with_payload = e.payload.is_some(), "lease ended");
            drop(e.payload); // pages and quota charge return here
        }
        for (r, publication) in released {
            drop(publication);
            self.inner.releases.push(r);
        }
        if !deregistered.is_empty() {
            self.inner.deregistered.notify_waiters();
        }
    }

    /// Publishes `blocks` of `cache` — registration `reg`, held by the publication
    /// until it is released — under `key`. The engine must not write the blocks until
    /// they are reported released ([`take_released`](Self::take_released)): after a
    /// consumer's `Done` when `once`, after `ttl` (capped at `max_ttl`; zero = the
    /// default TTL), or after [`unpublish`](Self::unpublish). Publishing a key again
    /// replaces (and releases) the earlier publication.
    ///
    /// One path for both memory kinds; only how the blocks are sent differs: host
    /// blocks are sent straight from the cache (zero copy, checksum computed now),
    /// device blocks are gathered into staging pages (device-to-host on the cache's
    /// copy stream, bounded by its op timeout) when a consumer asks, and sent from
    /// there.
    pub(crate) fn publish(
        &self,
        key: ChunkKey,
        cache: KvCacheRef,
        reg: u64,
        blocks: &[u32],
        ttl: Duration,
        once: bool,
    ) -> Result<(), PeerError> {
        cache
            .map()
            .check_blocks(blocks)
            .map_err(|e| PeerError::InvalidArgument(format!("publish {key}: {e}")))?;
        let len = cache.map().chunk_bytes(blocks.len());
        let ranges = cache.chunk_ranges(blocks, len)?;
        let source = match cache {
            KvCacheRef::Host(cache) => {
                let sums = match self.live_sums_of(&cache, blocks) {
                    Some(sums) => sums,
                    None => {
                        let (units, checksum) = UnitCrcs::compute(&cache, &ranges)?;
                        Arc::new(HostSums { checksum, units })
                    }
                };
                PubSource::Host { cache, sums }
            }
            KvCacheRef::Device(cache) => PubSource::Device { cache },
        };
        let p = Publication {
            key,
            source,
            ranges,
            blocks: blocks.to_vec(),
            len,
        };
        self.insert_publication(p, ttl, once, RegId(reg))
    }

    /// The checksums of the last host publication if it is of `blocks` of `cache` and
    /// still live (published, not expired): the engine promised not to write those
    /// blocks since it was taken, so it describes them now. A request published under
    /// several reader-slot keys in a row is read once instead of once per key.
    fn live_sums_of(&self, cache: &Arc<KvCache>, blocks: &[u32]) -> Option<Arc<HostSums>> {
        let last = self.inner.last_host_pub.lock().upgrade()?;
        let PubSource::Host { cache: c, sums } = &last.source else {
            return None;
        };
        if !Arc::ptr_eq(c, cache) || last.blocks != blocks {
            return None;
        }
        let ledger = self.inner.ledger.lock();
        let found = ledger.lookup(std::slice::from_ref(&last.key), Instant::now());
        let live = found.first().is_some_and(|(_, p)| Arc::ptr_eq(p, &last));
        live.then(|| sums.clone())
    }

    fn insert_publication(&self, p: Publication, ttl: Duration, once: bool, reg: RegId) -> Result<(), PeerError> {
        let ttl = self.clamp_ttl(ttl);
        let key = p.key;
        let now = Instant::now();
        let p = Arc::new(p);
        let host = matches!(p.source, PubSource::Host { .. });
        let published = self
            .inner
            .ledger
            .lock()
            .publish(key, p.clone(), once, now + ttl, Some(reg), now);
        match published {
            Ok((_, out)) => {
                if host {
                    *self.inner.last_host_pub.lock() = Arc::downgrade(&p);
                }
                self.act(out);
                Ok(())
            }
            Err(e) => Err(PeerError::InvalidArgument(format!("publish {key}: the cache is {e}"))),
        }
    }

    /// Releases a publication now (the engine's own release). False if unknown. The
    /// release is reported once every transfer sending it has stopped.
    pub fn unpublish(&self, key: &ChunkKey) -> bool {
        let out = self.inner.ledger.lock().unpublish(key, Instant::now());
        match out {
            Some(out) => {
                self.act(out);
                true
            }
            None => false,
        }
    }

    /// Publications released since the last call: their blocks are the engine's again.
    pub fn take_released(&self) -> Vec<Released> {
        self.inner.releases.take()
    }

    /// Waits until a release is reported or `deadline` passes.
    pub async fn wait_released(&self, deadline: Instant) {
        self.inner.releases.wait(deadline).await
    }

    fn clamp_ttl(&self, ttl: Duration) -> Duration {
        if ttl.is_zero() {
            self.inner.cfg.default_ttl
        } else {
            ttl.min(self.inner.cfg.max_ttl)
        }
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

    /// Charges `pages` to `holder`, or refuses (counted).
    fn charge(&self, holder: &Holder, pages: usize) -> Result<Charge, PeerError> {
        self.inner.quotas.charge(holder, pages).map_err(|e| {
            self.inner.counters.quota_refused.fetch_add(1, Ordering::Relaxed);
            quota_error(e)
        })
    }

    /// Starts a lease for `holder` serving publications `pubs` (held by it from now
    /// on); the guard ends it unless it is granted.
    fn begin(&self, holder: &Holder, incarnation: Option<u64>, pubs: Vec<PubId>) -> Staging<'_> {
        let terms = LeaseTerms {
            owner: holder.identity.clone(),
            owner_incarnation: incarnation,
            publications: pubs,
        };
        let id = self.inner.ledger.lock().begin(terms, rand::random::<LeaseId>);
        Staging {
            producer: self,
            id,
            armed: true,
        }
    }

    /// Writes `data` into free blocks and registers it under `key` (the local put).
    pub fn put_local(&self, key: ChunkKey, data: &[u8]) -> Result<(), PeerError> {
        let layout = *self.inner.store.layout();
        let nblocks = data.len().div_ceil(layout.block_bytes()).max(1);
        let blocks = self.inner.store.alloc_blocks(nblocks)?;
        let mut ranges = layout.chunk_ranges(&blocks)?;
        truncate_ranges(&mut ranges, data.len());
        let mut at = 0;
        for (off, len) in ranges {
            self.inner.store.region().write(off, &data[at..at + len])?;
            at += len;
        }
        let checksum = crate::checksum::checksum(data);
        self.inner.store.insert_checked(key, blocks, data.len(), checksum)
    }

    /// Stages the leading held chunks of `keys` (as many as fit in free arena pages)
    /// and records them under a new lease with `ttl`. Copy before advertise: the lease
    /// is recorded only after the gather completed and checksums were computed.
    pub async fn stage(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        owner: &str,
    ) -> Result<(LeaseId, Vec<ChunkMeta>, u32), PeerError> {
        let (lease, chunks, ttl, _) = self.stage_for(keys, ttl, &Holder::local(owner), None, None).await?;
        Ok((lease, chunks, ttl))
    }

    /// [`stage`](Self::stage) of the selected part of published keys (see
    /// [`super::selection`]): only the selected bytes are staged (device caches) or
    /// pinned for sending (host caches). Returns the frames and the stream's shape.
    pub async fn stage_selected(
        &self,
        keys: &[ChunkKey],
        select: &WireSelection,
        ttl: Duration,
        owner: &str,
    ) -> Result<(LeaseId, Vec<ChunkMeta>, u32, Option<SelectedShape>), PeerError> {
        self.stage_for(keys, ttl, &Holder::local(owner), None, Some(select))
            .await
    }

    /// [`stage`](Self::stage) for `holder`, the lease bound to `incarnation` too when
    /// given (a claimed identity); only the `select`ed part when given.
    async fn stage_for(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        holder: &Holder,
        incarnation: Option<u64>,
        select: Option<&WireSelection>,
    ) -> StageResult {
        let owner = holder.identity.as_str();
        let inner = &self.inner;
        let ttl = self.clamp_ttl(ttl);
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        if let Some(k) = keys.iter().find(|k| !seen.insert(**k)) {
            return Err(PeerError::InvalidArgument(format!(
                "key {k} listed twice in one request"
            )));
        }
        if let Some(r) = self.stage_published(keys, ttl, holder, incarnation, select).await {
            return r;
        }
        if select.is_some() {
            if inner.store.lookup(keys) > 0 {
                let why = format!("key {} is a store chunk: selections apply to published blocks", keys[0]);
                return Err(SelectionError::Unsupported(why).into());
            }
            return Ok((0, Vec::new(), ttl.as_millis() as u32, None));
        }
        // Store chunks are served in place: pinned until the lease ends, sent from the
        // store's blocks with the checksum they were stored with (no staging copy, no
        // pass over the bytes). The pages a copy would take are still charged to the
        // requester's quotas, so what one peer can hold pinned stays bounded as before.
        let room = inner.quotas.room(holder);
        let arena = &inner.arena;
        let pinned = inner.store.pin_for_send(keys, |bytes| arena.pages_for(bytes) <= room)?;
        if pinned.is_empty() {
            let Some(len) = pinned.unfit_len() else {
                return Ok((0, Vec::new(), ttl.as_millis() as u32, None));
            };
            let pages = inner.arena.pages_for(len);
            // Names the scope that is full.
            return Err(self.charge(holder, pages).err().unwrap_or(PeerError::QuotaExceeded {
                peer: owner.to_string(),
                held: 0,
                asked: pages,
                quota: room,
            }));
        }
        let bytes: usize = pinned.locations().iter().map(|l| l.len).sum();
        let charge = self.charge(holder, inner.arena.pages_for(bytes))?; // owned by the lease's payload
        let mut chunks = Vec::with_capacity(pinned.len());
        for (i, loc) in pinned.locations().iter().enumerate() {
            chunks.push(ChunkMeta {
                key: loc.key,
                len: loc.len as u64,
                checksum: pinned.checksum(i)?,
            });
        }
        let pages = inner.arena.pages_for(bytes);
        let payload = StagedLease {
            data: StagedData::Store { chunks: pinned },
            chunks: chunks.clone(),
            _charge: Some(charge),
            publications: Vec::new(),
        };
        let lease_id = self.begin(holder, incarnation, Vec::new()).grant(payload, pages, ttl)?;
        Ok((lease_id, chunks, ttl.as_millis() as u32, None))
    }

    /// How many leading `keys` this producer would serve: the leading published ones
    /// when the first is published (what a stage would send), else those in the store.
    fn lookup_hits(&self, keys: &[ChunkKey]) -> usize {
        let published = self.inner.ledger.lock().lookup(keys, Instant::now()).len();
        if published > 0 {
            published
        } else {
            self.inner.store.lookup(keys)
        }
    }

    /// Stages the leading published keys: host publications with no copy (the lease
    /// holds them and sends from the cache), device publications of one cache gathered
    /// into staging pages. `None` when the first key is not published (the store
    /// serves the request).
    async fn stage_published(
        &self,
        keys: &[ChunkKey],
        ttl: Duration,
        holder: &Holder,
        incarnation: Option<u64>,
        select: Option<&WireSelection>,
    ) -> Option<StageResult> {
        // The leading live publications, held by a new lease from the same instant
        // (under one lock): none can be released while this stage reads them.
        let (pubs, leading, staging) = {
            let mut ledger = self.inner.ledger.lock();
            let found = ledger.lookup(keys, Instant::now());
            let first = found.first()?;
            let mut pubs: Vec<(PubId, Arc<Publication>)> = Vec::with_capacity(found.len());
            let leading = match (&first.1.source, select) {
                // A selection takes every key (it checks they share one cache).
                (_, Some(select)) => {
                    pubs.extend(found.iter().map(|(id, p)| (*id, Arc::clone(p))));
                    Leading::Selected(select)
                }
                // The leading host publications, sent in place.
                (PubSource::Host { .. }, None) => {
                    let (mut chunks, mut caches) = (Vec::new(), Vec::new());
                    for (id, p) in &found {
                        let PubSource::Host { cache, sums } = &p.source else {
                            break;
                        };
                        chunks.push(ChunkMeta {
                            key: p.key,
                            len: p.len as u64,
                            checksum: sums.checksum,
                        });
                        caches.push(cache.clone());
                        pubs.push((*id, Arc::clone(p)));
                    }
                    Leading::Host { chunks, caches }
                }
                // The leading publications of the first one's device cache, gathered.
                (PubSource::Device { cache }, None) => {
                    pubs.extend(
                        found
                            .iter()
                            .take_while(|(_, p)| p.source.is_of_device(cache))
                            .map(|(id, p)| (*id, Arc::clone(p))),
                    );
                    Leading::Device(cache.clone())
                }
            };
            let terms = LeaseTerms {
                owner: holder.identity.clone(),
                owner_incarnation: incarnation,
                publications: pubs.iter().map(|(id, _)| *id).collect(),
            };
            let id = ledger.begin(terms, rand::random::<LeaseId>);
            (
                pubs.into_iter().map(|(_, p)| p).collect::<Vec<_>>(),
                leading,
                Staging {
                    producer: self,
                    id,
                    armed: true,
                },
            )
        };
        let (chunks, data, charge) = match leading {
            Leading::Selected(select) => {
                return Some(self.stage_selected_pubs(staging, keys, pubs, select, ttl, holder).await)
            }
            Leading::Host { chunks, caches } => (chunks, StagedData::Pinned { caches }, None),
            Leading::Device(cache) => {
                let frames = pubs.iter().map(|p| (p.key, p.len, p.ranges.clone())).collect();
                match self.gather_device(&cache, frames, holder).await {
                    Ok((chunks, data, charge)) => (chunks, data, Some(charge)),
                    Err(e) => return Some(Err(e)),
                }
            }
        };
        let pages = charge.as_ref().map_or(0, Charge::pages);
        let payload = StagedLease {
            data,
            chunks: chunks.clone(),
            _charge: charge,
            publications: pubs,
        };
        Some(
            staging
                .grant(payload, pages, ttl)
                .map(|lease_id| (lease_id, chunks, ttl.as_millis() as u32, None)),
        )
    }

    /// Stages the selected part of publications `pubs` (the leading published ones
    /// of `keys`): all keys must be published, from one cache. A host cache's
    /// selected bytes are sent from the cache under checksums made of the units taken
    /// at publication (read again only where the units do not cover a range exactly);
    /// a device cache's are gathered into staging pages.
    async fn stage_selected_pubs(
        &self,
        staging: Staging<'_>,
        keys: &[ChunkKey],
        pubs: Vec<Arc<Publication>>,
        select: &WireSelection,
        ttl: Duration,
        holder: &Holder,
    ) -> StageResult {
        let ttl_ms = ttl.as_millis() as u32;
        if pubs.len() < keys.len() {
            // Not everything is published (yet): a selection over missing blocks
            // cannot be served, so the request is a miss.
            return Ok((0, Vec::new(), ttl_ms, None));
        }
        let cache = pubs[0].source.cache();
        if let Some(p) = pubs.iter().find(|p| !p.source.cache().ptr_eq(&cache)) {
            let why = format!("keys {} and {} are published from different caches", pubs[0].key, p.key);
            return Err(SelectionError::Unsupported(why).into());
        }
        let map = cache.map().clone();
        let lists: Vec<(ChunkKey, &[u32])> = pubs.iter().map(|p| (p.key, p.blocks.as_slice())).collect();
        let limits = Limits::default();
        let plan = plan_source(&lists, &map, select, limits.max_keys, limits.max_bulk_bytes)?;
        let shape = plan.shape.clone();
        let (chunks, data, charge) = match cache {
            KvCacheRef::Host(cache) => {
                // From the units taken at publication wherever they cover the selected
                // ranges: no second pass, and checked against the published bytes.
                let units: Vec<&UnitCrcs> = pubs
                    .iter()
                    .filter_map(|p| match &p.source {
                        PubSource::Host { sums, .. } => Some(&sums.units),
                        PubSource::Device { .. } => None,
                    })
                    .collect();
                let mut chunks = Vec::with_capacity(plan.frame_count());
                for i in 0..plan.frame_count() {
                    let (key, len) = plan.frame(i);
                    let checksum = selected_checksum(&units, &cache, &plan.frame_ranges(i))?;
                    chunks.push(ChunkMeta {
                        key,
                        len: len as u64,
                        checksum,
                    });
                }
                let data = StagedData::Selected {
                    plan: Arc::new(plan),
                    cache,
                };
                (chunks, data, None)
            }
            KvCacheRef::Device(cache) => {
                let all = plan.all_ranges()?;
                let frames = all
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| {
                        let (key, len) = plan.frame(i);
                        (key, len, r)
                    })
                    .collect();
                let (chunks, data, charge) = self.gather_device(&cache, frames, holder).await?;
                (chunks, data, Some(charge))
            }
        };
        let pages = charge.as_ref().map_or(0, Charge::pages);
        let payload = StagedLease {
            data,
            chunks: chunks.clone(),
            _charge: charge,
            publications: pubs,
        };
        let lease_id = staging.grant(payload, pages, ttl)?;
        Ok((lease_id, chunks, ttl_ms, Some(shape)))
    }

    /// Gathers device publications into fresh staging pages (device-to-host on the
    /// cache's copy stream, waited for at most the cache's op timeout) and checksums
    /// them. On timeout or cancel the pages are quarantined until the device confirms.
    ///
    /// `frames`: what to gather, one staged chunk each: its key, length and ranges in
    /// the cache (a publication's, or a frame of a selection).
    async fn gather_device(
        &self,
        cache: &Arc<DeviceKvCache>,
        frames: Vec<GatherFrame>,
        holder: &Holder,
    ) -> Result<(Vec<ChunkMeta>, StagedData, Charge), PeerError> {
        let inner = &self.inner;
        let total: usize = frames.iter().map(|f| f.1).sum();
        let pages = inner.arena.pages_for(total);
        let lease = inner.arena.try_alloc(pages).map_err(|_| {
            inner.counters.busy.fetch_add(1, Ordering::Relaxed);
            PeerError::StagingExhausted {
                needed: pages,
                free: inner.arena.stats().free_pages,
            }
        })?;
        let charge = self.charge(holder, lease.page_count())?;
        let mut offsets = Vec::with_capacity(frames.len());
        let mut plan = Vec::with_capacity(frames.len());
        let mut metas = Vec::with_capacity(frames.len());
        let mut at = 0;
        for (key, len, ranges) in frames {
            offsets.push(at);
            plan.push((at, ranges));
            metas.push((key, len));
            at += len;
        }
        let device_err = |error| PeerError::Device {
            cache: cache.name().to_string(),
            error,
        };
        let gathered = async {
            let pending = cache.gather(&plan, lease, "stage: device-to-host gather")?;
            let deadline = pending.event().meta().submitted() + cache.op_timeout();
            pending.wait(deadline).await
        }
        .await;
        let lease = match gathered {
            Ok(l) => l,
            Err(e) => {
                // The pages are back (failed copy) or quarantined (timeout): either way
                // no longer this peer's (the charge drops here).
                drop(charge);
                return Err(device_err(e));
            }
        };
        let mut chunks = Vec::with_capacity(metas.len());
        for (&(key, len), &off) in metas.iter().zip(&offsets) {
            let mut crc = 0u32;
            for s in lease.io_slices(off, len)? {
                crc = crate::checksum::append(crc, s);
            }
            chunks.push(ChunkMeta {
                key,
                len: len as u64,
                checksum: crc,
            });
        }
        Ok((chunks, StagedData::Pages { lease, offsets }, charge))
    }

    /// Releases a staged lease on `owner`'s `Done`: published chunks it sent that
    /// were published `once` leave the table. Unknown leases, and leases of another
    /// peer (refused and counted), change nothing. A lease being sent is released when
    /// its send ends (the `Done` is accepted now).
    pub fn release(&self, lease_id: LeaseId, owner: &str) -> Result<(), LeaseRefusal> {
        self.done_for(lease_id, &Who::Local(owner.to_string()))
    }

    /// A `Done` from `who`: for a remote requester its identity, and without TLS its
    /// incarnation, must be the ones the lease was granted to.
    fn done_for(&self, lease_id: LeaseId, who: &Who) -> Result<(), LeaseRefusal> {
        let out = self.inner.ledger.lock().done(lease_id, who, Instant::now())?;
        self.act(out); // the lease's pages and charge drop here, unless it is being sent
        Ok(())
    }

    /// A consumer's `Release`: each key that is a `once` publication leaves the table
    /// (reason `Declined`; reported once every transfer still sending it stopped), and
    /// a key retired recently answers released again. Whoever may pull a `once`
    /// publication may release it (it could stage it and send `Done`): a key is the
    /// capability. Publications many may read and store chunks are never touched.
    /// Nothing is staged.
    fn decline(&self, keys: &[ChunkKey]) -> Vec<bool> {
        let (answers, out) = self.inner.ledger.lock().decline(keys, Instant::now());
        self.act(out);
        answers
    }

    async fn send_lease(&self, conn: &mut Connection, request_id: u64, entry: &StagedLease) -> Result<(), NetError> {
        let faults = &self.inner.faults;
        for (i, meta) in entry.chunks.iter().enumerate() {
            faults.before_frame(conn.peer()).await?;
            let parts = match &entry.data {
                StagedData::Store { chunks } => chunks.io_slices(i),
                StagedData::Pages { lease, offsets } => lease.io_slices(offsets[i], meta.len as usize),
                // Published blocks: straight from the engine's cache (the lease holds
                // the publication, and so the cache, until this write stopped).
                StagedData::Pinned { caches } => caches[i].io_slices(&entry.publications[i].ranges),
                // A selection: frame `i`'s ranges of the (one) host cache.
                StagedData::Selected { plan, cache } => cache.io_slices(&plan.frame_ranges(i)),
            }
            .map_err(|e| NetError::Protocol(e.to_string()))?;
            if meta.len > 0 && faults.corrupt_frame() {
                conn.send_bulk(request_id, &[&corrupted(&parts)]).await?;
            } else {
                conn.send_bulk_with_checksum(request_id, &parts, meta.checksum).await?;
            }
            self.inner.counters.bytes_sent.fetch_add(meta.len, Ordering::Relaxed);
            self.inner.counters.chunks_sent.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Checks lease `lease_id` out for a send to `who` (tied to `eager_conn` for an
    /// eager get), or the refusal to answer.
    fn check_out(
        &self,
        lease_id: LeaseId,
        who: &Who,
        eager_conn: Option<u64>,
    ) -> Result<Sending<'_>, (ErrorKind, String)> {
        let r = self
            .inner
            .ledger
            .lock()
            .check_out(lease_id, who, eager_conn, Instant::now());
        match r {
            CheckOut::Out(lease) => Ok(Sending {
                producer: self,
                id: lease_id,
                lease: Some(lease),
            }),
            CheckOut::Expired(out) => {
                self.act(out); // pages and charge back
                Err((ErrorKind::LeaseExpired, format!("lease {lease_id} expired")))
            }
            CheckOut::ExpiredEarlier => Err((ErrorKind::LeaseExpired, format!("lease {lease_id} expired"))),
            CheckOut::Refused(LeaseRefusal::Foreign) => {
                Err((ErrorKind::UnknownLease, format!("no lease {lease_id} for this peer")))
            }
            CheckOut::Refused(LeaseRefusal::Unknown) => Err((ErrorKind::UnknownLease, format!("no lease {lease_id}"))),
        }
    }

    async fn handle_request(&self, conn: &mut Connection, id: u64, msg: Message) -> Result<(), NetError> {
        // Under TLS, the certificate's identity: a peer cannot claim another's leases.
        // Without it, the claimed id, and leases are bound to the claimant's
        // incarnation too; quotas then count its source address as well.
        let peer = conn.peer();
        let holder = Holder {
            identity: peer.authenticated_id().to_string(),
            conn: Some(conn.id()),
            source: peer.addr.map(|a| a.ip()),
            proven: peer.tls_identity.is_some(),
        };
        let incarnation = (!holder.proven).then_some(peer.incarnation);
        let who = Who::Remote {
            identity: holder.identity.clone(),
            incarnation,
        };
        // A selected get or stage is served as the plain one, with its selection.
        let (msg, select) = match msg {
            Message::GetSelected { keys, ttl_ms, select } => (Message::Get { keys, ttl_ms }, Some(select)),
            Message::StageSelected { keys, ttl_ms, select } => (Message::Stage { keys, ttl_ms }, Some(select)),
            other => (other, None),
        };
        // A selected request's reply is `StagedSelected`, a miss included.
        let selected = select.is_some();
        let staged = |lease_id, chunks, ttl_ms, shape: Option<SelectedShape>| match shape {
            Some(shape) => Message::StagedSelected {
                lease_id,
                incarnation: self.inner.incarnation,
                chunks,
                ttl_ms,
                shape,
            },
            None if selected => Message::StagedSelected {
                lease_id,
                incarnation: self.inner.incarnation,
                chunks,
                ttl_ms,
                shape: SelectedShape::default(),
            },
            None => Message::Staged {
                lease_id,
                incarnation: self.inner.incarnation,
                chunks,
                ttl_ms,
            },
        };
        if self.inner.refusing.load(Ordering::Acquire) && matches!(msg, Message::Stage { .. } | Message::Get { .. }) {
            self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
            let why = "not registered in the peer directory (its lease was lost; registering again)";
            return refuse(conn, id, ErrorKind::Busy, why.into()).await;
        }
        match msg {
            Message::Ping => conn.send(id, &Message::Pong).await,
            Message::Lookup { keys } => {
                let hits = self.lookup_hits(&keys) as u32;
                accounting::note_found(hits > 0);
                conn.send(id, &Message::LookupReply { hits }).await
            }
            Message::Stage { keys, ttl_ms } | Message::Get { keys, ttl_ms } if keys.is_empty() => {
                let _ = ttl_ms;
                refuse(conn, id, ErrorKind::BadRequest, "empty key list".into()).await
            }
            Message::Stage { keys, ttl_ms } => {
                let Ok(_permit) = self.inner.gets.try_acquire() else {
                    self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return refuse(conn, id, ErrorKind::Busy, "too many concurrent gets".into()).await;
                };
                let ttl = Duration::from_millis(ttl_ms as u64);
                match self.stage_for(&keys, ttl, &holder, incarnation, select.as_ref()).await {
                    Ok((lease_id, chunks, ttl_ms, shape)) => {
                        accounting::note_found(!chunks.is_empty());
                        conn.send(id, &staged(lease_id, chunks, ttl_ms, shape)).await
                    }
                    Err(e) => refuse(conn, id, kind_of(&e), e.to_string()).await,
                }
            }
            Message::Get { keys, ttl_ms } => {
                let Ok(_permit) = self.inner.gets.try_acquire() else {
                    self.inner.counters.busy.fetch_add(1, Ordering::Relaxed);
                    return refuse(conn, id, ErrorKind::Busy, "too many concurrent gets".into()).await;
                };
                let ttl = Duration::from_millis(ttl_ms as u64);
                let (lease_id, chunks, ttl_ms, shape) =
                    match self.stage_for(&keys, ttl, &holder, incarnation, select.as_ref()).await {
                        Ok(s) => s,
                        Err(e) => return refuse(conn, id, kind_of(&e), e.to_string()).await,
                    };
                accounting::note_found(!chunks.is_empty());
                conn.send(id, &staged(lease_id, chunks, ttl_ms, shape)).await?;
                if lease_id == 0 {
                    return Ok(()); // miss: nothing staged, nothing follows
                }
                // Tied to this connection: released after the grace if it closes
                // without `Done`.
                let sending = match self.check_out(lease_id, &who, Some(conn.id())) {
                    Ok(s) => s,
                    Err((kind, message)) => return refuse(conn, id, kind, message).await,
                };
                // On a failed (or aborted) send the guard drops: the lease ends, its
                // pages and its quota charge return (the eager consumer is gone).
                self.send_lease(conn, id, sending.lease()).await?;
                conn.send(id, &Message::PullDone { lease_id }).await?;
                sending.check_in();
                Ok(())
            }
            Message::Pull { lease_id, incarnation } => {
                if incarnation != self.inner.incarnation {
                    let m = format!(
                        "lease from incarnation {incarnation:#x}, this is {:#x}",
                        self.inner.incarnation
                    );
                    return refuse(conn, id, ErrorKind::StaleIncarnation, m).await;
                }
                let sending = match self.check_out(lease_id, &who, None) {
                    Ok(s) => s,
                    Err((kind, message)) => return refuse(conn, id, kind, message).await,
                };
                let r = self.send_lease(conn, id, sending.lease()).await;
                // A delayed pull may be retried: keep the lease until Done or TTL
                // (or end it now, if a Done arrived while it was being sent).
                sending.check_in();
                r?;
                conn.send(id, &Message::PullDone { lease_id }).await
            }
            Message::Done { lease_id } => {
                // Duplicate or unknown Dones change nothing and are acknowledged (a
                // Done may race the TTL); a foreign one is refused.
                match self.done_for(lease_id, &who) {
                    Err(LeaseRefusal::Foreign) => {
                        let m = format!("lease {lease_id} was not granted to this peer");
                        refuse(conn, id, ErrorKind::UnknownLease, m).await
                    }
                    _ => conn.send(id, &Message::DoneAck).await,
                }
            }
            Message::Release { keys, incarnation } => {
                if incarnation != self.inner.incarnation {
                    let m = format!(
                        "release for incarnation {incarnation:#x}, this is {:#x}",
                        self.inner.incarnation
                    );
                    return refuse(conn, id, ErrorKind::StaleIncarnation, m).await;
                }
                let released = self.decline(&keys);
                conn.send(id, &Message::ReleaseAck { released }).await
            }
            Message::Put { key, len } => self.receive_put(conn, id, key, len, &holder).await,
            other => {
                let m = format!("unexpected request {}", other.name());
                refuse(conn, id, ErrorKind::BadRequest, m).await
            }
        }
    }

    /// Push: bytes land straight into fresh store blocks (their quota charged like
    /// staging pages), registered under the key with their verified wire checksum.
    async fn receive_put(
        &self,
        conn: &mut Connection,
        id: u64,
        key: ChunkKey,
        len: u64,
        holder: &Holder,
    ) -> Result<(), NetError> {
        let inner = &self.inner;
        let header = conn.read_header(conn.io_timeout()).await?;
        if header.request_id != id || header.kind != FrameKind::Bulk {
            // Not this put's bytes: skip the frame (the connection stays in sync) and
            // refuse, rather than storing (and acknowledging) another request's frame.
            conn.skip(&header).await?;
            let m = format!(
                "put {id} expects its bulk frame, got a {:?} frame for request {}",
                header.kind, header.request_id
            );
            return refuse(conn, id, ErrorKind::BadRequest, m).await;
        }
        let layout = *inner.store.layout();
        let len = len as usize;
        let cap = layout.block_bytes() * layout.blocks as usize;
        if header.len as usize != len || len == 0 || len > cap {
            conn.skip(&header).await?;
            let m = format!(
                "put of {len} bytes (frame {}) does not fit a chunk (max {cap})",
                header.len
            );
            return refuse(conn, id, ErrorKind::TooLarge, m).await;
        }
        // Charged to the sender's quotas before a byte of the body is read (a put that
        // stalls holds no more than its sender may), uncharged when this request ends.
        let pages = inner.arena.pages_for(len);
        let _charge = match self.charge(holder, pages) {
            Ok(c) => c,
            Err(e) => {
                conn.skip(&header).await?;
                return refuse(conn, id, ErrorKind::Busy, e.to_string()).await;
            }
        };
        // Straight into fresh store blocks (no staging copy); they return to the free
        // list if the read fails, and hold the chunk only once its checksum matched.
        let mut blocks = match inner.store.alloc_put(len) {
            Ok(b) => b,
            Err(e) => {
                conn.skip(&header).await?;
                return refuse(conn, id, ErrorKind::Busy, e.to_string()).await;
            }
        };
        let checksum = {
            let mut parts = blocks.io_slices_mut().map_err(|e| NetError::Protocol(e.to_string()))?;
            conn.read_bulk_into(&header, &mut parts).await?
        };
        inner.counters.bytes_received.fetch_add(len as u64, Ordering::Relaxed);
        if let Err(e) = blocks.commit(key, checksum) {
            return refuse(conn, id, ErrorKind::Internal, e.to_string()).await;
        }
        inner.counters.pushed.fetch_add(1, Ordering::Relaxed);
        conn.send(id, &Message::PutAck { key }).await
    }
}

/// A refused quota charge as the peer error callers know.
fn quota_error(e: super::quota::QuotaError) -> PeerError {
    let super::quota::QuotaError::Exceeded {
        scope,
        held,
        asked,
        quota,
    } = e;
    PeerError::QuotaExceeded {
        peer: scope,
        held,
        asked,
        quota,
    }
}

fn kind_of(e: &PeerError) -> ErrorKind {
    match e {
        PeerError::StagingExhausted { .. } | PeerError::StoreFull { .. } | PeerError::QuotaExceeded { .. } => {
            ErrorKind::Busy
        }
        PeerError::InvalidArgument(_) => ErrorKind::BadRequest,
        PeerError::Selection(_) => ErrorKind::BadSelection,
        PeerError::ShuttingDown => ErrorKind::ShuttingDown,
        _ => ErrorKind::Internal,
    }
}

async fn refuse(conn: &mut Connection, id: u64, kind: ErrorKind, message: String) -> Result<(), NetError> {
    tracing::debug!(target: "kvferry::peer", ?kind, reason = %message, "request refused");
    accounting::note_refusal(kind);
    conn.send(id, &Message::Error { kind, message }).await
}

/// A holder of a registration (a transfer using its cache): the ledger counts it
/// until this drops; the last drop of a cache being deregistered completes the
/// deregistration.
pub struct Hold {
    producer: Producer,
    id: RegId,
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hold({})", self.id.0)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let done = self.producer.inner.ledger.lock().unhold(self.id);
        if done.is_some() {
            self.producer.inner.deregistered.notify_waiters();
        }
    }
}

/// Registrations: each registered cache (host or device) counted in the ledger.
impl Producer {
    /// Records registration `id` (no holders).
    pub(crate) fn register(&self, id: u64) -> Result<(), RegError> {
        self.inner.ledger.lock().register(RegId(id))
    }

    /// One more holder of registration `id`, until the [`Hold`] drops; refused if it
    /// is not registered or is being deregistered.
    pub(crate) fn hold(&self, id: u64) -> Result<Hold, RegError> {
        self.inner.ledger.lock().hold(RegId(id))?;
        Ok(Hold {
            producer: self.clone(),
            id: RegId(id),
        })
    }

    /// Holders of registration `id` now (`None`: not registered).
    pub(crate) fn holders(&self, id: u64) -> Option<usize> {
        self.inner.ledger.lock().holders(RegId(id))
    }

    /// Deregisters `id`: at once without holders, else when the last holder lets go
    /// (woken by it, not polled), or at `deadline`: then it stays registered and the
    /// holders left are the error.
    pub(crate) async fn deregister(&self, id: u64, deadline: Instant) -> Result<(), DeregisterError> {
        let id = RegId(id);
        let notified = self.inner.deregistered.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match self.inner.ledger.lock().deregister(id) {
            Err(_) => return Err(DeregisterError::NotRegistered),
            Ok(Deregistration::Done) => return Ok(()),
            Ok(Deregistration::Pending(_)) => {}
        }
        loop {
            let woken = tokio::time::timeout_at(deadline, notified.as_mut()).await.is_ok();
            // Armed before the check: a completion after it wakes the next wait.
            notified.set(self.inner.deregistered.notified());
            notified.as_mut().enable();
            let mut ledger = self.inner.ledger.lock();
            if ledger.holders(id).is_none() {
                return Ok(());
            }
            if !woken {
                let holders = ledger.abandon_deregister(id).unwrap_or(0);
                return Err(DeregisterError::InUse { holders });
            }
        }
    }
}

/// Why a deregistration failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeregisterError {
    /// Not registered (or already deregistered).
    NotRegistered,
    /// Still held at the deadline by this many holders.
    InUse {
        /// Holders left.
        holders: usize,
    },
}

impl Producer {
    /// An eager get's connection closed: its leases not yet released by `Done` are
    /// released `lease_grace` from now (sooner if their TTL says so). Returns how many.
    fn orphan_eager(&self, conn_id: u64) -> usize {
        self.inner
            .ledger
            .lock()
            .orphan(conn_id, self.inner.cfg.lease_grace, Instant::now())
    }
}

/// A lease being staged (its pages filled, its publications held): granted with
/// [`grant`](Self::grant); dropped on any other path (a failed or cancelled stage), it
/// ends the lease in the ledger.
struct Staging<'a> {
    producer: &'a Producer,
    id: LeaseId,
    armed: bool,
}

impl Staging<'_> {
    /// Grants the lease its payload (charged for `pages`) for `ttl`; refused (with
    /// the payload dropped) when the producer shut down or the owner left meanwhile.
    fn grant(mut self, payload: StagedLease, pages: usize, ttl: Duration) -> Result<LeaseId, PeerError> {
        self.armed = false;
        let granted = self
            .producer
            .inner
            .ledger
            .lock()
            .grant(self.id, payload, pages, Instant::now(), ttl);
        match granted {
            Ok(()) => Ok(self.id),
            Err(out) => {
                self.producer.act(out);
                Err(PeerError::ShuttingDown)
            }
        }
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if self.armed {
            let out = self
                .producer
                .inner
                .ledger
                .lock()
                .staging_failed(self.id, Instant::now());
            self.producer.act(out);
        }
    }
}

/// A lease checked out for a send: the send reads [`lease`](Self::lease), then
/// [`check_in`](Self::check_in)s it. Dropped instead (a failed or aborted send, after
/// the socket write stopped, since the write borrows it), it drops the payload and
/// tells the ledger, which ends the lease.
struct Sending<'a> {
    producer: &'a Producer,
    id: LeaseId,
    lease: Option<StagedLease>,
}

impl Sending<'_> {
    fn lease(&self) -> &StagedLease {
        self.lease.as_ref().expect("held until checked in or dropped")
    }

    /// Gives the lease back to the ledger (it waits again, or ends now if an end was
    /// accepted while it was out).
    fn check_in(mut self) {
        if let Some(lease) = self.lease.take() {
            let out = self
                .producer
                .inner
                .ledger
                .lock()
                .check_in(self.id, lease, Instant::now());
            self.producer.act(out);
        }
    }
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            drop(lease); // pages and charge back
            let out = self.producer.inner.ledger.lock().send_dropped(self.id, Instant::now());
            self.producer.act(out);
        }
    }
}

impl Handler for Producer {
    fn handle<'a>(
        &'a self,
        conn: &'a mut Connection,
        request_id: u64,
        msg: Message,
    ) -> BoxFuture<'a, Result<(), NetError>> {
        let span = tracing::info_span!(target: "kvferry::peer", "request", request = request_id,
            peer = %conn.peer(), msg = msg.name());
        let kind = accounting::kind_of(&msg);
        async move {
            let handler = self.handle_request(conn, request_id, msg);
            let r = accounting::measured(&self.inner.requests, kind, handler).await;
            if let Err(e) = &r {
                tracing::debug!(target: "kvferry::peer", error = %e, "request ended the connection");
            }
            r
        }
        .instrument(span)
        .boxed()
    }

    fn disconnected(&self, conn: &Connection) {
        let n = self.orphan_eager(conn.id());
        if n > 0 {
            tracing::debug!(target: "kvferry::peer", peer = %conn.peer(), leases = n,
                grace = ?self.inner.cfg.lease_grace, "eager get connection closed without Done");
        }
    }
}

/// Releases expired leases and publications. Holds only a weak reference, so it ends
/// with the producer.
async fn sweeper(inner: Weak<Inner>, stop: CancellationToken) {
    loop {
        let period = match inner.upgrade() {
            Some(i) => (i.cfg.default_ttl / 4).clamp(Duration::from_millis(5), Duration::from_millis(100)),
            None => return,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        let out = inner.ledger.lock().expire(Instant::now());
        Producer { inner }.act(out);
    }
}
