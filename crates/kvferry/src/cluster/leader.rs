//! The leader: starts the worker processes, sends them steps, and turns their answers,
//! their silence and their deaths into one result per step.
//!
//! # Semantics
//!
//! [`Leader::start`] validates the configuration, binds a Unix socket in a fresh
//! private directory, starts `program args... <worker flags>` once per rank and waits
//! (bounded by `startup_timeout`) until every worker has connected and said hello. A
//! worker that exits first, or does not connect in time, fails the start with
//! [`ClusterError::Startup`] naming its rank.
//!
//! Per rank, a reader task feeds every response into the [`StepTracker`] and a writer
//! task sends the steps. End of stream (or a broken frame) on a rank's socket means the
//! rank is dead: its exit status is collected if the process is gone, and the process
//! is SIGKILLed if it is not (a rank the leader calls dead is dead). Every step waiting
//! for that rank then fails with [`ClusterError::WorkerDied`] — within milliseconds of
//! the death, not at the deadline.
//!
//! Workers are spawned from a dedicated thread that lives as long as the leader: a
//! worker's `PR_SET_PDEATHSIG` fires when the thread that spawned it exits, so spawning
//! from a short-lived (e.g. blocking-pool) thread would kill the workers early.
//!
//! Dropping a [`Leader`] SIGKILLs and reaps every worker, stops its tasks and removes
//! its socket directory. [`Leader::shutdown`] asks the workers to exit first.
//!
//! # Cancellation
//!
//! [`Leader::run_step`] may be dropped at any time: the step is abandoned (its result
//! is discarded), while the ranks still owe their answers and are reported stuck by
//! [`Leader::health`] if those never come. Dropping [`Leader::start`] kills and reaps
//! the workers started so far and removes the socket directory. Dropping
//! [`Leader::shutdown`] leaves the leader to be dropped, which kills the workers.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::config::{format_duration, LeaderConfig, WorkerConfig};
use super::processes::{describe_exit, ChildSet, Spawner};
use super::protocol::{StepOp, StepOutcome, ToLeader, ToWorker};
use super::sockdir::SocketDir;
use super::tracker::{Health, Ingest, StepReport, StepTracker};
use super::ClusterError;
use super::StepOutcomeCounts;
use crate::wire::{self, Limits, WireError};

type Waiter = oneshot::Sender<Result<StepReport, ClusterError>>;

/// How long the leader waits, after a rank's socket closed, for its process to become
/// reapable (so the failure can say how it died) before killing it.
const REAP_WAIT: Duration = Duration::from_millis(20);

/// How often start-up checks whether a worker exited before connecting.
const STARTUP_POLL: Duration = Duration::from_millis(20);

/// What [`Leader::shutdown`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Ranks whose process exited within the grace period.
    pub exited: Vec<u32>,
    /// Ranks that had to be SIGKILLed.
    pub killed: Vec<u32>,
}

/// A leader and its worker processes (see the module docs).
#[derive(Debug)]
pub struct Leader {
    shared: Arc<Shared>,
    config: LeaderConfig,
    tasks: Vec<JoinHandle<()>>,
    startup: Duration,
    // Field order matters for drop: the directory goes after the workers are dead, and
    // the spawning thread last (its exit is what PR_SET_PDEATHSIG watches).
    dir: SocketDir,
    _spawner: Spawner,
}

#[derive(Debug)]
struct State {
    tracker: StepTracker,
    waiters: HashMap<u64, Waiter>,
    next_step: u64,
    shut_down: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    children: ChildSet,
    writers: Vec<mpsc::UnboundedSender<(u64, ToWorker)>>,
    budget_us: u64,
    /// Step outcomes by rank (for metrics); locked after `state` when both are held.
    outcomes: Mutex<Vec<StepOutcomeCounts>>,
}

impl Shared {
    /// Resolves whatever the tracker can resolve at `now` and hands the results to the
    /// waiting callers.
    fn settle(&self, state: &mut State, now: Instant) {
        for resolved in state.tracker.poll(now) {
            match &resolved.result {
                Err(ClusterError::Timeout { missing, .. }) => {
                    let mut outcomes = self.outcomes.lock();
                    for r in missing {
                        if let Some(c) = outcomes.get_mut(*r as usize) {
                            c.timeout += 1;
                        }
                    }
                }
                Err(ClusterError::WorkerDied { rank, .. }) => {
                    if let Some(c) = self.outcomes.lock().get_mut(*rank as usize) {
                        c.died += 1;
                    }
                }
                _ => {}
            }
            if let Some(tx) = state.waiters.remove(&resolved.step) {
                let _ = tx.send(resolved.result);
            }
        }
    }
}

