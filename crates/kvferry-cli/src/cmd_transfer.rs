//! `kvferry put` / `kvferry get`: push a chunk to, or fetch one from, a running
//! `kvferry serve` — for scripts and smoke tests. With `--directory etcd://...`, `--peer`
//! may name a peer id, and `get` without `--peer` asks every live peer which holds the
//! key (a bounded fan-out under `--timeout`) and fetches it from the best one.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvferry::engine::{Engine, EngineConfig, StoreConfig};
use kvferry::layout::{Arrangement, KvLayout, Preset};
use kvferry::mem::{ByteSize, Region};
use kvferry::peer::{Destination, PeerError};
use kvferry::wire::{ChunkKey, ErrorKind};
use tokio::time::Instant;

use crate::cmd_peers::DirectoryArgs;
use crate::util::{parse_model, parse_timeout, read_secret_file, usage};

/// Connection options shared by put and get.
#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    /// The `kvferry serve` to talk to: an address, or a peer id with --directory etcd://...
    /// (default: 127.0.0.1:7070; with an etcd directory, `get` without it finds a live
    /// peer that holds the key).
    #[arg(long, value_name = "ID_OR_ADDR")]
    peer: Option<String>,
    /// Chunk key: a name (hashed) or 64 hex digits.
    #[arg(long)]
    key: String,
    /// Give up after this long (e.g. 2s, 500ms).
    #[arg(long, default_value = "10s", value_parser = parse_timeout)]
    timeout: Duration,
    /// Shared secret, if the server requires one (prefer --secret-file or KVFERRY_SECRET).
    #[arg(long, env = "KVFERRY_SECRET", hide_env_values = true)]
    secret: Option<String>,
    /// File holding the shared secret (like `serve --secret-file`; surrounding
    /// whitespace is ignored).
    #[arg(long, conflicts_with = "secret")]
    secret_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    tls: crate::engine_args::TlsArgs,
    #[command(flatten)]
    dir: DirectoryArgs,
    /// "auto": read a server on this host from its memory (process_vm_readv) when the
    /// kernel allows it, else the socket; "tcp": the socket only.
    #[arg(long, default_value = "auto")]
    transport: kvferry::peer::Transport,
}

/// Without `--peer`: the default address, with a static directory.
const DEFAULT_PEER: &str = "127.0.0.1:7070";

impl PeerArgs {
    /// The peer named on the command line, or the default one for a static directory.
    fn named_peer(&self) -> Option<String> {
        self.peer
            .clone()
            .or_else(|| self.dir.is_static().then(|| DEFAULT_PEER.to_string()))
    }

    fn secret(&self) -> anyhow::Result<Option<Vec<u8>>> {
        if let Some(f) = &self.secret_file {
            return Ok(Some(read_secret_file(f)?));
        }
        Ok(self.secret.as_ref().map(|s| s.as_bytes().to_vec()))
    }
}

/// Options for `put`.
#[derive(Args, Debug)]
pub struct PutArgs {
    #[command(flatten)]
    peer: PeerArgs,
    /// File with the chunk's bytes ("-" for stdin).
    #[arg(long)]
    file: String,
    /// Largest chunk the server accepts: its `--max-bulk` (256MiB unless the server
    /// was started with another). A larger file is refused here, before anything is sent.
    #[arg(long, default_value = "256MiB")]
    max_bulk: ByteSize,
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
    #[arg(long, default_value = "llama3-70b-tp8", value_parser = parse_model)]
    model: String,
    /// Largest chunk to accept, in blocks of the model's layout (a bigger chunk is an
    /// error that says how many blocks it needs).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    max_blocks: u32,
}

fn key(s: &str) -> ChunkKey {
    s.parse::<ChunkKey>().unwrap_or_else(|_| ChunkKey::from_name(s))
}

/// A client-only engine (serves nothing) with a small staging arena and store,
/// following the directory of `p` (waiting, bounded by `p.timeout` and at most 3 s,
/// for its first list).
async fn consumer(p: &PeerArgs, arena_bytes: usize) -> anyhow::Result<Engine> {
    let page = 64 << 10;
    let mut cfg = EngineConfig::default()
        .listen(None)
        .peer_id(format!("kvferry-cli-{}", std::process::id()))
        .secret(p.secret()?)
        .arena(arena_bytes.div_ceil(page).max(1) * page, page);
    cfg.pinned = false;
    cfg.net.connections_per_peer = 1;
    cfg.net.tls = p.tls.config()?;
    cfg.copy.threads = 1;
    cfg.producer.transport = p.transport;
    cfg.store = StoreConfig::Bytes {
        bytes: 64 << 10,
        block_bytes: 64 << 10,
    };
    if let Some(d) = p.dir.connect(p.timeout.min(Duration::from_secs(3))).await? {
        cfg.directory = Some(d);
    }
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
    let limit = args.max_bulk.bytes();
    if data.len() as u64 > limit {
        anyhow::bail!(
            "{} is {} bytes ({}), more than --max-bulk {} ({limit} bytes): the server would refuse it; \
             start the server with a larger --max-bulk and pass the same --max-bulk to put",
            if args.file == "-" { "stdin" } else { &args.file },
            data.len(),
            ByteSize(data.len() as u64),
            args.max_bulk
        );
    }
    let peer = args
        .peer
        .named_peer()
        .ok_or_else(|| usage("put needs --peer ID_OR_ADDR: which peer should store the chunk"))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let c = consumer(&args.peer, 64 << 10).await?;
        let k = key(&args.peer.key);
        let deadline = Instant::now() + args.peer.timeout;
        c.push(&peer, k, &data, deadline)
            .await
            .map_err(|e| explain_put(e, data.len()))
            .with_context(|| format!("put to {peer}"))?;
        println!("put {} bytes as {k}", data.len());
        Ok(())
    })
}

