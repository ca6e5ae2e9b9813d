//! The producer side of a point: producer engines on loopback (over mutual TLS under
//! `--tls`), filled with a model preset's KV for every request, each chunk with its own
//! byte pattern — as store chunks (`staged`), published blocks of a host KV cache
//! (`direct`) or of a simulated device's (`device-sim`). Request `r` lives on producer
//! `r % P`; the crc32c of every chunk's pattern is kept for verifying what lands.
//!
//! The producers run in this process ([`start`]) or, by default with the same-host
//! mover, in a child process of their own ([`start_child`], which runs [`start_local`]
//! there, see `child`): the consumer then recomputes the expected checksums from the
//! deterministic patterns, and what the one-copy limit reads is named by the child's
//! memory addresses.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvferry::device::{Device, DeviceBuffer, DeviceKvCache, SimConfig, SimDevice};
use kvferry::engine::{Engine, Registered};
use kvferry::layout::{Arrangement, KvCache, KvLayout};
use kvferry::mem::{ByteSize, HostMemory, Region};
use kvferry::net::TlsConfig;
use kvferry::wire::ChunkKey;

use super::args::{BenchPath, P2pBenchArgs};
use super::child::{Hello, ProducerChild, Setup};
use super::Shape;
use crate::cmd_bench::tls::EphemeralCa;
use crate::engine_args::EngineArgs;

