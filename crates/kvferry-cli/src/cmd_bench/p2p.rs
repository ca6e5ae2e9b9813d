//! `kvferry bench` (the main job): producers and a consumer in one process over real
//! loopback sockets. Producers are filled with a model preset's KV for many requests,
//! each request with its own byte pattern; the consumer pulls them through host staging
//! with many transfers in flight and verifies every landed byte (a crc32c of the landed
//! chunk against the pattern's, and an exact comparison on mismatch — another request's
//! bytes are caught). The limit is raw loopback TCP measured in the same run: plain
//! sockets moving the same bytes (as much memory as the producers hold, chunk by chunk)
//! over the same number of connections. Also reported: TCP from one hot 4 MiB buffer,
//! memcpy, and the staged-pipeline limit (see `limits`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvferry::device::{Device, DeviceBuffer, DeviceKvCache, SimConfig, SimDevice};
use kvferry::engine::Engine;
use kvferry::layout::{Arrangement, KvCache, KvLayout};
use kvferry::mem::{ByteSize, Region};
use kvferry::peer::{Destination, TransferPath};
use kvferry::wire::ChunkKey;
use serde::Serialize;
use tokio::sync::Semaphore;

use super::cpu::{per_chunk, per_gb, Contention, CpuClock};
use super::limits::{memcpy_limit, pipeline_limit, tcp_limit};
use crate::engine_args::EngineArgs;
use crate::util::parse_model;

/// Parser of counts that must be at least 1 (zero is refused with exit status 2).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Options for the transfer benchmark.
#[derive(Args, Debug, Clone)]
pub struct P2pBenchArgs {
    /// Model preset giving the KV layout (llama3-8b: 2 MiB per block; llama3-70b-tp8:
    /// 640 KiB per block).
    #[arg(long, default_value = "llama3-70b-tp8", value_parser = parse_model)]
    pub model: String,
    /// Blocks per chunk (chunk size = blocks × block size; 4 × 640 KiB = 2.5 MiB)
    /// [default: 4; under --sweep, when not given: 1, 2, 4 and 6].
    #[arg(long = "blocks-per-chunk", value_name = "BLOCKS", value_parser = clap::value_parser!(u32).range(1..))]
    pub blocks_per_chunk_arg: Option<u32>,
    /// `--blocks-per-chunk` as run (set from the flag by `run`, or by the sweep).
    #[arg(skip = 4u32)]
    pub blocks_per_chunk: u32,
    /// Requests (distinct byte patterns) held by the producers.
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    pub requests: usize,
    /// Chunks per request.
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    pub chunks_per_request: usize,
    /// Total bytes to move (under --sweep: per point, at most 1GiB).
    #[arg(long, default_value = "4GiB")]
    pub bytes: ByteSize,
    /// Transfers in flight at once [default: 4; under --sweep, when not given: 1, 4
    /// and 16].
    #[arg(long = "in-flight", value_name = "N", value_parser = at_least_one)]
    pub in_flight_arg: Option<usize>,
    /// `--in-flight` as run (set from the flag by `run`, or by the sweep).
    #[arg(skip = 4usize)]
    pub in_flight: usize,
    /// Connections per producer (transfers are striped over them; used at every point
    /// of a sweep).
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    pub connections: usize,
    /// Producer instances.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub producers: usize,
    /// Copy threads per engine (default: available cores).
    #[arg(long)]
    pub copy_threads: Option<usize>,
    /// How KV moves: `direct` (zero copy: producers publish blocks of their KV cache and
    /// the socket writes from them; the consumer's socket reads straight into its
    /// destination blocks), `staged` (producers copy chunks into staging pages before
    /// advertising them; the consumer receives into staging pages, then lands them), or
    /// `device-sim` (KV in simulated device memory on both sides: device-to-host gather
    /// into staging, socket, host-to-device scatter; every byte still verified).
    #[arg(long, default_value = "direct")]
    pub path: BenchPath,
    /// Run a sweep instead of one point: chunk sizes of 1, 2, 4 and 6 blocks × 1, 4 and
    /// 16 transfers in flight, up to 1GiB per point. --blocks-per-chunk or --in-flight,
    /// when given, fix that dimension and only the other is swept (both given: one
    /// point). --connections, --producers, --path and --model apply to every point. The
    /// summary reports the best point and the range over all points.
    #[arg(long)]
    pub sweep: bool,
    /// Draw throughput against chunk size and transfers in flight, with the measured
    /// TCP and memcpy limits, into this SVG file (implies --sweep).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
    /// Run every connection over mutual TLS (rustls with ring, TLS 1.3 AES-256-GCM),
    /// with a CA and certificates generated in memory for the run; compare with the
    /// same command without --tls.
    #[arg(long)]
    pub tls: bool,
    /// Contention mode: run the point twice in this invocation, first alone, then with
    /// N busy threads beside it (each computes crc32c over its own 256 KiB buffer in a
    /// loop, standing for the other work of an inference host; they stop when the
    /// point ends), and report both (JSON: the second under `contended`). Their CPU is
    /// left out of the benchmark's CPU per GB. With --sweep, every point runs with them.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub contend: usize,
    /// How every landed byte is verified against its request's pattern: `receive`
    /// (direct path: the crc32c the receive path computed over the destination blocks
    /// as each piece arrived, combined, compared with the pattern's — no second pass
    /// over the bytes; staged and device-sim paths, whose receive checksums are taken
    /// in staging pages, re-read the landed chunk as with `reread`) or `reread`
    /// (checksum the landed chunk again after the transfer).
    #[arg(long, default_value = "receive")]
    pub verify: Verify,
    /// Print JSON (one object; an array with --sweep) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl Default for P2pBenchArgs {
    fn default() -> Self {
        P2pBenchArgs {
            model: "llama3-70b-tp8".into(),
            blocks_per_chunk_arg: None,
            blocks_per_chunk: 4,
            requests: 32,
            chunks_per_request: 4,
            bytes: ByteSize(4 << 30),
            in_flight_arg: None,
            in_flight: 4,
            connections: 4,
            producers: 1,
            copy_threads: None,
            path: BenchPath::Direct,
            sweep: false,
            plot: None,
            tls: false,
            contend: 0,
            verify: Verify::Receive,
            json: false,
            quiet: false,
        }
    }
}

