//! The aggregation state machine: which ranks answered which step, which steps are
//! finished, failed or overdue, and which ranks are healthy.
//!
//! # Semantics
//!
//! [`StepTracker`] is pure: no I/O, no clock. It is fed events — a step began, a rank
//! answered, a rank died — each with the current time as an explicit `now`, and
//! [`StepTracker::poll`] says which steps are resolved at that instant. The leader
//! drives it from its sockets and timers; the unit tests drive it with made-up
//! instants and never sleep.
//!
//! A step resolves, at the first `poll` where one of these holds, in this order:
//!
//! 1. some rank answered FAILURE → [`ClusterError::RankFailed`] with the first failure
//!    received (fail fast: the other ranks are not waited for);
//! 2. some rank that has not answered is dead → [`ClusterError::WorkerDied`];
//! 3. every rank answered SUCCESS → a [`StepReport`] with every rank's payload (a step
//!    is finished only when all ranks report it);
//! 4. `now >= deadline` → [`ClusterError::Timeout`] naming the lowest silent rank and
//!    listing all of them.
//!
//! A rank owes an answer to every step sent to it until it answers or dies, even after
//! the step resolved without it; a rank owing an answer past that step's deadline is
//! **stuck**, and [`StepTracker::health`] reports it (and dead ranks) as unhealthy.
//! There is no "healthy while hung". A rank whose latest answer was a device failure
//! is **faulted** (its device may be wedged) until it next answers SUCCESS.
//!
//! Responses are classified by [`Ingest`]: a second answer to the same step from the
//! same rank, an answer to a step never begun, or from a rank out of range is ignored
//! (and reported as such), never counted twice.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::config::format_duration;
use super::protocol::{FailureKind, RankFailure, StepOutcome, StepPayload};
use super::ClusterError;

/// The result of a step on which every rank reported SUCCESS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepReport {
    /// The step id.
    pub step: u64,
    /// From dispatch to the last rank's answer.
    pub elapsed: Duration,
    /// Each rank's payload, indexed by rank.
    pub payloads: Vec<StepPayload>,
}

impl StepReport {
    /// Number of ranks that reported.
    pub fn ranks(&self) -> usize {
        self.payloads.len()
    }

    /// Total bytes moved across ranks.
    pub fn bytes(&self) -> u64 {
        self.payloads.iter().map(StepPayload::bytes).sum()
    }
}

/// How a response was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ingest {
    /// Counted toward its step.
    Accepted,
    /// The step already resolved (e.g. timed out); the rank is no longer stuck on it,
    /// but the answer changes no result.
    Late,
    /// This rank already answered this step; ignored.
    Duplicate,
    /// No such step was sent to this rank; ignored.
    Unknown,
    /// The rank is out of range; ignored.
    BadRank,
}

/// One rank's health.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankHealth {
    /// Alive, and no step it owes an answer to is overdue.
    Healthy {
        /// Steps it is working on.
        in_flight: usize,
    },
    /// Alive but owes an answer to a step whose deadline has passed.
    Stuck {
        /// The oldest overdue step.
        step: u64,
        /// How far past that step's deadline.
        overdue: Duration,
    },
    /// Alive and answering, but its latest answer was a device failure
    /// (`DeviceTimeout` or `DeviceFault`): its device may still be wedged. Cleared by
    /// its next SUCCESS.
    Faulted {
        /// The step that failed.
        step: u64,
        /// How it failed.
        kind: FailureKind,
    },
    /// Its process died or its connection closed.
    Dead {
        /// What was observed.
        cause: String,
    },
}

/// Health of every rank at one instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// By rank.
    pub ranks: Vec<RankHealth>,
}

impl Health {
    /// True only when every rank is alive and none is stuck.
    pub fn is_healthy(&self) -> bool {
        self.ranks.iter().all(|r| matches!(r, RankHealth::Healthy { .. }))
    }

