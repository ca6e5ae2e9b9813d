//! The leader's worker processes: [`ChildSet`] holds them by rank (killed and reaped
//! on drop), [`Spawner`] starts them from a dedicated thread that lives as long as the
//! leader (a worker's `PR_SET_PDEATHSIG` fires when the thread that spawned it exits,
//! so spawning from a short-lived thread would kill the workers early; a process whose
//! caller went away before it was handed over is killed and reaped at once), and
//! [`describe_exit`] says how one ended.
//!
//! # Cancellation
//!
//! Dropping [`Spawner::spawn`] leaves nothing behind: the spawning thread kills and
//! reaps a process nobody is waiting for.

use std::process::{Child, Command, ExitStatus};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::ClusterError;

/// Describes how a process ended.
pub(crate) fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        let name = match sig {
            libc::SIGKILL => " (SIGKILL)",
            libc::SIGTERM => " (SIGTERM)",
            libc::SIGABRT => " (SIGABRT)",
            libc::SIGSEGV => " (SIGSEGV)",
            libc::SIGBUS => " (SIGBUS)",
            _ => "",
        };
        format!("killed by signal {sig}{name}")
    } else if let Some(code) = status.code() {
        format!("exited with status {code}")
    } else {
        status.to_string()
    }
}

/// The worker processes, by rank. Killed and reaped on drop.
#[derive(Debug, Default)]
pub(super) struct ChildSet {
    children: Vec<Mutex<Child>>,
    pids: Vec<u32>,
}

impl ChildSet {
    pub(super) fn push(&mut self, child: Child) {
        self.pids.push(child.id());
        self.children.push(Mutex::new(child));
    }

    pub(super) fn pids(&self) -> Vec<u32> {
        self.pids.clone()
    }

    pub(super) fn pid(&self, rank: u32) -> Option<u32> {
        self.pids.get(rank as usize).copied()
    }

    /// The exit status if the process has exited (reaping it).
    pub(super) fn try_wait(&self, rank: u32) -> Option<ExitStatus> {
        self.children.get(rank as usize)?.lock().try_wait().ok().flatten()
    }

    /// SIGKILLs one worker (a no-op if it was already reaped: `Child` never signals a
    /// reaped, possibly reused, pid).
    pub(super) fn kill(&self, rank: u32) -> Result<u32, ClusterError> {
        let child = self
            .children
            .get(rank as usize)
            .ok_or_else(|| ClusterError::InvalidConfig {
                field: "rank",
                reason: format!("no rank {rank}"),
            })?;
        let mut child = child.lock();
        child
            .kill()
            .map_err(|e| ClusterError::io(format!("cannot kill rank {rank}"), e))?;
        Ok(child.id())
    }

    /// SIGKILLs every worker, then reaps every one.
    pub(super) fn kill_all_and_reap(&self) {
        for child in &self.children {
            let _ = child.lock().kill();
        }
        for child in &self.children {
            let _ = child.lock().wait();
        }
    }
}

impl Drop for ChildSet {
    fn drop(&mut self) {
        self.kill_all_and_reap();
    }
}

/// A thread that spawns the worker processes and then lives as long as the leader.
#[derive(Debug)]
pub(super) struct Spawner {
    tx: std::sync::mpsc::Sender<SpawnJob>,
}

struct SpawnJob {
    cmd: Command,
    reply: oneshot::Sender<std::io::Result<Child>>,
}

impl Spawner {
    pub(super) fn new() -> Result<Spawner, ClusterError> {
        let (tx, rx) = std::sync::mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("kvferry-leader-spawn".into())
            .spawn(move || {
                // Ends when the leader drops the sender.
                for mut job in rx {
                    // If the caller went away meanwhile, no process may be left behind.
                    if let Err(Ok(mut orphan)) = job.reply.send(job.cmd.spawn()) {
                        let _ = orphan.kill();
                        let _ = orphan.wait();
                    }
                }
            })
            .map_err(|e| ClusterError::io("cannot start the spawning thread", e))?;
        Ok(Spawner { tx })
    }

    pub(super) async fn spawn(&self, cmd: Command) -> std::io::Result<Child> {
        let (reply, rx) = oneshot::channel();
        let gone = || std::io::Error::other("the spawning thread is gone");
        self.tx.send(SpawnJob { cmd, reply }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}
