//! The producer process (`--producer-process`): the benchmark re-runs its own program
//! (`std::env::current_exe()`) with the point's options and the hidden
//! `--serve-producers`, so that the consumer's same-host reads cross a process boundary
//! as they do in production.
//!
//! The conversation, one JSON line each way at a time:
//! 1. the parent writes a [`Setup`] line on the child's stdin (mutual-TLS PEMs under
//!    `--tls`, generated in memory by the parent's ephemeral CA);
//! 2. the child starts and fills the producers exactly as in-process producers are
//!    ([`start_local`]), then prints a [`Hello`] line on stdout: its pid, the
//!    producers' addresses, the memory the one-copy limit reads, its staging backing;
//! 3. the child serves until its stdin closes (the parent drops it once the rounds
//!    are over, or dies), then quiesces and counts every page of its producers'
//!    arenas that did not come back, closes its engines and prints a [`Farewell`] line
//!    with that count, and exits.
//!
//! The parent kills and reaps the child when its [`ProducerChild`] is dropped without
//! [`ProducerChild::finish`] (an error, a panic): the child is never left behind, and a
//! parent that dies closes the child's stdin, which ends it too.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::args::P2pBenchArgs;
use super::producers::start_local;

/// What the parent hands the child first (on its stdin).
#[derive(Serialize, Deserialize, Default)]
pub(super) struct Setup {
    /// Per producer, `(certificate, key, CA)` PEMs under `--tls`.
    pub(super) tls: Vec<Option<(String, String, String)>>,
}

/// The child's first stdout line, once its producers are filled and listening.
#[derive(Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) pid: u32,
    pub(super) addrs: Vec<String>,
    /// Per producer, the `(address, length)` its chunks are laid out in (see
    /// `producers::Local::bases`).
    pub(super) bases: Vec<(usize, usize)>,
    /// The least pinned producer arena's backing, why it is not pinned, and whether
    /// every producer arena is pinned.
    pub(super) staging_backing: String,
    pub(super) staging_fallback: Option<String>,
    pub(super) staging_pinned: bool,
}

/// The child's last stdout line, after its stdin closed.
#[derive(Serialize, Deserialize)]
pub(super) struct Farewell {
    /// Pages of the producers' arenas not returned after a quiesce (measured in the
    /// child, where those arenas live).
    pub(super) leaked_pages: u64,
}

/// Longest the child may take to start and fill its producers.
const HELLO_WITHIN: Duration = Duration::from_secs(600);
/// Longest the child may take to quiesce, close and say goodbye.
const FAREWELL_WITHIN: Duration = Duration::from_secs(30);

/// A running producer process.
pub(super) struct ProducerChild {
    child: Child,
    stdin: Option<ChildStdin>,
    /// The child's stdout lines (a reader thread ends at its end of file; in a mutex
    /// only so that the point's future, which holds this, is `Send`).
    lines: std::sync::Mutex<mpsc::Receiver<String>>,
}

impl ProducerChild {
    /// Starts the producer process for the point `args` and sends it `setup`.
    pub(super) fn spawn(args: &P2pBenchArgs, setup: &Setup) -> anyhow::Result<ProducerChild> {
        let exe = std::env::current_exe().context("finding this program to run the producer process")?;
        let mut cmd = Command::new(exe);
        cmd.args(child_args(args))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("starting the producer process")?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name("bench-producer-stdout".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })?;
        let mut me = ProducerChild {
            stdin: child.stdin.take(),
            child,
            lines: std::sync::Mutex::new(lines),
        };
        let stdin = me.stdin.as_mut().expect("piped");
        writeln!(stdin, "{}", serde_json::to_string(setup)?)?;
        stdin.flush()?;
        Ok(me)
    }

    /// The child's pid.
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the child's [`Hello`] (blocking).
    pub(super) fn hello(mut self) -> anyhow::Result<(ProducerChild, Hello)> {
        let line = self.line(HELLO_WITHIN)?;
        let hello: Hello =
            serde_json::from_str(&line).with_context(|| format!("the producer process said {line:?}"))?;
        anyhow::ensure!(
            hello.pid == self.pid(),
            "the producer process reports pid {}",
            hello.pid
        );
        Ok((self, hello))
    }

    /// Closes the child's stdin, reads its [`Farewell`] and reaps it (blocking).
    pub(super) fn finish(mut self) -> anyhow::Result<Farewell> {
        drop(self.stdin.take());
        let line = self.line(FAREWELL_WITHIN)?;
        let bye: Farewell =
            serde_json::from_str(&line).with_context(|| format!("the producer process said {line:?}"))?;
        let until = Instant::now() + FAREWELL_WITHIN;
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::ensure!(status.success(), "the producer process ended with {status}");
                return Ok(bye);
            }
            anyhow::ensure!(Instant::now() < until, "the producer process did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The child's next stdout line, within `limit`.
    fn line(&mut self, limit: Duration) -> anyhow::Result<String> {
        let got = self
            .lines
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .recv_timeout(limit);
        match got {
            Ok(line) => Ok(line),
            Err(mpsc::RecvTimeoutError::Timeout) => anyhow::bail!("the producer process said nothing for {limit:?}"),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.wait()?;
                anyhow::bail!(
                    "the producer process ended ({status}) before saying what it should (see its errors above)"
                )
            }
        }
    }
}