impl Leader {
    /// Validates `config`, starts one worker process per rank and waits until all have
    /// connected (see the module docs).
    pub async fn start(config: LeaderConfig) -> Result<Leader, ClusterError> {
        config.validate()?;
        let t0 = Instant::now();
        let dir = SocketDir::create()?;
        let socket = dir.socket_path();
        let listener = UnixListener::bind(&socket)
            .map_err(|e| ClusterError::io(format!("cannot listen on {}", socket.display()), e))?;
        let spawner = Spawner::new()?;
        let mut children = ChildSet::default();
        for rank in 0..config.ranks {
            let worker = WorkerConfig {
                socket: socket.clone(),
                rank,
                ranks: config.ranks,
                leader_pid: std::process::id(),
                setup: config.worker.clone(),
                fault: config.faults.get(&rank).copied(),
            };
            let mut cmd = Command::new(&config.program);
            cmd.args(&config.args)
                .args(worker.to_args())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(if config.worker_stderr {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                });
            let child = spawner
                .spawn(cmd)
                .await
                .map_err(|source| ClusterError::Spawn { rank, source })?;
            children.push(child);
        }
        let deadline = t0 + config.startup_timeout;
        let streams = accept_all(&listener, &children, config.ranks, deadline, &config).await?;
        drop(listener);

        let mut writers = Vec::new();
        let mut halves = Vec::new();
        for stream in streams {
            let (rd, wr) = stream.into_split();
            let (tx, rx) = mpsc::unbounded_channel();
            writers.push(tx);
            halves.push((rd, wr, rx));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                tracker: StepTracker::new(config.ranks),
                waiters: HashMap::new(),
                next_step: 1,
                shut_down: false,
            }),
            children,
            writers,
            budget_us: config.worker_budget().as_micros() as u64,
            outcomes: Mutex::new(vec![StepOutcomeCounts::default(); config.ranks as usize]),
        });
        let mut tasks = Vec::new();
        for (rank, (rd, wr, rx)) in halves.into_iter().enumerate() {
            let rank = rank as u32;
            tasks.push(tokio::spawn(read_loop(shared.clone(), rank, rd)));
            tasks.push(tokio::spawn(write_loop(Arc::downgrade(&shared), rank, wr, rx)));
        }
        let startup = t0.elapsed();
        tracing::debug!(target: "kvferry::cluster", ranks = config.ranks, pids = ?shared.children.pids(),
            "workers up in {}", format_duration(startup));
        Ok(Leader {
            shared,
            config,
            tasks,
            startup,
            dir,
            _spawner: spawner,
        })
    }

    /// Sends `op` to every rank and waits for the step to resolve: a [`StepReport`]
    /// once every rank answered SUCCESS; [`ClusterError::RankFailed`],
    /// [`ClusterError::WorkerDied`] or [`ClusterError::Timeout`] (each naming a rank)
    /// otherwise, at the latest `step_timeout` after dispatch (plus timer and
    /// scheduling latency).
    ///
    /// Steps may overlap; each gets the next step id (from 1).
    ///
    /// # Cancellation
    ///
    /// Dropping the future abandons the step (see the module docs).
    pub async fn run_step(&self, op: StepOp) -> Result<StepReport, ClusterError> {
        let (tx, mut rx) = oneshot::channel();
        let (step, deadline) = {
            let mut st = self.shared.state.lock();
            if st.shut_down {
                return Err(ClusterError::ShutDown);
            }
            let step = st.next_step;
            st.next_step += 1;
            let now = Instant::now();
            let deadline = now + self.config.step_timeout;
            st.tracker.begin(step, now, deadline)?;
            st.waiters.insert(step, tx);
            for (rank, writer) in self.shared.writers.iter().enumerate() {
                if !st.tracker.is_dead(rank as u32) {
                    let msg = ToWorker::Step {
                        op: op.clone(),
                        budget_us: self.shared.budget_us,
                    };
                    // A closed queue means the rank is dying; the reader reports it.
                    let _ = writer.send((step, msg));
                }
            }
            self.shared.settle(&mut st, now);
            (step, deadline)
        };
        let _abandon = AbandonOnDrop {
            shared: &self.shared,
            step,
        };
        let result = tokio::select! {
            r = &mut rx => r,
            _ = tokio::time::sleep_until(deadline) => {
                {
                    let mut st = self.shared.state.lock();
                    self.shared.settle(&mut st, Instant::now().max(deadline));
                }
                rx.await
            }
        };
        result.unwrap_or(Err(ClusterError::ShutDown))
    }

    /// Every rank's health now: unhealthy while any rank is dead or owes an answer past
    /// its step's deadline.
    pub fn health(&self) -> Health {
        self.shared.state.lock().tracker.health(Instant::now())
    }

    /// Step outcomes counted so far, indexed by rank: each rank's SUCCESS and FAILURE
    /// answers (late ones included), the steps that timed out with it silent, and the
    /// steps failed because its worker died. Render with
    /// `metrics::sources::step_outcome_metrics`.
    pub fn step_outcomes(&self) -> Vec<StepOutcomeCounts> {
        self.shared.outcomes.lock().clone()
    }

    /// Number of ranks.
    pub fn ranks(&self) -> u32 {
        self.config.ranks
    }

    /// The configuration the leader runs with.
    pub fn config(&self) -> &LeaderConfig {
        &self.config
    }

    /// The worker process ids, by rank.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.shared.children.pids()
    }

    /// How long start-up took (spawn to last hello).
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The private directory holding the leader's socket (removed on drop).
    pub fn socket_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// SIGKILLs the worker of `rank` (fault injection and tests); returns its pid. The
    /// death is then observed like any other: steps waiting for the rank fail with
    /// [`ClusterError::WorkerDied`].
    pub fn kill_rank(&self, rank: u32) -> Result<u32, ClusterError> {
        self.shared.children.kill(rank)
    }

    /// Asks every worker to exit, waits up to `shutdown_grace` for them, SIGKILLs the
    /// rest and reaps all. Steps still running fail with [`ClusterError::ShutDown`].
    pub async fn shutdown(self) -> ShutdownReport {
        {
            let mut st = self.shared.state.lock();
            st.shut_down = true;
            for (_, tx) in st.waiters.drain() {
                let _ = tx.send(Err(ClusterError::ShutDown));
            }
        }
        for writer in &self.shared.writers {
            let _ = writer.send((0, ToWorker::Shutdown));
        }
        let deadline = Instant::now() + self.config.shutdown_grace;
        let ranks = self.config.ranks;
        let exited: Vec<u32> = loop {
            let exited: Vec<u32> = (0..ranks)
                .filter(|r| self.shared.children.try_wait(*r).is_some())
                .collect();
            if exited.len() == ranks as usize || Instant::now() >= deadline {
                break exited;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let killed = (0..ranks).filter(|r| !exited.contains(r)).collect();
        drop(self);
        ShutdownReport { exited, killed }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        // Kill first, so no worker mistakes the closing sockets for a dead leader.
        self.shared.children.kill_all_and_reap();
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Stops tracking a step whose caller went away; a no-op once it resolved.
struct AbandonOnDrop<'a> {
    shared: &'a Shared,
    step: u64,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        st.tracker.abandon(self.step);
        st.waiters.remove(&self.step);
    }
}

/// Accepts one connection per rank and reads each one's hello, until `deadline`.
async fn accept_all(
    listener: &UnixListener,
    children: &ChildSet,
    ranks: u32,
    deadline: Instant,
    config: &LeaderConfig,
) -> Result<Vec<UnixStream>, ClusterError> {
    let mut conns: Vec<Option<UnixStream>> = (0..ranks).map(|_| None).collect();
    let mut hellos = FuturesUnordered::new();
    let mut tick = tokio::time::interval(STARTUP_POLL);
    let missing = |conns: &[Option<UnixStream>]| conns.iter().position(Option::is_none).map(|r| r as u32);
    while let Some(first_missing) = missing(&conns) {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted.map_err(|e| ClusterError::io("accepting a worker connection", e))?;
                hellos.push(read_hello(stream, deadline));
            }
            Some(hello) = hellos.next(), if !hellos.is_empty() => match hello {
                Ok((rank, pid, stream)) => {
                    let slot = conns.get_mut(rank as usize).filter(|s| s.is_none()).ok_or_else(|| {
                        ClusterError::Protocol(format!("hello from rank {rank}, which is out of range or already connected"))
                    })?;
                    if children.pid(rank) != Some(pid) {
                        tracing::warn!(target: "kvferry::cluster", rank, pid, "hello from an unexpected process id");
                    }
                    *slot = Some(stream);
                }
                Err(e) => tracing::warn!(target: "kvferry::cluster", "dropping a connection without a valid hello: {e}"),
            },
            _ = tick.tick() => {
                for rank in 0..ranks {
                    if conns[rank as usize].is_none() {
                        if let Some(status) = children.try_wait(rank) {
                            return Err(ClusterError::Startup {
                                rank,
                                reason: format!("worker {} before connecting", describe_exit(status)),
                            });
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(ClusterError::Startup {
                    rank: first_missing,
                    reason: format!("did not connect within {}", format_duration(config.startup_timeout)),
                });
            }
        }
    }
    Ok(conns.into_iter().flatten().collect())
}

async fn read_hello(mut stream: UnixStream, deadline: Instant) -> Result<(u32, u32, UnixStream), ClusterError> {
    let limits = Limits::default();
    let read = wire::read_control::<_, ToLeader>(&mut stream, &limits);
    match tokio::time::timeout_at(deadline, read).await {
        Ok(Ok((_, ToLeader::Hello { rank, pid }))) => Ok((rank, pid, stream)),
        Ok(Ok((_, other))) => Err(ClusterError::Unexpected {
            expected: "Hello",
            got: other.name(),
        }),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ClusterError::Protocol("no hello before the start-up deadline".into())),
    }
}

/// Feeds a rank's responses into the tracker until its connection ends, then reports
/// the rank dead.
async fn read_loop(shared: Arc<Shared>, rank: u32, mut rd: OwnedReadHalf) {
    let limits = Limits::default();
    let why = loop {
        match wire::read_control::<_, ToLeader>(&mut rd, &limits).await {
            Ok((step, ToLeader::Response(outcome))) => {
                let success = matches!(outcome, StepOutcome::Success(_));
                let mut st = shared.state.lock();
                match st.tracker.on_response(step, rank, outcome) {
                    Ingest::Accepted | Ingest::Late => {
                        if let Some(c) = shared.outcomes.lock().get_mut(rank as usize) {
                            if success {
                                c.success += 1;
                            } else {
                                c.failure += 1;
                            }
                        }
                    }
                    other => {
                        tracing::warn!(target: "kvferry::cluster", rank, step, "ignoring response: {other:?}")
                    }
                }
                shared.settle(&mut st, Instant::now());
            }
            Ok((_, other)) => {
                tracing::warn!(target: "kvferry::cluster", rank, "ignoring unexpected message {}", other.name());
            }
            Err(WireError::Closed) => break "connection closed".to_string(),
            Err(e) => break format!("connection failed: {e}"),
        }
    };
    drop(rd);
    // The socket closes while the process exits; give it a moment to become reapable so
    // the failure can say how it died.
    let give_up = Instant::now() + REAP_WAIT;
    let status = loop {
        if let Some(status) = shared.children.try_wait(rank) {
            break Some(status);
        }
        if Instant::now() >= give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let cause = match status {
        Some(status) => describe_exit(status),
        None => {
            let _ = shared.children.kill(rank);
            format!("{why}; process killed")
        }
    };
    tracing::debug!(target: "kvferry::cluster", rank, "rank died: {cause}");
    let mut st = shared.state.lock();
    st.tracker.on_rank_died(rank, cause);
    shared.settle(&mut st, Instant::now());
}

/// Sends queued messages to one rank. A failed write kills the rank's process (its
/// reader then reports it dead): the stream is no longer usable.
async fn write_loop(
    shared: Weak<Shared>,
    rank: u32,
    mut wr: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<(u64, ToWorker)>,
) {
    while let Some((id, msg)) = rx.recv().await {
        if let Err(e) = wire::write_control(&mut wr, id, &msg).await {
            tracing::debug!(target: "kvferry::cluster", rank, "write failed: {e}");
            if let Some(shared) = shared.upgrade() {
                let _ = shared.children.kill(rank);
            }
            return;
        }
    }
}
