//! [`Engine`]: the library's front door. One [`EngineConfig`] builds and owns the
//! staging arena, the copy engine, the producer (store, publications, staging), the
//! consumer (pools, transfers), the server and the metrics sources; embedders — the
//! `kvferry` command, the Python package, connectors — use this and nothing below it.
//!
//! # What it offers
//!
//! - **Memory**: [`register`](Engine::register) one [`KvCacheRef`] — a cache in any
//!   kind of memory: a host [`KvCache`] (one buffer of blocks, a set of per-layer
//!   tensors, or a model layout) or a [`DeviceKvCache`] (buffers of the host, sim or
//!   CUDA device); both convert with `into()`. One [`Registered`] comes back, and
//!   registrations of every kind live in one map under one id space;
//!   [`deregister`](Engine::deregister) waits, bounded, until nothing uses it. Who
//!   uses a cache is counted explicitly by the producer's ledger: each publication of
//!   it, and each transfer landing into it (from its start until its drain), holds its
//!   registration; the last one to let go wakes the deregistration.
//! - **Offering KV** (producer side): [`publish`](Engine::publish) pins blocks of a
//!   registered cache under a key — every publication is of a registration, whatever
//!   the memory (register first). Host blocks are sent straight from the cache (zero
//!   copy); device blocks are gathered into staging pages on the cache's copy stream
//!   when a consumer asks. Released by the consumer's `Done`, the TTL or
//!   [`unpublish`](Engine::unpublish), reported by
//!   [`take_released`](Engine::take_released); [`put`](Engine::put) copies bytes into
//!   the engine's own store for callers that reuse their buffers at once.
//! - **Fetching KV** (consumer side): one entry, [`transfer`](Engine::transfer) of a
//!   [`Fetch`], which these wrap: [`get`](Engine::get) (eager), [`start_get`]
//!   (a [`Transfer`] whose drain fence is known up front), [`get_blocking`]
//!   (synchronous, bounded), [`stage`](Engine::stage) + [`resolve`](Engine::resolve)
//!   (delayed pull), [`push`](Engine::push) and [`lookup`](Engine::lookup). Each names
//!   its destination blocks and path (direct or staged) in a [`Destination`].
//! - **Partial gets**: a [`Selection`] (a subset of a publication's blocks, byte
//!   ranges of every per-layer piece, and where they land in the destination's
//!   pieces) rides on the destination ([`Destination::with_selection`]) for
//!   [`start_get`], [`get`](Engine::get), [`start_pull`](Engine::start_pull) and
//!   [`resolve`](Engine::resolve); [`stage_selected`](Engine::stage_selected) stages
//!   only the selected bytes. See [`crate::peer::selection`].
//! - [`stats`](Engine::stats) and [`close`](Engine::close), which drains everything
//!   and reports what was still out at its deadline.
//!
//! Peers are named by address (`host:port`) or by a name the configured
//! [`Directory`] resolves. With a directory, a listening engine registers itself, fails
//! a peer's in-flight transfers at once when the directory reports it restarted or
//! lost, and [`locate`](Engine::locate) finds which live peers hold keys
//! (`engine/fleet.rs`).
//!
//! # Cancellation
//!
//! Every async method may be dropped: transfers cancel and drain in the background
//! (their fences fire when destination blocks are quiet), exactly as
//! [`Consumer`](crate::peer::Consumer) documents. [`close`](Engine::close) dropped
//! midway leaves the engine closed to new work; what it was waiting for still drains.
//!
//! [`start_get`]: Engine::start_get
//! [`get_blocking`]: Engine::get_blocking

mod config;
pub mod directory;
mod error;
mod exports;
mod fetching;
mod fleet;
mod options;

