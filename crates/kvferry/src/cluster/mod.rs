//! The rank runtime: a [`Leader`] starts one worker process per rank, sends every step
//! to all of them, and aggregates their answers under a per-step deadline.
//!
//! # Promise
//!
//! A stuck or dead rank becomes an explicit, typed failure naming that rank — never a
//! silent stall:
//!
//! - Every step resolves within its deadline plus a small bound: SUCCESS only when
//!   every rank reported SUCCESS; otherwise [`ClusterError::RankFailed`] (a worker
//!   answered FAILURE: kind, rank, message), [`ClusterError::WorkerDied`] (its process
//!   died or its socket closed; seen within milliseconds through end of stream) or
//!   [`ClusterError::Timeout`] (a rank stayed silent past the deadline).
//! - Inside a worker, every error — a device event that never completes (a bounded
//!   wait turns it into `DeviceTimeout`), a failed copy, a panic — becomes a FAILURE
//!   response.
//! - [`Leader::health`] is unhealthy while any rank is dead or owes an answer past its
//!   step's deadline: no "healthy while hung".
//! - When the leader goes away, workers exit on their own: end of stream on their
//!   socket, `PR_SET_PDEATHSIG` = `SIGKILL` as a backstop, and a watch on `getppid`.
//!   Dropping a [`Leader`] SIGKILLs and reaps every worker and removes its socket
//!   directory.
//!
//! # Structure
//!
//! - [`config`]: [`LeaderConfig`], [`WorkerConfig`], duration parsing; every timeout is
//!   validated once, at start-up.
//! - [`protocol`]: the messages ([`StepOp`], [`StepOutcome`], [`RankFailure`]), carried in
//!   [`crate::wire`] control frames.
//! - [`tracker`]: the aggregation state machine, pure and clock-free ([`StepTracker`]).
//! - `leader` and `worker`: the I/O around it.
//!
//! # Cancellation
//!
//! Dropping a [`Leader::run_step`] future abandons the step: nothing is freed under a
//! worker, the ranks still owe their answers (and show as stuck if they never give
//! them). Dropping [`Leader::start`] kills and reaps the workers started so far.

pub mod config;
mod leader;
mod outcomes;
mod processes;
pub mod protocol;
mod rank_device;
mod sockdir;
pub mod tracker;
mod worker;

use std::time::Duration;

pub use config::{
    format_duration, parse_duration, DeviceKind, FaultPlan, LeaderConfig, WorkerConfig, WorkerFault, WorkerSetup,
    MAX_TIMEOUT,
};
pub use leader::{Leader, ShutdownReport};
pub use outcomes::StepOutcomeCounts;
pub use protocol::{FailureKind, RankFailure, StepOp, StepOutcome, StepPayload};
pub use tracker::{Health, Ingest, RankHealth, Resolved, StepReport, StepTracker};
pub use worker::{run_worker, run_worker_process};

/// Errors of the rank runtime.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A configuration value is unusable (reported at start-up, naming the field).
    #[error("invalid cluster configuration: {field}: {reason}")]
    InvalidConfig {
        /// The offending field or flag.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A duration string could not be parsed.
    #[error("invalid duration {input:?}: {reason}")]
    InvalidDuration {
        /// The text given.
        input: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A local I/O operation (socket directory, listener, connect) failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A worker process could not be started.
    #[error("cannot start worker for rank {rank}: {source}")]
    Spawn {
        /// The rank.
        rank: u32,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The workers did not all start and connect.
    #[error("worker for rank {rank} failed to start: {reason}")]
    Startup {
        /// The first rank that failed.
        rank: u32,
        /// What happened.
        reason: String,
    },
    /// A rank answered FAILURE.
    #[error("step {step} failed after {}: {failure}", format_duration(*elapsed))]
    RankFailed {
        /// The step id.
        step: u64,
        /// The first failure received.
        failure: RankFailure,
        /// From dispatch to the failure.
        elapsed: Duration,
    },
    /// A rank's process died (or its connection closed) before it answered.
    #[error("step {step} failed after {}: worker for rank {rank} died ({cause})", format_duration(*elapsed))]
    WorkerDied {
        /// The step id.
        step: u64,
        /// The rank.
        rank: u32,
        /// What was observed (exit status or signal, closed connection).
        cause: String,
        /// From dispatch to the failure.
        elapsed: Duration,
    },
    /// A rank did not answer before the step's deadline.
    #[error("step {step} timed out after {}: rank {rank} did not answer (silent ranks: {missing:?})", format_duration(*waited))]
    Timeout {
        /// The step id.
        step: u64,
        /// The lowest silent rank.
        rank: u32,
        /// Every silent rank.
        missing: Vec<u32>,
        /// From dispatch to the deadline.
        waited: Duration,
    },
    /// The peer sent something the protocol does not allow.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer sent a message of the wrong kind (named, not dumped: a response may
    /// carry a long failure report).
    #[error("protocol error: expected {expected}, got {got}")]
    Unexpected {
        /// The message kind expected.
        expected: &'static str,
        /// The message kind received.
        got: &'static str,
    },
    /// Reading or writing a frame failed.
    #[error(transparent)]
    Wire(#[from] crate::wire::WireError),
    /// The leader is shutting down and takes no more steps.
    #[error("the leader is shut down")]
    ShutDown,
}

impl ClusterError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            ClusterError::InvalidConfig { .. } | ClusterError::InvalidDuration { .. } => C::InvalidConfig,
            ClusterError::Io { .. } | ClusterError::Spawn { .. } => C::Io,
            ClusterError::Startup { .. } | ClusterError::WorkerDied { .. } => C::WorkerDied,
            ClusterError::RankFailed { .. } => C::RankFailed,
            ClusterError::Timeout { .. } => C::Timeout,
            ClusterError::Protocol(_) | ClusterError::Unexpected { .. } => C::Protocol,
            ClusterError::Wire(e) => e.code(),
            ClusterError::ShutDown => C::Closed,
        }
    }
}

impl ClusterError {
    /// The failure in uniform structured form (kind, rank, message), for errors that
    /// fail a step on a rank: [`ClusterError::RankFailed`], [`ClusterError::Timeout`]
    /// and [`ClusterError::WorkerDied`].
    pub fn rank_failure(&self) -> Option<RankFailure> {
        tracker::rank_failure_of(self)
    }

    /// The failure kind, for step failures.
    pub fn kind(&self) -> Option<FailureKind> {
        self.rank_failure().map(|f| f.kind)
    }

    /// The rank named by a step failure.
    pub fn rank(&self) -> Option<u32> {
        match self {
            ClusterError::Spawn { rank, .. } | ClusterError::Startup { rank, .. } => Some(*rank),
            _ => self.rank_failure().map(|f| f.rank),
        }
    }

    /// How long the step ran before this failure surfaced, for step failures.
    pub fn elapsed(&self) -> Option<Duration> {
        match self {
            ClusterError::RankFailed { elapsed, .. } | ClusterError::WorkerDied { elapsed, .. } => Some(*elapsed),
            ClusterError::Timeout { waited, .. } => Some(*waited),
            _ => None,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> ClusterError {
        ClusterError::Io {
            context: context.into(),
            source,
        }
    }
}