/// A refused or cut-off push in terms of the server's `--max-bulk`, when that is the
/// likely cause: the server refuses an oversized chunk and closes the connection, which
/// the sender sees as a broken pipe when the chunk did not fit in the socket buffers.
fn explain_put(e: PeerError, len: usize) -> anyhow::Error {
    let size = format!("{len} bytes ({})", ByteSize(len as u64));
    match &e {
        PeerError::Remote {
            kind: ErrorKind::TooLarge,
            message,
        } => anyhow::anyhow!(
            "the server refused the chunk: it exceeds the server's --max-bulk ({message}); \
             start the server with a larger --max-bulk"
        ),
        PeerError::PeerLost { reason, .. }
            if ["Broken pipe", "Connection reset", "os error 32", "os error 104"]
                .iter()
                .any(|w| reason.contains(w)) =>
        {
            anyhow::anyhow!(
                "the server refused the chunk: it most likely exceeds the server's --max-bulk \
                 (256 MiB by default; this chunk is {size}): the server closed the connection \
                 while it was sent ({reason}); start the server with a larger --max-bulk"
            )
        }
        _ => anyhow::Error::new(e),
    }
}

pub fn get(args: GetArgs) -> anyhow::Result<()> {
    let preset: Preset = args.model.parse()?;
    let layout = KvLayout::preset(preset, args.max_blocks, Arrangement::FullyContiguous)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (peer, landed, bytes, mover) = rt.block_on(async {
        let c = consumer(&args.peer, layout.region_bytes()).await?;
        let region = Arc::new(Region::host("get", layout.region_bytes())?);
        let dst = Destination::from_layout(region.clone(), &layout, vec![(0..args.max_blocks).collect()])
            .expect("valid destination");
        let started = Instant::now();
        let deadline = started + args.peer.timeout;
        let k = key(&args.peer.key);
        let peer = match args.peer.named_peer() {
            Some(p) => p,
            None => locate(&c, &args.peer, k, deadline).await?,
        };
        let landed = c.get(&peer, &[k], dst, deadline).await.map_err(|mut f| {
            // `--timeout` bounds the whole command (locating included): a timeout
            // reports the time waited since the command began, not since the get did.
            if let PeerError::Timeout { waited, .. } = &mut f.error {
                *waited = started.elapsed();
            }
            let why = explain_get(&f.error, &args, layout.block_bytes());
            anyhow::anyhow!("get from {peer} failed: {why}")
        })?;
        // Fully contiguous layout with blocks 0..n: the chunk is the region's prefix.
        let bytes = region.to_vec(0, landed.bytes)?;
        let mover = match c.consumer().movers().into_iter().next() {
            Some(m) => match (m.mover, m.fallback) {
                (kvferry::peer::Mover::Cma, _) => "cma".to_string(),
                (_, Some(why)) => format!("socket; same-host read not used: {why}"),
                (_, None) => "socket".to_string(),
            },
            None => "socket".to_string(),
        };
        anyhow::Ok((peer, landed, bytes, mover))
    })?;
    if landed.chunks == 0 {
        anyhow::bail!("miss: {peer} does not hold {}", args.peer.key);
    }
    match args.out.as_deref() {
        Some("-") => std::io::stdout().write_all(&bytes)?,
        Some(path) => std::fs::write(path, &bytes).with_context(|| format!("writing {path}"))?,
        None => println!(
            "got {} bytes, crc32c {:#010x}, via {mover}",
            bytes.len(),
            kvferry::checksum::checksum(&bytes)
        ),
    }
    Ok(())
}

/// The live peer (id) that holds `k`, found by asking every live peer of the
/// directory; a clear error when none does.
async fn locate(c: &Engine, p: &PeerArgs, k: ChunkKey, deadline: Instant) -> anyhow::Result<String> {
    let view = c.config().directory.as_ref().expect("etcd directory").live_peers();
    // The first peer holding it: one that never answers does not hold up the get.
    match c.locate_holder(&[k], deadline).await? {
        Some(l) => Ok(l.peer_id),
        None => anyhow::bail!(
            "no live peer in namespace {} holds {} (asked {} peer(s){})",
            p.dir.namespace,
            p.key,
            view.peers.len(),
            if view.stale {
                "; the directory view is stale: etcd is not answering"
            } else {
                ""
            }
        ),
    }
}

/// A chunk bigger than the destination in terms of `--max-blocks`.
fn explain_get(e: &PeerError, args: &GetArgs, block_bytes: usize) -> String {
    if let PeerError::InvalidArgument(m) = e {
        if m.contains("destination blocks hold") {
            let len = m
                .split(" is ")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse::<usize>().ok());
            let limit = format!(
                "the chunk is larger than --max-blocks {} ({} of {})",
                args.max_blocks,
                ByteSize(args.max_blocks as u64 * block_bytes as u64),
                args.model
            );
            return match len {
                Some(len) => {
                    let need = len.div_ceil(block_bytes);
                    format!(
                        "{limit}: it is {len} bytes ({}), {need} blocks; rerun with --max-blocks {need} or more",
                        ByteSize(len as u64)
                    )
                }
                None => format!("{limit}: {m}; rerun with a larger --max-blocks"),
            };
        }
    }
    e.to_string()
}