/// One measured point.
#[derive(Serialize, Debug, Clone)]
pub struct Point {
    pub model: String,
    /// `direct` or `staged` (see `--path`).
    pub path: BenchPath,
    /// Whether connections ran over mutual TLS (`--tls`).
    pub tls: bool,
    pub chunk_bytes: usize,
    pub in_flight: usize,
    pub connections: usize,
    pub producers: usize,
    pub chunks: u64,
    pub bytes: u64,
    /// Seconds the transfer rounds took together.
    pub elapsed_s: f64,
    /// Bytes landed and verified over `elapsed_s` (all rounds together).
    pub gbps: f64,
    /// Each transfer round's GB/s (a third of the chunks each, in order).
    pub round_gbps: Vec<f64>,
    /// The best round's GB/s: what `ratio` compares with the best raw-TCP run.
    pub best_round_gbps: f64,
    /// Raw loopback TCP moving the same bytes: plain sockets sending the producers'
    /// amount of memory chunk by chunk (as cold in cache as the transfers' data).
    pub tcp_limit_gbps: f64,
    /// Raw loopback TCP re-sending one 4 MiB buffer that stays in cache (for reference:
    /// the most flattering figure loopback gives).
    pub tcp_hot_limit_gbps: f64,
    /// `best_round_gbps / tcp_limit_gbps`: the best of 3 transfer rounds against the best
    /// of 3 raw-TCP runs, interleaved (round, run, round, run, …).
    pub ratio: f64,
    /// `gbps / tcp_limit_gbps`: all rounds together against the best raw-TCP run (the
    /// ratio as this benchmark defined it until 2026-12-03; lower by the noise).
    pub ratio_overall: f64,
    pub memcpy_gbps: f64,
    /// The staged pipeline's limit: the design's mandatory copies (gather, socket,
    /// landing) in plain code, same chunks and connections, no checksums.
    pub pipeline_limit_gbps: f64,
    /// `gbps / pipeline_limit_gbps`: what kvferry's own machinery costs.
    pub pipeline_ratio: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub errors: u64,
    pub corrupted_bytes: u64,
    pub leaked_pages: u64,
    /// Process resident memory after the first tenth of the transfers (warm-up), MiB.
    pub rss_warm_mib: f64,
    /// Process resident memory after the last transfer, MiB: flat against
    /// `rss_warm_mib` means nothing grows per transfer.
    pub rss_end_mib: f64,
    /// Backing of the staging arenas (consumer's and producers'), e.g.
    /// `mmap+mlock (pinned)`; the least pinned one when they differ.
    pub staging_backing: String,
    /// Whether every staging arena is pinned (page-locked).
    pub staging_pinned: bool,
    /// The crc32c implementation this process checksums with (`fold-clmul`,
    /// `fold-avx2` or `crc32-instruction`; chosen per CPU, `KVFERRY_CRC32C` forces one).
    pub checksum_impl: String,
    /// Why staging is not pinned, when it is not (e.g. `RLIMIT_MEMLOCK` too low).
    pub staging_fallback: Option<String>,
    /// CPU seconds (user + system, every thread of the benchmark, contention threads
    /// left out) per GB over the transfer phase.
    pub cpu_s_per_gb: f64,
    /// The same over the raw-TCP (same bytes) phase.
    pub tcp_cpu_s_per_gb: f64,
    /// `cpu_s_per_gb / tcp_cpu_s_per_gb`: what kvferry spends per byte beyond sockets.
    pub cpu_ratio: f64,
    /// Busy threads beside this point (`--contend`; 0: alone).
    pub contend: usize,
    /// How landed bytes were verified (`--verify`; `receive` on the staged and
    /// device-sim paths re-reads, see there).
    pub verify: Verify,
    /// Voluntary context switches (a benchmark thread blocked, then woken) per chunk
    /// over the transfer phase: the wake-ups and thread hand-offs a transfer costs,
    /// producer and consumer together.
    pub wakeups_per_chunk: f64,
    /// Involuntary context switches (a benchmark thread preempted) per chunk.
    pub preemptions_per_chunk: f64,
    /// Voluntary context switches of the raw-TCP phase per chunk-sized write.
    pub tcp_wakeups_per_chunk: f64,
    /// With `--contend N`: the same point measured again with N busy threads beside it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contended: Option<Box<Point>>,
}