pub use crate::peer::selection::Selection;
pub use crate::wire::SelectionError;
pub use config::{EngineConfig, StoreConfig};
// Names the engine's API uses, re-exported (and used here through the same glob).
pub use directory::{Directory, StaticDirectory};
pub use error::EngineError;
pub use exports::*;
pub use fetching::Fetch;
pub use fleet::{Located, FAN_OUT, MISS_TTL};
pub use options::{is_device_name, EngineOptions, OptionError, MAX_WAIT_SPIN_US};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::copy::{CopyEngine, CopyStats};
use crate::layout::{Arrangement, KvLayout};
use crate::mem::{ArenaConfig, ArenaStats};
use crate::net::{NetError, Server, ServerStats};
use crate::peer::{
    ChunkStore, Consumer, ConsumerConfig, ConsumerStats, DeregisterError, Producer, ProducerStats, Released, StoreStats,
};

/// Everything an engine counts, in one snapshot.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EngineStats {
    /// The staging arena.
    pub arena: ArenaStats,
    /// The producer side.
    pub producer: ProducerStats,
    /// The consumer side.
    pub consumer: ConsumerStats,
    /// The copy-in store.
    pub store: StoreStats,
    /// The copy engine.
    pub copy: CopyStats,
    /// The server (zero for a client-only engine).
    pub server: ServerStats,
    /// Caches registered now.
    pub registered: usize,
    /// The mover chosen per producer this engine has read from, and why (see
    /// [`crate::peer::movers`]).
    pub movers: Vec<crate::peer::PeerMover>,
}

/// What [`Engine::close`] found at its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EngineCloseReport {
    /// Staging pages still leased (their memory stays mapped until released).
    pub outstanding_pages: usize,
    /// Pages quarantined (hardware may still target them; never reused).
    pub quarantined_pages: usize,
    /// Transfers whose drain had not finished.
    pub draining_transfers: u64,
}

impl EngineCloseReport {
    /// True when everything came back.
    pub fn is_clean(&self) -> bool {
        self.outstanding_pages == 0 && self.quarantined_pages == 0 && self.draining_transfers == 0
    }
}

struct Inner {
    cfg: EngineConfig,
    arena: Arena,
    copy: CopyEngine,
    producer: Producer,
    consumer: Consumer,
    server: Mutex<Option<Server>>,
    address: Option<SocketAddr>,
    /// Server counters, kept after the server stopped.
    last_server_stats: Mutex<ServerStats>,
    /// Caches registered (host and device memory alike), by registration id.
    registered: Mutex<HashMap<u64, KvCacheRef>>,
    next_region: AtomicU64,
    closed: AtomicBool,
    /// The directory side: event task stop token and the lookup miss cache.
    fleet: fleet::FleetState,
}

/// A kvferry engine. Cheap to clone (all clones are one engine).
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("peer_id", &self.peer_id())
            .field("address", &self.inner.address)
            .finish()
    }
}

/// A registered cache, in host or device memory: the cache and its registration id.
/// Cloning it does not add a holder (holders are counted by the producer's ledger).
#[derive(Clone, Debug)]
pub struct Registered {
    /// Registration id (unique within the engine, whatever the memory kind).
    pub id: u64,
    /// The cache.
    pub cache: KvCacheRef,
}

fn store_layout(cfg: &StoreConfig) -> Result<KvLayout, EngineError> {
    match cfg {
        StoreConfig::Layout(l) => Ok(l.validated()?),
        StoreConfig::Bytes { bytes, block_bytes } => {
            if *block_bytes == 0 || block_bytes % 4 != 0 {
                return Err(EngineError::InvalidConfig(format!(
                    "store block size must be a positive multiple of 4 bytes, got {block_bytes}"
                )));
            }
            let blocks = u32::try_from(bytes / block_bytes)
                .ok()
                .filter(|b| *b > 0)
                .ok_or_else(|| {
                    EngineError::InvalidConfig(format!(
                        "store of {bytes} bytes must hold 1..2^32 blocks of {block_bytes}"
                    ))
                })?;
            // One layer, one head: a "piece" is half a block (K, then V).
            Ok(KvLayout {
                layers: 1,
                blocks,
                tokens_per_block: 1,
                kv_heads: 1,
                head_dim: (*block_bytes / 4) as u32,
                elem_size: 2,
                arrangement: Arrangement::FullyContiguous,
            }
            .validated()?)
        }
    }
}

