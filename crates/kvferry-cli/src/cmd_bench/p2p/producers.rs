//! The producer side of a point: producer engines on loopback (over mutual TLS under
//! `--tls`), filled with a model preset's KV for every request, each chunk with its own
//! byte pattern — as store chunks (`staged`), published blocks of a host KV cache
//! (`direct`) or of a simulated device's (`device-sim`). Request `r` lives on producer
//! `r % P`; the crc32c of every chunk's pattern is kept for verifying what lands.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvferry::device::{Device, DeviceBuffer, DeviceKvCache, SimConfig, SimDevice};
use kvferry::engine::{Engine, Registered};
use kvferry::layout::{Arrangement, KvCache, KvLayout};
use kvferry::mem::{ByteSize, Region};
use kvferry::wire::ChunkKey;

use super::args::P2pBenchArgs;
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
    pub(super) engines: Vec<Engine>,
    /// Each producer's listening address, in producer order.
    pub(super) addrs: Vec<String>,
    /// The crc32c of each request's chunks' patterns, by request and chunk.
    pub(super) expected: Arc<Vec<Vec<u32>>>,
    /// Registered host KV caches and their regions (`direct`).
    _caches: Vec<(Registered, Arc<Region>)>,
    /// Registered sim-device KV caches and their memory (`device-sim`).
    _device_caches: Vec<(Registered, DeviceBuffer)>,
}

/// Starts the producers and fills them with every request's chunks.
pub(super) async fn start(args: &P2pBenchArgs, shape: &Shape, ca: Option<&EphemeralCa>) -> anyhow::Result<Producers> {
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
        arena: ByteSize((2 * args.in_flight.max(2) * chunk_bytes.div_ceil(staging_page) * staging_page) as u64),
        page_size: ByteSize(staging_page as u64),
        copy_threads: args.copy_threads,
        max_gets: 1024,
        max_ttl: Some(Duration::from_secs(24 * 3600)),
        peer_quota_pages: Some(usize::MAX / 2),
        ..EngineArgs::default()
    };
    let mut producers = Vec::new();
    for i in 0..args.producers {
        let name = format!("bench-producer-{i}");
        let mut cfg = pnode.config(Some("127.0.0.1:0"), &name)?;
        if let Some(ca) = ca {
            cfg.net.tls = Some(ca.node(&name)?);
        }
        let e = Engine::start(cfg).await?;
        if let Some(why) = e.arena().fallback_reason() {
            crate::engine_args::note_unpinned(&e.arena().backing_kind().to_string(), &why);
        }
        producers.push(e);
    }
    // Fill: request r lives on producer r % P, every chunk with its own pattern.
    let playout = KvLayout::preset(args.model.parse()?, producer_blocks, Arrangement::LayerSeparate)?;
    let mut caches = Vec::new();
    let mut device_caches = Vec::new();
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
    let mut expected = vec![vec![0u32; args.chunks_per_request]; args.requests];
    for (r, exp) in expected.iter_mut().enumerate() {
        let p = &producers[r % args.producers];
        for (c, e) in exp.iter_mut().enumerate() {
            let bytes = pattern(r, c, chunk_bytes);
            *e = kvferry::checksum::checksum(&bytes);
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
    let addrs: Vec<String> = producers
        .iter()
        .map(|p| p.address().expect("producers listen").to_string())
        .collect();
    Ok(Producers {
        engines: producers,
        addrs,
        expected: Arc::new(expected),
        _caches: caches,
        _device_caches: device_caches,
    })
}