fn word(req: usize, chunk: usize, i: usize) -> u64 {
    let mut x = ((req as u64) << 40) ^ ((chunk as u64) << 32) ^ i as u64 ^ 0x9E37_79B9_7F4A_7C15;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The request's pattern: differs in every 8-byte word across requests and chunks.
fn pattern(req: usize, chunk: usize, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    for i in 0..len.div_ceil(8) {
        v.extend_from_slice(&word(req, chunk, i).to_le_bytes());
    }
    v.truncate(len);
    v
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

fn key(req: usize, chunk: usize) -> ChunkKey {
    ChunkKey::from_name(&format!("bench/req{req}/chunk{chunk}"))
}

/// The sweep's points `(blocks per chunk, transfers in flight)`: the dimensions given on
/// the command line are fixed, the others take the sweep's values.
fn sweep_plan(args: &P2pBenchArgs) -> Vec<(u32, usize)> {
    let bpcs = match args.blocks_per_chunk_arg {
        Some(b) => vec![b],
        None => vec![1, 2, 4, 6],
    };
    let inflights = match args.in_flight_arg {
        Some(n) => vec![n],
        None => vec![1, 4, 16],
    };
    bpcs.iter()
        .flat_map(|&b| inflights.iter().map(move |&n| (b, n)))
        .collect()
}

pub fn run(mut args: P2pBenchArgs) -> anyhow::Result<()> {
    if let Some(b) = args.blocks_per_chunk_arg {
        args.blocks_per_chunk = b;
    }
    if let Some(n) = args.in_flight_arg {
        args.in_flight = n;
    }
    anyhow::ensure!(args.in_flight >= 1, "--in-flight must be at least 1");
    anyhow::ensure!(args.connections >= 1, "--connections must be at least 1");
    anyhow::ensure!(args.producers >= 1, "--producers must be at least 1");
    anyhow::ensure!(
        args.requests >= 1 && args.chunks_per_request >= 1,
        "--requests and --chunks-per-request must be at least 1"
    );
    anyhow::ensure!(args.blocks_per_chunk >= 1, "--blocks-per-chunk must be at least 1");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let sweep = args.sweep || args.plot.is_some();
    let points = if sweep {
        let plan = sweep_plan(&args);
        let per_point = ByteSize(args.bytes.bytes().min(1 << 30));
        if !args.json {
            let fixed = |given: bool| if given { " (given)" } else { "" };
            let mut bpcs: Vec<u32> = plan.iter().map(|p| p.0).collect();
            bpcs.dedup();
            let mut ifs: Vec<usize> = plan.iter().map(|p| p.1).collect();
            ifs.sort_unstable();
            ifs.dedup();
            eprintln!(
                "sweep: {}: {} blocks per chunk{} x {} in flight{}; {} connection(s) per producer, \
                 {} producer(s), path {}, {} per point",
                points_word(plan.len()),
                join(&bpcs),
                fixed(args.blocks_per_chunk_arg.is_some()),
                join(&ifs),
                fixed(args.in_flight_arg.is_some()),
                args.connections,
                args.producers,
                args.path,
                per_point
            );
        }
        let mut pts = Vec::new();
        for (bpc, inflight) in plan {
            let mut a = args.clone();
            a.blocks_per_chunk = bpc;
            a.in_flight = inflight;
            a.bytes = per_point;
            a.quiet = true;
            let busy = Contention::start(args.contend);
            let p = on_workers(&rt, &a, busy.clock(), busy.threads())?;
            drop(busy);
            if !args.json {
                eprintln!(
                    "  chunk {:>9}  in flight {:>2}: {:.2} GB/s ({:.2} of raw TCP moving the same bytes, \
                     {:.2} of the staged pipeline)",
                    ByteSize(p.chunk_bytes as u64).to_string(),
                    inflight,
                    p.gbps,
                    p.ratio,
                    p.pipeline_ratio
                );
            }
            pts.push(p);
        }
        pts
    } else {
        let mut p = on_workers(&rt, &args, CpuClock::default(), 0)?;
        if args.contend > 0 {
            let busy = Contention::start(args.contend);
            let q = on_workers(&rt, &args, busy.clock(), busy.threads())?;
            drop(busy);
            p.contended = Some(Box::new(q));
        }
        vec![p]
    };
    if let Some(path) = &args.plot {
        std::fs::write(path, super::plot::svg(&points)).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    if args.json {
        if sweep {
            println!("{}", serde_json::to_string_pretty(&points)?);
        } else {
            println!("{}", serde_json::to_string_pretty(&points[0])?);
        }
    } else {
        print_table(&points);
        if sweep {
            print_sweep_summary(&points);
        } else {
            print_point_summary(&points[0]);
        }
    }
    let bad: Vec<&Point> = points
        .iter()
        .flat_map(|p| std::iter::once(p).chain(p.contended.as_deref()))
        .filter(|p| p.corrupted_bytes > 0 || p.leaked_pages > 0)
        .collect();
    anyhow::ensure!(
        bad.is_empty(),
        "integrity failure: {} point(s) with corrupted bytes or leaked pages",
        bad.len()
    );
    Ok(())
}

fn points_word(n: usize) -> String {
    format!("{n} point{}", if n == 1 { "" } else { "s" })
}

fn join<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// Transfer rounds per point, each followed by one raw-TCP run of the limit.
const ROUNDS: u64 = 3;

/// The ratio kvferry aims at (docs/benchmarks.md, "Against the target").
const TARGET_RATIO: f64 = 0.85;

fn print_table(points: &[Point]) {
    println!(
        "{:>10} {:>9} {:>6} {:>8} {:>9} {:>7} {:>10} {:>8} {:>8} {:>7} {:>9} {:>7}",
        "chunk",
        "in-flight",
        "conns",
        "GB/s",
        "TCP GB/s",
        "ratio",
        "pipe GB/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "corrupted",
        "leaked"
    );
    for p in points {
        println!(
            "{:>10} {:>9} {:>6} {:>8.2} {:>9.2} {:>7.2} {:>10.2} {:>8.2} {:>8.2} {:>7} {:>9} {:>7}",
            ByteSize(p.chunk_bytes as u64).to_string(),
            p.in_flight,
            p.connections,
            p.gbps,
            p.tcp_limit_gbps,
            p.ratio,
            p.pipeline_limit_gbps,
            p.p50_ms,
            p.p99_ms,
            p.errors,
            p.corrupted_bytes,
            p.leaked_pages
        );
    }
}

/// How the benchmark verifies landed bytes (`--verify`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Verify {
    /// The receive path's checksums (direct path), combined.
    Receive,
    /// Checksum the landed chunk again.
    Reread,
}

/// How the benchmark's KV moves (`--path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchPath {
    /// Producers publish host blocks; sockets write from and read into KV blocks.
    Direct,
    /// Store chunks copied into staging pages; received into staging pages, landed.
    Staged,
    /// KV in (simulated) device memory on both sides: device-to-host gather into
    /// staging, socket, staging, host-to-device scatter.
    DeviceSim,
}

impl std::str::FromStr for BenchPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "direct" => Ok(BenchPath::Direct),
            "staged" => Ok(BenchPath::Staged),
            "device-sim" => Ok(BenchPath::DeviceSim),
            _ => Err(format!("unknown path {s:?} (expected direct, staged or device-sim)")),
        }
    }
}

