//! The measured phase of a point: `ROUNDS` transfer rounds of a third of the chunks
//! each, every round followed by one raw-TCP run of the limit over the same number of
//! connections (both sides measured the same way — best round against best run —
//! interleaved, so a noisy moment of a shared machine does not fall on one side only).
//! Transfers (each a `get` of `--keys-per-get` consecutive chunks of one request) run
//! with `--in-flight` of them at once, each into the oldest free destination slot (of
//! `--slots`), and every
//! landed byte is verified against its request's pattern (the receive path's
//! checksum, or the landed chunk re-read; bad bytes counted exactly on a mismatch). A
//! failed transfer's slot is reused only after its drain fence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry::layout::{Arrangement, KvLayout};
use kvferry::peer::Destination;
use tokio::sync::Semaphore;

use super::args::{BenchPath, P2pBenchArgs, Verify};
use super::consumer::Consumer;
use super::producers::{key, pattern, Producers};
use super::Shape;
use crate::cmd_bench::cpu::{perf_phase, CpuClock, Usage};
use crate::cmd_bench::limits::{cma_limit, huge_source, tcp_limit};

/// Transfer rounds per point, each followed by one raw-TCP run of the limit.
const ROUNDS: u64 = 3;

/// What the rounds measured, and what the limits measured after them reuse.
pub(super) struct Rounds {
    /// Chunks the point moves (`--bytes` in chunks, at least one).
    pub(super) total_chunks: u64,
    /// Rounds run (`ROUNDS`, fewer when there are fewer chunks).
    pub(super) rounds: u64,
    /// Seconds the transfer rounds took together.
    pub(super) elapsed: f64,
    /// Each round's GB/s, and the best of them.
    pub(super) round_gbps: Vec<f64>,
    pub(super) best_round: f64,
    /// The best raw-TCP run moving the same bytes, and from one hot buffer (GB/s).
    pub(super) tcp: f64,
    pub(super) tcp_hot: f64,
    /// CPU and context switches of the raw-TCP runs and of the transfer rounds.
    pub(super) tcp_usage: Usage,
    pub(super) transfer_usage: Usage,
    /// Transfers that failed or landed no chunk; bytes found corrupted.
    pub(super) errors: u64,
    pub(super) corrupted: u64,
    /// Each landed transfer's latency, ms, in completion order.
    pub(super) latencies: Vec<f64>,
    /// Resident memory after the warm-up (a tenth of the chunks) and at the end, MiB.
    pub(super) rss_warm: f64,
    pub(super) rss_end: f64,
    /// Bytes of each raw-TCP run, and its connections.
    pub(super) limit_bytes: u64,
    pub(super) conns: usize,
    /// The same-bytes source and its layout (one producer's region's worth).
    pub(super) source: Arc<Vec<u8>>,
    pub(super) src_layout: KvLayout,
    /// Whether landed bytes were verified by the receive path's checksums.
    pub(super) from_receive: bool,
    /// Bytes landed and verified.
    pub(super) moved: u64,
    /// The best one-copy same-host run (`limits::cma_limit`) after each round, GB/s
    /// (`None`: refused by the kernel), and its threads.
    pub(super) cma_limit: Option<f64>,
    /// The same with the crc32c of every chunk read (`cma_limit(.., verify: true)`).
    pub(super) cma_verified_limit: Option<f64>,
    pub(super) cma_threads: usize,
}

/// This process's resident memory in MiB (0 where /proc is not available).
fn rss_mib() -> f64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()))
        .unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
    pages * page / (1 << 20) as f64
}

