//! `kvferry cluster-demo`: a leader with N worker processes (ranks) on the sim device,
//! driven through offload and land steps, with optional faults.
//!
//! Step `i` (from 1) offloads a set of KV blocks to staging when `i` is odd and lands
//! the same blocks when `i` is even; a land's per-rank checksum must equal the
//! offload's. Each step prints the rank count, the outcome and the elapsed time. A
//! failed step prints the failure's kind, the rank it names and how long it took to
//! surface, then the leader's health; the remaining steps are skipped and the command
//! exits non-zero.
//!
//! Faults strike at `--fault-step`:
//!
//! - `--inject-hang RANK`: the rank stops answering → `Timeout` naming it at the step
//!   deadline.
//! - `--inject-kill RANK`: the rank's device is slowed so it is mid-step, and the
//!   leader SIGKILLs it shortly after dispatch → `WorkerDied` naming it.
//! - `--inject-stuck-event RANK`: a device event never completes on the rank → its
//!   bounded wait answers FAILURE `DeviceTimeout` naming it, just before the deadline.
//!
//! With `--json`, every event is one JSON object per line: `started` (with the worker
//! pids), `step`, `health` (after a failure), `summary`.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvferry::cluster::{
    format_duration, parse_duration, DeviceKind, Health, Leader, LeaderConfig, RankHealth, StepOp, StepPayload,
    WorkerFault, WorkerSetup,
};
use serde_json::json;
use tokio::time::Instant;

/// Options for `cluster-demo`.
#[derive(Args, Debug)]
pub struct ClusterDemoArgs {
    /// Number of worker processes (ranks), from 1 to 256.
    #[arg(long, default_value_t = 8)]
    ranks: u32,
    /// Number of steps to run, alternating offload (odd steps) and land (even steps).
    #[arg(long, default_value_t = 4)]
    steps: u32,
    /// Deadline of each step, from dispatch to the last rank's answer, e.g. 500ms or 2s
    /// (greater than zero, at most 1h). A rank still silent at the deadline fails the
    /// step with Timeout naming it.
    #[arg(long, default_value = "2s", value_name = "DURATION", allow_hyphen_values = true)]
    step_timeout: String,
    /// Deadline for every worker process to start and connect, e.g. 10s.
    #[arg(long, default_value = "10s", value_name = "DURATION", allow_hyphen_values = true)]
    startup_timeout: String,
    /// Device backend of the workers: sim (simulated accelerator with fault injection)
    /// or host (host memory and the copy engine).
    #[arg(long, default_value = "sim", value_parser = ["sim", "host"])]
    device: String,
    /// KV blocks each rank moves per step.
    #[arg(long, default_value_t = 8, value_name = "N")]
    blocks_per_step: u32,
    /// Size of one KV block, in KiB.
    #[arg(long, default_value_t = 64, value_name = "KIB")]
    block_kib: usize,
    /// Fault: RANK stops answering from the fault step on. The step fails with Timeout
    /// naming RANK when its deadline passes, and the leader's health reports RANK stuck.
    #[arg(long, value_name = "RANK")]
    inject_hang: Option<u32>,
    /// Fault: RANK's process is SIGKILLed in the middle of the fault step (its device is
    /// slowed so it is mid-step). The step fails with WorkerDied naming RANK within
    /// milliseconds of the kill, long before the deadline.
    #[arg(long, value_name = "RANK")]
    inject_kill: Option<u32>,
    /// Fault: on RANK, a device event of the fault step never completes. The worker's
    /// bounded wait turns it into a FAILURE answer, DeviceTimeout naming RANK, just
    /// before the step deadline.
    #[arg(long, value_name = "RANK")]
    inject_stuck_event: Option<u32>,
    /// The step (counting from 1) at which the injected faults strike.
    #[arg(long, default_value_t = 2, value_name = "STEP")]
    fault_step: u64,
    /// Print one JSON object per line (events: started, step, health, summary) instead
    /// of text.
    #[arg(long)]
    json: bool,
}

/// The faults, as (rank, fault, description).
fn faults(args: &ClusterDemoArgs, step_timeout: Duration) -> Vec<(u32, WorkerFault, &'static str)> {
    let mut out = Vec::new();
    if let Some(r) = args.inject_hang {
        out.push((r, WorkerFault::Hang, "hang"));
    }
    if let Some(r) = args.inject_kill {
        // Slow enough to be mid-step when the kill lands.
        out.push((r, WorkerFault::Slow(step_timeout / 2), "kill"));
    }
    if let Some(r) = args.inject_stuck_event {
        out.push((r, WorkerFault::StuckEvent, "stuck-event"));
    }
    out
}