impl std::fmt::Display for BenchPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BenchPath::Direct => "direct",
            BenchPath::Staged => "staged",
            BenchPath::DeviceSim => "device-sim",
        })
    }
}

/// `path direct (zero copy); staging mmap+mlock (pinned)` or, when not pinned, why.
fn setup_line(p: &Point) -> String {
    let path = match p.path {
        BenchPath::Staged => "staged (through staging pages on both sides)",
        BenchPath::DeviceSim => "device-sim (sim device memory on both sides, through staging pages)",
        BenchPath::Direct => "direct (zero copy: sockets read and write the KV blocks)",
    };
    let bypass = if p.path == BenchPath::Direct {
        "; the direct path bypasses it"
    } else {
        ""
    };
    let staging = match &p.staging_fallback {
        None if p.staging_pinned => format!("staging memory pinned ({}{bypass})", p.staging_backing),
        None => format!("staging memory NOT pinned ({}{bypass})", p.staging_backing),
        Some(why) => format!(
            "staging memory NOT pinned ({}: {why}; `ulimit -l unlimited` fixes it{bypass})",
            p.staging_backing
        ),
    };
    let tls = if p.tls {
        "; over mutual TLS (TLS 1.3, AES-256-GCM; the raw TCP limits are plaintext)"
    } else {
        ""
    };
    format!("path {path}{tls}; {staging}; crc32c: {}", p.checksum_impl)
}

