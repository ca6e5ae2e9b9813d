//! A `kvferry` library client running inside a host: its tokio runtime is built on a
//! thread that joined the host's namespace, so its workers (and every thread they
//! spawn: copy threads, blocking threads) open their sockets there. Every call is run
//! as a task on that runtime, never on the calling thread, and returns the library's
//! typed [`PeerError`].
//!
//! # Cancellation
//! Calls block the calling thread until the library returns, which it does by the
//! call's deadline (plus its small bound); a failed get also waits (bounded) for its
//! drain fence so the client's staging pages are back before the next call.

use std::sync::Arc;
use std::time::Duration;

use kvferry::copy::{CopyConfig, CopyEngine};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::{Arena, ArenaConfig, Region};
use kvferry::net::NetConfig;
use kvferry::peer::{Consumer, ConsumerConfig, Destination, PeerError};
use kvferry::wire::ChunkKey;
use tokio::runtime::Runtime;
use tokio::time::Instant;

use super::net::{current_netns_inode, netns_inode, Host};
use super::serve::SECRET;

/// Blocks a get can land: chunks up to this many blocks of the `tiny` layout.
pub const MAX_BLOCKS: u32 = 1024;

/// A library client inside a host.
pub struct NsClient {
    rt: Runtime,
    consumer: Consumer,
    arena: Arena,
    layout: KvLayout,
}

/// What a get returned.
pub type GetResult = Result<Option<Vec<u8>>, PeerError>;

impl NsClient {
    /// A client in `host` with peer id `id`, speaking with the shared secret.
    pub fn new(host: &Host, id: &str) -> NsClient {
        let rt = host.run_in(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("client runtime")
        });
        let want = netns_inode(&host.ns);
        let got = rt.block_on(rt.spawn(async { current_netns_inode() })).unwrap();
        assert_eq!(got, want, "client runtime workers are not in {}", host.ns);
        let layout = KvLayout::preset(Preset::Tiny, MAX_BLOCKS, Arrangement::FullyContiguous).unwrap();
        let pages = layout.region_bytes().div_ceil(64 << 10) * 2;
        let id = id.to_string();
        let (consumer, arena) = rt
            .block_on(rt.spawn(async move {
                let arena = Arena::new(ArenaConfig::new(64 << 10, pages).unpinned()).unwrap();
                let engine = CopyEngine::new(CopyConfig {
                    threads: 1,
                    ..CopyConfig::default()
                })
                .unwrap();
                let net = NetConfig::new(id).with_secret(SECRET.as_bytes().to_vec());
                let c = Consumer::new(arena.clone(), engine, ConsumerConfig::new(net)).unwrap();
                (c, arena)
            }))
            .unwrap();
        NsClient {
            rt,
            consumer,
            arena,
            layout,
        }
    }

    /// Largest chunk a get can land.
    pub fn max_chunk(&self) -> usize {
        self.layout.region_bytes()
    }

    /// The client's staging arena (all pages free between calls).
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// The library consumer (for pool/incarnation checks); use it only inside
    /// [`NsClient::block_on`].
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// Runs `fut` as a task on the client's runtime (inside the host) and waits for it.
    pub fn block_on<R: Send + 'static>(&self, fut: impl std::future::Future<Output = R> + Send + 'static) -> R {
        self.rt.block_on(self.rt.spawn(fut)).expect("client task panicked")
    }

    /// Pushes `data` as chunk `key` to `peer`.
    pub fn put(&self, peer: &str, key: &str, data: &[u8], timeout: Duration) -> Result<(), PeerError> {
        let (c, peer, k, data) = (
            self.consumer.clone(),
            peer.to_string(),
            ChunkKey::from_name(key),
            data.to_vec(),
        );
        self.block_on(async move { c.put(&peer, k, &data, Instant::now() + timeout).await })
    }

    /// Fetches chunk `key` from `peer`: its bytes, `None` on a miss, or the error.
    pub fn get(&self, peer: &str, key: &str, timeout: Duration) -> GetResult {
        let (c, peer, k, layout) = (
            self.consumer.clone(),
            peer.to_string(),
            ChunkKey::from_name(key),
            self.layout,
        );
        self.block_on(async move {
            let region = Arc::new(Region::host("netns-get", layout.region_bytes()).unwrap());
            let dst = Destination::from_layout(region.clone(), &layout, vec![(0..MAX_BLOCKS).collect()])
                .expect("valid destination");
            match c.get(&peer, &[k], dst, Instant::now() + timeout).await {
                Ok(landed) if landed.chunks == 0 => Ok(None),
                Ok(landed) => Ok(Some(region.to_vec(0, landed.bytes).unwrap())),
                Err(f) => {
                    let quiet = f.fence.wait_until(Instant::now() + Duration::from_secs(5)).await;
                    assert!(quiet, "drain fence of a failed get did not fire within 5 s");
                    Err(f.error)
                }
            }
        })
    }

    /// The incarnation `peer` presents in its handshake, as this client's pool last saw
    /// it (a lookup first, so that there is a connection). Ask from a new client to
    /// learn what the process presents now.
    pub fn peer_incarnation(&self, peer: &str, timeout: Duration) -> Result<u64, PeerError> {
        let (c, peer) = (self.consumer.clone(), peer.to_string());
        self.block_on(async move {
            let key = ChunkKey::from_name("incarnation-probe");
            c.lookup(&peer, &[key], Instant::now() + timeout).await?;
            Ok(c.pool(&peer)?.incarnation())
        })
    }

    /// How many restarts of `peer` this client's pool has seen.
    pub fn restarts_seen(&self, peer: &str) -> u64 {
        self.consumer.pool(peer).map(|p| p.restarts_seen()).unwrap_or(0)
    }
}

/// Deterministic test bytes for chunk `key` of `len` bytes.
pub fn pattern(key: &str, len: usize) -> Vec<u8> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    (0..len)
        .map(|i| {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            (h >> (i % 8 * 8)) as u8
        })
        .collect()
}