impl Engine {
    /// Builds and starts an engine (binding its listen address, if any). Must be called
    /// inside a tokio runtime: its server, sweeper and transfers run on it.
    pub async fn start(cfg: EngineConfig) -> Result<Engine, EngineError> {
        cfg.net
            .validate()
            .map_err(|e| EngineError::InvalidConfig(e.to_string()))?;
        let arena = match &cfg.staging {
            Some(a) => a.clone(),
            None => {
                if cfg.page_size == 0 {
                    return Err(EngineError::InvalidConfig("page size must be greater than zero".into()));
                }
                let pages = cfg.arena_bytes / cfg.page_size;
                if pages == 0 {
                    return Err(EngineError::InvalidConfig(format!(
                        "staging arena of {} bytes must hold at least one page of {}",
                        cfg.arena_bytes, cfg.page_size
                    )));
                }
                let mut acfg = ArenaConfig::new(cfg.page_size, pages);
                if !cfg.pinned {
                    acfg = acfg.unpinned();
                }
                Arena::new(acfg)?
            }
        };
        if let Some(why) = arena.fallback_reason() {
            tracing::info!(target: "kvferry::engine", backing = %arena.backing_kind(), "staging arena not pinned: {why}");
        }
        let copy = match &cfg.copy_body {
            Some(body) => CopyEngine::with_body(cfg.copy.clone(), body.clone()),
            None => CopyEngine::new(cfg.copy.clone()),
        }
        .map_err(|e| EngineError::InvalidConfig(format!("copy engine: {e}")))?;
        let layout = store_layout(&cfg.store)?;
        let region = Arc::new(Region::host("store", layout.region_bytes())?);
        let store = ChunkStore::new(region, layout, cfg.store_capacity)?;
        let producer = Producer::new(
            store,
            arena.clone(),
            copy.clone(),
            cfg.producer.clone(),
            cfg.net.incarnation,
        )?;
        let mut ccfg = ConsumerConfig::new(cfg.net.clone());
        ccfg.lease_ttl = cfg.lease_ttl;
        ccfg.lease_guard = cfg.lease_guard;
        ccfg.done_timeout = cfg.done_timeout;
        ccfg.transport = cfg.producer.transport;
        let consumer = Consumer::new(arena.clone(), copy.clone(), ccfg)?;
        let (server, address) = match &cfg.listen {
            Some(addr) => {
                let s = Server::bind(addr, cfg.net.clone(), Arc::new(producer.clone()))
                    .await
                    .map_err(|e| EngineError::Bind {
                        addr: addr.clone(),
                        reason: match e {
                            NetError::Connect { reason, .. } => reason,
                            other => other.to_string(),
                        },
                    })?;
                let a = s.local_addr();
                (Some(s), Some(a))
            }
            None => (None, None),
        };
        let engine = Engine {
            inner: Arc::new(Inner {
                cfg,
                arena,
                copy,
                producer,
                consumer,
                server: Mutex::new(server),
                address,
                last_server_stats: Mutex::new(ServerStats::default()),
                registered: Mutex::new(HashMap::new()),
                next_region: AtomicU64::new(1),
                closed: AtomicBool::new(false),
                fleet: fleet::FleetState::default(),
            }),
        };
        if let Err(e) = engine.attach_directory().await {
            engine.close(Instant::now() + Duration::from_secs(1)).await;
            return Err(e);
        }
        Ok(engine)
    }

    /// The address peers reach this engine on (`None` for a client-only engine).
    pub fn address(&self) -> Option<SocketAddr> {
        self.inner.address
    }

    /// This engine's peer id.
    pub fn peer_id(&self) -> &str {
        &self.inner.cfg.net.peer_id
    }

    /// This engine's incarnation (changes with every start).
    pub fn incarnation(&self) -> u64 {
        self.inner.cfg.net.incarnation
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.cfg
    }

    /// The producer side (for fault injection, metrics and the store's layout).
    pub fn producer(&self) -> &Producer {
        &self.inner.producer
    }

    /// The consumer side (for metrics).
    pub fn consumer(&self) -> &Consumer {
        &self.inner.consumer
    }

