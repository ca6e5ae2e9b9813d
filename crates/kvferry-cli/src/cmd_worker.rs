//! `kvferry worker` (hidden): one rank of a cluster, started by a leader
//! ([`kvferry::cluster::Leader`]), never by hand.
//!
//! The flags are produced by [`kvferry::cluster::WorkerConfig::to_args`] and parsed by
//! [`kvferry::cluster::WorkerConfig::parse_args`]; this command only forwards them, so
//! the format has a single owner. The process serves steps until the leader says
//! shutdown or goes away (socket end of stream, parent death signal, parent change),
//! and exits on its own within a second of the leader's death.

use std::ffi::OsString;

use clap::Args;
use kvferry::cluster::{run_worker_process, WorkerConfig};

/// Options for `worker` (internal).
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Worker flags, as the leader passes them (--socket, --rank, --ranks, --leader-pid,
    /// --device, --block-bytes, --blocks, [--fault, --fault-from-step]).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    flags: Vec<OsString>,
}

pub fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let config = WorkerConfig::parse_args(&args.flags)?;
    run_worker_process(config)?;
    Ok(())
}
