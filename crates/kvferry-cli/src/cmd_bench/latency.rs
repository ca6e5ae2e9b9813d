//! `kvferry bench latency`: one transfer at a time, the latency of each (p50, p99),
//! between a producer and a consumer engine over loopback.
//!
//! Each transfer is an eager get of one freshly published key (`--blocks` blocks of
//! `--block-bytes`) into a registered destination, on `--transport` (tcp or auto) and
//! `--path` (direct or staged), timed from the call to the bytes landed and verified.
//! Transfers never overlap: what is measured is the cost of one, not a throughput.
//!
//! `--publish-delay-ms D` reproduces a disaggregated prefill, which hands out its
//! keys before it publishes them (vLLM publishes a step later): the key is published
//! `D` ms after the get started, so the get first misses. `--on-miss` says what the
//! consumer does then: `wait` (the get waits on the producer, which answers when the
//! key is published: `Destination::with_await_published`) or `poll` (retry after 4,
//! 8, 16, 32, then every 50 ms, as the vLLM connector did before it could wait). The
//! latency reported is from the get's start; `publish→landed` is the part after the
//! publication, the cost the miss handling adds to the transfer itself.
//!
//! The two engines run in this process, on one runtime of two threads.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvferry::engine::{Engine, EngineConfig};
use kvferry::layout::KvCache;
use kvferry::mem::{ByteSize, Region};
use kvferry::peer::{Destination, TransferPath, Transport};
use kvferry::wire::ChunkKey;
use serde::Serialize;
use tokio::time::Instant;

/// Options for `bench latency`.
#[derive(Args, Debug, Clone)]
pub struct LatencyBenchArgs {
    /// Which movers carry the bytes (the engines' `transport`; `--mover` is an older
    /// spelling, still accepted): `tcp` (every byte on the socket) or `auto` (the
    /// same-host mover, `process_vm_readv`, where it qualifies).
    #[arg(long, alias = "mover", default_value = "tcp")]
    transport: Transport,
    /// `direct` (the socket reads into the destination blocks) or `staged` (through
    /// staging pages, then landed).
    #[arg(long, default_value = "staged")]
    path: TransferPath,
    /// Blocks per transfer.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    blocks: u32,
    /// Bytes per block.
    #[arg(long, default_value = "64KiB")]
    block_bytes: ByteSize,
    /// Transfers (one at a time).
    #[arg(long, default_value_t = 200)]
    transfers: usize,
    /// Publish each key this long after its get started (0: before it).
    #[arg(long, default_value_t = 0)]
    publish_delay_ms: u64,
    /// What a get that missed does: `wait` for the publication on the producer, or
    /// `poll` (retry on a 4-50 ms timer).
    #[arg(long, default_value = "wait")]
    on_miss: OnMiss,
    /// Print a JSON object instead of a line.
    #[arg(long)]
    json: bool,
}

/// What a get that missed does (`--on-miss`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
enum OnMiss {
    /// Wait on the producer for the key (`AwaitPublished`).
    Wait,
    /// Retry after 4, 8, 16, 32, then every 50 ms.
    Poll,
}

#[derive(Serialize, Debug)]
struct Report {
    mover: String,
    path: TransferPath,
    on_miss: OnMiss,
    publish_delay_ms: u64,
    bytes_per_transfer: usize,
    transfers: usize,
    /// Gets sent per transfer (1: no miss; more: retries).
    gets_per_transfer: f64,
    p50_ms: f64,
    p99_ms: f64,
    min_ms: f64,
    max_ms: f64,
    /// Publication to landed (with a publish delay; else the whole transfer).
    after_publish_p50_ms: f64,
    after_publish_p99_ms: f64,
}

fn quantile(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

fn engine_config(id: &str, transport: Transport) -> EngineConfig {
    let mut cfg = EngineConfig::default().peer_id(id).arena(64 << 20, 64 << 10);
    cfg.producer.transport = transport;
    cfg
}

pub fn run(args: LatencyBenchArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(measure(&args))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "latency {} {} on-miss={} publish-delay={}ms {} B x {}: p50 {:.3} ms  p99 {:.3} ms  (min {:.3}, max {:.3}; \
             publish→landed p50 {:.3} p99 {:.3}; {:.2} gets per transfer)",
            report.mover,
            match report.path {
                TransferPath::Direct => "direct",
                TransferPath::Staged => "staged",
            },
            match report.on_miss {
                OnMiss::Wait => "wait",
                OnMiss::Poll => "poll",
            },
            report.publish_delay_ms,
            report.bytes_per_transfer,
            report.transfers,
            report.p50_ms,
            report.p99_ms,
            report.min_ms,
            report.max_ms,
            report.after_publish_p50_ms,
            report.after_publish_p99_ms,
            report.gets_per_transfer,
        );
    }
    Ok(())
}