    /// The staging arena.
    pub fn arena(&self) -> &Arena {
        &self.inner.arena
    }

    /// The server's counters (the last ones seen, once it stopped).
    pub fn server_stats(&self) -> ServerStats {
        match &*self.inner.server.lock() {
            Some(s) => {
                let st = s.stats();
                *self.inner.last_server_stats.lock() = st;
                st
            }
            None => *self.inner.last_server_stats.lock(),
        }
    }

    /// Everything counted, in one snapshot.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            arena: self.inner.arena.stats(),
            producer: self.inner.producer.stats(),
            consumer: self.inner.consumer.stats(),
            store: self.inner.producer.store().stats(),
            copy: self.inner.copy.stats(),
            server: self.server_stats(),
            registered: self.inner.registered.lock().len(),
            movers: self.inner.consumer.movers(),
        }
    }

    fn check_open(&self) -> Result<(), EngineError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(EngineError::Closed);
        }
        Ok(())
    }

    /// Resolves a peer name through the directory; an unknown name is used as an
    /// address. A name the directory has a record of is dialled expecting that
    /// record's peer id and incarnation (see [`Engine::expect_record`]).
    pub fn resolve_peer(&self, peer: &str) -> String {
        let Some(dir) = self.inner.cfg.directory.as_ref() else {
            return peer.to_string();
        };
        match dir.record(peer) {
            Some(r) => self.expect_record(&r),
            None => dir.resolve(peer).unwrap_or_else(|| peer.to_string()),
        }
    }

    /// Registers a cache in host or device memory (anything that converts into a
    /// [`KvCacheRef`]: a [`KvCache`], a [`DeviceKvCache`], either in an `Arc`): the
    /// engine holds it (and the memory it keeps alive) until
    /// [`deregister`](Self::deregister) and every transfer touching it have finished.
    /// Its publications and the transfers landing into it hold the registration.
    pub fn register(&self, cache: impl Into<KvCacheRef>) -> Result<Registered, EngineError> {
        self.check_open()?;
        let id = self.new_registration()?;
        let cache = cache.into();
        self.inner.registered.lock().insert(id, cache.clone());
        Ok(Registered { id, cache })
    }

    fn new_registration(&self) -> Result<u64, EngineError> {
        let id = self.inner.next_region.fetch_add(1, Ordering::Relaxed);
        self.inner
            .producer
            .register(id)
            .map_err(|e| EngineError::InvalidConfig(format!("registration {id}: {e}")))?;
        Ok(id)
    }

    /// Transfers and publications holding registration `id` now (`None`: not
    /// registered).
    pub fn holders(&self, id: u64) -> Option<usize> {
        self.inner.producer.holders(id)
    }

    /// Deregisters a cache and waits until no transfer or publication holds it, or
    /// `timeout` passes: then it fails with [`EngineError::InUse`] and the cache stays
    /// registered. Publications of the cache count as uses: unpublish them first. The
    /// last holder to let go wakes the wait (no polling).
    pub async fn deregister(&self, reg: &Registered, timeout: Duration) -> Result<(), EngineError> {
        if !self.inner.registered.lock().contains_key(&reg.id) {
            return Err(EngineError::NotRegistered(reg.cache.name().to_string()));
        }
        self.deregister_id(reg.id, reg.cache.name(), timeout).await?;
        self.inner.registered.lock().remove(&reg.id);
        Ok(())
    }

    async fn deregister_id(&self, id: u64, name: &str, timeout: Duration) -> Result<(), EngineError> {
        let started = Instant::now();
        match self.inner.producer.deregister(id, started + timeout).await {
            Ok(()) => Ok(()),
            Err(DeregisterError::NotRegistered) => Err(EngineError::NotRegistered(name.to_string())),
            Err(DeregisterError::InUse { holders }) => Err(EngineError::InUse {
                name: name.to_string(),
                holders,
                waited: started.elapsed(),
            }),
        }
    }

    /// `dst` holding the registration of its cache for as long as the transfer uses
    /// it (a cache not registered with this engine is taken as it is).
    fn held(&self, dst: Destination) -> Result<Destination, GetFailure> {
        let id = self
            .inner
            .registered
            .lock()
            .iter()
            .find(|(_, r)| r.ptr_eq(&dst.target))
            .map(|(id, _)| *id);
        let Some(id) = id else { return Ok(dst) };
        match self.inner.producer.hold(id) {
            Ok(hold) => Ok(dst.with_hold(hold)),
            Err(e) => Err(GetFailure {
                error: PeerError::InvalidArgument(format!("destination cache is {e}")),
                fence: crate::copy::DrainFence::ready(),
                dirty: false,
            }),
        }
    }

    /// Publishes `blocks` of a registered cache under `key`; the publication holds the
    /// registration until it is released. Every publication is of a registration, in
    /// any memory: host blocks are sent straight from the cache (zero copy, checksum
    /// computed now); device blocks are gathered into staging pages (device-to-host on
    /// the cache's copy stream, bounded by its op timeout) when a consumer asks, and
    /// sent from there. The blocks must stay unwritten until reported by
    /// [`take_released`](Self::take_released): after a consumer's `Done` when `once`,
    /// after `ttl` (zero: the default TTL; capped at the producer's max TTL), or after
    /// [`unpublish`](Self::unpublish).
    pub fn publish(
        &self,
        key: ChunkKey,
        reg: &Registered,
        blocks: &[u32],
        ttl: Duration,
        once: bool,
    ) -> Result<(), EngineError> {
        self.check_open()?;
        if !self.inner.registered.lock().contains_key(&reg.id) {
            return Err(EngineError::NotRegistered(reg.cache.name().to_string()));
        }
        Ok(self
            .inner
            .producer
            .publish(key, reg.cache.clone(), reg.id, blocks, ttl, once)?)
    }

    /// Releases a publication (reported through `take_released` once its sends
    /// stopped). False if the key is not published.
    pub fn unpublish(&self, key: &ChunkKey) -> bool {
        self.inner.producer.unpublish(key)
    }

    /// Publications released since the last call.
    pub fn take_released(&self) -> Vec<Released> {
        self.inner.producer.take_released()
    }

    /// Waits until a publication is released or `deadline` passes.
    pub async fn wait_released(&self, deadline: Instant) {
        self.inner.producer.wait_released(deadline).await
    }

    /// Copies `data` into the engine's store under `key` (copy in: the caller may
    /// reuse `data` at once).
    pub fn put(&self, key: ChunkKey, data: &[u8]) -> Result<(), EngineError> {
        self.check_open()?;
        if data.is_empty() {
            return Err(EngineError::Peer(PeerError::InvalidArgument(
                "refusing to store an empty chunk".into(),
            )));
        }
        let layout = self.inner.producer.store().layout();
        let cap = layout.block_bytes() * layout.blocks as usize;
        if data.len() > cap {
            return Err(EngineError::Peer(PeerError::InvalidArgument(format!(
                "chunk of {} bytes exceeds the store ({cap} bytes)",
                data.len()
            ))));
        }
        Ok(self.inner.producer.put_local(key, data)?)
    }

    /// Closes the engine: refuses new work, stops serving, releases every staged lease
    /// and publication, waits until transfers drained and staging pages came back or
    /// `deadline` passes, and reports what was still out. Idempotent.
    pub async fn close(&self, deadline: Instant) -> EngineCloseReport {
        self.inner.closed.store(true, Ordering::Release);
        // Leave the directory first: peers stop sending new work here.
        self.detach_directory(deadline).await;
        let server = self.inner.server.lock().take();
        if let Some(s) = server {
            *self.inner.last_server_stats.lock() = s.stats();
            let _ = tokio::time::timeout_at(deadline, s.shutdown()).await;
        }
        self.inner.producer.release_all();
        while self.inner.consumer.stats().draining > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let arena = self.inner.arena.close(deadline).await;
        EngineCloseReport {
            outstanding_pages: arena.outstanding_pages,
            quarantined_pages: arena.quarantined_pages,
            draining_transfers: self.inner.consumer.stats().draining,
        }
    }
}
