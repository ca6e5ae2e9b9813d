//! A private etcd server for a test: free loopback ports, its own data directory,
//! killed (and the directory removed) on drop. Tests skip, with a message, when the
//! `etcd` binary is absent — unless `CI=true`, where its absence is a failure.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    dir: PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

impl Etcd {
    /// Starts one, or returns `None` (after saying why) when `etcd` is not installed
    /// and this is not CI.
    pub fn start() -> Option<Etcd> {
        if etcd_binary().is_none() {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("the `etcd` binary is not installed (apt-get install etcd-server); CI needs it");
            }
            eprintln!("SKIP: the `etcd` binary is not installed (apt-get install etcd-server)");
            return None;
        }
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvferry-etcd-{}-{}-{:08x}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut e = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir,
        };
        // A port picked free may be taken by another test before etcd binds it: pick
        // again (only at first start; a restart keeps its ports).
        for attempt in 0.. {
            match e.try_spawn() {
                Ok(()) => break,
                Err(log) if attempt < 5 && log.contains("address already in use") => {
                    let _ = std::fs::remove_dir_all(e.dir.join("data"));
                    e.client_port = free_port();
                    e.peer_port = free_port();
                }
                Err(log) => panic!("etcd exited while starting:\n{log}"),
            }
        }
        Some(e)
    }

    /// `etcd://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn spawn(&mut self) {
        if let Err(log) = self.try_spawn() {
            panic!("etcd exited while starting:\n{log}");
        }
    }

    /// Starts etcd and waits until it is healthy; `Err(its log)` when it exited first.
    fn try_spawn(&mut self) -> Result<(), String> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).unwrap();
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(20))
    }

    fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(
            &format!("127.0.0.1:{}", self.client_port).parse().unwrap(),
            Duration::from_millis(200),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n").is_err() {
            return false;
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.contains("\"health\":\"true\"")
    }

    fn wait_healthy(&mut self, limit: Duration) -> Result<(), String> {
        let start = Instant::now();
        while !self.healthy() {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
                return Err(format!("({st})\n{log}"));
            }
            assert!(start.elapsed() < limit, "etcd not healthy after {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// SIGKILLs it (its data stays, for `restart`).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The next directory event about `peer` on `rx`, within `limit` (events about other
/// peers are skipped); panics naming the peer when none comes.
pub async fn next_event(
    rx: &mut tokio::sync::broadcast::Receiver<kvferry::directory::PeerEvent>,
    peer: &str,
    limit: Duration,
) -> kvferry::directory::PeerEvent {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let ev = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no event about {peer} within {limit:?}"))
            .unwrap();
        if ev.peer_id() == peer {
            return ev;
        }
    }
}
