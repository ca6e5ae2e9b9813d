//! The `kvferry` command.
//!
//! Each subcommand lives in its own `cmd_*.rs` file; this file only parses arguments
//! and dispatches.

mod cmd_bench;
mod cmd_chaos;
mod cmd_cluster_demo;
mod cmd_peers;
mod cmd_serve;
mod cmd_transfer;
mod cmd_worker;
mod engine_args;
mod serve_config;
mod util;

use clap::{CommandFactory, Parser, Subcommand};

/// kvferry: a cancel-safe KV-cache transfer engine for LLM inference.
///
/// Moves KV cache between engine memory, a pinned host staging arena and peer
/// instances. It never corrupts, leaks or hangs when a transfer is cancelled, times
/// out, or a device or peer stalls.
#[derive(Parser, Debug)]
#[command(
    name = "kvferry",
    version,
    propagate_version = true,
    after_help = "Exit status: 0 on success; 1 when the work failed (the error says why); \
                  2 when a flag, its value or a combination of flags is invalid."
)]
struct Cli {
    /// Log as JSON lines instead of text (filter with RUST_LOG, e.g. RUST_LOG=kvferry=debug).
    #[arg(long, global = true)]
    log_json: bool,

    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Run benchmarks (default: the end-to-end transfer benchmark).
    Bench(cmd_bench::BenchArgs),
    /// Serve KV chunks to peers over TCP (a producer; accepts pushes too).
    #[command(args_override_self = true)]
    Serve(cmd_serve::ServeArgs),
    /// Push a chunk's bytes to a running `kvferry serve`.
    Put(cmd_transfer::PutArgs),
    /// Fetch a chunk from a running `kvferry serve` (or, with --directory etcd://...
    /// and no --peer, from whichever live peer holds it).
    Get(cmd_transfer::GetArgs),
    /// List the live peers of a directory namespace: id, address, incarnation, role,
    /// age, and whether the view is stale.
    Peers(cmd_peers::PeersArgs),
    /// Run a leader with N worker processes (ranks) on the sim device through offload
    /// and land steps, optionally injecting a hang, a SIGKILL or a stuck device event,
    /// and print each step's outcome.
    ClusterDemo(cmd_cluster_demo::ClusterDemoArgs),
    /// One rank of a cluster (started by a leader, not by hand).
    #[command(hide = true)]
    Worker(cmd_worker::WorkerArgs),
    /// Soak test: producers in child processes and a consumer on loopback, thousands of
    /// transfers under injected faults; every landed byte verified, every arena
    /// checked, every deadline timed. Prints a ledger; fails on any violation.
    Chaos(cmd_chaos::ChaosArgs),
}

fn init_tracing(json: bool) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Colour codes only for a terminal: logs piped to a file or a collector stay plain.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if json {
        let _ = builder.json().try_init();
    } else {
        let _ = builder.try_init();
    }
}

fn main() {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let command = Cli::command();
    let serve = command.find_subcommand("serve").expect("serve is a subcommand");
    let argv = match serve_config::expand(argv, serve) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(argv);
    init_tracing(cli.log_json);
    if let Err(e) = dispatch(cli.command) {
        // `{:#}` prints the whole context chain on one line; no backtrace noise.
        eprintln!("error: {e:#}");
        // Status 2 for what the user asked for (like the parser's own refusals), 1 for
        // everything that went wrong while doing it.
        std::process::exit(if util::is_usage(&e) { 2 } else { 1 });
    }
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Bench(args) => cmd_bench::run(args),
        Command::Serve(args) => cmd_serve::run(args),
        Command::Put(args) => cmd_transfer::put(args),
        Command::Get(args) => cmd_transfer::get(args),
        Command::Peers(args) => cmd_peers::run(args),
        Command::ClusterDemo(args) => cmd_cluster_demo::run(args),
        Command::Worker(args) => cmd_worker::run(args),
        Command::Chaos(args) => cmd_chaos::run(args),
    }
}
