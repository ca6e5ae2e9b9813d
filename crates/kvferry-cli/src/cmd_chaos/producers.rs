//! Producer child processes: `kvferry serve` started from this same executable on
//! loopback with a small arena and the hidden fault flags, SIGKILLed and restarted on
//! the same port, and stopped with SIGTERM at the end — when `serve` closes its arena
//! and reports what was still outstanding.
//!
//! Each child's stderr is read to the end: `injected fault: …` log lines count the
//! faults the child injected (wire corruption, slow sends, connection resets), and the
//! `arena closed: N pages outstanding, M quarantined` line is its final accounting.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// Producer arena: pages of 64 KiB.
pub const PAGE_BYTES: u64 = 64 << 10;
/// Producer arena pages (48 MiB).
pub const ARENA_PAGES: u64 = 768;

/// How to start producers.
#[derive(Clone, Debug)]
pub struct Spec {
    /// The `kvferry` executable.
    pub exe: PathBuf,
    /// Blocks of the producer's KV store.
    pub blocks: u32,
    /// Wire corruption probability per sent chunk (ppm).
    pub corrupt_ppm: u64,
    /// Slow-send probability per sent chunk (ppm).
    pub slow_ppm: u64,
    /// Delay of a slow send (µs).
    pub slow_us: u64,
    /// Connection-reset probability per sent chunk (ppm).
    pub reset_ppm: u64,
}

/// What a producer's stderr said (across its incarnations).
#[derive(Default)]
pub struct ChildLog {
    /// Injected faults by kind, as logged.
    pub faults: Mutex<BTreeMap<String, u64>>,
    /// `(outstanding, quarantined)` from the last incarnation's `arena closed` line.
    pub closed: Mutex<Option<(u64, u64)>>,
    /// `(staged leases, leased pages)` from its `stopped serving` line: what was still
    /// held when it stopped, before the forced release.
    pub held: Mutex<Option<(u64, u64)>>,
    /// The last lines, for diagnostics.
    pub tail: Mutex<VecDeque<String>>,
}

impl ChildLog {
    fn line(&self, line: &str) {
        if let Some(i) = line.find("injected fault: ") {
            let kind = line[i + "injected fault: ".len()..].trim().replace(' ', "_");
            *self.faults.lock().unwrap().entry(kind).or_default() += 1;
            return;
        }
        for (tag, slot) in [("arena closed: ", &self.closed), ("stopped serving: ", &self.held)] {
            if let Some(i) = line.find(tag) {
                let nums: Vec<u64> = line[i..]
                    .split(|c: char| !c.is_ascii_digit())
                    .filter_map(|s| s.parse().ok())
                    .collect();
                if let [a, b, ..] = nums[..] {
                    *slot.lock().unwrap() = Some((a, b));
                }
            }
        }
        let mut t = self.tail.lock().unwrap();
        if t.len() == 20 {
            t.pop_front();
        }
        t.push_back(line.to_string());
    }

    fn tail_text(&self) -> String {
        self.tail.lock().unwrap().iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

/// One producer process (its current incarnation).
pub struct Producer {
    /// Index (names the chunk keys it holds).
    pub index: usize,
    /// Its address, fixed across restarts.
    pub addr: String,
    /// Its log.
    pub log: Arc<ChildLog>,
    child: Child,
    pid: i32,
    readers: Vec<JoinHandle<()>>,
}

impl Producer {
    /// Starts producer `index` on `listen` (a fixed port when restarting: the bind is
    /// retried for a while in case the port is not free yet).
    pub async fn start(spec: &Spec, index: usize, listen: &str, log: Arc<ChildLog>) -> anyhow::Result<Producer> {
        let mut last_err = None;
        for _attempt in 0..50 {
            match Self::try_start(spec, index, listen, log.clone()).await {
                Ok(p) => return Ok(p),
                Err(e) => {
                    last_err = Some(e);
                    if listen.ends_with(":0") {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    async fn try_start(spec: &Spec, index: usize, listen: &str, log: Arc<ChildLog>) -> anyhow::Result<Producer> {
        let mut cmd = Command::new(&spec.exe);
        cmd.arg("serve")
            .args(["--listen", listen])
            .args(["--peer-id", &format!("chaos-producer-{index}")])
            .args(["--model", super::workload::MODEL, "--blocks", &spec.blocks.to_string()])
            .args(["--page-size", &format!("{}KiB", PAGE_BYTES / 1024)])
            .args(["--arena", &format!("{}KiB", ARENA_PAGES * PAGE_BYTES / 1024)])
            .args(["--copy-threads", "1", "--ttl", "2s", "--max-gets", "32"])
            .args(["--io-timeout", "2s", "--idle-timeout", "30s"])
            .args(["--fault-corrupt-ppm", &spec.corrupt_ppm.to_string()])
            .args(["--fault-slow-ppm", &spec.slow_ppm.to_string()])
            .args(["--fault-slow-us", &spec.slow_us.to_string()])
            .args(["--fault-reset-ppm", &spec.reset_ppm.to_string()])
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .env_remove("KVFERRY_SECRET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", spec.exe.display()))?;
        let pid = child.id().context("child has no pid")? as i32;
        let stderr = child.stderr.take().context("child stderr")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let l2 = log.clone();
        let err_reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                l2.line(&line);
            }
        });
        let mut out = BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(10), async {
            while let Ok(Some(line)) = out.next_line().await {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    return rest.split_whitespace().next().map(str::to_string);
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        let Some(addr) = addr else {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            let _ = tokio::time::timeout(Duration::from_secs(1), err_reader).await;
            anyhow::bail!(
                "producer {index} did not start on {listen}; its stderr:\n{}",
                log.tail_text()
            );
        };
        // Keep draining stdout so the child never blocks on (or dies of) a full pipe.
        let out_reader = tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
        *log.closed.lock().unwrap() = None;
        *log.held.lock().unwrap() = None;
        Ok(Producer {
            index,
            addr,
            log,
            child,
            pid,
            readers: vec![err_reader, out_reader],
        })
    }

    /// SIGKILLs the process and reaps it; its in-flight transfers see the sockets die.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        // SAFETY: plain kill(2) on our own child, which has not been reaped yet.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .context("killed producer did not exit")??;
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(2), r).await;
        }
        Ok(())
    }

    /// Stops it with SIGTERM and returns its final accounting.
    pub async fn stop(mut self) -> anyhow::Result<StopReport> {
        // SAFETY: plain kill(2) on our own child, which has not been reaped yet.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        let exited = tokio::time::timeout(Duration::from_secs(15), self.child.wait()).await;
        if exited.is_err() {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(2), r).await;
        }
        let (closed, held) = (*self.log.closed.lock().unwrap(), *self.log.held.lock().unwrap());
        let (Some((outstanding, quarantined)), Some((_, held_pages))) = (closed, held) else {
            anyhow::bail!(
                "producer {} ({}) did not report its arena at shutdown; its stderr:\n{}",
                self.index,
                self.addr,
                self.log.tail_text()
            );
        };
        Ok(StopReport {
            held_pages,
            outstanding,
            quarantined,
        })
    }
}

/// A producer's accounting when it was stopped.
#[derive(Clone, Copy, Debug)]
pub struct StopReport {
    /// Pages still leased when it stopped serving (after the run quiesced and every
    /// lease's TTL passed: each should have come back by `Done` or TTL).
    pub held_pages: u64,
    /// Pages still outstanding after it released everything and closed its arena.
    pub outstanding: u64,
    /// Quarantined pages.
    pub quarantined: u64,
}
