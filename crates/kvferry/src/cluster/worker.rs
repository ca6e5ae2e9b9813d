//! The worker side: one process per rank, started by a [`Leader`](super::Leader) as
//! `kvferry worker <flags>`.
//!
//! # Semantics
//!
//! The worker connects to the leader's socket, says hello, and runs every step it
//! receives in its own task. Every step gets exactly one answer: SUCCESS with a payload
//! or FAILURE with a [`RankFailure`] — device timeouts and faults, bad requests, step
//! errors, and panics (caught at the task boundary) alike. The only way a step goes
//! unanswered is the injected [`WorkerFault::Hang`], or the process dying.
//!
//! The worker never outlives its leader by more than a fraction of a second:
//!
//! - end of stream on its socket ends [`run_worker`] (the leader died or dropped it);
//! - [`run_worker_process`] sets `PR_SET_PDEATHSIG` to `SIGKILL` (the kernel kills the
//!   worker when the leader's spawning thread exits) and exits at once if its parent is
//!   already not the leader;
//! - a watchdog thread checks `getppid` every [`PARENT_POLL`] and exits the process when
//!   the parent changed — even if the async runtime is wedged.
//!
//! # Cancellation
//!
//! Dropping [`run_worker`] drops the connection; step tasks already spawned keep their
//! memory (leases, device buffers) until their device work drains, as the device layer
//! guarantees, and are dropped with the runtime.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::config::{WorkerConfig, WorkerFault};
use super::protocol::{FailureKind, RankFailure, StepOp, StepOutcome, StepPayload, ToLeader, ToWorker};
use super::rank_device::RankDevice;
use super::ClusterError;
use crate::wire::{self, Limits, WireError};

/// How often the watchdog thread checks that the parent is still the leader.
pub const PARENT_POLL: Duration = Duration::from_millis(100);

/// Exit status of a worker whose leader went away (seen by the watchdog).
pub const EXIT_LEADER_GONE: i32 = 3;

/// Runs a worker process to completion: installs the parent-death safeguards, builds a
/// single-threaded runtime and runs [`run_worker`] on it. Returns when the leader says
/// shutdown or goes away; never waits more than 100 ms for leftover step tasks.
pub fn run_worker_process(config: WorkerConfig) -> Result<(), ClusterError> {
    install_parent_death_signal(config.leader_pid);
    spawn_parent_watchdog(config.leader_pid);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name(format!("kvferry-rank{}", config.rank))
        .build()
        .map_err(|e| ClusterError::io("cannot build the worker runtime", e))?;
    let result = rt.block_on(run_worker(config));
    rt.shutdown_timeout(Duration::from_millis(100));
    result
}

/// Asks the kernel to SIGKILL this process when the thread that spawned it exits, then
/// closes the race where that already happened.
fn install_parent_death_signal(leader_pid: u32) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl(PR_SET_PDEATHSIG, sig) takes integer arguments only and touches
        // no memory of ours.
        let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) };
        if rc != 0 {
            tracing::warn!(target: "kvferry::cluster", "PR_SET_PDEATHSIG failed: {}", std::io::Error::last_os_error());
        }
    }
    if parent_pid() != leader_pid {
        tracing::warn!(target: "kvferry::cluster", leader_pid, "leader is already gone; exiting");
        std::process::exit(EXIT_LEADER_GONE);
    }
}

fn parent_pid() -> u32 {
    // SAFETY: getppid has no preconditions and cannot fail.
    unsafe { libc::getppid() as u32 }
}