    /// The ranks that are stuck or dead.
    pub fn problems(&self) -> impl Iterator<Item = (u32, &RankHealth)> {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(_, h)| !matches!(h, RankHealth::Healthy { .. }))
            .map(|(r, h)| (r as u32, h))
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_healthy() {
            return write!(f, "healthy ({} ranks)", self.ranks.len());
        }
        f.write_str("unhealthy:")?;
        for (i, (rank, h)) in self.problems().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            match h {
                RankHealth::Stuck { step, overdue } => write!(
                    f,
                    "{sep}rank {rank} stuck on step {step} ({} overdue)",
                    format_duration(*overdue)
                )?,
                RankHealth::Faulted { step, kind } => write!(f, "{sep}rank {rank} faulted ({kind} in step {step})")?,
                RankHealth::Dead { cause } => write!(f, "{sep}rank {rank} dead ({cause})")?,
                RankHealth::Healthy { .. } => {}
            }
        }
        Ok(())
    }
}

/// A resolved step.
#[derive(Debug)]
pub struct Resolved {
    /// The step id.
    pub step: u64,
    /// Its result.
    pub result: Result<StepReport, ClusterError>,
}

#[derive(Debug)]
struct Pending {
    started: Instant,
    deadline: Instant,
    payloads: Vec<Option<StepPayload>>,
    answered: usize,
    first_failure: Option<RankFailure>,
}

#[derive(Debug, Default)]
struct RankSlot {
    dead: Option<String>,
    /// Steps this rank owes an answer to, with their deadlines.
    owes: BTreeMap<u64, Instant>,
    /// The latest device failure it reported, until a later SUCCESS.
    faulted: Option<(u64, FailureKind)>,
}

/// The aggregation state machine (see the module docs).
#[derive(Debug)]
pub struct StepTracker {
    ranks: Vec<RankSlot>,
    steps: BTreeMap<u64, Pending>,
    /// The highest step id begun; ids increase, so every id up to it was begun (this
    /// tells late answers from unknown ones in constant space).
    last_begun: Option<u64>,
}

impl StepTracker {
    /// A tracker for ranks `0..ranks`, all alive.
    pub fn new(ranks: u32) -> StepTracker {
        StepTracker {
            ranks: (0..ranks).map(|_| RankSlot::default()).collect(),
            steps: BTreeMap::new(),
            last_begun: None,
        }
    }

