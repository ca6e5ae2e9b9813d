//! `kvferry put` / `kvferry get`: push a chunk to, or fetch one from, a running
//! `kvferry serve` — for scripts and smoke tests.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvferry::engine::{Engine, EngineConfig, StoreConfig};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::Region;
use kvferry::peer::Destination;
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

use crate::util::parse_timeout;

/// Connection options shared by put and get.
#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    /// Address of the `kvferry serve` to talk to.
    #[arg(long, default_value = "127.0.0.1:7070")]
    peer: String,
    /// Chunk key: a name (hashed) or 64 hex digits.
    #[arg(long)]
    key: String,
    /// Give up after this long (e.g. 2s, 500ms).
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    timeout: Duration,
    /// Shared secret, if the server requires one (prefer KVFERRY_SECRET).
    #[arg(long, env = "KVFERRY_SECRET", hide_env_values = true)]
    secret: Option<String>,
}

/// Options for `put`.
#[derive(Args, Debug)]
pub struct PutArgs {
    #[command(flatten)]
    peer: PeerArgs,
    /// File with the chunk's bytes ("-" for stdin).
    #[arg(long)]
    file: String,
}

/// Options for `get`.
#[derive(Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    peer: PeerArgs,
    /// Where to write the chunk's bytes ("-" for stdout; default: print a summary).
    #[arg(long)]
    out: Option<String>,
    /// Model preset of the server's layout (pieces must match to land).
    #[arg(long, default_value = "llama3-70b-tp8")]
    model: String,
    /// Largest chunk to accept, in blocks of the model's layout.
    #[arg(long, default_value_t = 16)]
    max_blocks: u32,
}

fn key(s: &str) -> ChunkKey {
    s.parse::<ChunkKey>().unwrap_or_else(|_| ChunkKey::from_name(s))
}

/// A client-only engine (serves nothing) with a small staging arena and store.
async fn consumer(p: &PeerArgs, arena_bytes: usize) -> anyhow::Result<Engine> {
    let page = 64 << 10;
    let mut cfg = EngineConfig::default()
        .listen(None)
        .peer_id(format!("kvferry-cli-{}", std::process::id()))
        .secret(p.secret.as_ref().map(|s| s.as_bytes().to_vec()))
        .arena(arena_bytes.div_ceil(page).max(1) * page, page);
    cfg.pinned = false;
    cfg.net.connections_per_peer = 1;
    cfg.copy.threads = 1;
    cfg.store = StoreConfig::Bytes {
        bytes: 64 << 10,
        block_bytes: 64 << 10,
    };
    Ok(Engine::start(cfg).await?)
}

pub fn put(args: PutArgs) -> anyhow::Result<()> {
    let mut data = Vec::new();
    if args.file == "-" {
        std::io::stdin().read_to_end(&mut data)?;
    } else {
        data = std::fs::read(&args.file).with_context(|| format!("reading {}", args.file))?;
    }
    anyhow::ensure!(!data.is_empty(), "refusing to put an empty chunk");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let c = consumer(&args.peer, 64 << 10).await?;
        let k = key(&args.peer.key);
        let deadline = Instant::now() + args.peer.timeout;
        c.push(&args.peer.peer, k, &data, deadline)
            .await
            .with_context(|| format!("put to {}", args.peer.peer))?;
        println!("put {} bytes as {k}", data.len());
        Ok(())
    })
}

pub fn get(args: GetArgs) -> anyhow::Result<()> {
    let preset: Preset = args.model.parse()?;
    anyhow::ensure!(args.max_blocks > 0, "--max-blocks must be at least 1");
    let layout = KvLayout::preset(preset, args.max_blocks, Arrangement::FullyContiguous)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (landed, bytes) = rt.block_on(async {
        let c = consumer(&args.peer, layout.region_bytes()).await?;
        let region = Arc::new(Region::host("get", layout.region_bytes())?);
        let dst = Destination::from_layout(region.clone(), &layout, vec![(0..args.max_blocks).collect()])
            .expect("valid destination");
        let deadline = Instant::now() + args.peer.timeout;
        let k = key(&args.peer.key);
        let landed = c
            .get(&args.peer.peer, &[k], dst, deadline)
            .await
            .map_err(|f| anyhow::anyhow!("get from {} failed: {}", args.peer.peer, f.error))?;
        // Fully contiguous layout with blocks 0..n: the chunk is the region's prefix.
        let bytes = region.to_vec(0, landed.bytes)?;
        anyhow::Ok((landed, bytes))
    })?;
    if landed.chunks == 0 {
        anyhow::bail!("miss: {} does not hold {}", args.peer.peer, args.peer.key);
    }
    match args.out.as_deref() {
        Some("-") => std::io::stdout().write_all(&bytes)?,
        Some(path) => std::fs::write(path, &bytes).with_context(|| format!("writing {path}"))?,
        None => println!(
            "got {} bytes, crc32c {:#010x}",
            bytes.len(),
            kvferry::wire::crc::checksum(&bytes)
        ),
    }
    Ok(())
}
