//! The producer: holds chunks in a [`ChunkStore`], stages them into arena pages on
//! request (copy before advertise), serves lookups, pulls, eager gets and pushes, and
//! releases staged pages on `Done` or when their TTL expires.
//!
//! A staged lease lives in the `staged` table while it waits; while its bytes are being
//! written to a socket it is *checked out* of the table and owned by that write, so the
//! TTL sweeper cannot release pages a socket is still sending. Concurrent staging
//! requests are capped: over the cap, the reply is an immediate `Busy` miss, not a
//! queue.
//!
//! Two kinds of chunks are served: chunks of the store (pinned in the store and sent
//! straight from its blocks with the checksum they were stored with), and **published** blocks of an engine's own
//! [`KvCache`] (see [`super::publish`]), which are sent straight from the cache with
//! vectored writes — zero copies on this side.
//!
//! A consumer that will not pull sends `Release`: the `once` publications it names
//! leave the table at once (reason `Declined`), with nothing staged, so it works while
//! staging is full. A key is the capability (whoever may pull a `once` publication may
//! end it); other publications and store chunks are never touched.
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
//! the staging copy job (its pages return after the drain) or the checked-out lease
//! (after the socket write stopped, since the write borrows it).

use std::collections::{HashMap, VecDeque};
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

use super::accounting;
use super::publish::{PubSource, Publication, ReleaseQueue, ReleaseReason, Released};
use super::quota::{Charge, Holder, QuotaLimits, Quotas};
use super::selection::{plan_source, SourcePlan};
use super::store::{truncate_ranges, ChunkStore, PinnedChunks};
use super::PeerError;
use crate::copy::CopyEngine;
use crate::device::DeviceKvCache;
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

/// Faults a producer can inject (for chaos and tests).
#[derive(Debug, Default)]
pub struct ProducerFaults {
    /// Corrupt one byte of the next N bulk frames sent (on the wire only; staged
    /// pages stay intact).
    pub corrupt_next_sends: AtomicU64,
    /// Delay before each bulk frame, in microseconds (a slow peer).
    pub send_delay_us: AtomicU64,
    /// Corrupt one byte of each bulk frame sent with this probability, in parts per
    /// million (on the wire only, as `corrupt_next_sends`).
    pub corrupt_ppm: AtomicU64,
    /// Delay a bulk frame by `slow_delay_us` with this probability, in parts per million.
    pub slow_ppm: AtomicU64,
    /// The delay of a frame picked by `slow_ppm`, in microseconds.
    pub slow_delay_us: AtomicU64,
    /// Drop the connection before a bulk frame with this probability, in parts per
    /// million (a connection reset in the middle of a transfer).
    pub reset_ppm: AtomicU64,
}

