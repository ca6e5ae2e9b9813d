//! The leader/worker protocol: control messages carried in [`crate::wire`] control
//! frames over each worker's Unix socket.
//!
//! # Semantics
//!
//! - A worker connects and sends [`ToLeader::Hello`] (request id 0) naming its rank.
//! - The leader sends [`ToWorker::Step`] with the step id as the frame's request id.
//!   Steps may overlap; a worker runs each in its own task.
//! - The worker answers every step exactly once with [`ToLeader::Response`] (same
//!   request id): [`StepOutcome::Success`] with a payload, or
//!   [`StepOutcome::Failure`] with a structured [`RankFailure`] (kind, rank, message).
//!   Any error inside the worker — a device timeout, a failed copy, a panic — becomes a
//!   FAILURE response, never silence.
//! - [`ToWorker::Shutdown`] asks the worker to exit; end of stream means the same.

use serde::{Deserialize, Serialize};

/// One step, as sent to every rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepOp {
    /// Copy these KV blocks from the rank's device region into staging pages (D2H).
    Offload {
        /// Block indices.
        blocks: Vec<u32>,
    },
    /// Copy these previously staged blocks from staging pages into the rank's landing
    /// region on the device (H2D), then release the pages.
    Land {
        /// Block indices (each must have been offloaded and not yet landed).
        blocks: Vec<u32>,
    },
    /// Test step: sleep this long, then succeed.
    Sleep {
        /// Milliseconds.
        millis: u64,
    },
    /// Test step: fail with a step error carrying this message.
    Fail {
        /// The error message.
        message: String,
    },
    /// Test step: panic inside the worker with this message.
    Panic {
        /// The panic message.
        message: String,
    },
    /// Test step: answer with these bytes, prefixed by the rank (little-endian u32).
    Echo {
        /// Bytes to echo.
        payload: Vec<u8>,
    },
}

impl StepOp {
    /// A short name for reports (`offload`, `land`, `sleep`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            StepOp::Offload { .. } => "offload",
            StepOp::Land { .. } => "land",
            StepOp::Sleep { .. } => "sleep",
            StepOp::Fail { .. } => "fail",
            StepOp::Panic { .. } => "panic",
            StepOp::Echo { .. } => "echo",
        }
    }

    /// Whether the step drives the device (and so is subject to device faults).
    pub fn uses_device(&self) -> bool {
        matches!(self, StepOp::Offload { .. } | StepOp::Land { .. })
    }
}

/// What one rank returns for a successful step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepPayload {
    /// Blocks were copied to staging.
    Offloaded {
        /// Blocks copied.
        blocks: u32,
        /// Bytes copied.
        bytes: u64,
        /// crc32c over the staged bytes, block by block in request order.
        checksum: u32,
    },
    /// Staged blocks were landed on the device.
    Landed {
        /// Blocks copied.
        blocks: u32,
        /// Bytes copied.
        bytes: u64,
        /// crc32c over the landed bytes, block by block in request order.
        checksum: u32,
    },
    /// The sleep finished.
    Slept {
        /// Milliseconds slept.
        millis: u64,
    },
    /// The echoed bytes (rank prefix + payload).
    Echo {
        /// The bytes.
        payload: Vec<u8>,
    },
}

impl StepPayload {
    /// Bytes moved by the step (0 for test steps).
    pub fn bytes(&self) -> u64 {
        match self {
            StepPayload::Offloaded { bytes, .. } | StepPayload::Landed { bytes, .. } => *bytes,
            _ => 0,
        }
    }
}

/// The kind of a rank's failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FailureKind {
    /// A bounded device wait (event, stream) passed its deadline.
    DeviceTimeout,
    /// The device reported an error (failed copy, bad handle).
    DeviceFault,
    /// Staging memory could not be obtained.
    Memory,
    /// The step itself raised an error.
    StepError,
    /// The step panicked inside the worker.
    Panic,
    /// The request is invalid for this worker (unknown block, not staged).
    BadRequest,
    /// The rank did not answer before the step's deadline (decided by the leader).
    Timeout,
    /// The rank's process died or its connection closed (decided by the leader).
    WorkerDied,
    /// The rank broke the protocol (decided by the leader).
    Protocol,
}

impl FailureKind {
    /// The kind's name, as printed and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::DeviceTimeout => "DeviceTimeout",
            FailureKind::DeviceFault => "DeviceFault",
            FailureKind::Memory => "Memory",
            FailureKind::StepError => "StepError",
            FailureKind::Panic => "Panic",
            FailureKind::BadRequest => "BadRequest",
            FailureKind::Timeout => "Timeout",
            FailureKind::WorkerDied => "WorkerDied",
            FailureKind::Protocol => "Protocol",
        }
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A structured failure of one rank: never reduced to a bare string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind} on rank {rank}: {message}")]
pub struct RankFailure {
    /// What went wrong.
    pub kind: FailureKind,
    /// The rank it went wrong on.
    pub rank: u32,
    /// Details.
    pub message: String,
}

/// A rank's answer to one step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepOutcome {
    /// SUCCESS with the rank's payload.
    Success(StepPayload),
    /// FAILURE with a structured error.
    Failure(RankFailure),
}

/// Leader → worker messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToWorker {
    /// Run a step (the frame's request id is the step id).
    Step {
        /// What to do.
        op: StepOp,
        /// Budget for the worker's own bounded waits, in microseconds from receipt.
        budget_us: u64,
    },
    /// Exit cleanly.
    Shutdown,
}

/// Worker → leader messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToLeader {
    /// First message on a connection.
    Hello {
        /// The worker's rank.
        rank: u32,
        /// The worker's process id.
        pid: u32,
    },
    /// The answer to the step whose id is the frame's request id.
    Response(StepOutcome),
}

impl ToLeader {
    /// The variant's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            ToLeader::Hello { .. } => "Hello",
            ToLeader::Response(_) => "Response",
        }
    }
}
