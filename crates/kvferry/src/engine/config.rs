//! [`EngineConfig`]: everything an [`Engine`](super::Engine) is built from, with
//! defaults that work on one machine out of the box (loopback, ephemeral port, no
//! secret, a 64 MiB staging arena, a 64 MiB copy-in store).

use std::sync::Arc;
use std::time::Duration;

use super::directory::Directory;
use crate::copy::{CopyBody, CopyConfig};
use crate::layout::KvLayout;
use crate::net::NetConfig;
use crate::peer::ProducerConfig;

/// The copy-in store ([`Engine::put`](super::Engine::put)): chunks copied into
/// engine-owned memory, for callers that overwrite their buffers right after storing.
#[derive(Clone, Debug)]
pub enum StoreConfig {
    /// `bytes` of generic blocks of `block_bytes` each.
    Bytes {
        /// Total bytes.
        bytes: usize,
        /// Bytes per block (chunks take whole blocks).
        block_bytes: usize,
    },
    /// A model layout (its blocks are the store's blocks).
    Layout(KvLayout),
}

/// Settings of an engine.
#[derive(Clone)]
pub struct EngineConfig {
    /// Address to serve peers on (`None`: a client-only engine that serves nothing).
    pub listen: Option<String>,
    /// Transport settings: peer id, incarnation, secret, timeouts, limits, pool size.
    pub net: NetConfig,
    /// Staging arena size in bytes (rounded down to whole pages, at least one).
    pub arena_bytes: usize,
    /// Staging page size in bytes.
    pub page_size: usize,
    /// Ask for pinned (mlocked) staging memory; falls back, and says so, when refused.
    pub pinned: bool,
    /// A staging arena built by the caller (e.g. CUDA pinned memory from
    /// `device::cuda_pinned_arena`), used instead of allocating one; `arena_bytes`,
    /// `page_size` and `pinned` are then ignored.
    pub staging: Option<crate::mem::Arena>,
    /// Copy threads and slice size.
    pub copy: CopyConfig,
    /// A custom copy body (fault injection in tests and chaos); `None`: memcpy.
    pub copy_body: Option<Arc<dyn CopyBody>>,
    /// The copy-in store.
    pub store: StoreConfig,
    /// Most chunks the store holds (least recently used are evicted).
    pub store_capacity: usize,
    /// Producer settings: TTLs, concurrent gets, per-peer staging quota.
    pub producer: ProducerConfig,
    /// TTL asked for leases staged on peers for this engine's pulls.
    pub lease_ttl: Duration,
    /// Resolving a pull is refused when less than this is left on its lease.
    pub lease_guard: Duration,
    /// Bound on sending `Done` after a transfer.
    pub done_timeout: Duration,
    /// Where peer names are resolved to addresses (`None`: peers are addresses). With
    /// a directory, a listening engine registers itself in it (see `advertise`,
    /// `role`) and fails transfers to peers the directory reports restarted or lost.
    pub directory: Option<Arc<dyn Directory>>,
    /// The address registered in the directory (`None`: the bound listen address,
    /// refused when that is unspecified such as 0.0.0.0).
    pub advertise: Option<String>,
    /// The role registered in the directory.
    pub role: crate::directory::Role,
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("listen", &self.listen)
            .field("peer_id", &self.net.peer_id)
            .field("secret", &self.net.secret.as_ref().map(|_| "<set>"))
            .field("arena_bytes", &self.arena_bytes)
            .field("page_size", &self.page_size)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        let peer_id = format!("kvferry-{}-{:04x}", std::process::id(), rand::random::<u16>());
        EngineConfig {
            listen: Some("127.0.0.1:0".into()),
            net: NetConfig::new(peer_id),
            arena_bytes: 64 << 20,
            page_size: 1 << 20,
            pinned: true,
            staging: None,
            copy: CopyConfig::default(),
            copy_body: None,
            store: StoreConfig::Bytes {
                bytes: 64 << 20,
                block_bytes: 64 << 10,
            },
            store_capacity: 100_000,
            producer: ProducerConfig::default(),
            lease_ttl: Duration::from_secs(10),
            lease_guard: Duration::from_millis(100),
            done_timeout: Duration::from_secs(1),
            directory: None,
            advertise: None,
            role: crate::directory::Role::Both,
        }
    }
}

impl EngineConfig {
    /// Sets the listen address (`None`: client only).
    pub fn listen(mut self, addr: Option<&str>) -> Self {
        self.listen = addr.map(str::to_string);
        self
    }

    /// Sets the peer id.
    pub fn peer_id(mut self, id: impl Into<String>) -> Self {
        self.net.peer_id = id.into();
        self
    }

    /// Sets the shared secret.
    pub fn secret(mut self, secret: Option<Vec<u8>>) -> Self {
        self.net.secret = secret;
        self
    }

    /// Sets the staging arena's size and page size.
    pub fn arena(mut self, bytes: usize, page_size: usize) -> Self {
        self.arena_bytes = bytes;
        self.page_size = page_size;
        self
    }
}
