//! `kvferry bench`: benchmarks that report ratios against a limit measured in the same
//! run.

use clap::{Args, Subcommand};

#[path = "cmd_bench/copy.rs"]
mod copy;
#[path = "cmd_bench/cpu.rs"]
mod cpu;
#[path = "cmd_bench/device.rs"]
mod device;
#[path = "cmd_bench/latency.rs"]
mod latency;
#[path = "cmd_bench/limits.rs"]
mod limits;
#[path = "cmd_bench/p2p/mod.rs"]
mod p2p;
#[path = "cmd_bench/plot.rs"]
mod plot;
#[path = "cmd_bench/tls.rs"]
mod tls;

/// Benchmark options. Without a subcommand, runs the end-to-end transfer benchmark
/// (`bench p2p`) with the options given here.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, after_help = AFTER_HELP)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchWhat>,
    #[command(flatten)]
    p2p: p2p::P2pBenchArgs,
}

const AFTER_HELP: &str = "\
What the transfer benchmark prints (one row per point; --json: the same fields):
  GB/s       chunk bytes landed and verified per second (all chunks; they move in 3
             rounds, each followed by one raw-TCP run)
  TCP GB/s   raw loopback TCP moving the same bytes over as many connections, measured
             in the same run (best of 3 runs); ratio = the best transfer round's GB/s /
             TCP GB/s (both sides best of 3, interleaved): 1.00 is the ceiling (no cost
             over plain sockets), the target is 0.85; --json also gives ratio_overall
             (all rounds together / TCP GB/s)
  pipe GB/s  the staged pipeline: gather memcpy + socket + landing memcpy in plain code,
             no checksums (what the design's copies alone cost on this machine)
  p50/p99    per-chunk latency, request to landed in the destination
  errors     transfers that failed (none expected without faults)
  corrupted  bytes that landed wrong; leaked: arena pages not returned afterwards
Under the table: the path (direct or staged), whether staging memory was pinned, the
crc32c implementation checksumming every byte (chosen per CPU: fold-clmul with
AVX-512, fold-avx2 with AVX2 + VPCLMULQDQ, else crc32-instruction;
KVFERRY_CRC32C=NAME forces one, for A/B runs), and the limits in words; after a
sweep, the best point and the range over all points.
The command exits non-zero if any byte was corrupted or any page leaked.
Figures and the machine they were measured on: docs/benchmarks.md";

#[derive(Subcommand, Debug)]
enum BenchWhat {
    /// Copy engine vs single-thread memcpy: 1 GiB contiguous (1 MiB segments) and
    /// 1 GiB gathered from randomly placed 32 KiB segments.
    Copy(copy::CopyBenchArgs),
    /// Device layer: CPU cost of a 1 s wait on a pending event, wake-up latency
    /// (p50/p99) per backend, and host-backend D2H/H2D vs single-thread memcpy.
    Device(device::DeviceBenchArgs),
    /// One transfer at a time between two engines over loopback: the latency of each
    /// (p50, p99) per mover and path; with --publish-delay-ms, a get that reaches the
    /// producer before the key is published, as in disaggregated serving.
    Latency(latency::LatencyBenchArgs),
    /// The end-to-end transfer benchmark (the default): producers and a consumer over
    /// loopback, every byte verified, against raw TCP measured in the same run.
    #[command(after_help = AFTER_HELP)]
    P2p(p2p::P2pBenchArgs),
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        Some(BenchWhat::Copy(a)) => copy::run(a),
        Some(BenchWhat::Device(a)) => device::run(a),
        Some(BenchWhat::Latency(a)) => latency::run(a),
        Some(BenchWhat::P2p(a)) => p2p::run(a),
        None => p2p::run(args.p2p),
    }
}