    /// Number of ranks.
    pub fn rank_count(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Starts tracking step `step`, sent to every rank at `now`, due by `deadline`.
    /// Dead ranks are not sent anything and owe nothing; the next `poll` fails the step
    /// with [`ClusterError::WorkerDied`].
    ///
    /// Step ids must increase from one `begin` to the next.
    pub fn begin(&mut self, step: u64, now: Instant, deadline: Instant) -> Result<(), ClusterError> {
        if self.last_begun.is_some_and(|last| step <= last) {
            return Err(ClusterError::Protocol(format!(
                "step {step} does not follow step {}",
                self.last_begun.unwrap_or_default()
            )));
        }
        self.last_begun = Some(step);
        for slot in &mut self.ranks {
            if slot.dead.is_none() {
                slot.owes.insert(step, deadline);
            }
        }
        self.steps.insert(
            step,
            Pending {
                started: now,
                deadline,
                payloads: vec![None; self.ranks.len()],
                answered: 0,
                first_failure: None,
            },
        );
        Ok(())
    }

    /// Feeds one rank's answer to one step. A FAILURE's `rank` is set to `rank` (the
    /// connection it came from is authoritative).
    pub fn on_response(&mut self, step: u64, rank: u32, outcome: StepOutcome) -> Ingest {
        let begun = self.was_begun(step);
        let Some(slot) = self.ranks.get_mut(rank as usize) else {
            return Ingest::BadRank;
        };
        let owed = slot.owes.remove(&step).is_some();
        if owed {
            match &outcome {
                StepOutcome::Success(_) => slot.faulted = None,
                StepOutcome::Failure(f) if matches!(f.kind, FailureKind::DeviceTimeout | FailureKind::DeviceFault) => {
                    slot.faulted = Some((step, f.kind))
                }
                StepOutcome::Failure(_) => {}
            }
        }
        let pending = self.steps.get_mut(&step);
        let pending = match (owed, pending) {
            (true, Some(pending)) => pending,
            (true, None) => return Ingest::Late,
            (false, _) if begun && slot.dead.is_none() => return Ingest::Duplicate,
            (false, _) => return Ingest::Unknown,
        };
        pending.answered += 1;
        match outcome {
            StepOutcome::Success(payload) => pending.payloads[rank as usize] = Some(payload),
            StepOutcome::Failure(mut failure) => {
                failure.rank = rank;
                pending.first_failure.get_or_insert(failure);
            }
        }
        Ingest::Accepted
    }

    fn was_begun(&self, step: u64) -> bool {
        self.last_begun.is_some_and(|last| step <= last)
    }

    /// Records that `rank` died (process exit or connection closed). It owes nothing
    /// any more; every step still waiting for it fails at the next `poll`. Repeated
    /// calls keep the first cause.
    pub fn on_rank_died(&mut self, rank: u32, cause: impl Into<String>) {
        if let Some(slot) = self.ranks.get_mut(rank as usize) {
            slot.dead.get_or_insert_with(|| cause.into());
            slot.owes.clear();
        }
    }

    /// Whether `rank` is known dead.
    pub fn is_dead(&self, rank: u32) -> bool {
        self.ranks.get(rank as usize).is_some_and(|s| s.dead.is_some())
    }

    /// Stops tracking `step` without resolving it (its caller went away). Ranks still
    /// owe it an answer, so an unanswered, overdue step still makes its rank stuck.
    pub fn abandon(&mut self, step: u64) {
        self.steps.remove(&step);
    }

    /// Resolves every step that can be resolved at `now` (see the module docs) and
    /// stops tracking them.
    pub fn poll(&mut self, now: Instant) -> Vec<Resolved> {
        let mut done = Vec::new();
        for (&step, pending) in &self.steps {
            if let Some(result) = self.resolve(step, pending, now) {
                done.push(Resolved { step, result });
            }
        }
        for r in &done {
            self.steps.remove(&r.step);
        }
        done
    }

    fn resolve(&self, step: u64, p: &Pending, now: Instant) -> Option<Result<StepReport, ClusterError>> {
        let elapsed = now.saturating_duration_since(p.started);
        if let Some(failure) = &p.first_failure {
            return Some(Err(ClusterError::RankFailed {
                step,
                failure: failure.clone(),
                elapsed,
            }));
        }
        let silent = || {
            p.payloads
                .iter()
                .enumerate()
                .filter(|(_, pl)| pl.is_none())
                .map(|(r, _)| r as u32)
        };
        if let Some(rank) = silent().find(|r| self.is_dead(*r)) {
            let cause = self.ranks[rank as usize].dead.clone().unwrap_or_default();
            return Some(Err(ClusterError::WorkerDied {
                step,
                rank,
                cause,
                elapsed,
            }));
        }
        if p.answered == self.ranks.len() {
            let payloads = p.payloads.iter().flatten().cloned().collect();
            return Some(Ok(StepReport {
                step,
                elapsed,
                payloads,
            }));
        }
        if now >= p.deadline {
            let missing: Vec<u32> = silent().collect();
            return Some(Err(ClusterError::Timeout {
                step,
                rank: missing[0],
                missing,
                waited: elapsed,
            }));
        }
        None
    }

    /// The earliest deadline among unresolved steps.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.steps.values().map(|p| p.deadline).min()
    }

    /// Steps being tracked (not yet resolved or abandoned).
    pub fn pending_steps(&self) -> usize {
        self.steps.len()
    }

