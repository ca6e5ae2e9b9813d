//! What the CLI tests share: [`Serve`], a running `kvferry serve` child process.
#![allow(dead_code)]

pub mod other_uid;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How `serve` announces its peer address (the first line it prints).
const LISTENING: &str = "kvferry serve: listening on ";
/// How `serve` announces its metrics address (`--metrics`).
const METRICS_ON: &str = "kvferry serve: metrics on ";

/// A running `kvferry serve`: started by [`Serve::spawn`] once it printed where it
/// listens, SIGKILLed and reaped on drop (also when the test fails). A thread reads
/// its stdout to the end (kept, up to 1 MiB, for failure messages), so the process
/// never blocks on a full pipe.
pub struct Serve {
    pub child: Child,
    /// Its peer address, from the "listening on" line.
    pub addr: String,
    /// The "listening on" line.
    pub line: String,
    /// Its metrics address, when start-up waited for it.
    pub metrics: Option<SocketAddr>,
    /// Its stdout so far.
    stdout: Arc<Mutex<String>>,
}

impl Serve {
    /// `kvferry serve --listen LISTEN --model tiny --transport tcp` (this crate's
    /// binary), for [`Serve::spawn`]; the caller adds the rest. The socket mover: the
    /// suites built on it count, shape and cut bytes on the wire (`p2p_process` also
    /// tests the same-host mover, which `serve` offers by default).
    pub fn command_on(listen: &str) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
        cmd.args(["serve", "--listen", listen, "--model", "tiny", "--transport", "tcp"]);
        cmd
    }

    /// [`command_on`](Serve::command_on) a free loopback port.
    pub fn command() -> Command {
        Serve::command_on("127.0.0.1:0")
    }

    /// Spawns `cmd` (a `kvferry serve` command; its stdout is piped here, everything
    /// else is the caller's) and waits, at most `within`, for the "listening on" line
    /// and, with `metrics`, the "metrics on" line. Otherwise the process is killed and
    /// the error says why, with its stderr where the caller piped it.
    pub fn spawn(cmd: &mut Command, within: Duration, metrics: bool) -> Result<Serve, String> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot spawn kvferry serve: {e}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = mpsc::channel();
        let kept = Arc::new(Mutex::new(String::new()));
        // Read on after start-up too (nobody listens then): the process may print more.
        keep_lines(stdout, kept.clone(), move |line| {
            let _ = tx.send(line);
        });
        let deadline = Instant::now() + within;
        let (mut addr, mut line, mut metrics_addr) = (None, String::new(), None);
        while addr.is_none() || (metrics && metrics_addr.is_none()) {
            let next = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
            let l = match next {
                Ok(l) => l,
                Err(end) => {
                    let _ = child.kill();
                    let mut err = String::new();
                    if let Some(mut stderr) = child.stderr.take() {
                        let _ = stderr.read_to_string(&mut err);
                    }
                    let _ = child.wait();
                    let why = match end {
                        RecvTimeoutError::Timeout => format!("no address within {within:?}"),
                        RecvTimeoutError::Disconnected => "it ended".to_string(),
                    };
                    return Err(format!("serve did not start ({why}); stderr: {err}"));
                }
            };
            if let Some(rest) = l.strip_prefix(LISTENING) {
                addr = rest.split_whitespace().next().map(str::to_string);
                line = l;
            } else if let Some(rest) = l.strip_prefix(METRICS_ON) {
                metrics_addr = rest.split_whitespace().next().and_then(|a| a.parse().ok());
            }
        }
        Ok(Serve {
            child,
            addr: addr.expect("waited for it"),
            line,
            metrics: metrics_addr,
            stdout: kept,
        })
    }

    /// What it printed on stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// Its metrics address; panics when start-up did not wait for one.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics.expect("serve was started with metrics")
    }

    /// [`spawn`](Serve::spawn), panicking when it does not start.
    pub fn start(cmd: &mut Command, within: Duration, metrics: bool) -> Serve {
        Serve::spawn(cmd, within, metrics).unwrap_or_else(|why| panic!("{why}"))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads `r` line by line to its end on a thread of its own: each line is appended to
/// `log` (up to 1 MiB; the rest is read and dropped) and then handed to `each`.
pub fn keep_lines(
    r: impl Read + Send + 'static,
    log: Arc<Mutex<String>>,
    mut each: impl FnMut(String) + Send + 'static,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { return };
            {
                let mut l = log.lock().unwrap();
                if l.len() < 1 << 20 {
                    l.push_str(&line);
                    l.push('\n');
                }
            }
            each(line);
        }
    });
}

/// `put --peer PEER --key KEY --file FILE`: the arguments of a `kvferry put`.
pub fn put_args<'a>(peer: &'a str, key: &'a str, file: &'a str) -> Vec<&'a str> {
    vec!["put", "--peer", peer, "--key", key, "--file", file]
}

/// `get --peer PEER --key KEY --model tiny`: the arguments of a `kvferry get` of the
/// tiny model; the caller adds the rest (`--out`, `--timeout`, TLS flags).
pub fn get_args<'a>(peer: &'a str, key: &'a str) -> Vec<&'a str> {
    vec!["get", "--peer", peer, "--key", key, "--model", "tiny"]
}

/// The 20 000 bytes the `put` / `get` round trips send.
pub fn round_trip_bytes() -> Vec<u8> {
    (0..20_000u32).map(|i| (i * 31 % 251) as u8).collect()
}

/// `kvferry SUBCOMMAND ARGS` (this crate's binary) run to its end, with no stdin and
/// without `RUST_BACKTRACE` or `RUST_LOG` from the test's environment.
pub fn run_subcommand(subcommand: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .arg(subcommand)
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// `bytes` (a child's stdout or stderr) as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