/// Builds and validates the leader's configuration: every bad value is reported here,
/// before any process starts.
fn build_config(args: &ClusterDemoArgs) -> anyhow::Result<LeaderConfig> {
    use kvferry::cluster::ClusterError;
    let step_timeout = parse_duration(&args.step_timeout).context("invalid --step-timeout")?;
    let startup_timeout = parse_duration(&args.startup_timeout).context("invalid --startup-timeout")?;
    let invalid = |field, reason: String| ClusterError::InvalidConfig { field, reason };
    if args.steps == 0 || args.steps > 100_000 {
        Err(invalid("steps", format!("{} is not in 1..=100000", args.steps)))?;
    }
    let has_faults = !faults(args, step_timeout).is_empty();
    if has_faults && (args.fault_step == 0 || args.fault_step > u64::from(args.steps)) {
        Err(invalid(
            "fault_step",
            format!("{} is not a step of this run (1..={})", args.fault_step, args.steps),
        ))?;
    }
    if args.block_kib == 0 {
        Err(invalid("block_kib", "must be at least 1".into()))?;
    }
    let program = std::env::current_exe().context("cannot locate the kvferry executable")?;
    let mut config = LeaderConfig::new(program, args.ranks);
    config.step_timeout = step_timeout;
    config.startup_timeout = startup_timeout;
    config.worker = WorkerSetup {
        device: args.device.parse::<DeviceKind>()?,
        block_bytes: args.block_kib.saturating_mul(1024),
        blocks: args.blocks_per_step.saturating_mul(2),
    };
    for (rank, fault, name) in faults(args, step_timeout) {
        if config.faults.contains_key(&rank) {
            Err(invalid(
                "inject",
                format!("rank {rank} has two faults; use one per rank"),
            ))?;
        }
        if rank >= args.ranks {
            Err(invalid(
                "inject",
                format!("--inject-{name} {rank}: ranks are 0..{}", args.ranks),
            ))?;
        }
        config = config.fault(rank, fault, args.fault_step);
    }
    config.validate()?;
    Ok(config)
}