impl Drop for ProducerChild {
    fn drop(&mut self) {
        drop(self.stdin.take());
        // Already exited (finish): nothing to kill; reaped either way.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The command line of the producer process for the point `args`: what the producers
/// depend on (sizes, layout, path, mover, copy threads), as run.
fn child_args(args: &P2pBenchArgs) -> Vec<String> {
    let mut v: Vec<String> = [
        "bench",
        "p2p",
        "--serve-producers",
        "--quiet",
        "--model",
        &args.model,
        "--blocks-per-chunk",
        &args.blocks_per_chunk.to_string(),
        "--in-flight",
        &args.in_flight.to_string(),
        "--requests",
        &args.requests.to_string(),
        "--chunks-per-request",
        &args.chunks_per_request.to_string(),
        "--keys-per-get",
        &args.keys_per_get.to_string(),
        "--producers",
        &args.producers.to_string(),
        "--path",
        &args.path.to_string(),
        "--transport",
        args.transport.as_str(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(t) = args.copy_threads {
        v.extend(["--copy-threads".to_string(), t.to_string()]);
    }
    v
}

/// The producer process's main (`--serve-producers`): see the module docs.
pub(super) fn serve(args: P2pBenchArgs) -> anyhow::Result<()> {
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line).context("reading the setup")?;
    let setup: Setup = serde_json::from_str(&line).context("the setup line")?;
    let tls = setup
        .tls
        .iter()
        .map(|t| t.as_ref().map(crate::cmd_bench::tls::from_pem).transpose())
        .collect::<anyhow::Result<Vec<_>>>()?;
    let shape = super::shape(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let local = rt.block_on(start_local(&args, &shape, tls))?;
    let is_pinned = |a: &kvferry::mem::Arena| a.backing_kind() != kvferry::mem::BackingKind::Unlocked;
    let mut staging = None;
    let mut pinned = true;
    for e in &local.engines {
        let a = e.arena();
        if staging.is_none() || (pinned && !is_pinned(a)) {
            staging = Some((a.backing_kind().to_string(), a.fallback_reason()));
            pinned = is_pinned(a);
        }
    }
    let (staging_backing, staging_fallback) = staging.unwrap_or_default();
    let hello = Hello {
        pid: std::process::id(),
        addrs: local
            .engines
            .iter()
            .map(|p| p.address().expect("producers listen").to_string())
            .collect(),
        bases: local.bases.clone(),
        staging_backing,
        staging_fallback,
        staging_pinned: pinned,
    };
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&hello)?)?;
        out.flush()?;
    }
    // Serve until the parent closes stdin (or dies).
    let mut buf = [0u8; 256];
    while !matches!(stdin.read(&mut buf), Ok(0) | Err(_)) {}
    let leaked = rt.block_on(async {
        let quiesce = Instant::now() + Duration::from_secs(5);
        let leaked = loop {
            let leaked: u64 = local
                .engines
                .iter()
                .map(|p| {
                    let s = p.arena().stats();
                    (s.total_pages - s.free_pages - s.quarantined_pages) as u64
                })
                .sum();
            if leaked == 0 || Instant::now() > quiesce {
                break leaked;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        for p in &local.engines {
            p.clone()
                .close(tokio::time::Instant::now() + Duration::from_secs(5))
                .await;
        }
        leaked
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&Farewell { leaked_pages: leaked })?)?;
    out.flush()?;
    drop(local);
    Ok(())
}