/// Runs the rounds, each followed by its raw-TCP run.
pub(super) async fn run(
    args: &P2pBenchArgs,
    shape: &Shape,
    cpu: &CpuClock,
    producers: &Producers,
    side: &Consumer,
) -> anyhow::Result<Rounds> {
    let Shape {
        bpc,
        chunk_bytes,
        per_producer_reqs,
        ..
    } = *shape;
    let addrs = &producers.addrs;
    let Consumer {
        engine: consumer,
        layout,
        region,
        cache,
        device_dst,
        path,
        ..
    } = side;
    let (layout, path) = (*layout, *path);
    // Whole transfers of `k` chunks each (`--keys-per-get`).
    let k = args.keys_per_get.max(1);
    let total_chunks = ((args.bytes.bytes() as usize / chunk_bytes / k).max(1) * k) as u64;
    let total_transfers = total_chunks / k as u64;
    let bar = if args.quiet || args.json {
        indicatif::ProgressBar::hidden()
    } else {
        // Counted in bytes, so the rate is bytes per second, in the table's decimal GB/s.
        let b = indicatif::ProgressBar::new(total_chunks * chunk_bytes as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {decimal_bytes}/{decimal_total_bytes}  {decimal_bytes_per_sec}  eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    };
    // Free destination slots, oldest first: every slot is written in turn.
    let slots = Arc::new(parking_lot::Mutex::new(
        (0..args.slot_count(chunk_bytes)).collect::<std::collections::VecDeque<usize>>(),
    ));
    let sem = Arc::new(Semaphore::new(args.in_flight));
    let errors = Arc::new(AtomicU64::new(0));
    let corrupted = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(parking_lot::Mutex::new(Vec::with_capacity(total_chunks as usize)));
    let expected = producers.expected.clone();
    // The transfer runs as ROUNDS rounds of a third of the chunks each, and each round
    // is followed by one raw-TCP run of the limit: both sides are measured the same way
    // (best round against best run), interleaved, so a noisy moment of a shared machine
    // does not fall on one side only.
    let limit_bytes = (args.bytes.bytes() / ROUNDS).clamp(256 << 20, 1 << 30);
    let conns = args.connections * args.producers;
    // One source for the same-bytes limits: as much memory as one producer's region,
    // laid out like it, so it is as cold in cache as theirs.
    let src_blocks = (per_producer_reqs * args.chunks_per_request * bpc) as u32;
    let src_layout = KvLayout::preset(args.model.parse()?, src_blocks, Arrangement::LayerSeparate)?;
    let source: Arc<Vec<u8>> = Arc::new(huge_source(src_layout.region_bytes()));
    let mut tcp = 0f64;
    let mut tcp_hot = 0f64;
    let mut tcp_usage = Usage::default();
    let mut elapsed = 0f64;
    let mut best_round = 0f64;
    let mut round_gbps = Vec::new();
    let mut transfer_usage = Usage::default();
    let rounds = ROUNDS.min(total_transfers);
    // Direct path with `--verify receive`: the receive path's checksum of the landed
    // bytes (taken over the destination blocks themselves) is compared as is.
    let from_receive = args.verify == Verify::Receive && args.path == BenchPath::Direct;
    let mut rss_warm = 0.0;
    // The one-copy limit reads with as many threads as the consumer copies with.
    let cma_threads = args
        .copy_threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let mut cma: Option<f64> = Some(0.0);
    let mut cma_verified: Option<f64> = Some(0.0);
    for round in 0..rounds {
        let first_transfer = total_transfers * round / rounds;
        let end_transfer = total_transfers * (round + 1) / rounds;
        let (first_chunk, end_chunk) = (first_transfer * k as u64, end_transfer * k as u64);
        let errors_before = errors.load(Ordering::Relaxed);
        perf_phase("transfer", true);
        let started = Instant::now();
        let usage_started = cpu.usage();
        let mut tasks = tokio::task::JoinSet::new();
        for transfer in first_transfer..end_transfer {
            if transfer == total_transfers / 10 {
                rss_warm = rss_mib();
            }
            let permit = sem.clone().acquire_owned().await?;
            let slot = slots.lock().pop_front().expect("a slot per permit");
            let (consumer, region, cache, device_dst, slots, errors, corrupted, latencies, expected, bar) = (
                consumer.clone(),
                region.clone(),
                cache.clone(),
                device_dst.clone(),
                slots.clone(),
                errors.clone(),
                corrupted.clone(),
                latencies.clone(),
                expected.clone(),
                bar.clone(),
            );
            // Chunks `c0 .. c0 + k` of request `r` (k divides the chunks per request).
            let n = transfer as usize * k;
            let r = (n / args.chunks_per_request) % args.requests;
            let c0 = n % args.chunks_per_request;
            let addr = addrs[r % args.producers].clone();
            tasks.spawn(async move {
                // Chunk `i` of this transfer lands in the slot's `i`-th run of `bpc` blocks.
                let blocks: Vec<Vec<u32>> = (0..k)
                    .map(|i| (0..bpc as u32).map(|b| ((slot * k + i) * bpc) as u32 + b).collect())
                    .collect();
                let dst = match &device_dst {
                    Some((dcache, _)) => Destination::new(dcache, blocks.clone()),
                    None => Destination::new(cache.clone(), blocks.clone()).with_path(path),
                };
                let keys: Vec<_> = (c0..c0 + k).map(|c| key(r, c)).collect();
                // Reads landed bytes back (from the sim device's memory on that path).
                let read = |off: usize, len: usize| -> Vec<u8> {
                    match &device_dst {
                        Some((_, buf)) => buf.to_vec(off, len).expect("in range"),
                        None => region.to_vec(off, len).expect("in range"),
                    }
                };
                let t = Instant::now();
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                match consumer.get(&addr, &keys, dst, deadline).await {
                    Ok(l) if l.chunks == k => {
                        latencies.lock().push(t.elapsed().as_secs_f64() * 1e3);
                        // Verify every landed byte: crc of the landed chunks against the
                        // patterns'; exact count of bad bytes on mismatch (chunk by chunk).
                        let want_all = (c0..c0 + k).fold(0u32, |crc, c| {
                            kvferry::checksum::combine(crc, expected[r][c], chunk_bytes)
                        });
                        let landed_crc = |blocks: &[u32]| -> u32 {
                            let mut crc = 0u32;
                            for (off, len) in layout.chunk_ranges(blocks).expect("valid blocks") {
                                let piece = match &device_dst {
                                    Some(_) => kvferry::checksum::checksum(&read(off, len)),
                                    None => region.checksum(off, len).expect("in range"),
                                };
                                crc = kvferry::checksum::combine(crc, piece, len);
                            }
                            crc
                        };
                        let crc = if from_receive {
                            l.checksum
                        } else {
                            blocks.iter().fold(0u32, |crc, b| {
                                kvferry::checksum::combine(crc, landed_crc(b), chunk_bytes)
                            })
                        };
                        if crc != want_all {
                            let mut bad = 0u64;
                            for (i, b) in blocks.iter().enumerate() {
                                let want = pattern(r, c0 + i, chunk_bytes);
                                let mut at = 0;
                                for (off, len) in layout.chunk_ranges(b).expect("valid blocks") {
                                    let got = read(off, len);
                                    bad += got.iter().zip(&want[at..at + len]).filter(|(a, b)| a != b).count() as u64;
                                    at += len;
                                }
                            }
                            corrupted.fetch_add(bad.max(1), Ordering::Relaxed);
                        }
                    }
                    Ok(_) => {
                        errors.fetch_add(k as u64, Ordering::Relaxed);
                    }
                    Err(f) => {
                        errors.fetch_add(k as u64, Ordering::Relaxed);
                        tracing::warn!("transfer failed: {}", f.error);
                        // The destination slot is reused only after the drain.
                        f.fence.wait().await;
                    }
                }
                bar.inc((k * chunk_bytes) as u64);
                slots.lock().push_back(slot);
                drop(permit);
            });
            while let Some(r) = tasks.try_join_next() {
                r?;
            }
        }
        while let Some(r) = tasks.join_next().await {
            r?;
        }
        let round_s = started.elapsed().as_secs_f64();
        transfer_usage += cpu.usage() - usage_started;
        perf_phase("transfer", false);
        elapsed += round_s;
        let landed = (end_chunk - first_chunk - (errors.load(Ordering::Relaxed) - errors_before)) * chunk_bytes as u64;
        let g = landed as f64 / round_s / 1e9;
        round_gbps.push(g);
        best_round = best_round.max(g);
        let u0 = cpu.usage();
        let destination_bytes = args.slot_count(chunk_bytes) * k * chunk_bytes;
        perf_phase("tcp", true);
        tcp = tcp.max(tcp_limit(conns, limit_bytes, Some((&source, chunk_bytes, destination_bytes))).await?);
        perf_phase("tcp", false);
        tcp_usage += cpu.usage() - u0;
        tcp_hot = tcp_hot.max(tcp_limit(conns, limit_bytes, None).await?);
        if let (Some(best), Some(best_verified)) = (cma, cma_verified) {
            let chunks = producers.limit_chunks.clone();
            let pid = producers.pid;
            let limit = |verify| {
                tokio::task::block_in_place(|| {
                    cma_limit(
                        pid,
                        &chunks,
                        cma_threads,
                        args.slot_count(chunk_bytes) * k,
                        limit_bytes,
                        verify,
                    )
                })
            };
            let unverified = limit(false);
            perf_phase("cma", true);
            let verified = limit(true);
            perf_phase("cma", false);
            (cma, cma_verified) = match (unverified, verified) {
                (Ok(g), Ok(v)) => (Some(best.max(g)), Some(best_verified.max(v))),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!("one-copy limit not measured: {e:#}");
                    (None, None)
                }
            };
        }
    }
    let rss_end = rss_mib();
    bar.finish_and_clear();
    let moved = (total_chunks - errors.load(Ordering::Relaxed)) * chunk_bytes as u64;
    let latencies_ms = latencies.lock().clone();
    Ok(Rounds {
        total_chunks,
        rounds,
        elapsed,
        round_gbps,
        best_round,
        tcp,
        tcp_hot,
        tcp_usage,
        transfer_usage,
        errors: errors.load(Ordering::Relaxed),
        corrupted: corrupted.load(Ordering::Relaxed),
        latencies: latencies_ms,
        rss_warm,
        rss_end,
        limit_bytes,
        conns,
        source,
        src_layout,
        from_receive,
        moved,
        cma_limit: cma,
        cma_verified_limit: cma_verified,
        cma_threads,
    })
}