impl ProducerFaults {
    /// True with probability `ppm` parts per million; logs the fault when it fires.
    fn roll(ppm: &AtomicU64, what: &'static str) -> bool {
        let ppm = ppm.load(Ordering::Relaxed);
        let hit = ppm > 0 && rand::random::<u64>() % 1_000_000 < ppm;
        if hit {
            tracing::warn!(target: "kvferry::fault", "injected fault: {what}");
        }
        hit
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

/// Why a `Done` changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseRefusal {
    /// No such lease (already released, expired, or never granted).
    Unknown,
    /// The lease was granted to another peer.
    Foreign,
}

/// What a staged lease sends from.
enum StagedData {
    /// Store chunks, pinned in the store until the lease ends and sent from its blocks.
    Store { chunks: PinnedChunks },
    /// Staging pages holding copies of store chunks, chunk `i` at `offsets[i]`.
    Pages { lease: Lease, offsets: Vec<usize> },
    /// Published host blocks (the lease's `publications`), sent straight from the
    /// engine's cache.
    Pinned,
    /// The selected part of published host blocks (one cache: the first
    /// publication's), sent straight from the cache frame by frame.
    Selected { plan: Arc<SourcePlan> },
}

struct StagedLease {
    data: StagedData,
    chunks: Vec<ChunkMeta>,
    expires: Instant,
    /// The peer it was granted to.
    owner: String,
    /// Without TLS, the incarnation of the peer it was granted to: a `Done` or `Pull`
    /// must come from the same process, not merely claim the same peer id (`None`:
    /// bound to a certificate identity, or granted locally).
    owner_incarnation: Option<u64>,
    /// Its staging pages' quota charge (uncharged when the lease drops, on every path).
    _charge: Option<Charge>,
    /// The connection of the eager get that holds it (`None`: a lease staged for a
    /// later pull, which outlives its connection).
    eager_conn: Option<u64>,
    /// The publications it serves (pinned until the lease ends; empty for store chunks).
    publications: Vec<Arc<Publication>>,
}

impl StagedLease {
    /// True if `who` may pull or release it.
    fn belongs_to(&self, who: &Requester) -> bool {
        self.owner == who.identity && self.owner_incarnation.is_none_or(|i| Some(i) == who.incarnation)
    }
}

/// Who asks, as far as lease binding goes.
struct Requester {
    identity: String,
    /// Its incarnation, when its identity is only claimed (no TLS).
    incarnation: Option<u64>,
}

#[derive(Default)]
struct Counters {
    staged: AtomicU64,
    done: AtomicU64,
    expired: AtomicU64,
    busy: AtomicU64,
    bytes_sent: AtomicU64,
    chunks_sent: AtomicU64,
    pushed: AtomicU64,
    bytes_received: AtomicU64,
    foreign_lease_refused: AtomicU64,
    quota_refused: AtomicU64,
    orphaned: AtomicU64,
}

struct Inner {
    store: ChunkStore,
    arena: Arena,
    engine: CopyEngine,
    cfg: ProducerConfig,
    incarnation: u64,
    staged: Mutex<HashMap<LeaseId, StagedLease>>,
    recently_expired: Mutex<VecDeque<LeaseId>>,
    published: Mutex<HashMap<ChunkKey, Arc<Publication>>>,
    releases: Arc<ReleaseQueue>,
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
            staged: Mutex::new(HashMap::new()),
            recently_expired: Mutex::new(VecDeque::new()),
            published: Mutex::new(HashMap::new()),
            releases: Arc::new(ReleaseQueue::default()),
            counters: Counters::default(),
            requests: RequestStats::default(),
            faults: ProducerFaults::default(),
            stop: CancellationToken::new(),
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
        ProducerStats {
            staged: c.staged.load(Ordering::Relaxed),
            staged_now: self.inner.staged.lock().len(),
            done: c.done.load(Ordering::Relaxed),
            expired: c.expired.load(Ordering::Relaxed),
            busy: c.busy.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            chunks_sent: c.chunks_sent.load(Ordering::Relaxed),
            pushed: c.pushed.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            published_now: self.inner.published.lock().len(),
            foreign_lease_refused: c.foreign_lease_refused.load(Ordering::Relaxed),
            quota_refused: c.quota_refused.load(Ordering::Relaxed),
            orphaned: c.orphaned.load(Ordering::Relaxed),
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

    /// Releases every lease staged for peer `owner` that is still waiting for its
    /// pull (e.g. when the directory says the peer is gone); returns how many. Leases
    /// being sent are released when their send ends.
    pub fn release_peer(&self, owner: &str) -> usize {
        let drained: Vec<StagedLease> = {
            let mut st = self.inner.staged.lock();
            let ids: Vec<LeaseId> = st.iter().filter(|(_, e)| e.owner == owner).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| st.remove(&id)).collect()
        };
        // Their quota charges drop with them.
        drained.len()
    }

    /// Releases every staged lease and publication now (e.g. at shutdown).
    pub fn release_all(&self) {
        let drained: Vec<_> = self.inner.staged.lock().drain().collect();
        drop(drained); // pages and quota charges return here
        let published: Vec<_> = self.inner.published.lock().drain().collect();
        for (_, p) in &published {
            p.retire(ReleaseReason::Shutdown);
        }
    }

