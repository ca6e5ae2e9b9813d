//! The worker side of the rank runtime, in process: a test plays the leader on a real
//! Unix socket, speaking the wire protocol, and checks that every step gets exactly one
//! structured answer — including a device event that never completes (a bounded wait
//! turns it into `DeviceTimeout`), a step error and a panic — and that the worker ends
//! when the leader goes away.
//!
//! Process-level behaviour (spawning, SIGKILL, leader death) is tested from the CLI
//! crate, which can point the leader at the `kvferry` binary.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvferry::cluster::protocol::{ToLeader, ToWorker};
use kvferry::cluster::{
    run_worker, ClusterError, DeviceKind, FailureKind, FaultPlan, StepOp, StepOutcome, StepPayload, WorkerConfig,
    WorkerFault, WorkerSetup,
};
use kvferry::wire::{read_control, write_control, Limits};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const RANK: u32 = 3;

/// A unique scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvferry-test-worker-{}-{}-{:x}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        ));
        std::fs::create_dir(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The test's side of one worker connection.
struct FakeLeader {
    stream: UnixStream,
    worker: JoinHandle<Result<(), ClusterError>>,
    _dir: Scratch,
}

impl FakeLeader {
    async fn start(device: DeviceKind, fault: Option<FaultPlan>) -> FakeLeader {
        let dir = Scratch::new();
        let socket = dir.0.join("leader.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let config = WorkerConfig {
            socket,
            rank: RANK,
            ranks: 8,
            leader_pid: std::process::id(),
            setup: WorkerSetup {
                device,
                block_bytes: 16 << 10,
                blocks: 8,
            },
            fault,
        };
        let worker = tokio::spawn(run_worker(config));
        let (mut stream, _) = listener.accept().await.unwrap();
        let (id, hello) = read_control::<_, ToLeader>(&mut stream, &Limits::default())
            .await
            .unwrap();
        assert_eq!(id, 0);
        assert_eq!(
            hello,
            ToLeader::Hello {
                rank: RANK,
                pid: std::process::id()
            }
        );
        FakeLeader {
            stream,
            worker,
            _dir: dir,
        }
    }

    async fn send(&mut self, step: u64, op: StepOp, budget: Duration) {
        let msg = ToWorker::Step {
            op,
            budget_us: budget.as_micros() as u64,
        };
        write_control(&mut self.stream, step, &msg).await.unwrap();
    }

    async fn recv(&mut self) -> (u64, StepOutcome) {
        match read_control::<_, ToLeader>(&mut self.stream, &Limits::default()).await {
            Ok((id, ToLeader::Response(outcome))) => (id, outcome),
            other => panic!("expected a response, got {other:?}"),
        }
    }

    async fn step(&mut self, step: u64, op: StepOp) -> StepOutcome {
        self.send(step, op, Duration::from_secs(5)).await;
        let (id, outcome) = self.recv().await;
        assert_eq!(id, step);
        outcome
    }
}

fn failure(outcome: StepOutcome) -> kvferry::cluster::RankFailure {
    match outcome {
        StepOutcome::Failure(f) => f,
        other => panic!("expected FAILURE, got {other:?}"),
    }
}

#[tokio::test]
async fn every_step_gets_one_structured_answer() {
    let mut l = FakeLeader::start(DeviceKind::Sim, None).await;
    let echo = l
        .step(
            1,
            StepOp::Echo {
                payload: b"hi".to_vec(),
            },
        )
        .await;
    let mut expected = RANK.to_le_bytes().to_vec();
    expected.extend_from_slice(b"hi");
    assert_eq!(echo, StepOutcome::Success(StepPayload::Echo { payload: expected }));

    let f = failure(
        l.step(
            2,
            StepOp::Fail {
                message: "bad input".into(),
            },
        )
        .await,
    );
    assert_eq!(
        (f.kind, f.rank, f.message.as_str()),
        (FailureKind::StepError, RANK, "bad input")
    );

    let f = failure(
        l.step(
            3,
            StepOp::Panic {
                message: "kaboom 42".into(),
            },
        )
        .await,
    );
    assert_eq!((f.kind, f.rank), (FailureKind::Panic, RANK));
    assert!(f.message.contains("kaboom 42"), "{}", f.message);

    // The worker survived the panic and still answers.
    let slept = l.step(4, StepOp::Sleep { millis: 1 }).await;
    assert_eq!(slept, StepOutcome::Success(StepPayload::Slept { millis: 1 }));

    // Shutdown ends the worker cleanly.
    write_control(&mut l.stream, 0, &ToWorker::Shutdown).await.unwrap();
    l.worker.await.unwrap().unwrap();
}

#[tokio::test]
async fn steps_overlap_and_answers_carry_their_step_id() {
    let mut l = FakeLeader::start(DeviceKind::Sim, None).await;
    l.send(10, StepOp::Sleep { millis: 150 }, Duration::from_secs(5)).await;
    l.send(11, StepOp::Echo { payload: vec![] }, Duration::from_secs(5))
        .await;
    assert_eq!(l.recv().await.0, 11, "the quick step answers first");
    assert_eq!(l.recv().await.0, 10);
}

async fn offload_land_round_trip(device: DeviceKind) {
    let mut l = FakeLeader::start(device, None).await;
    let blocks = vec![1, 4, 6];
    let offloaded = l.step(1, StepOp::Offload { blocks: blocks.clone() }).await;
    let StepOutcome::Success(StepPayload::Offloaded {
        blocks: 3,
        bytes,
        checksum: staged,
    }) = offloaded
    else {
        panic!("{offloaded:?}")
    };
    assert_eq!(bytes, 3 * (16 << 10));
    // Offloading a staged block again, an unknown block, or landing an unstaged one is a
    // bad request, not a stall.
    let f = failure(l.step(2, StepOp::Offload { blocks: vec![4] }).await);
    assert_eq!(f.kind, FailureKind::BadRequest, "{f}");
    let f = failure(l.step(3, StepOp::Offload { blocks: vec![99] }).await);
    assert_eq!(f.kind, FailureKind::BadRequest, "{f}");
    let f = failure(l.step(4, StepOp::Land { blocks: vec![0] }).await);
    assert_eq!(f.kind, FailureKind::BadRequest, "{f}");

    let landed = l.step(5, StepOp::Land { blocks }).await;
    let StepOutcome::Success(StepPayload::Landed {
        blocks: 3, checksum, ..
    }) = landed
    else {
        panic!("{landed:?}")
    };
    assert_eq!(checksum, staged, "landed bytes differ from the offloaded bytes");
}

#[tokio::test]
async fn offload_then_land_moves_the_same_bytes_on_sim() {
    offload_land_round_trip(DeviceKind::Sim).await;
}

#[tokio::test]
async fn offload_then_land_moves_the_same_bytes_on_host() {
    offload_land_round_trip(DeviceKind::Host).await;
}

async fn stuck_event_becomes_device_timeout(device: DeviceKind) {
    let fault = FaultPlan {
        fault: WorkerFault::StuckEvent,
        from_step: 2,
    };
    let mut l = FakeLeader::start(device, Some(fault)).await;
    assert!(matches!(
        l.step(1, StepOp::Offload { blocks: vec![0, 1] }).await,
        StepOutcome::Success(_)
    ));
    let budget = Duration::from_millis(200);
    let t0 = Instant::now();
    l.send(2, StepOp::Land { blocks: vec![0, 1] }, budget).await;
    let (id, outcome) = l.recv().await;
    let elapsed = t0.elapsed();
    assert_eq!(id, 2);
    let f = failure(outcome);
    assert_eq!((f.kind, f.rank), (FailureKind::DeviceTimeout, RANK), "{f}");
    assert!(f.message.contains("did not complete"), "{}", f.message);
    assert!(elapsed >= budget, "answered before the budget: {elapsed:?}");
    assert!(elapsed < budget + Duration::from_millis(250), "late: {elapsed:?}");
    // Not a silent stall: the worker keeps answering.
    assert!(matches!(
        l.step(3, StepOp::Echo { payload: vec![1] }).await,
        StepOutcome::Success(_)
    ));
}

#[tokio::test]
async fn a_never_completing_event_is_a_device_timeout_failure_on_sim() {
    stuck_event_becomes_device_timeout(DeviceKind::Sim).await;
}

#[tokio::test]
async fn a_never_completing_event_is_a_device_timeout_failure_on_host() {
    stuck_event_becomes_device_timeout(DeviceKind::Host).await;
}

#[tokio::test]
async fn a_slow_device_past_the_budget_is_a_device_timeout() {
    let fault = FaultPlan {
        fault: WorkerFault::Slow(Duration::from_secs(2)),
        from_step: 1,
    };
    let mut l = FakeLeader::start(DeviceKind::Sim, Some(fault)).await;
    l.send(1, StepOp::Offload { blocks: vec![2] }, Duration::from_millis(100))
        .await;
    let f = failure(l.recv().await.1);
    assert_eq!(f.kind, FailureKind::DeviceTimeout, "{f}");
}

#[tokio::test]
async fn a_hung_worker_stops_answering_from_its_fault_step() {
    let fault = FaultPlan {
        fault: WorkerFault::Hang,
        from_step: 2,
    };
    let mut l = FakeLeader::start(DeviceKind::Sim, Some(fault)).await;
    assert!(matches!(
        l.step(1, StepOp::Echo { payload: vec![] }).await,
        StepOutcome::Success(_)
    ));
    l.send(2, StepOp::Echo { payload: vec![] }, Duration::from_secs(5))
        .await;
    let silent = tokio::time::timeout(Duration::from_millis(300), l.recv()).await;
    assert!(silent.is_err(), "a hung worker answered: {silent:?}");
}

#[tokio::test]
async fn the_worker_ends_when_the_leader_closes_the_connection() {
    let l = FakeLeader::start(DeviceKind::Sim, None).await;
    let FakeLeader { stream, worker, _dir } = l;
    drop(stream);
    let ended = tokio::time::timeout(Duration::from_secs(1), worker).await;
    ended.expect("worker outlived its leader").unwrap().unwrap();
}