fn word(req: usize, chunk: usize, i: usize) -> u64 {
    let mut x = ((req as u64) << 40) ^ ((chunk as u64) << 32) ^ i as u64 ^ 0x9E37_79B9_7F4A_7C15;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The request's pattern: differs in every 8-byte word across requests and chunks.
pub(super) fn pattern(req: usize, chunk: usize, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    for i in 0..len.div_ceil(8) {
        v.extend_from_slice(&word(req, chunk, i).to_le_bytes());
    }
    v.truncate(len);
    v
}

pub(super) fn key(req: usize, chunk: usize) -> ChunkKey {
    ChunkKey::from_name(&format!("bench/req{req}/chunk{chunk}"))
}

/// The running producers and what they serve from (held until the point ends).
pub(super) struct Producers {
    /// The producer engines, when they run in this process (none with a child).
    pub(super) engines: Vec<Engine>,
    /// Each producer's listening address, in producer order.
    pub(super) addrs: Vec<String>,
    /// The crc32c of each request's chunks' patterns, by request and chunk.
    pub(super) expected: Arc<Vec<Vec<u32>>>,
    /// The process holding the producers' memory (this one, or the child).
    pub(super) pid: u32,
    /// For the one-copy limit: every chunk's `(address, length)` runs in the producer
    /// process, chunk `n` of the rounds' order at `n % len`.
    pub(super) limit_chunks: Arc<Vec<Vec<(usize, usize)>>>,
    /// The producer process, when the producers run in one.
    pub(super) child: Option<ProducerChild>,
    /// The child's staging backing: `(kind, why not pinned, pinned)`.
    pub(super) child_staging: Option<(String, Option<String>, bool)>,
    _local: Option<Local>,
}

/// Producers running in this process, with what they serve from.
pub(super) struct Local {
    pub(super) engines: Vec<Engine>,
    /// Per producer, the `(address, length)` of the memory its chunks are laid out in
    /// for the one-copy limit (its KV cache's region on the direct path; a region
    /// holding the same patterns chunk after chunk on the others, whose store or device
    /// memory has no address to read).
    pub(super) bases: Vec<(usize, usize)>,
    /// Registered host KV caches and their regions (`direct`).
    _caches: Vec<(Registered, Arc<Region>)>,
    /// Registered sim-device KV caches and their memory (`device-sim`).
    _device_caches: Vec<(Registered, DeviceBuffer)>,
    /// The limit's regions (`staged`, `device-sim`).
    _limit_regions: Vec<Arc<Region>>,
}

/// The crc32c of every request's chunks' patterns, by request and chunk.
pub(super) fn expected(args: &P2pBenchArgs, chunk_bytes: usize) -> Vec<Vec<u32>> {
    (0..args.requests)
        .map(|r| {
            (0..args.chunks_per_request)
                .map(|c| kvferry::checksum::checksum(&pattern(r, c, chunk_bytes)))
                .collect()
        })
        .collect()
}

/// The first address of `region` (one contiguous allocation).
fn base_of(region: &Region) -> anyhow::Result<(usize, usize)> {
    let mut runs = Vec::new();
    region.for_each_run(0, region.len(), &mut |p, n| runs.push((p as usize, n)))?;
    anyhow::ensure!(runs.len() == 1, "a host region is one run");
    Ok(runs[0])
}

/// Every chunk's runs in the producer process, in the rounds' order (request `r`'s
/// chunk `c` at `r * chunks_per_request + c`), from each producer's `bases`.
fn limit_chunks(
    args: &P2pBenchArgs,
    shape: &Shape,
    bases: &[(usize, usize)],
) -> anyhow::Result<Vec<Vec<(usize, usize)>>> {
    anyhow::ensure!(bases.len() == args.producers, "one base per producer");
    let playout = KvLayout::preset(args.model.parse()?, shape.producer_blocks, Arrangement::LayerSeparate)?;
    let mut out = Vec::new();
    for r in 0..args.requests {
        let (base, len) = bases[r % args.producers];
        for c in 0..args.chunks_per_request {
            let first = ((r / args.producers) * args.chunks_per_request + c) * shape.bpc;
            let runs: Vec<(usize, usize)> = if args.path == BenchPath::Direct {
                let blocks: Vec<u32> = (first as u32..(first + shape.bpc) as u32).collect();
                playout
                    .chunk_ranges(&blocks)?
                    .into_iter()
                    .map(|(off, n)| (base + off, n))
                    .collect()
            } else {
                let off = first / shape.bpc * shape.chunk_bytes;
                vec![(base + off, shape.chunk_bytes)]
            };
            anyhow::ensure!(
                runs.iter().all(|&(a, n)| a >= base && a + n <= base + len),
                "limit chunk outside its producer's memory"
            );
            out.push(runs);
        }
    }
    Ok(out)
}

/// Starts the producers in this process (`--producer-process false`).
pub(super) async fn start(args: &P2pBenchArgs, shape: &Shape, ca: Option<&EphemeralCa>) -> anyhow::Result<Producers> {
    let tls = (0..args.producers)
        .map(|i| ca.map(|ca| ca.node(&format!("bench-producer-{i}"))).transpose())
        .collect::<anyhow::Result<Vec<_>>>()?;
    let local = start_local(args, shape, tls).await?;
    let addrs = local
        .engines
        .iter()
        .map(|p| p.address().expect("producers listen").to_string())
        .collect();
    let limit = limit_chunks(args, shape, &local.bases)?;
    Ok(Producers {
        engines: local.engines.clone(),
        addrs,
        expected: Arc::new(expected(args, shape.chunk_bytes)),
        pid: std::process::id(),
        limit_chunks: Arc::new(limit),
        child: None,
        child_staging: None,
        _local: Some(local),
    })
}

/// Starts the producers in a child process (see `child`); while it fills them, this
/// process computes the expected checksums from the same patterns.
pub(super) async fn start_child(
    args: &P2pBenchArgs,
    shape: &Shape,
    ca: Option<&EphemeralCa>,
) -> anyhow::Result<Producers> {
    let tls = (0..args.producers)
        .map(|i| ca.map(|ca| ca.node_pem(&format!("bench-producer-{i}"))).transpose())
        .collect::<anyhow::Result<Vec<_>>>()?;
    let child = ProducerChild::spawn(args, &Setup { tls })?;
    let (args2, chunk_bytes) = (args.clone(), shape.chunk_bytes);
    let expected = tokio::task::spawn_blocking(move || expected(&args2, chunk_bytes)).await?;
    let (child, hello): (ProducerChild, Hello) = tokio::task::spawn_blocking(move || child.hello()).await??;
    anyhow::ensure!(
        hello.addrs.len() == args.producers,
        "the producer process started {} producers",
        hello.addrs.len()
    );
    let limit = limit_chunks(args, shape, &hello.bases)?;
    Ok(Producers {
        engines: Vec::new(),
        addrs: hello.addrs,
        expected: Arc::new(expected),
        pid: hello.pid,
        limit_chunks: Arc::new(limit),
        child: Some(child),
        child_staging: Some((hello.staging_backing, hello.staging_fallback, hello.staging_pinned)),
        _local: None,
    })
}

/// Starts the producers in this process and fills them with every request's chunks;
/// `tls[i]` is producer `i`'s mutual-TLS configuration (under `--tls`).
pub(super) async fn start_local(
    args: &P2pBenchArgs,
    shape: &Shape,
    tls: Vec<Option<TlsConfig>>,
) -> anyhow::Result<Local> {
    let Shape {
        bpc,
        chunk_bytes,
        staging_page,
        staged,
        on_device,
        producer_blocks,
        ..
    } = *shape;
    // Producer: store (staged) or published KV cache (direct) for its requests; staging
    // for every transfer in flight, twice (a lease waits for `Done` while the next is
    // staged).
    let pnode = EngineArgs {
        model: args.model.clone(),
        blocks: if staged { producer_blocks } else { 1 },
        arena: ByteSize(
            (2 * args.in_flight.max(2) * args.keys_per_get * chunk_bytes.div_ceil(staging_page) * staging_page) as u64,
        ),
        page_size: ByteSize(staging_page as u64),
        copy_threads: args.copy_threads,
        max_gets: 1024,
        max_ttl: Some(Duration::from_secs(24 * 3600)),
        peer_quota_pages: Some(usize::MAX / 2),
        transport: args.transport,
        ..EngineArgs::default()
    };
    let mut producers = Vec::new();
    let mut tls = tls.into_iter();
    for i in 0..args.producers {
        let name = format!("bench-producer-{i}");
        let mut cfg = pnode.config(Some("127.0.0.1:0"), &name)?;
        if let Some(t) = tls.next().flatten() {
            cfg.net.tls = Some(t);
        }
        let e = Engine::start(cfg).await?;
        // A producer child reports its backing to the parent, which says it once.
        if let (Some(why), false) = (e.arena().fallback_reason(), args.serve_producers) {
            crate::engine_args::note_unpinned(&e.arena().backing_kind().to_string(), &why);
        }
        producers.push(e);
    }
    // Fill: request r lives on producer r % P, every chunk with its own pattern.
    let playout = KvLayout::preset(args.model.parse()?, producer_blocks, Arrangement::LayerSeparate)?;
    let mut caches = Vec::new();
    let mut device_caches = Vec::new();
    let mut limit_regions = Vec::new();
    if staged || on_device {
        for _ in &producers {
            let len = args.chunks_per_request * shape.per_producer_reqs * chunk_bytes;
            limit_regions.push(Arc::new(Region::host("bench-limit", len)?));
        }
    }
    if on_device {
        for (i, p) in producers.iter().enumerate() {
            let dev: Arc<dyn Device> = SimDevice::new(SimConfig::new(i as u32))?;
            let buf = dev.alloc(playout.region_bytes())?;
            let spans = kvferry::layout::BlockMap::from_layout(&playout).spans().to_vec();
            let cache = DeviceKvCache::new(
                "bench-kv",
                dev,
                vec![(buf.clone(), spans)],
                producer_blocks,
                Duration::from_secs(10),
            )?;
            device_caches.push((p.register(cache)?, buf));
        }
    } else if !staged {
        for p in &producers {
            let region = Arc::new(Region::host("bench-kv", playout.region_bytes())?);
            caches.push((p.register(KvCache::with_layout(region.clone(), &playout)?)?, region));
        }
    }
    for r in 0..args.requests {
        let p = &producers[r % args.producers];
        for c in 0..args.chunks_per_request {
            let bytes = pattern(r, c, chunk_bytes);
            if let Some(l) = limit_regions.get(r % args.producers) {
                let at = ((r / args.producers) * args.chunks_per_request + c) * chunk_bytes;
                l.write(at, &bytes)?;
            }
            if staged {
                p.put(key(r, c), &bytes)
                    .with_context(|| format!("filling request {r}"))?;
            } else if on_device {
                let first = ((r / args.producers) * args.chunks_per_request + c) * bpc;
                let blocks: Vec<u32> = (first as u32..(first + bpc) as u32).collect();
                let (reg, buf) = &device_caches[r % args.producers];
                let mut at = 0;
                for (off, len) in playout.chunk_ranges(&blocks)? {
                    buf.write(off, &bytes[at..at + len])?;
                    at += len;
                }
                p.publish(key(r, c), reg, &blocks, Duration::from_secs(24 * 3600), false)?;
            } else {
                // Request r's chunk c takes consecutive blocks of its producer's cache.
                let first = ((r / args.producers) * args.chunks_per_request + c) * bpc;
                let blocks: Vec<u32> = (first as u32..(first + bpc) as u32).collect();
                let (reg, region) = &caches[r % args.producers];
                let mut at = 0;
                for (off, len) in playout.chunk_ranges(&blocks)? {
                    region.write(off, &bytes[at..at + len])?;
                    at += len;
                }
                p.publish(key(r, c), reg, &blocks, Duration::from_secs(24 * 3600), false)?;
            }
        }
    }
    let bases = match limit_regions.is_empty() {
        true => caches
            .iter()
            .map(|(_, r)| base_of(r))
            .collect::<anyhow::Result<Vec<_>>>()?,
        false => limit_regions
            .iter()
            .map(|r| base_of(r))
            .collect::<anyhow::Result<Vec<_>>>()?,
    };
    Ok(Local {
        engines: producers,
        bases,
        _caches: caches,
        _device_caches: device_caches,
        _limit_regions: limit_regions,
    })
}
