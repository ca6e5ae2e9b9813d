//! Building a producer node (store, arena, copy engine, server) from command-line
//! settings; shared by `serve` and `bench`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvferry::copy::{CopyConfig, CopyEngine};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::{Arena, ArenaConfig, ByteSize, Region};
use kvferry::net::{NetConfig, Server};
use kvferry::peer::{ChunkStore, Producer, ProducerConfig};
use kvferry::wire::Limits;

use crate::util::parse_timeout;

/// Settings of a node's KV store and staging.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Model preset giving the KV layout: llama3-8b, llama3-70b-tp8, tiny.
    #[arg(long, default_value = "llama3-70b-tp8")]
    pub model: String,
    /// Blocks in this node's KV region (the store's capacity in blocks).
    #[arg(long, default_value_t = 1024)]
    pub blocks: u32,
    /// Staging arena size.
    #[arg(long, default_value = "256MiB")]
    pub arena: ByteSize,
    /// Staging arena page size.
    #[arg(long, default_value = "2MiB")]
    pub page_size: ByteSize,
    /// Most chunks the store holds (least recently used are evicted).
    #[arg(long, default_value_t = 100_000)]
    pub store_capacity: usize,
    /// Copy threads (default: available cores).
    #[arg(long)]
    pub copy_threads: Option<usize>,
    /// TTL of staged leases not released by `Done`.
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    pub ttl: Duration,
    /// Staging requests served at once; more get an immediate "busy" miss.
    #[arg(long, default_value_t = 64)]
    pub max_gets: usize,
    /// Shared secret for HMAC authentication (prefer --secret-file or KVFERRY_SECRET).
    #[arg(long, env = "KVFERRY_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// File holding the shared secret.
    #[arg(long, conflicts_with = "secret")]
    pub secret_file: Option<std::path::PathBuf>,
    /// Largest control frame accepted.
    #[arg(long, default_value = "1MiB")]
    pub max_control: ByteSize,
    /// Largest bulk frame (chunk) accepted.
    #[arg(long, default_value = "256MiB")]
    pub max_bulk: ByteSize,
    /// Bound on any frame read or write once started.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub io_timeout: Duration,
    /// Idle connections are closed after this long.
    #[arg(long, default_value = "300s", value_parser = parse_timeout)]
    pub idle_timeout: Duration,
    /// Accepted connections at once; more are refused.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
}

impl NodeArgs {
    pub fn layout(&self, arrangement: Arrangement) -> anyhow::Result<KvLayout> {
        let preset: Preset = self.model.parse()?;
        Ok(KvLayout::preset(preset, self.blocks, arrangement)?)
    }

    pub fn secret(&self) -> anyhow::Result<Option<Vec<u8>>> {
        if let Some(f) = &self.secret_file {
            let s = std::fs::read(f).with_context(|| format!("reading secret file {}", f.display()))?;
            let s: Vec<u8> = s.trim_ascii().to_vec();
            anyhow::ensure!(!s.is_empty(), "secret file {} is empty", f.display());
            return Ok(Some(s));
        }
        Ok(self.secret.as_ref().map(|s| s.as_bytes().to_vec()))
    }

    pub fn net(&self, peer_id: &str) -> anyhow::Result<NetConfig> {
        let mut net = NetConfig::new(peer_id);
        net.secret = self.secret()?;
        net.io_timeout = self.io_timeout;
        net.idle_timeout = self.idle_timeout;
        net.max_connections = self.max_connections;
        net.limits = Limits {
            max_control_bytes: self.max_control.bytes(),
            max_bulk_bytes: self.max_bulk.bytes(),
            ..Limits::default()
        };
        net.validate()?;
        Ok(net)
    }

    pub fn arena(&self) -> anyhow::Result<Arena> {
        let page = self.page_size.bytes() as usize;
        anyhow::ensure!(page > 0, "--page-size must be greater than zero");
        let pages = (self.arena.bytes() as usize) / page;
        anyhow::ensure!(
            pages > 0,
            "--arena ({}) must hold at least one page of {}",
            self.arena,
            self.page_size
        );
        let arena = Arena::new(ArenaConfig::new(page, pages)).context("creating the staging arena")?;
        if let Some(why) = arena.fallback_reason() {
            eprintln!("note: staging arena is {} ({why})", arena.backing_kind());
        }
        Ok(arena)
    }

    pub fn engine(&self) -> anyhow::Result<CopyEngine> {
        let mut cfg = CopyConfig::default();
        if let Some(t) = self.copy_threads {
            cfg.threads = t;
        }
        Ok(CopyEngine::new(cfg)?)
    }
}

impl Default for NodeArgs {
    fn default() -> Self {
        NodeArgs {
            model: "llama3-70b-tp8".into(),
            blocks: 1024,
            arena: ByteSize(256 << 20),
            page_size: ByteSize(2 << 20),
            store_capacity: 100_000,
            copy_threads: None,
            ttl: Duration::from_secs(10),
            max_gets: 64,
            secret: None,
            secret_file: None,
            max_control: ByteSize(1 << 20),
            max_bulk: ByteSize(256 << 20),
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            max_connections: 4096,
        }
    }
}

/// A running producer node.
pub struct ProducerNode {
    pub producer: Producer,
    pub server: Server,
    pub layout: KvLayout,
}

/// Starts a producer serving on `listen`. Must run inside a tokio runtime.
pub async fn start_producer(args: &NodeArgs, listen: &str, peer_id: &str) -> anyhow::Result<ProducerNode> {
    let layout = args.layout(Arrangement::LayerSeparate)?;
    let region = Arc::new(Region::host("kv", layout.region_bytes()).context("allocating the KV region")?);
    let store = ChunkStore::new(region, layout, args.store_capacity)?;
    let net = args.net(peer_id)?;
    let cfg = ProducerConfig {
        default_ttl: args.ttl,
        max_ttl: args.ttl.max(Duration::from_secs(120)),
        max_concurrent_gets: args.max_gets,
    };
    let producer = Producer::new(store, args.arena()?, args.engine()?, cfg, net.incarnation)?;
    let server = Server::bind(listen, net, Arc::new(producer.clone()))
        .await
        .with_context(|| format!("listening on {listen}"))?;
    Ok(ProducerNode {
        producer,
        server,
        layout,
    })
}