/// What a ratio to same-bytes raw TCP means.
const CEILING: &str = "1.00 is the ceiling: kvferry costing nothing over plain sockets \
                       (no framing, checksums or copies)";

fn print_point_summary(p: &Point) {
    print_one_point(p);
    if let Some(q) = &p.contended {
        println!();
        println!("the same with {} busy thread(s) beside it (--contend):", q.contend);
        print_one_point(q);
        println!(
            "contention costs {:.0} % of throughput (raw TCP: {:.0} %); ratio {:.2} alone, {:.2} contended",
            (1.0 - q.gbps / p.gbps) * 100.0,
            (1.0 - q.tcp_limit_gbps / p.tcp_limit_gbps) * 100.0,
            p.ratio,
            q.ratio
        );
    }
}

fn print_one_point(p: &Point) {
    println!("{}", setup_line(p));
    println!(
        "moved {} in {} chunks over loopback, every byte verified: {:.2} GB/s",
        ByteSize(p.bytes),
        p.chunks,
        p.gbps
    );
    println!(
        "ratio {:.2} of raw TCP moving the same bytes: best of {} rounds {:.2} GB/s against best of {} raw TCP runs \
         {:.2} GB/s over {} connection(s), interleaved (all rounds together: {:.2})",
        p.ratio,
        p.round_gbps.len(),
        p.best_round_gbps,
        p.round_gbps.len(),
        p.tcp_limit_gbps,
        p.connections * p.producers,
        p.ratio_overall,
    );
    println!(
        "  {CEILING}; target >= {TARGET_RATIO:.2}: {}",
        if p.ratio >= TARGET_RATIO { "met" } else { "not met" }
    );
    println!(
        "CPU {:.3} s per GB moved (raw TCP {:.3} s per GB: {:.2}x; user + system, every thread of the benchmark)",
        p.cpu_s_per_gb, p.tcp_cpu_s_per_gb, p.cpu_ratio
    );
    println!(
        "wake-ups {:.1} per chunk (raw TCP {:.1} per chunk-sized write), preemptions {:.1} per chunk; \
         landed bytes verified by {}",
        p.wakeups_per_chunk,
        p.tcp_wakeups_per_chunk,
        p.preemptions_per_chunk,
        match p.verify {
            Verify::Receive => "the receive path's checksums of the destination blocks",
            Verify::Reread => "re-reading every landed chunk",
        }
    );
    println!(
        "staged-pipeline limit {:.2} GB/s (the staged design's copies alone in plain code, {:.2} of raw TCP); \
         kvferry reaches {:.2} of it",
        p.pipeline_limit_gbps,
        p.pipeline_limit_gbps / p.tcp_limit_gbps,
        p.pipeline_ratio
    );
    println!(
        "for reference: raw TCP from one hot 4 MiB buffer {:.2} GB/s (kvferry {:.2} of it; the most flattering \
         loopback figure); single-thread memcpy {:.2} GB/s",
        p.tcp_hot_limit_gbps,
        p.gbps / p.tcp_hot_limit_gbps,
        p.memcpy_gbps
    );
}

/// `lo–hi` of `f` over the points, with `digits` decimals.
fn range(points: &[Point], f: impl Fn(&Point) -> f64) -> String {
    let lo = points.iter().map(&f).fold(f64::INFINITY, f64::min);
    let hi = points.iter().map(&f).fold(f64::NEG_INFINITY, f64::max);
    if (hi - lo).abs() < 0.005 {
        format!("{lo:.2}")
    } else {
        format!("{lo:.2}-{hi:.2}")
    }
}

fn print_sweep_summary(points: &[Point]) {
    let Some(best) = points.iter().max_by(|a, b| a.gbps.total_cmp(&b.gbps)) else {
        return;
    };
    let moved: u64 = points.iter().map(|p| p.bytes).sum();
    let chunks: u64 = points.iter().map(|p| p.chunks).sum();
    let met = points.iter().filter(|p| p.ratio >= TARGET_RATIO).count();
    // Staging is reported as the least pinned point's.
    let setup = points
        .iter()
        .find(|p| !p.staging_pinned)
        .map_or_else(|| setup_line(best), setup_line);
    println!("sweep of {}; {setup}", points_word(points.len()));
    println!(
        "moved {} in {} chunks over loopback in all, every byte verified",
        ByteSize(moved),
        chunks
    );
    println!(
        "best point: {:.2} GB/s at {} chunks, {} in flight = {:.2} of raw TCP moving the same bytes ({:.2} GB/s)",
        best.gbps,
        ByteSize(best.chunk_bytes as u64),
        best.in_flight,
        best.ratio,
        best.tcp_limit_gbps
    );
    println!(
        "over all points: {} GB/s; ratio {} of raw TCP moving the same bytes; {} of the staged pipeline; \
         p99 {} ms",
        range(points, |p| p.gbps),
        range(points, |p| p.ratio),
        range(points, |p| p.pipeline_ratio),
        range(points, |p| p.p99_ms)
    );
    println!(
        "limits measured at each point: raw TCP (same bytes) {} GB/s, staged pipeline {} GB/s, \
         raw TCP from a hot buffer {} GB/s, memcpy {} GB/s",
        range(points, |p| p.tcp_limit_gbps),
        range(points, |p| p.pipeline_limit_gbps),
        range(points, |p| p.tcp_hot_limit_gbps),
        range(points, |p| p.memcpy_gbps)
    );
    println!(
        "  {CEILING}; target >= {TARGET_RATIO:.2}: met at {met} of {}",
        points_word(points.len())
    );
}

