//! The rank runtime with real processes: a [`Leader`] in this test process starts
//! `kvferry worker` processes (the binary built with this crate) over Unix sockets.
//!
//! Faults are real: a device event that never completes (sim fault injection), a
//! worker that stops answering, a SIGKILL. Every test starts its own leader (own socket
//! directory, own workers), so the tests run in any order and in parallel; dropping a
//! leader SIGKILLs and reaps its workers.

use std::time::Duration;

use kvferry::cluster::{ClusterError, FailureKind, Leader, LeaderConfig, RankHealth, StepOp, StepPayload, WorkerFault};
use tokio::time::Instant;

/// Slack for process scheduling on a loaded 2-core machine, on top of the 50 ms the
/// runtime promises.
const LATE: Duration = Duration::from_millis(250);

fn config(ranks: u32) -> LeaderConfig {
    LeaderConfig::new(env!("CARGO_BIN_EXE_kvferry"), ranks)
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start().chars().next();
            !matches!(state, Some('Z') | Some('X'))
        }
        Err(_) => false,
    }
}

fn checksums(payloads: &[StepPayload]) -> Vec<u32> {
    payloads
        .iter()
        .map(|p| match p {
            StepPayload::Offloaded { checksum, .. } | StepPayload::Landed { checksum, .. } => *checksum,
            other => panic!("unexpected payload {other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_ranks_answer_echo_offload_and_land() {
    let leader = Leader::start(config(8)).await.unwrap();
    assert_eq!(leader.worker_pids().len(), 8);
    let echo = leader.run_step(StepOp::Echo { payload: vec![7] }).await.unwrap();
    for (rank, p) in echo.payloads.iter().enumerate() {
        let mut expected = (rank as u32).to_le_bytes().to_vec();
        expected.push(7);
        assert_eq!(p, &StepPayload::Echo { payload: expected });
    }
    let blocks: Vec<u32> = (0..8).collect();
    let off = leader
        .run_step(StepOp::Offload { blocks: blocks.clone() })
        .await
        .unwrap();
    let land = leader.run_step(StepOp::Land { blocks }).await.unwrap();
    assert_eq!(off.ranks(), 8);
    assert_eq!(checksums(&off.payloads), checksums(&land.payloads));
    assert!(leader.health().is_healthy(), "{}", leader.health());
    let report = leader.shutdown().await;
    assert_eq!(report.exited.len(), 8, "{report:?}");
    assert!(report.killed.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_completing_event_on_one_of_eight_ranks_fails_the_step_on_time_naming_it() {
    let timeout = Duration::from_secs(1);
    let leader = Leader::start(config(8).step_timeout(timeout).fault(3, WorkerFault::StuckEvent, 2))
        .await
        .unwrap();
    let blocks: Vec<u32> = (0..4).collect();
    leader
        .run_step(StepOp::Offload { blocks: blocks.clone() })
        .await
        .unwrap();
    let t0 = Instant::now();
    let err = leader.run_step(StepOp::Land { blocks }).await.unwrap_err();
    let elapsed = t0.elapsed();
    let f = err
        .rank_failure()
        .unwrap_or_else(|| panic!("not a rank failure: {err}"));
    assert_eq!(f.rank, 3, "{err}");
    // The worker's bounded wait answers just before the leader's deadline; under extreme
    // load the leader's own Timeout may win, which names the same rank.
    assert!(
        matches!(f.kind, FailureKind::DeviceTimeout | FailureKind::Timeout),
        "{err}"
    );
    assert!(elapsed < timeout + LATE, "surfaced after {elapsed:?}");
    assert!(!leader.health().is_healthy(), "{}", leader.health());
    if f.kind == FailureKind::DeviceTimeout {
        assert!(f.message.contains("did not complete"), "{f}");
        assert!(matches!(leader.health().ranks[3], RankHealth::Faulted { step: 2, .. }));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_rank_times_out_naming_it_and_health_reports_it_stuck() {
    let timeout = Duration::from_millis(400);
    let leader = Leader::start(config(4).step_timeout(timeout).fault(2, WorkerFault::Hang, 2))
        .await
        .unwrap();
    leader.run_step(StepOp::Echo { payload: vec![] }).await.unwrap();
    let t0 = Instant::now();
    let err = leader.run_step(StepOp::Echo { payload: vec![] }).await.unwrap_err();
    let elapsed = t0.elapsed();
    match &err {
        ClusterError::Timeout {
            step: 2,
            rank: 2,
            missing,
            ..
        } => assert_eq!(missing, &vec![2]),
        other => panic!("expected a Timeout naming rank 2, got {other}"),
    }
    assert!(elapsed >= timeout, "timed out early: {elapsed:?}");
    assert!(elapsed < timeout + LATE, "timed out late: {elapsed:?}");
    let health = leader.health();
    assert!(!health.is_healthy());
    assert!(matches!(health.ranks[2], RankHealth::Stuck { step: 2, .. }), "{health}");
    assert!(matches!(health.ranks[0], RankHealth::Healthy { .. }), "{health}");
    assert!(health.to_string().contains("rank 2 stuck on step 2"), "{health}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_rank_fails_the_step_then_recovers_when_it_answers() {
    let leader = Leader::start(config(2).step_timeout(Duration::from_millis(200)))
        .await
        .unwrap();
    let err = leader.run_step(StepOp::Sleep { millis: 500 }).await.unwrap_err();
    assert!(matches!(err, ClusterError::Timeout { rank: 0, .. }), "{err}");
    assert!(!leader.health().is_healthy());
    let deadline = Instant::now() + Duration::from_secs(2);
    while !leader.health().is_healthy() {
        assert!(
            Instant::now() < deadline,
            "late answers never cleared: {}",
            leader.health()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    leader.run_step(StepOp::Echo { payload: vec![] }).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_panics_inside_workers_are_structured_failures() {
    let mut c = config(3);
    c.worker_stderr = false; // keep the panic messages out of the test output
    let leader = Leader::start(c).await.unwrap();
    let err = leader
        .run_step(StepOp::Fail {
            message: "disk on fire".into(),
        })
        .await
        .unwrap_err();
    match &err {
        ClusterError::RankFailed { step: 1, failure, .. } => {
            assert_eq!(failure.kind, FailureKind::StepError);
            assert_eq!(failure.message, "disk on fire");
            assert!(failure.rank < 3);
        }
        other => panic!("{other}"),
    }
    let err = leader
        .run_step(StepOp::Panic {
            message: "invariant broken".into(),
        })
        .await
        .unwrap_err();
    let f = err.rank_failure().unwrap();
    assert_eq!(f.kind, FailureKind::Panic, "{err}");
    assert!(f.message.contains("invariant broken"), "{f}");
    // Every worker survived both and still answers.
    leader.run_step(StepOp::Echo { payload: vec![] }).await.unwrap();
    assert!(leader.health().is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_step_fails_it_with_worker_died_within_a_second() {
    let leader = Leader::start(config(4).step_timeout(Duration::from_secs(20)))
        .await
        .unwrap();
    let pid = leader.worker_pids()[2];
    let step = leader.run_step(StepOp::Sleep { millis: 10_000 });
    tokio::pin!(step);
    let killed_at = tokio::select! {
        r = &mut step => panic!("the step ended before the kill: {r:?}"),
        _ = tokio::time::sleep(Duration::from_millis(100)) => {
            assert_eq!(leader.kill_rank(2).unwrap(), pid);
            Instant::now()
        }
    };
    let err = step.await.unwrap_err();
    let surfaced = killed_at.elapsed();
    match &err {
        ClusterError::WorkerDied {
            step: 1,
            rank: 2,
            cause,
            ..
        } => {
            assert!(cause.contains("signal 9"), "{cause}");
        }
        other => panic!("expected WorkerDied for rank 2, got {other}"),
    }
    assert!(surfaced < Duration::from_secs(1), "surfaced after {surfaced:?}");
    assert!(!alive(pid));
    let health = leader.health();
    assert!(matches!(health.ranks[2], RankHealth::Dead { .. }), "{health}");
    // Later steps fail at once, naming the dead rank.
    let t0 = Instant::now();
    let err = leader.run_step(StepOp::Echo { payload: vec![] }).await.unwrap_err();
    assert!(
        matches!(err, ClusterError::WorkerDied { step: 2, rank: 2, .. }),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_millis(100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_leader_kills_and_reaps_every_worker_and_removes_its_socket_dir() {
    let leader = Leader::start(config(4).fault(1, WorkerFault::Hang, 1)).await.unwrap();
    let pids = leader.worker_pids();
    let dir = leader.socket_dir().to_path_buf();
    assert!(dir.exists());
    // A step in flight (rank 1 hangs) when the leader goes away.
    let _ = tokio::time::timeout(
        Duration::from_millis(50),
        leader.run_step(StepOp::Echo { payload: vec![] }),
    )
    .await;
    drop(leader);
    for pid in pids {
        // Reaped, not merely dead: no zombie left behind.
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "worker {pid} survived"
        );
    }
    assert!(!dir.exists(), "socket directory {} left behind", dir.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_steps_resolve_independently() {
    let leader = Leader::start(config(2)).await.unwrap();
    let (a, b) = tokio::join!(
        leader.run_step(StepOp::Sleep { millis: 100 }),
        leader.run_step(StepOp::Echo { payload: vec![1] })
    );
    assert_eq!(a.unwrap().step, 1);
    assert_eq!(b.unwrap().step, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_rejected_before_any_process_starts() {
    for (c, field) in [
        (config(4).step_timeout(Duration::ZERO), "step_timeout"),
        (config(4).step_timeout(Duration::from_secs(2 * 3600)), "step_timeout"),
        (config(0), "ranks"),
        (config(2).fault(5, WorkerFault::Hang, 1), "faults"),
    ] {
        let err = Leader::start(c).await.unwrap_err();
        assert!(
            matches!(&err, ClusterError::InvalidConfig { field: f, .. } if *f == field),
            "{field}: {err}"
        );
    }
    let mut c = config(2);
    c.startup_timeout = Duration::ZERO;
    let err = Leader::start(c).await.unwrap_err();
    assert!(err.to_string().contains("startup_timeout"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_cannot_start_fail_the_start_naming_a_rank() {
    let err = Leader::start(LeaderConfig::new("/nonexistent/kvferry", 2))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Spawn { rank: 0, .. }), "{err}");

    // A "worker" that exits at once.
    let mut c = LeaderConfig::new("/bin/sh", 2);
    c.args = vec!["-c".into(), "exit 7".into(), "sh".into()];
    let err = Leader::start(c).await.unwrap_err();
    match &err {
        ClusterError::Startup { reason, .. } => assert!(reason.contains("status 7"), "{err}"),
        other => panic!("{other}"),
    }

    // A "worker" that never connects.
    let mut c = LeaderConfig::new("/bin/sh", 2);
    c.args = vec!["-c".into(), "exec sleep 30".into(), "sh".into()];
    c.startup_timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let err = Leader::start(c).await.unwrap_err();
    assert!(matches!(err, ClusterError::Startup { rank: 0, .. }), "{err}");
    assert!(err.to_string().contains("did not connect within 300ms"), "{err}");
    assert!(t0.elapsed() < Duration::from_millis(300) + LATE);
}
