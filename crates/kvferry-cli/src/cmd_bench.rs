//! `kvferry bench`: benchmarks that report ratios against a limit measured in the same
//! run.

use clap::{Args, Subcommand};

#[path = "cmd_bench/copy.rs"]
mod copy;
#[path = "cmd_bench/device.rs"]
mod device;

/// Benchmark options.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = false)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchWhat>,
}

#[derive(Subcommand, Debug)]
enum BenchWhat {
    /// Copy engine vs single-thread memcpy: 1 GiB contiguous (1 MiB segments) and
    /// 1 GiB gathered from randomly placed 32 KiB segments.
    Copy(copy::CopyBenchArgs),
    /// Device layer: CPU cost of a 1 s wait on a pending event, wake-up latency
    /// (p50/p99) per backend, and host-backend D2H/H2D vs single-thread memcpy.
    Device(device::DeviceBenchArgs),
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        Some(BenchWhat::Copy(a)) => copy::run(a),
        Some(BenchWhat::Device(a)) => device::run(a),
        None => copy::run(copy::CopyBenchArgs::default()),
    }
}