    /// Every rank's health at `now`.
    pub fn health(&self, now: Instant) -> Health {
        let ranks = self
            .ranks
            .iter()
            .map(|slot| {
                if let Some(cause) = &slot.dead {
                    return RankHealth::Dead { cause: cause.clone() };
                }
                let overdue = slot
                    .owes
                    .iter()
                    .filter(|(_, deadline)| **deadline <= now)
                    .min_by_key(|(_, deadline)| **deadline);
                match overdue {
                    Some((&step, &deadline)) => RankHealth::Stuck {
                        step,
                        overdue: now - deadline,
                    },
                    None => match slot.faulted {
                        Some((step, kind)) => RankHealth::Faulted { step, kind },
                        None => RankHealth::Healthy {
                            in_flight: slot.owes.len(),
                        },
                    },
                }
            })
            .collect();
        Health { ranks }
    }
}

/// Converts any step error into the uniform structured form (kind, rank, message).
pub(crate) fn rank_failure_of(err: &ClusterError) -> Option<RankFailure> {
    match err {
        ClusterError::RankFailed { failure, .. } => Some(failure.clone()),
        ClusterError::Timeout {
            rank, missing, waited, ..
        } => Some(RankFailure {
            kind: FailureKind::Timeout,
            rank: *rank,
            message: format!(
                "no answer within {} (silent ranks: {missing:?})",
                format_duration(*waited)
            ),
        }),
        ClusterError::WorkerDied { rank, cause, .. } => Some(RankFailure {
            kind: FailureKind::WorkerDied,
            rank: *rank,
            message: cause.clone(),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn ok(n: u64) -> StepOutcome {
        StepOutcome::Success(StepPayload::Slept { millis: n })
    }

    fn fail(rank: u32, msg: &str) -> StepOutcome {
        StepOutcome::Failure(RankFailure {
            kind: FailureKind::StepError,
            rank,
            message: msg.into(),
        })
    }

    fn setup(ranks: u32) -> (StepTracker, Instant) {
        let t0 = Instant::now();
        let mut t = StepTracker::new(ranks);
        t.begin(1, t0, t0 + ms(1000)).unwrap();
        (t, t0)
    }

    #[test]
    fn all_ranks_succeed() {
        let (mut t, t0) = setup(4);
        for r in 0..3 {
            assert_eq!(t.on_response(1, r, ok(r as u64)), Ingest::Accepted);
            assert!(t.poll(t0 + ms(10)).is_empty(), "finished before every rank reported");
        }
        assert_eq!(t.health(t0 + ms(10)).ranks[3], RankHealth::Healthy { in_flight: 1 });
        assert_eq!(t.on_response(1, 3, ok(3)), Ingest::Accepted);
        let done = t.poll(t0 + ms(20));
        assert_eq!(done.len(), 1);
        let report = done.into_iter().next().unwrap().result.unwrap();
        assert_eq!(report.elapsed, ms(20));
        assert_eq!(report.ranks(), 4);
        assert_eq!(report.payloads[2], StepPayload::Slept { millis: 2 });
        assert!(t.health(t0 + ms(5000)).is_healthy());
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn one_failure_fails_the_step_at_once_with_kind_rank_and_message() {
        let (mut t, t0) = setup(8);
        t.on_response(1, 0, ok(0));
        // The worker claims rank 9; the connection (rank 5) is authoritative.
        assert_eq!(t.on_response(1, 5, fail(9, "boom")), Ingest::Accepted);
        let done = t.poll(t0 + ms(3));
        match &done[0].result {
            Err(ClusterError::RankFailed {
                step: 1,
                failure,
                elapsed,
            }) => {
                assert_eq!(failure.kind, FailureKind::StepError);
                assert_eq!(failure.rank, 5);
                assert_eq!(failure.message, "boom");
                assert_eq!(*elapsed, ms(3));
            }
            other => panic!("{other:?}"),
        }
        // Ranks that have not answered yet still owe an answer (busy, not stuck).
        assert_eq!(t.health(t0 + ms(3)).ranks[1], RankHealth::Healthy { in_flight: 1 });
        assert!(t.health(t0 + ms(3)).is_healthy());
        // ... and become stuck once the deadline passes without one.
        let h = t.health(t0 + ms(1500));
        assert_eq!(
            h.ranks[1],
            RankHealth::Stuck {
                step: 1,
                overdue: ms(500)
            }
        );
        assert_eq!(t.on_response(1, 1, ok(1)), Ingest::Late);
        assert_eq!(t.health(t0 + ms(1500)).ranks[1], RankHealth::Healthy { in_flight: 0 });
    }

    #[test]
    fn device_failure_makes_a_rank_faulted_until_it_succeeds() {
        let (mut t, t0) = setup(2);
        let device_timeout = StepOutcome::Failure(RankFailure {
            kind: FailureKind::DeviceTimeout,
            rank: 1,
            message: "event never completed".into(),
        });
        t.on_response(1, 1, device_timeout);
        t.on_response(1, 0, ok(0));
        assert!(matches!(
            &t.poll(t0)[0].result,
            Err(ClusterError::RankFailed { failure, .. }) if failure.kind == FailureKind::DeviceTimeout && failure.rank == 1
        ));
        let h = t.health(t0);
        assert_eq!(
            h.ranks[1],
            RankHealth::Faulted {
                step: 1,
                kind: FailureKind::DeviceTimeout
            }
        );
        assert!(!h.is_healthy());
        assert!(
            h.to_string().contains("rank 1 faulted (DeviceTimeout in step 1)"),
            "{h}"
        );
        t.begin(2, t0, t0 + ms(10)).unwrap();
        t.on_response(2, 0, ok(0));
        t.on_response(2, 1, ok(0));
        assert!(t.poll(t0).pop().unwrap().result.is_ok());
        assert!(t.health(t0).is_healthy());
        // A step error (not a device failure) leaves the rank healthy.
        t.begin(3, t0, t0 + ms(10)).unwrap();
        t.on_response(3, 0, fail(0, "bad input"));
        assert!(matches!(t.health(t0).ranks[0], RankHealth::Healthy { .. }));
    }

    #[test]
    fn first_failure_wins() {
        let (mut t, t0) = setup(3);
        t.on_response(1, 2, fail(2, "first"));
        t.on_response(1, 0, fail(0, "second"));
        let done = t.poll(t0);
        let f = rank_failure_of(done[0].result.as_ref().unwrap_err()).unwrap();
        assert_eq!((f.rank, f.message.as_str()), (2, "first"));
    }

    #[test]
    fn late_rank_times_out_exactly_at_the_deadline() {
        let (mut t, t0) = setup(8);
        for r in (0..8).filter(|r| *r != 3) {
            t.on_response(1, r, ok(0));
        }
        assert_eq!(t.next_deadline(), Some(t0 + ms(1000)));
        assert!(t.poll(t0 + ms(999)).is_empty());
        assert!(t.health(t0 + ms(999)).is_healthy());
        let done = t.poll(t0 + ms(1000));
        match &done[0].result {
            Err(ClusterError::Timeout {
                step: 1,
                rank: 3,
                missing,
                waited,
            }) => {
                assert_eq!(missing, &vec![3]);
                assert_eq!(*waited, ms(1000));
            }
            other => panic!("{other:?}"),
        }
        // No "healthy while hung".
        let h = t.health(t0 + ms(1200));
        assert!(!h.is_healthy());
        assert_eq!(
            h.ranks[3],
            RankHealth::Stuck {
                step: 1,
                overdue: ms(200)
            }
        );
        assert!(h.to_string().contains("rank 3 stuck on step 1"), "{h}");
        // A late answer changes no result but clears the stuck state.
        assert_eq!(t.on_response(1, 3, ok(0)), Ingest::Late);
        assert!(t.poll(t0 + ms(1300)).is_empty());
        assert!(t.health(t0 + ms(1300)).is_healthy());
    }

    #[test]
    fn timeout_names_the_lowest_silent_rank_and_lists_all() {
        let (mut t, t0) = setup(4);
        t.on_response(1, 0, ok(0));
        t.on_response(1, 3, ok(0));
        let done = t.poll(t0 + ms(2000));
        assert!(matches!(
            &done[0].result,
            Err(ClusterError::Timeout { rank: 1, missing, .. }) if missing == &vec![1, 2]
        ));
    }

    #[test]
    fn dead_rank_fails_waiting_steps_and_future_ones() {
        let (mut t, t0) = setup(4);
        t.on_response(1, 2, ok(0));
        t.on_rank_died(1, "killed by signal 9");
        t.on_rank_died(1, "connection closed"); // first cause kept
        let done = t.poll(t0 + ms(40));
        assert!(matches!(
            &done[0].result,
            Err(ClusterError::WorkerDied { step: 1, rank: 1, cause, elapsed })
                if cause == "killed by signal 9" && *elapsed == ms(40)
        ));
        let h = t.health(t0 + ms(40));
        assert!(!h.is_healthy());
        assert!(matches!(&h.ranks[1], RankHealth::Dead { .. }));
        // A later step fails at once.
        t.begin(2, t0 + ms(50), t0 + ms(1050)).unwrap();
        let done = t.poll(t0 + ms(50));
        assert!(matches!(
            &done[0].result,
            Err(ClusterError::WorkerDied { step: 2, rank: 1, .. })
        ));
    }

    #[test]
    fn death_after_answering_does_not_fail_the_step() {
        let (mut t, t0) = setup(2);
        t.on_response(1, 0, ok(0));
        t.on_rank_died(0, "exited");
        assert!(t.poll(t0).is_empty());
        t.on_response(1, 1, ok(1));
        assert!(t.poll(t0).pop().unwrap().result.is_ok());
    }

    #[test]
    fn duplicate_unknown_and_bad_rank_responses_are_ignored() {
        let (mut t, t0) = setup(2);
        assert_eq!(t.on_response(1, 0, ok(1)), Ingest::Accepted);
        assert_eq!(t.on_response(1, 0, fail(0, "again")), Ingest::Duplicate);
        assert_eq!(t.on_response(7, 0, ok(1)), Ingest::Unknown);
        assert_eq!(t.on_response(1, 2, ok(1)), Ingest::BadRank);
        assert!(t.poll(t0).is_empty(), "a duplicate must not count as rank 1");
        assert_eq!(t.on_response(1, 1, ok(1)), Ingest::Accepted);
        let report = t.poll(t0).pop().unwrap().result.unwrap();
        assert_eq!(report.payloads, vec![StepPayload::Slept { millis: 1 }; 2]);
        // After resolution: a repeat is a duplicate, not late.
        assert_eq!(t.on_response(1, 1, ok(1)), Ingest::Duplicate);
        assert!(t.begin(1, t0, t0 + ms(5)).is_err(), "step ids are single-use");
    }

    #[test]
    fn overlapping_steps_resolve_independently() {
        let t0 = Instant::now();
        let mut t = StepTracker::new(2);
        t.begin(1, t0, t0 + ms(100)).unwrap();
        t.begin(2, t0 + ms(10), t0 + ms(50)).unwrap();
        assert_eq!(t.next_deadline(), Some(t0 + ms(50)));
        t.on_response(1, 0, ok(0));
        t.on_response(1, 1, ok(0));
        let done = t.poll(t0 + ms(60));
        assert_eq!(done.len(), 2);
        assert!(done.iter().any(|d| d.step == 1 && d.result.is_ok()));
        assert!(done
            .iter()
            .any(|d| d.step == 2 && matches!(d.result, Err(ClusterError::Timeout { rank: 0, .. }))));
        assert_eq!(t.pending_steps(), 0);
    }

    #[test]
    fn abandoned_step_still_makes_a_silent_rank_stuck() {
        let (mut t, t0) = setup(2);
        t.abandon(1);
        assert_eq!(t.pending_steps(), 0);
        assert!(t.poll(t0 + ms(5000)).is_empty());
        assert!(!t.health(t0 + ms(5000)).is_healthy());
        assert_eq!(t.on_response(1, 0, ok(0)), Ingest::Late);
    }
}