/// Runs one point as a task on the runtime's worker threads. The point's dispatch loop
/// (take a permit, spawn the next transfer) wakes once per landed chunk: driven from
/// `block_on` it would run on the main thread, a third thread beside the two workers,
/// and every chunk would cost a hand-off to it that the raw-TCP limit (whose driver only
/// joins its tasks) does not pay.
fn on_workers(
    rt: &tokio::runtime::Runtime,
    args: &P2pBenchArgs,
    cpu: CpuClock,
    contend: usize,
) -> anyhow::Result<Point> {
    let args = args.clone();
    rt.block_on(async move { tokio::spawn(async move { run_point(&args, &cpu, contend).await }).await? })
}

async fn run_point(args: &P2pBenchArgs, cpu: &CpuClock, contend: usize) -> anyhow::Result<Point> {
    let probe = EngineArgs {
        model: args.model.clone(),
        blocks: 1,
        ..EngineArgs::default()
    };
    let block_bytes = probe.layout(Arrangement::LayerSeparate)?.block_bytes();
    let bpc = args.blocks_per_chunk as usize;
    let chunk_bytes = block_bytes * bpc;
    let per_producer_reqs = args.requests.div_ceil(args.producers);
    let staging_page: usize = 1 << 20;
    let staged = args.path == BenchPath::Staged;
    let on_device = args.path == BenchPath::DeviceSim;
    let producer_blocks = (per_producer_reqs * args.chunks_per_request * bpc) as u32;
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
    let ca = match args.tls {
        true => Some(super::tls::EphemeralCa::new()?),
        false => None,
    };
    let mut producers = Vec::new();
    for i in 0..args.producers {
        let name = format!("bench-producer-{i}");
        let mut cfg = pnode.config(Some("127.0.0.1:0"), &name)?;
        if let Some(ca) = &ca {
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

    // Consumer: one destination slot per transfer in flight.
    let layout = KvLayout::preset(
        args.model.parse()?,
        (args.in_flight * bpc) as u32,
        Arrangement::FullyContiguous,
    )?;
    let region = Arc::new(Region::host("bench-consumer", layout.region_bytes())?);
    // Resident before the first round, like a serving engine's KV cache (else the first
    // round pays the page faults of first touch and the rounds are not alike).
    region.fill(0, region.len(), 0)?;
    let cache = Arc::new(KvCache::with_layout(region.clone(), &layout)?);
    // On the device-sim path the destination is sim device memory of the same shape.
    let device_dst: Option<(Arc<DeviceKvCache>, DeviceBuffer)> = if on_device {
        let dev: Arc<dyn Device> = SimDevice::new(SimConfig::new(99))?;
        let buf = dev.alloc(layout.region_bytes())?;
        let spans = kvferry::layout::BlockMap::from_layout(&layout).spans().to_vec();
        let c = DeviceKvCache::new(
            "bench-consumer",
            dev,
            vec![(buf.clone(), spans)],
            layout.blocks,
            Duration::from_secs(10),
        )?;
        Some((Arc::new(c), buf))
    } else {
        None
    };
    let consumer_pages = if staged || on_device {
        args.in_flight * chunk_bytes.div_ceil(staging_page)
    } else {
        1
    };
    let cnode = EngineArgs {
        model: args.model.clone(),
        blocks: 1,
        arena: ByteSize((consumer_pages * staging_page) as u64),
        page_size: ByteSize(staging_page as u64),
        copy_threads: args.copy_threads,
        ..EngineArgs::default()
    };
    let mut ccfg = cnode.config(None, "bench-consumer")?;
    ccfg.net.connections_per_peer = args.connections;
    if let Some(ca) = &ca {
        ccfg.net.tls = Some(ca.node("bench-consumer")?);
    }
    let consumer = Engine::start(ccfg).await?;
    let arena = consumer.arena().clone();
    let path = if staged {
        TransferPath::Staged
    } else {
        TransferPath::Direct
    };

    let total_chunks = (args.bytes.bytes() as usize / chunk_bytes).max(1) as u64;
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
    let slots = Arc::new(parking_lot::Mutex::new((0..args.in_flight).collect::<Vec<usize>>()));
    let sem = Arc::new(Semaphore::new(args.in_flight));
    let errors = Arc::new(AtomicU64::new(0));
    let corrupted = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(parking_lot::Mutex::new(Vec::with_capacity(total_chunks as usize)));
    let expected = Arc::new(expected);
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
    let source: Arc<Vec<u8>> = Arc::new(super::limits::huge_source(src_layout.region_bytes()));
    let mut tcp = 0f64;
    let mut tcp_hot = 0f64;
    let mut tcp_usage = super::cpu::Usage::default();
    let mut elapsed = 0f64;
    let mut best_round = 0f64;
    let mut round_gbps = Vec::new();
    let mut transfer_usage = super::cpu::Usage::default();
    let rounds = ROUNDS.min(total_chunks);
    // Direct path with `--verify receive`: the receive path's checksum of the landed
    // bytes (taken over the destination blocks themselves) is compared as is.
    let from_receive = args.verify == Verify::Receive && args.path == BenchPath::Direct;
    let mut rss_warm = 0.0;
    for round in 0..rounds {
        let first_chunk = total_chunks * round / rounds;
        let end_chunk = total_chunks * (round + 1) / rounds;
        let errors_before = errors.load(Ordering::Relaxed);
        super::cpu::perf_phase("transfer", true);
        let started = Instant::now();
        let usage_started = cpu.usage();
        let mut tasks = tokio::task::JoinSet::new();
        for n in first_chunk..end_chunk {
            if n == total_chunks / 10 {
                rss_warm = rss_mib();
            }
            let permit = sem.clone().acquire_owned().await?;
            let slot = slots.lock().pop().expect("a slot per permit");
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
            let r = (n as usize / args.chunks_per_request) % args.requests;
            let c = n as usize % args.chunks_per_request;
            let addr = addrs[r % args.producers].clone();
            tasks.spawn(async move {
                let blocks: Vec<u32> = (0..bpc as u32).map(|b| (slot * bpc) as u32 + b).collect();
                let dst = match &device_dst {
                    Some((dcache, _)) => Destination::new(dcache, vec![blocks.clone()]),
                    None => Destination::new(cache.clone(), vec![blocks.clone()]).with_path(path),
                };
                // Reads landed bytes back (from the sim device's memory on that path).
                let read = |off: usize, len: usize| -> Vec<u8> {
                    match &device_dst {
                        Some((_, buf)) => buf.to_vec(off, len).expect("in range"),
                        None => region.to_vec(off, len).expect("in range"),
                    }
                };
                let t = Instant::now();
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                match consumer.get(&addr, &[key(r, c)], dst, deadline).await {
                    Ok(l) if l.chunks == 1 => {
                        latencies.lock().push(t.elapsed().as_secs_f64() * 1e3);
                        // Verify every landed byte: crc of the landed chunk against the
                        // pattern's; exact count of bad bytes on mismatch.
                        let ranges = layout.chunk_ranges(&blocks).expect("valid blocks");
                        let crc = if from_receive {
                            l.checksum
                        } else {
                            let mut crc = 0u32;
                            for (off, len) in &ranges {
                                let piece = match &device_dst {
                                    Some(_) => kvferry::checksum::checksum(&read(*off, *len)),
                                    None => region.checksum(*off, *len).expect("in range"),
                                };
                                crc = kvferry::checksum::combine(crc, piece, *len);
                            }
                            crc
                        };
                        if crc != expected[r][c] {
                            let want = pattern(r, c, chunk_bytes);
                            let mut at = 0;
                            let mut bad = 0u64;
                            for (off, len) in &ranges {
                                let got = read(*off, *len);
                                bad += got.iter().zip(&want[at..at + len]).filter(|(a, b)| a != b).count() as u64;
                                at += len;
                            }
                            corrupted.fetch_add(bad.max(1), Ordering::Relaxed);
                        }
                    }
                    Ok(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(f) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!("transfer failed: {}", f.error);
                        // The destination slot is reused only after the drain.
                        f.fence.wait().await;
                    }
                }
                bar.inc(chunk_bytes as u64);
                slots.lock().push(slot);
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
        super::cpu::perf_phase("transfer", false);
        elapsed += round_s;
        let landed = (end_chunk - first_chunk - (errors.load(Ordering::Relaxed) - errors_before)) * chunk_bytes as u64;
        let g = landed as f64 / round_s / 1e9;
        round_gbps.push(g);
        best_round = best_round.max(g);
        let u0 = cpu.usage();
        super::cpu::perf_phase("tcp", true);
        tcp = tcp.max(tcp_limit(conns, limit_bytes, Some((&source, chunk_bytes))).await?);
        super::cpu::perf_phase("tcp", false);
        tcp_usage += cpu.usage() - u0;
        tcp_hot = tcp_hot.max(tcp_limit(conns, limit_bytes, None).await?);
    }
    let transfer_cpu = transfer_usage.cpu_s;
    let rss_end = rss_mib();
    bar.finish_and_clear();
    let moved = (total_chunks - errors.load(Ordering::Relaxed)) * chunk_bytes as u64;

    // Staging backing, for the summary: the least pinned arena's.
    let is_pinned = |a: &kvferry::mem::Arena| a.backing_kind() != kvferry::mem::BackingKind::Unlocked;
    let mut staging = (arena.backing_kind().to_string(), arena.fallback_reason());
    let mut pinned = is_pinned(&arena);
    for p in &producers {
        let a = p.arena();
        if pinned && !is_pinned(a) {
            staging = (a.backing_kind().to_string(), a.fallback_reason());
            pinned = false;
        }
    }
    if let Some(why) = &staging.1 {
        crate::engine_args::note_unpinned(&staging.0, why);
    }

    // Quiesce and account every page of every arena.
    let quiesce = Instant::now() + Duration::from_secs(5);
    let leaked = loop {
        let s = arena.stats();
        let mut leaked = (s.total_pages - s.free_pages - s.quarantined_pages) as u64;
        for p in &producers {
            let s = p.arena().stats();
            leaked += (s.total_pages - s.free_pages - s.quarantined_pages) as u64;
        }
        if leaked == 0 || Instant::now() > quiesce {
            break leaked;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for p in producers {
        p.close(tokio::time::Instant::now() + Duration::from_secs(5)).await;
    }
    consumer
        .close(tokio::time::Instant::now() + Duration::from_secs(5))
        .await;

    let tcp_cpu_s_per_gb = per_gb(tcp_usage.cpu_s, rounds * limit_bytes);
    let tcp_pieces = rounds * limit_bytes / chunk_bytes as u64;
    let memcpy = memcpy_limit(256 << 20);
    let pipeline = tokio::task::block_in_place(|| -> anyhow::Result<f64> {
        let mut best = 0f64;
        for _ in 0..3 {
            best = best.max(pipeline_limit(
                src_layout,
                &source,
                args.blocks_per_chunk,
                conns,
                limit_bytes,
            )?);
        }
        Ok(best)
    })?;
    let mut lat = latencies.lock().clone();
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| {
        if lat.is_empty() {
            0.0
        } else {
            lat[((lat.len() - 1) as f64 * q).round() as usize]
        }
    };
    let gbps = moved as f64 / elapsed / 1e9;
    Ok(Point {
        model: args.model.clone(),
        path: args.path,
        tls: args.tls,
        chunk_bytes,
        in_flight: args.in_flight,
        connections: args.connections,
        producers: args.producers,
        chunks: total_chunks,
        bytes: moved,
        elapsed_s: elapsed,
        gbps,
        tcp_limit_gbps: tcp,
        tcp_hot_limit_gbps: tcp_hot,
        round_gbps,
        best_round_gbps: best_round,
        ratio: best_round / tcp,
        ratio_overall: gbps / tcp,
        memcpy_gbps: memcpy,
        pipeline_limit_gbps: pipeline,
        pipeline_ratio: best_round / pipeline,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        errors: errors.load(Ordering::Relaxed),
        corrupted_bytes: corrupted.load(Ordering::Relaxed),
        leaked_pages: leaked,
        rss_warm_mib: rss_warm,
        rss_end_mib: rss_end,
        cpu_s_per_gb: per_gb(transfer_cpu, moved),
        tcp_cpu_s_per_gb,
        cpu_ratio: if tcp_cpu_s_per_gb > 0.0 {
            per_gb(transfer_cpu, moved) / tcp_cpu_s_per_gb
        } else {
            0.0
        },
        contend,
        verify: if from_receive { Verify::Receive } else { Verify::Reread },
        wakeups_per_chunk: per_chunk(transfer_usage.wakeups, total_chunks),
        preemptions_per_chunk: per_chunk(transfer_usage.preemptions, total_chunks),
        tcp_wakeups_per_chunk: per_chunk(tcp_usage.wakeups, tcp_pieces),
        contended: None,
        staging_backing: staging.0,
        staging_pinned: pinned,
        checksum_impl: kvferry::checksum::backend().name().to_string(),
        staging_fallback: staging.1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_sweeps_only_what_was_not_given() {
        let mut a = P2pBenchArgs::default();
        assert_eq!(sweep_plan(&a).len(), 12);
        a.in_flight_arg = Some(8);
        assert_eq!(sweep_plan(&a), [(1, 8), (2, 8), (4, 8), (6, 8)]);
        a.blocks_per_chunk_arg = Some(3);
        assert_eq!(sweep_plan(&a), [(3, 8)]);
        a.in_flight_arg = None;
        assert_eq!(sweep_plan(&a), [(3, 1), (3, 4), (3, 16)]);
    }
}
