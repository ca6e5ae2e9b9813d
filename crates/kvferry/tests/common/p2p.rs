//! Helpers for in-process P2P tests over real loopback sockets.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use kvferry::copy::{CopyBody, CopyConfig, CopyEngine};
use kvferry::layout::{Arrangement, KvLayout};
use kvferry::mem::{Arena, ArenaConfig, Region};
use kvferry::net::{NetConfig, Server};
use kvferry::peer::{ChunkStore, Consumer, ConsumerConfig, Destination, Producer, ProducerConfig};
use kvferry::wire::ChunkKey;

/// 4 layers × K/V × 2 KiB pieces: 16 KiB per block.
pub fn layout(blocks: u32, arrangement: Arrangement) -> KvLayout {
    KvLayout {
        layers: 4,
        blocks,
        tokens_per_block: 16,
        kv_heads: 1,
        head_dim: 64,
        elem_size: 2,
        arrangement,
    }
    .validated()
    .unwrap()
}

/// The byte at `offset` of chunk `chunk` of request `req`: differs across requests.
pub fn pattern_byte(req: u64, chunk: usize, offset: usize) -> u8 {
    let x = (req.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (chunk as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
        .wrapping_add(offset as u64 / 8);
    (x ^ (x >> 29) ^ (offset as u64)) as u8
}

pub fn chunk_bytes(req: u64, chunk: usize, len: usize) -> Vec<u8> {
    (0..len).map(|o| pattern_byte(req, chunk, o)).collect()
}

pub fn key(req: u64, chunk: usize) -> ChunkKey {
    ChunkKey::from_name(&format!("req{req}/chunk{chunk}"))
}

pub struct ProducerNode {
    pub producer: Producer,
    pub server: Server,
    pub addr: String,
    pub layout: KvLayout,
}

pub struct NodeOpts {
    pub blocks: u32,
    pub arena_pages: usize,
    pub page_size: usize,
    pub secret: Option<Vec<u8>>,
    pub ttl: Duration,
    pub max_gets: usize,
    pub listen: String,
    /// Server `io_timeout` (None: the `NetConfig` default).
    pub io_timeout: Option<Duration>,
    /// Server `idle_timeout` (None: the `NetConfig` default).
    pub idle_timeout: Option<Duration>,
    /// Server `handshake_timeout` (None: the `NetConfig` default).
    pub handshake_timeout: Option<Duration>,
    /// Server `max_connections` (None: the `NetConfig` default).
    pub max_connections: Option<usize>,
    /// Server `max_unauthenticated` (None: the `NetConfig` default).
    pub max_unauthenticated: Option<usize>,
}

impl Default for NodeOpts {
    fn default() -> Self {
        NodeOpts {
            blocks: 256,
            arena_pages: 256,
            page_size: 16 << 10,
            secret: None,
            ttl: Duration::from_secs(10),
            max_gets: 64,
            listen: "127.0.0.1:0".into(),
            io_timeout: None,
            idle_timeout: None,
            handshake_timeout: None,
            max_connections: None,
            max_unauthenticated: None,
        }
    }
}

pub async fn producer_node(opts: NodeOpts) -> ProducerNode {
    let layout = layout(opts.blocks, Arrangement::LayerSeparate);
    let region = Arc::new(Region::host("producer-kv", layout.region_bytes()).unwrap());
    let store = ChunkStore::new(region, layout, 10_000).unwrap();
    let arena = Arena::new(ArenaConfig::new(opts.page_size, opts.arena_pages).unpinned()).unwrap();
    let engine = CopyEngine::new(CopyConfig {
        threads: 2,
        slice_bytes: 256 << 10,
    })
    .unwrap();
    let mut net = NetConfig::new("producer");
    net.secret = opts.secret.clone();
    if let Some(d) = opts.io_timeout {
        net.io_timeout = d;
    }
    if let Some(d) = opts.idle_timeout {
        net.idle_timeout = d;
    }
    if let Some(d) = opts.handshake_timeout {
        net.handshake_timeout = d;
    }
    if let Some(n) = opts.max_connections {
        net.max_connections = n;
    }
    if let Some(n) = opts.max_unauthenticated {
        net.max_unauthenticated = n;
    }
    let cfg = ProducerConfig {
        default_ttl: opts.ttl,
        max_ttl: opts.ttl,
        max_concurrent_gets: opts.max_gets,
        max_staged_pages_per_peer: Some(usize::MAX / 2),
        // The socket mover: these suites count and corrupt bytes on the wire.
        transport: kvferry::peer::Transport::Tcp,
        ..ProducerConfig::default()
    };
    let producer = Producer::new(store, arena, engine, cfg, net.incarnation).unwrap();
    let server = Server::bind(&opts.listen, net, Arc::new(producer.clone()))
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    ProducerNode {
        producer,
        server,
        addr,
        layout,
    }
}

/// Fills request `req` with `chunks` chunks of `blocks_per_chunk` blocks.
pub fn fill(p: &Producer, req: u64, chunks: usize, blocks_per_chunk: usize) -> Vec<ChunkKey> {
    let len = p.store().layout().chunk_bytes(blocks_per_chunk);
    (0..chunks)
        .map(|c| {
            let k = key(req, c);
            p.put_local(k, &chunk_bytes(req, c, len)).unwrap();
            k
        })
        .collect()
}

pub struct ConsumerNode {
    pub consumer: Consumer,
    pub region: Arc<Region>,
    pub layout: KvLayout,
}

pub fn consumer_with_engine(engine: CopyEngine, blocks: u32, pages: usize, secret: Option<Vec<u8>>) -> ConsumerNode {
    let layout = layout(blocks, Arrangement::FullyContiguous);
    let region = Arc::new(Region::host("consumer-kv", layout.region_bytes()).unwrap());
    let arena = Arena::new(ArenaConfig::new(16 << 10, pages).unpinned()).unwrap();
    let mut net = NetConfig::new("consumer");
    net.secret = secret;
    net.io_timeout = Duration::from_secs(2);
    let mut cfg = ConsumerConfig::new(net);
    cfg.transport = kvferry::peer::Transport::Tcp;
    cfg.lease_guard = Duration::from_millis(50);
    let consumer = Consumer::new(arena, engine, cfg).unwrap();
    ConsumerNode {
        consumer,
        region,
        layout,
    }
}

pub fn consumer_node(blocks: u32, pages: usize) -> ConsumerNode {
    consumer_with_engine(
        CopyEngine::new(CopyConfig {
            threads: 2,
            slice_bytes: 256 << 10,
        })
        .unwrap(),
        blocks,
        pages,
        None,
    )
}

pub fn consumer_with_body(body: Arc<dyn CopyBody>, blocks: u32, pages: usize) -> ConsumerNode {
    let engine = CopyEngine::with_body(
        CopyConfig {
            threads: 2,
            slice_bytes: 16 << 10,
        },
        body,
    )
    .unwrap();
    consumer_with_engine(engine, blocks, pages, None)
}

impl ConsumerNode {
    /// Destination: chunk i of this transfer lands in blocks `first + i*bpc ..`.
    pub fn dst(&self, first: u32, chunks: usize, bpc: usize) -> Destination {
        let chunks = (0..chunks)
            .map(|c| (0..bpc as u32).map(|b| first + (c * bpc) as u32 + b).collect())
            .collect();
        Destination::from_layout(self.region.clone(), &self.layout, chunks).unwrap()
    }

    /// Bad bytes of chunk `c` of `req` as landed in `blocks` (0 when intact).
    pub fn corrupted_bytes(&self, req: u64, c: usize, blocks: &[u32]) -> usize {
        self.corrupted_bytes_prefix(req, c, blocks, usize::MAX)
    }

    /// As `corrupted_bytes`, for the first `len` bytes only.
    pub fn corrupted_bytes_prefix(&self, req: u64, c: usize, blocks: &[u32], len: usize) -> usize {
        let mut ranges = self.layout.chunk_ranges(blocks).unwrap();
        let mut left = len;
        ranges.retain_mut(|r| {
            if left == 0 {
                return false;
            }
            r.1 = r.1.min(left);
            left -= r.1;
            true
        });
        let mut at = 0;
        let mut bad = 0;
        for (off, len) in ranges {
            let got = self.region.to_vec(off, len).unwrap();
            for (i, b) in got.iter().enumerate() {
                if *b != pattern_byte(req, c, at + i) {
                    bad += 1;
                }
            }
            at += len;
        }
        bad
    }
}