    /// Publishes `blocks` of `cache` under `key` (zero copy): the blocks are sent
    /// straight from the cache to consumers, and the engine must not write them until
    /// they are reported released ([`take_released`](Self::take_released)): after a
    /// consumer's `Done` when `once`, after `ttl` (capped at `max_ttl`; zero = the
    /// default TTL), or after [`unpublish`](Self::unpublish). Publishing a key again
    /// replaces (and releases) the earlier publication. The checksum is computed now.
    pub fn publish(
        &self,
        key: ChunkKey,
        cache: Arc<KvCache>,
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
        let checksum = cache.checksum(&ranges)?;
        let source = PubSource::Host { cache, checksum };
        self.insert_publication(key, source, ranges, blocks.to_vec(), len, ttl, once);
        Ok(())
    }

    /// Publishes `blocks` of a device cache under `key`: as [`publish`](Self::publish),
    /// except that the blocks are gathered into staging pages (device-to-host, bounded
    /// by the cache's op timeout) when a consumer asks, and sent from there. The blocks
    /// stay pinned until the release is reported.
    pub fn publish_device(
        &self,
        key: ChunkKey,
        cache: Arc<DeviceKvCache>,
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
        self.insert_publication(
            key,
            PubSource::Device { cache },
            ranges,
            blocks.to_vec(),
            len,
            ttl,
            once,
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_publication(
        &self,
        key: ChunkKey,
        source: PubSource,
        ranges: Vec<(usize, usize)>,
        blocks: Vec<u32>,
        len: usize,
        ttl: Duration,
        once: bool,
    ) {
        let ttl = self.clamp_ttl(ttl);
        let p = Arc::new(Publication::new(
            key,
            source,
            ranges,
            blocks,
            len,
            Instant::now() + ttl,
            once,
            self.inner.releases.clone(),
        ));
        let old = self.inner.published.lock().insert(key, p);
        if let Some(old) = old {
            old.retire(ReleaseReason::Replaced);
        }
    }

    /// Releases a publication now (the engine's own release). False if unknown. The
    /// release is reported once every transfer sending it has stopped.
    pub fn unpublish(&self, key: &ChunkKey) -> bool {
        let p = self.inner.published.lock().remove(key);
        match p {
            Some(p) => {
                p.retire(ReleaseReason::Released);
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

    fn new_lease_id(&self) -> LeaseId {
        loop {
            let id = rand::random::<LeaseId>();
            if id != 0 && !self.inner.staged.lock().contains_key(&id) {
                return id;
            }
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
        let charge = self.charge(holder, inner.arena.pages_for(bytes))?;
        let mut chunks = Vec::with_capacity(pinned.len());
        for (i, loc) in pinned.locations().iter().enumerate() {
            chunks.push(ChunkMeta {
                key: loc.key,
                len: loc.len as u64,
                checksum: pinned.checksum(i)?,
            });
        }
        let lease_id = self.new_lease_id();
        inner.counters.staged.fetch_add(1, Ordering::Relaxed);
        inner.staged.lock().insert(
            lease_id,
            StagedLease {
                data: StagedData::Store { chunks: pinned },
                chunks: chunks.clone(),
                expires: Instant::now() + ttl,
                owner: owner.to_string(),
                owner_incarnation: incarnation,
                _charge: Some(charge),
                eager_conn: None,
                publications: Vec::new(),
            },
        );
        Ok((lease_id, chunks, ttl.as_millis() as u32, None))
    }

    /// How many leading `keys` this producer would serve: the leading published ones
    /// when the first is published (what a stage would send), else those in the store.
    fn lookup_hits(&self, keys: &[ChunkKey]) -> usize {
        let published = {
            let table = self.inner.published.lock();
            keys.iter().take_while(|k| table.contains_key(*k)).count()
        };
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
        let pubs: Vec<Arc<Publication>> = {
            let table = self.inner.published.lock();
            let now = Instant::now();
            keys.iter()
                .map_while(|k| table.get(k).filter(|p| p.expires > now).cloned())
                .collect()
        };
        let first = pubs.first()?;
        if let Some(select) = select {
            return Some(
                self.stage_selected_pubs(keys, pubs, select, ttl, holder, incarnation)
                    .await,
            );
        }
        let (chunks, data, pubs, charge) = match &first.source {
            PubSource::Host { .. } => {
                let pubs: Vec<Arc<Publication>> = pubs
                    .into_iter()
                    .take_while(|p| matches!(p.source, PubSource::Host { .. }))
                    .collect();
                let chunks = pubs
                    .iter()
                    .map(|p| ChunkMeta {
                        key: p.key,
                        len: p.len as u64,
                        checksum: match &p.source {
                            PubSource::Host { checksum, .. } => *checksum,
                            PubSource::Device { .. } => unreachable!("host publications only"),
                        },
                    })
                    .collect();
                (chunks, StagedData::Pinned, pubs, None)
            }
            PubSource::Device { cache } => {
                let cache = cache.clone();
                let pubs: Vec<Arc<Publication>> = pubs
                    .into_iter()
                    .take_while(|p| matches!(&p.source, PubSource::Device { cache: c } if Arc::ptr_eq(c, &cache)))
                    .collect();
                let frames = pubs.iter().map(|p| (p.key, p.len, p.ranges.clone())).collect();
                match self.gather_device(&cache, frames, holder).await {
                    Ok((chunks, data, charge)) => (chunks, data, pubs, Some(charge)),
                    Err(e) => return Some(Err(e)),
                }
            }
        };
        let lease_id = self.new_lease_id();
        self.inner.counters.staged.fetch_add(1, Ordering::Relaxed);
        self.inner.staged.lock().insert(
            lease_id,
            StagedLease {
                data,
                chunks: chunks.clone(),
                expires: Instant::now() + ttl,
                owner: holder.identity.clone(),
                owner_incarnation: incarnation,
                _charge: charge,
                eager_conn: None,
                publications: pubs,
            },
        );
        Some(Ok((lease_id, chunks, ttl.as_millis() as u32, None)))
    }

    /// Stages the selected part of publications `pubs` (the leading published ones
    /// of `keys`): all keys must be published, from one cache. A host cache's
    /// selected bytes are checksummed in place and sent from the cache; a device
    /// cache's are gathered into staging pages.
    async fn stage_selected_pubs(
        &self,
        keys: &[ChunkKey],
        pubs: Vec<Arc<Publication>>,
        select: &WireSelection,
        ttl: Duration,
        holder: &Holder,
        incarnation: Option<u64>,
    ) -> StageResult {
        let ttl_ms = ttl.as_millis() as u32;
        if pubs.len() < keys.len() {
            // Not everything is published (yet): a selection over missing blocks
            // cannot be served, so the request is a miss.
            return Ok((0, Vec::new(), ttl_ms, None));
        }
        let same_cache = |a: &PubSource, b: &PubSource| match (a, b) {
            (PubSource::Host { cache: x, .. }, PubSource::Host { cache: y, .. }) => Arc::ptr_eq(x, y),
            (PubSource::Device { cache: x }, PubSource::Device { cache: y }) => Arc::ptr_eq(x, y),
            _ => false,
        };
        if let Some(p) = pubs.iter().find(|p| !same_cache(&p.source, &pubs[0].source)) {
            let why = format!("keys {} and {} are published from different caches", pubs[0].key, p.key);
            return Err(SelectionError::Unsupported(why).into());
        }
        let map = match &pubs[0].source {
            PubSource::Host { cache, .. } => cache.map().clone(),
            PubSource::Device { cache } => cache.map().clone(),
        };
        let lists: Vec<(ChunkKey, &[u32])> = pubs.iter().map(|p| (p.key, p.blocks.as_slice())).collect();
        let limits = Limits::default();
        let plan = plan_source(&lists, &map, select, limits.max_keys, limits.max_bulk_bytes)?;
        let shape = plan.shape.clone();
        let (chunks, data, charge) = match &pubs[0].source {
            PubSource::Host { cache, .. } => {
                let mut chunks = Vec::with_capacity(plan.frame_count());
                for i in 0..plan.frame_count() {
                    let (key, len) = plan.frame(i);
                    let checksum = cache.checksum(&plan.frame_ranges(i))?;
                    chunks.push(ChunkMeta {
                        key,
                        len: len as u64,
                        checksum,
                    });
                }
                let data = StagedData::Selected { plan: Arc::new(plan) };
                (chunks, data, None)
            }
            PubSource::Device { cache } => {
                let all = plan.all_ranges()?;
                let frames = all
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| {
                        let (key, len) = plan.frame(i);
                        (key, len, r)
                    })
                    .collect();
                let (chunks, data, charge) = self.gather_device(&cache.clone(), frames, holder).await?;
                (chunks, data, Some(charge))
            }
        };
        let lease_id = self.new_lease_id();
        self.inner.counters.staged.fetch_add(1, Ordering::Relaxed);
        self.inner.staged.lock().insert(
            lease_id,
            StagedLease {
                data,
                chunks: chunks.clone(),
                expires: Instant::now() + ttl,
                owner: holder.identity.clone(),
                owner_incarnation: incarnation,
                _charge: charge,
                eager_conn: None,
                publications: pubs,
            },
        );
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
    /// peer (refused and counted), change nothing.
    pub fn release(&self, lease_id: LeaseId, owner: &str) -> Result<(), LeaseRefusal> {
        self.release_for(
            lease_id,
            &Requester {
                identity: owner.to_string(),
                incarnation: None,
            },
        )
    }

    /// Releases a lease for a remote requester: its identity, and without TLS its
    /// incarnation, must be the ones the lease was granted to.
    fn release_for(&self, lease_id: LeaseId, who: &Requester) -> Result<(), LeaseRefusal> {
        let local = who.incarnation.is_none();
        let removed = {
            let mut st = self.inner.staged.lock();
            match st.get(&lease_id) {
                Some(e)
                    if !(if local {
                        e.owner == who.identity
                    } else {
                        e.belongs_to(who)
                    }) =>
                {
                    self.inner
                        .counters
                        .foreign_lease_refused
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(LeaseRefusal::Foreign);
                }
                Some(_) => st.remove(&lease_id),
                None => None,
            }
        };
        let Some(entry) = removed else {
            return Err(LeaseRefusal::Unknown);
        };
        self.inner.counters.done.fetch_add(1, Ordering::Relaxed);
        self.retire_sent(&entry);
        Ok(()) // the entry, its pages and its charge drop here
    }

    /// After a `Done`: publications made `once` that this lease sent leave the table
    /// (if still the same publication); the release is reported when the last
    /// holder drops them.
    fn retire_sent(&self, entry: &StagedLease) {
        if entry.publications.is_empty() {
            return;
        }
        let mut table = self.inner.published.lock();
        for p in entry.publications.iter().filter(|p| p.once) {
            if table.get(&p.key).is_some_and(|t| Arc::ptr_eq(t, p)) {
                table.remove(&p.key);
                p.retire(ReleaseReason::Done);
            }
        }
    }

    /// A consumer's `Release`: each key that is a `once` publication leaves the table
    /// (reason `Declined`; reported once every transfer still sending it stopped).
    /// Whoever may pull a `once` publication may release it (it could stage it and
    /// send `Done`): a key is the capability. Publications many may read and store
    /// chunks are never touched. Nothing is staged.
    fn decline(&self, keys: &[ChunkKey]) -> Vec<bool> {
        let mut table = self.inner.published.lock();
        keys.iter()
            .map(|k| match table.get(k) {
                Some(p) if p.once => {
                    if let Some(p) = table.remove(k) {
                        p.retire(ReleaseReason::Declined);
                    }
                    true
                }
                _ => false,
            })
            .collect()
    }

    async fn send_lease(&self, conn: &mut Connection, request_id: u64, entry: &StagedLease) -> Result<(), NetError> {
        for (i, meta) in entry.chunks.iter().enumerate() {
            let delay = self.inner.faults.send_delay_us.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(Duration::from_micros(delay)).await;
            }
            let faults = &self.inner.faults;
            if ProducerFaults::roll(&faults.slow_ppm, "slow send") {
                let us = faults.slow_delay_us.load(Ordering::Relaxed);
                tokio::time::sleep(Duration::from_micros(us)).await;
            }
            if ProducerFaults::roll(&faults.reset_ppm, "connection reset") {
                // Dropping the connection mid-transfer is what a reset looks like to the
                // consumer; the staged pages stay owned as on any failed send.
                return Err(NetError::Lost {
                    peer: conn.peer().to_string(),
                    reason: "injected connection reset".into(),
                });
            }
            let parts = match &entry.data {
                StagedData::Store { chunks } => chunks.io_slices(i),
                StagedData::Pages { lease, offsets } => lease.io_slices(offsets[i], meta.len as usize),
                // Published blocks: straight from the engine's cache (the lease holds
                // the publication, and so the cache, until this write stopped).
                StagedData::Pinned => match &entry.publications[i].source {
                    PubSource::Host { cache, .. } => cache.io_slices(&entry.publications[i].ranges),
                    PubSource::Device { .. } => unreachable!("device publications are sent from pages"),
                },
                // A selection: frame `i`'s ranges of the (one) host cache.
                StagedData::Selected { plan } => match &entry.publications[0].source {
                    PubSource::Host { cache, .. } => cache.io_slices(&plan.frame_ranges(i)),
                    PubSource::Device { .. } => unreachable!("device selections are sent from pages"),
                },
            }
            .map_err(|e| NetError::Protocol(e.to_string()))?;
            let corrupt = self
                .inner
                .faults
                .corrupt_next_sends
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
                || ProducerFaults::roll(&faults.corrupt_ppm, "wire corruption");
            if corrupt && meta.len > 0 {
                // Corrupt on the wire: send a damaged copy so the frame checksum (computed
                // over what is sent) is consistent but the staging checksum is not.
                let mut bad: Vec<u8> = parts.concat();
                let i = bad.len() / 2;
                bad[i] ^= 0x5A;
                conn.send_bulk(request_id, &[&bad]).await?;
            } else {
                conn.send_bulk_with_checksum(request_id, &parts, meta.checksum).await?;
            }
            self.inner.counters.bytes_sent.fetch_add(meta.len, Ordering::Relaxed);
            self.inner.counters.chunks_sent.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn check_out(&self, lease_id: LeaseId, who: &Requester) -> Result<StagedLease, (ErrorKind, String)> {
        let entry = {
            let mut st = self.inner.staged.lock();
            match st.get(&lease_id) {
                Some(e) if !e.belongs_to(who) => {
                    self.inner
                        .counters
                        .foreign_lease_refused
                        .fetch_add(1, Ordering::Relaxed);
                    return Err((ErrorKind::UnknownLease, format!("no lease {lease_id} for this peer")));
                }
                _ => st.remove(&lease_id),
            }
        };
        match entry {
            Some(e) if e.expires > Instant::now() => Ok(e),
            Some(e) => {
                drop(e); // pages and charge back
                self.note_expired(lease_id);
                Err((ErrorKind::LeaseExpired, format!("lease {lease_id} expired")))
            }
            None if self.inner.recently_expired.lock().contains(&lease_id) => {
                Err((ErrorKind::LeaseExpired, format!("lease {lease_id} expired")))
            }
            None => Err((ErrorKind::UnknownLease, format!("no lease {lease_id}"))),
        }
    }

    fn check_in(&self, lease_id: LeaseId, entry: StagedLease) {
        self.inner.staged.lock().insert(lease_id, entry);
    }

    fn note_expired(&self, lease_id: LeaseId) {
        self.inner.counters.expired.fetch_add(1, Ordering::Relaxed);
        let mut r = self.inner.recently_expired.lock();
        r.push_back(lease_id);
        if r.len() > 4096 {
            r.pop_front();
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
        let who = Requester {
            identity: holder.identity.clone(),
            incarnation: (!holder.proven).then_some(peer.incarnation),
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
                match self
                    .stage_for(&keys, ttl, &holder, who.incarnation, select.as_ref())
                    .await
                {
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
                let (lease_id, chunks, ttl_ms, shape) = match self
                    .stage_for(&keys, ttl, &holder, who.incarnation, select.as_ref())
                    .await
                {
                    Ok(s) => s,
                    Err(e) => return refuse(conn, id, kind_of(&e), e.to_string()).await,
                };
                accounting::note_found(!chunks.is_empty());
                conn.send(id, &staged(lease_id, chunks, ttl_ms, shape)).await?;
                if lease_id == 0 {
                    return Ok(()); // miss: nothing staged, nothing follows
                }
                let mut entry = match self.check_out(lease_id, &who) {
                    Ok(e) => e,
                    Err((kind, message)) => return refuse(conn, id, kind, message).await,
                };
                // Tied to this connection: released after the grace if it closes
                // without `Done`.
                entry.eager_conn = Some(conn.id());
                // On a failed (or aborted) send the entry, its pages and its quota
                // charge drop here: the eager consumer is gone.
                self.send_lease(conn, id, &entry).await?;
                conn.send(id, &Message::PullDone { lease_id }).await?;
                self.check_in(lease_id, entry);
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
                let entry = match self.check_out(lease_id, &who) {
                    Ok(e) => e,
                    Err((kind, message)) => return refuse(conn, id, kind, message).await,
                };
                let r = self.send_lease(conn, id, &entry).await;
                // A delayed pull may be retried: keep the lease until Done or TTL.
                self.check_in(lease_id, entry);
                r?;
                conn.send(id, &Message::PullDone { lease_id }).await
            }
            Message::Done { lease_id } => {
                // Duplicate or unknown Dones change nothing and are acknowledged (a
                // Done may race the TTL); a foreign one is refused.
                match self.release_for(lease_id, &who) {
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

impl Producer {
    /// An eager get's connection closed: its leases not yet released by `Done` are
    /// released `lease_grace` from now (sooner if their TTL says so). Returns how many.
    fn orphan_eager(&self, conn_id: u64) -> usize {
        let until = Instant::now() + self.inner.cfg.lease_grace;
        let mut n = 0;
        for e in self.inner.staged.lock().values_mut() {
            if e.eager_conn == Some(conn_id) {
                e.eager_conn = None;
                e.expires = e.expires.min(until);
                n += 1;
            }
        }
        self.inner.counters.orphaned.fetch_add(n as u64, Ordering::Relaxed);
        n
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

/// Releases expired leases. Holds only a weak reference, so it ends with the producer.
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
        let now = Instant::now();
        let expired: Vec<(LeaseId, StagedLease)> = {
            let mut st = inner.staged.lock();
            let ids: Vec<LeaseId> = st.iter().filter(|(_, e)| e.expires <= now).map(|(id, _)| *id).collect();
            ids.into_iter()
                .filter_map(|id| st.remove(&id).map(|e| (id, e)))
                .collect()
        };
        let p = Producer { inner: inner.clone() };
        let expired_pubs: Vec<Arc<Publication>> = {
            let mut table = inner.published.lock();
            let keys: Vec<ChunkKey> = table
                .iter()
                .filter(|(_, v)| v.expires <= now)
                .map(|(k, _)| *k)
                .collect();
            keys.iter().filter_map(|k| table.remove(k)).collect()
        };
        for pubn in &expired_pubs {
            pubn.retire(ReleaseReason::Expired);
        }
        drop(expired_pubs);
        if !expired.is_empty() {
            for (id, _) in &expired {
                p.note_expired(*id);
            }
            tracing::debug!(target: "kvferry::peer", n = expired.len(), "released expired staged leases");
        }
        drop(expired); // pages return here
    }
}
