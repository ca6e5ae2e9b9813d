//! Per-rank step outcome counts, kept by the [`Leader`](super::Leader) and read by
//! exporters (`metrics` renders them as `kvferry_step_outcomes_total`).

/// One rank's step outcomes, as counted by the cluster leader.
///
/// `success` and `failure` count the rank's answers (including answers that arrive
/// after their step was already resolved); `timeout` counts steps that timed out with
/// this rank silent; `died` counts steps failed because this rank's worker died.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepOutcomeCounts {
    /// Answered SUCCESS.
    pub success: u64,
    /// Answered FAILURE.
    pub failure: u64,
    /// Silent when its step's deadline passed.
    pub timeout: u64,
    /// Its worker died before it answered.
    pub died: u64,
}
