//! A real etcd server (the `etcd` binary) in a host of its own: one member, client
//! port `IP:2379` (and loopback), data in a temporary directory that survives
//! [`Etcd::kill`] so that [`Etcd::restart`] brings back the same store. Readiness is
//! etcd's `/health` answering `true`, polled from inside the host (bounded).
//! Drop kills the process and removes the data directory.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::net::{run, Host};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The etcd client port.
pub const ETCD_PORT: u16 = 2379;

/// A running (or killed, restartable) etcd.
pub struct Etcd {
    child: Option<Child>,
    host: Host,
    data: PathBuf,
    /// `etcd://IP:2379`, as `kvferry --directory` takes it.
    pub url: String,
}

/// Whether an `etcd` binary is installed.
pub fn etcd_available() -> Result<(), String> {
    run("etcd", &["--version"]).map(|_| ())
}

impl Etcd {
    /// Starts etcd in `host` and waits until it is healthy.
    pub fn start(host: &Host) -> Etcd {
        let data = std::env::temp_dir().join(format!(
            "kvferry-netns-etcd-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&data);
        let mut e = Etcd {
            child: None,
            host: host.clone(),
            data,
            url: format!("etcd://{}", host.addr(ETCD_PORT)),
        };
        e.restart();
        e
    }

    /// Starts the process again on the same data (after [`Etcd::kill`]).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "etcd is running");
        let ip = self.host.ip;
        let child = self
            .host
            .command("etcd")
            .args(["--name", "kvferry-test", "--data-dir", self.data.to_str().unwrap()])
            .args([
                "--listen-client-urls",
                &format!("http://{ip}:{ETCD_PORT},http://127.0.0.1:{ETCD_PORT}"),
            ])
            .args(["--advertise-client-urls", &format!("http://{ip}:{ETCD_PORT}")])
            .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-cluster", "kvferry-test=http://127.0.0.1:2380"])
            .args(["--logger", "zap", "--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd via ip netns exec");
        self.child = Some(child);
        let t = Instant::now();
        while !self.healthy() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "etcd in {} never became healthy",
                self.host.ns
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILLs the process (the data stays for [`Etcd::restart`]).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// True when `/health` answers healthy, asked from inside etcd's host.
    pub fn healthy(&self) -> bool {
        health(&self.host, format!("127.0.0.1:{ETCD_PORT}"))
    }

    /// True when `/health` answers healthy, asked from `from` over the network.
    pub fn healthy_from(&self, from: &Host) -> bool {
        health(from, self.host.addr(ETCD_PORT))
    }
}

/// Asks etcd's `/health` at `addr` from inside `from` (bounded: 1 s to connect, 2 s to
/// answer).
fn health(from: &Host, addr: String) -> bool {
    from.run_in(move || {
        let ask = || -> std::io::Result<String> {
            let mut s = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n")?;
            let mut body = String::new();
            s.read_to_string(&mut body)?;
            Ok(body)
        };
        ask().is_ok_and(|b| b.contains("\"health\":\"true\""))
    })
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