async fn measure(args: &LatencyBenchArgs) -> anyhow::Result<Report> {
    anyhow::ensure!(args.transfers > 0, "--transfers must be at least 1");
    let block = args.block_bytes.0 as usize;
    anyhow::ensure!(block > 0, "--block-bytes must be greater than zero");
    let nblocks = 2 * args.blocks;
    let prefill = Engine::start(engine_config("latency-prefill", args.transport)).await?;
    let decode = Engine::start(engine_config("latency-decode", args.transport)).await?;
    let addr = prefill
        .address()
        .context("the producer engine does not listen")?
        .to_string();
    let src_mem = Arc::new(Region::host("latency-src", nblocks as usize * block)?);
    for b in 0..nblocks as usize {
        src_mem.write(b * block, &vec![(b % 251) as u8 + 1; block])?;
    }
    let src = prefill.register(KvCache::contiguous(src_mem, block)?)?;
    let dst_mem = Arc::new(Region::host("latency-dst", nblocks as usize * block)?);
    let dst = decode.register(KvCache::contiguous(dst_mem.clone(), block)?)?;
    let src_blocks: Vec<u32> = (0..args.blocks).collect();
    let dst_blocks: Vec<u32> = (args.blocks..nblocks).collect();
    let delay = Duration::from_millis(args.publish_delay_ms);
    let timeout = Duration::from_secs(10);
    let (mut total, mut after) = (Vec::new(), Vec::new());
    let mut gets = 0usize;
    for i in 0..args.transfers {
        let key = ChunkKey::from_name(&format!("latency/{i}"));
        dst_mem.write(args.blocks as usize * block, &vec![0u8; args.blocks as usize * block])?;
        let started = Instant::now();
        let published = if delay.is_zero() {
            prefill.publish(key, &src, &src_blocks, timeout, true)?;
            tokio::spawn(async move { started })
        } else {
            let (p, src, blocks) = (prefill.clone(), src.clone(), src_blocks.clone());
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let at = Instant::now();
                p.publish(key, &src, &blocks, timeout, true).expect("publish");
                at
            })
        };
        let deadline = started + timeout;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let mut d = Destination::new(dst.cache.clone(), vec![dst_blocks.clone()]).with_path(args.path);
            if args.on_miss == OnMiss::Wait {
                d = d.with_await_published(timeout);
            }
            let landed = decode
                .get(&addr, &[key], d, deadline)
                .await
                .map_err(|f| anyhow::anyhow!("transfer {i}: {}", f.error))?;
            if landed.chunks == 1 {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "transfer {i}: {key} never arrived");
            if args.on_miss == OnMiss::Wait {
                continue; // the wait ended without the key: ask again
            }
            // The vLLM connector's schedule before it could wait: 4, 8, 16, 32, 50 ms.
            let backoff = Duration::from_millis(50).min(Duration::from_millis(2) * 2u32.pow(attempts.min(5)));
            tokio::time::sleep(backoff).await;
        }
        let landed_at = Instant::now();
        gets += attempts as usize;
        let published_at = published.await?;
        total.push(landed_at - started);
        after.push(landed_at.saturating_duration_since(published_at));
        let got = dst_mem.to_vec(args.blocks as usize * block, block)?;
        anyhow::ensure!(got.iter().all(|&b| b == 1), "transfer {i}: wrong bytes landed");
        // One at a time: let the producer take the Done before the next transfer.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let _ = decode.close(Instant::now() + Duration::from_secs(5)).await;
    let _ = prefill.close(Instant::now() + Duration::from_secs(5)).await;
    total.sort();
    after.sort();
    Ok(Report {
        mover: args.transport.to_string(),
        path: args.path,
        on_miss: args.on_miss,
        publish_delay_ms: args.publish_delay_ms,
        bytes_per_transfer: args.blocks as usize * block,
        transfers: args.transfers,
        gets_per_transfer: gets as f64 / args.transfers as f64,
        p50_ms: quantile(&total, 0.5),
        p99_ms: quantile(&total, 0.99),
        min_ms: quantile(&total, 0.0),
        max_ms: quantile(&total, 1.0),
        after_publish_p50_ms: quantile(&after, 0.5),
        after_publish_p99_ms: quantile(&after, 0.99),
    })
}