/// A thread that exits the process once the parent is no longer the leader.
fn spawn_parent_watchdog(leader_pid: u32) {
    let spawned = std::thread::Builder::new()
        .name("kvferry-parent-watch".into())
        .spawn(move || loop {
            std::thread::sleep(PARENT_POLL);
            if parent_pid() != leader_pid {
                // No logging machinery: the process may be wedged; just leave.
                std::process::exit(EXIT_LEADER_GONE);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(target: "kvferry::cluster", "cannot start the parent watchdog: {e}");
    }
}

/// Connects to the leader and serves steps until it says shutdown or closes the
/// connection (both return `Ok`). Needs a tokio runtime with I/O and timers.
pub async fn run_worker(config: WorkerConfig) -> Result<(), ClusterError> {
    let rank = config.rank;
    let device = Arc::new(RankDevice::open(&config)?);
    tracing::debug!(target: "kvferry::cluster", rank, "worker on {}", device.name());
    let stream = UnixStream::connect(&config.socket)
        .await
        .map_err(|e| ClusterError::io(format!("cannot connect to {}", config.socket.display()), e))?;
    let (mut rd, mut wr) = stream.into_split();
    let hello = ToLeader::Hello {
        rank,
        pid: std::process::id(),
    };
    wire::write_control(&mut wr, 0, &hello).await?;

    let (tx, mut rx) = mpsc::unbounded_channel::<(u64, ToLeader)>();
    let writer = tokio::spawn(async move {
        while let Some((id, msg)) = rx.recv().await {
            if let Err(e) = wire::write_control(&mut wr, id, &msg).await {
                tracing::debug!(target: "kvferry::cluster", rank, "cannot answer the leader: {e}");
                return;
            }
        }
    });

    let limits = Limits::default();
    let result = loop {
        match wire::read_control::<_, ToWorker>(&mut rd, &limits).await {
            Ok((step, ToWorker::Step { op, budget_us })) => {
                let deadline = Instant::now() + Duration::from_micros(budget_us);
                let ctx = StepContext {
                    rank,
                    step,
                    device: device.clone(),
                    fault: config.fault.filter(|f| step >= f.from_step).map(|f| f.fault),
                };
                let tx = tx.clone();
                tokio::spawn(async move {
                    let outcome = answer(ctx, op, deadline).await;
                    let _ = tx.send((step, ToLeader::Response(outcome)));
                });
            }
            Ok((_, ToWorker::Shutdown)) => {
                tracing::debug!(target: "kvferry::cluster", rank, "shutdown requested");
                break Ok(());
            }
            Err(WireError::Closed) => {
                tracing::debug!(target: "kvferry::cluster", rank, "leader closed the connection; exiting");
                break Ok(());
            }
            Err(e) => break Err(ClusterError::Wire(e)),
        }
    };
    writer.abort();
    result
}

struct StepContext {
    rank: u32,
    step: u64,
    device: Arc<RankDevice>,
    fault: Option<WorkerFault>,
}

/// Runs one step in its own task and turns every way it can end into an answer.
async fn answer(ctx: StepContext, op: StepOp, deadline: Instant) -> StepOutcome {
    if ctx.fault == Some(WorkerFault::Hang) {
        tracing::debug!(target: "kvferry::cluster", rank = ctx.rank, step = ctx.step, "injected hang");
        std::future::pending::<()>().await;
    }
    let rank = ctx.rank;
    match tokio::spawn(execute(ctx, op, deadline)).await {
        Ok(Ok(payload)) => StepOutcome::Success(payload),
        Ok(Err(failure)) => StepOutcome::Failure(failure),
        Err(e) if e.is_panic() => StepOutcome::Failure(RankFailure {
            kind: FailureKind::Panic,
            rank,
            message: panic_message(e.into_panic()),
        }),
        Err(e) => StepOutcome::Failure(RankFailure {
            kind: FailureKind::StepError,
            rank,
            message: format!("step task ended without an answer: {e}"),
        }),
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

async fn execute(ctx: StepContext, op: StepOp, deadline: Instant) -> Result<StepPayload, RankFailure> {
    let rank = ctx.rank;
    match op {
        StepOp::Offload { blocks } => ctx.device.offload(ctx.step, &blocks, ctx.fault, deadline).await,
        StepOp::Land { blocks } => ctx.device.land(ctx.step, &blocks, ctx.fault, deadline).await,
        StepOp::Sleep { millis } => {
            tokio::time::sleep(Duration::from_millis(millis)).await;
            Ok(StepPayload::Slept { millis })
        }
        StepOp::Fail { message } => Err(RankFailure {
            kind: FailureKind::StepError,
            rank,
            message,
        }),
        StepOp::Panic { message } => panic!("{message}"),
        StepOp::Echo { payload } => {
            let mut out = rank.to_le_bytes().to_vec();
            out.extend_from_slice(&payload);
            Ok(StepPayload::Echo { payload: out })
        }
    }
}