pub fn run(args: ClusterDemoArgs) -> anyhow::Result<()> {
    let config = build_config(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(demo(args, config))
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn health_json(h: &Health) -> serde_json::Value {
    let problems: Vec<_> = h
        .problems()
        .map(|(rank, state)| match state {
            RankHealth::Stuck { step, overdue } => {
                json!({"rank": rank, "state": "stuck", "step": step, "overdue_ms": ms(*overdue)})
            }
            RankHealth::Faulted { step, kind } => {
                json!({"rank": rank, "state": "faulted", "step": step, "kind": kind.as_str()})
            }
            RankHealth::Dead { cause } => json!({"rank": rank, "state": "dead", "cause": cause}),
            RankHealth::Healthy { .. } => json!({"rank": rank, "state": "healthy"}),
        })
        .collect();
    json!({"event": "health", "healthy": h.is_healthy(), "problems": problems})
}

async fn demo(args: ClusterDemoArgs, config: LeaderConfig) -> anyhow::Result<()> {
    let json = args.json;
    let steps = args.steps;
    let step_timeout = config.step_timeout;
    let fault_list = faults(&args, step_timeout);
    let fault_text: Vec<String> = fault_list
        .iter()
        .map(|(rank, _, name)| format!("{name} on rank {rank}"))
        .collect();
    let device = config.worker.device;
    let ranks = config.ranks;

    let leader = Leader::start(config).await.context("cannot start the cluster")?;
    let pids = leader.worker_pids();
    if json {
        println!(
            "{}",
            json!({"event": "started", "ranks": ranks, "device": device.as_str(),
                "step_timeout_ms": ms(step_timeout), "steps": steps, "fault_step": args.fault_step,
                "faults": fault_text, "worker_pids": pids, "leader_pid": std::process::id(),
                "socket_dir": leader.socket_dir().display().to_string(),
                "startup_ms": ms(leader.startup_time())})
        );
    } else {
        let faults = if fault_text.is_empty() {
            "no faults".to_string()
        } else {
            format!("fault: {} at step {}", fault_text.join(", "), args.fault_step)
        };
        println!(
            "cluster-demo: {ranks} ranks on {device}, step timeout {}, {steps} steps; {faults}",
            format_duration(step_timeout)
        );
        let pid_list: Vec<String> = pids.iter().map(u32::to_string).collect();
        println!(
            "workers up in {} (pids {})",
            format_duration(leader.startup_time()),
            pid_list.join(" ")
        );
    }

    let bps = args.blocks_per_step;
    let kill_after = (step_timeout / 10).min(Duration::from_millis(100));
    let mut offload_checksums: Vec<u32> = Vec::new();
    let mut failure: Option<String> = None;
    for i in 1..=steps {
        let base = ((i - 1) / 2 % 2) * bps;
        let blocks: Vec<u32> = (base..base + bps).collect();
        let op = if i % 2 == 1 {
            StepOp::Offload { blocks }
        } else {
            StepOp::Land { blocks }
        };
        let name = op.name();
        let kill = args.inject_kill.filter(|_| u64::from(i) == args.fault_step);
        let started = Instant::now();
        let mut killed_at = None;
        let step = leader.run_step(op);
        tokio::pin!(step);
        let result = match kill {
            None => step.await,
            Some(rank) => tokio::select! {
                r = &mut step => r,
                _ = tokio::time::sleep(kill_after) => {
                    let pid = leader.kill_rank(rank)?;
                    killed_at = Some(Instant::now());
                    if !json {
                        println!("  (sent SIGKILL to rank {rank}, pid {pid}, {} into step {i})",
                            format_duration(started.elapsed()));
                    }
                    step.await
                }
            },
        };
        let finished = Instant::now();
        let elapsed = finished - started;
        let since_kill = killed_at.map(|k| finished - k);
        match result {
            Ok(report) => {
                let checksums: Vec<u32> = report
                    .payloads
                    .iter()
                    .map(|p| match p {
                        StepPayload::Offloaded { checksum, .. } | StepPayload::Landed { checksum, .. } => *checksum,
                        _ => 0,
                    })
                    .collect();
                let mut verified = None;
                if i % 2 == 1 {
                    offload_checksums = checksums;
                } else {
                    let bad: Vec<usize> = (0..checksums.len())
                        .filter(|r| offload_checksums.get(*r) != Some(&checksums[*r]))
                        .collect();
                    verified = Some(bad.is_empty());
                    if !bad.is_empty() {
                        failure = Some(format!(
                            "step {i}: landed bytes differ from offloaded bytes on ranks {bad:?}"
                        ));
                    }
                }
                if json {
                    println!(
                        "{}",
                        json!({"event": "step", "step": i, "op": name, "blocks": bps, "ranks": report.ranks(),
                            "outcome": "ok", "elapsed_ms": ms(elapsed), "bytes": report.bytes(),
                            "checksums_match": verified})
                    );
                } else {
                    let check = match verified {
                        Some(true) => ", checksums match the offload",
                        Some(false) => ", CHECKSUM MISMATCH",
                        None => "",
                    };
                    println!(
                        "step {i}/{steps}  {name:<8} {bps} blocks  ok      {}/{ranks} ranks  {:>8}  {:.1} MiB{check}",
                        report.ranks(),
                        format_duration(elapsed),
                        report.bytes() as f64 / (1 << 20) as f64
                    );
                }
                if failure.is_some() {
                    break;
                }
            }
            Err(err) => {
                let Some(f) = err.rank_failure() else {
                    return Err(err).context(format!("step {i} could not run"));
                };
                if json {
                    println!(
                        "{}",
                        json!({"event": "step", "step": i, "op": name, "blocks": bps, "ranks": ranks,
                            "outcome": "failed", "kind": f.kind.as_str(), "rank": f.rank, "message": f.message,
                            "elapsed_ms": ms(elapsed), "step_timeout_ms": ms(step_timeout),
                            "after_kill_ms": since_kill.map(ms)})
                    );
                } else {
                    println!(
                        "step {i}/{steps}  {name:<8} {bps} blocks  FAILED  {} on rank {} after {} (step timeout {})",
                        f.kind,
                        f.rank,
                        format_duration(elapsed),
                        format_duration(step_timeout)
                    );
                    println!("          {}", f.message);
                    if let Some(d) = since_kill {
                        println!("          surfaced {} after the SIGKILL", format_duration(d));
                    }
                }
                failure = Some(format!("step {i} failed: {} on rank {}", f.kind, f.rank));
                break;
            }
        }
    }

    let completed = failure.is_none();
    if !completed {
        let health = leader.health();
        if json {
            println!("{}", health_json(&health));
        } else {
            println!("health: {health}");
        }
    }
    let shutdown = leader.shutdown().await;
    if json {
        println!(
            "{}",
            json!({"event": "summary", "ok": completed, "error": failure,
                "workers_exited": shutdown.exited.len(), "workers_killed": shutdown.killed})
        );
    } else if completed {
        println!("all {steps} steps succeeded on {ranks} ranks");
    } else if !shutdown.killed.is_empty() {
        println!("(ranks {:?} did not exit on shutdown and were killed)", shutdown.killed);
    }
    match failure {
        None => Ok(()),
        Some(f) => Err(anyhow::anyhow!(f)),
    }
}
