//! `kvferry serve` processes inside hosts, and the `kvferry put`/`get` commands run
//! inside hosts.
//!
//! Every server listens on `0.0.0.0:7070` of its own host (ports repeat freely across
//! namespaces), requires the shared [`SECRET`], serves Prometheus metrics on
//! `0.0.0.0:9090` and takes the peer id `h<index>` unless told otherwise. Start-up waits
//! for the "listening on" line (bounded); the rest of its output is drained into a
//! buffer kept for failure messages. Drop SIGKILLs the process.

use std::io::{Read, Write};
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::net::Host;

/// The shared secret of every server and client in these tests.
pub const SECRET: &str = "netns-hosts-secret-0123456789abcdef-0123";
/// The port every server listens on (inside its own host).
pub const PORT: u16 = 7070;
/// The port every server serves metrics on (inside its own host).
pub const METRICS_PORT: u16 = 9090;
/// The model preset of every server.
pub const MODEL: &str = "tiny";

/// A running `kvferry serve` in a host.
pub struct Serve {
    /// The process (SIGKILLed and reaped on drop).
    process: crate::common::Serve,
    /// Where it runs.
    pub host: Host,
    /// Its peer address, `IP:7070`.
    pub addr: String,
    /// Its incarnation, from the start-up line.
    pub incarnation: u64,
    /// Its stderr so far.
    log: Arc<Mutex<String>>,
}

fn drain(r: impl Read + Send + 'static, log: Arc<Mutex<String>>) {
    crate::common::keep_lines(r, log, |_| {});
}

/// Parses `incarnation 0x...` out of the start-up line.
fn parse_incarnation(line: &str) -> Option<u64> {
    let rest = line.split("incarnation ").nth(1)?;
    let hex: String = rest
        .trim_start_matches("0x")
        .chars()
        .take_while(|c| c.is_ascii_hexdigit())
        .collect();
    u64::from_str_radix(&hex, 16).ok()
}

impl Serve {
    /// Starts `kvferry serve` in `host` with the common flags plus `extra`.
    pub fn start(host: &Host, extra: &[&str]) -> Serve {
        let peer_id = format!("h{}", host.index);
        let t = Instant::now();
        loop {
            let mut cmd = host.command(env!("CARGO_BIN_EXE_kvferry"));
            // The socket mover: these tests shape and cut the links between hosts
            // (network namespaces share one kernel, so `auto` would read memory).
            cmd.args(["serve", "--listen", &format!("0.0.0.0:{PORT}"), "--model", MODEL])
                .args(["--transport", "tcp"])
                .args(["--blocks", "8192", "--arena", "32MiB", "--page-size", "64KiB"])
                .args(["--metrics", &format!("0.0.0.0:{METRICS_PORT}"), "--peer-id", &peer_id])
                .args(extra)
                .env("KVFERRY_SECRET", SECRET)
                .stdin(Stdio::null())
                .stderr(Stdio::piped());
            match crate::common::Serve::spawn(&mut cmd, Duration::from_secs(20), false) {
                Ok(mut process) => {
                    let log = Arc::new(Mutex::new(String::new()));
                    drain(process.child.stderr.take().unwrap(), log.clone());
                    let line = &process.line;
                    let incarnation = parse_incarnation(line).unwrap_or_else(|| panic!("no incarnation in {line:?}"));
                    let s = Serve {
                        process,
                        addr: host.addr(PORT),
                        host: host.clone(),
                        incarnation,
                        log,
                    };
                    s.wait_metrics();
                    return s;
                }
                Err(why) => assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "serve in {} did not start: {why}",
                    host.ns
                ),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_metrics(&self) {
        let t = Instant::now();
        while self.try_metrics().is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "metrics of {} never answered",
                self.host.ns
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) {
        let _ = self.process.child.kill();
        let _ = self.process.child.wait();
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.process.child.try_wait(), Ok(None))
    }

    /// Its stdout and stderr so far.
    pub fn log(&self) -> String {
        format!("{}{}", self.process.stdout(), self.log.lock().unwrap())
    }

    /// The Prometheus text from its metrics endpoint, fetched inside its host.
    pub fn try_metrics(&self) -> std::io::Result<String> {
        self.host.run_in(|| {
            let mut s = std::net::TcpStream::connect_timeout(
                &format!("127.0.0.1:{METRICS_PORT}").parse().unwrap(),
                Duration::from_secs(2),
            )?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")?;
            let mut body = String::new();
            s.read_to_string(&mut body)?;
            Ok(body)
        })
    }

    /// One metric's value: `name` is matched against the text before the value, e.g.
    /// `kvferry_arena_pages{role="producer",state="leased"}`.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let text = self.try_metrics().ok()?;
        metric_in(&text, name)
    }

    /// The sum of every sample of the family `name` (all label sets), if any.
    pub fn metric_total(&self, name: &str) -> Option<f64> {
        let text = self.try_metrics().ok()?;
        let samples: Vec<f64> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let value = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once("} ")?.1,
                    None => rest.strip_prefix(' ')?,
                };
                value.trim().parse::<f64>().ok()
            })
            .collect();
        (!samples.is_empty()).then(|| samples.iter().sum())
    }
}

impl Serve {
    /// Waits (at most `limit`) until the metrics show no leased page, no staged lease
    /// and no quarantined page; the error names what is still held.
    pub fn wait_no_leaks(&self, limit: Duration) -> Result<(), String> {
        let t = Instant::now();
        loop {
            let text = self.try_metrics().unwrap_or_default();
            let m = |name: &str| metric_in(&text, name);
            let leased = m(r#"kvferry_arena_pages{role="producer",state="leased"}"#);
            let quarantined = m(r#"kvferry_arena_pages{role="producer",state="quarantined"}"#);
            let staged = m(r#"kvferry_staged_leases{role="producer"}"#);
            if leased == Some(0.0) && staged == Some(0.0) && quarantined == Some(0.0) {
                return Ok(());
            }
            if t.elapsed() > limit {
                return Err(format!(
                    "{} holds after {limit:?}: leased pages {leased:?}, staged leases {staged:?}, quarantined {quarantined:?}",
                    self.addr
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A metric's value in Prometheus text.
pub fn metric_in(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Runs `kvferry ARGS` inside `host` with the shared secret, bounded by `limit`
/// (killed past it: the test then fails on the output).
pub fn kvferry(host: &Host, args: &[&str], limit: Duration) -> Output {
    let mut child = host
        .command(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .env("KVFERRY_SECRET", SECRET)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvferry via ip netns exec");
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait kvferry") {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            break child.wait().expect("wait killed kvferry");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}
