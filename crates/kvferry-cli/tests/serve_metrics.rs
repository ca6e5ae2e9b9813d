//! `kvferry serve --metrics`: the daemon's Prometheus endpoint, scraped over HTTP while
//! `kvferry put` and `kvferry get` move a chunk through it; and the `transfer` tracing
//! span of `kvferry get`, filtered by `RUST_LOG`, as JSON lines.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

/// A `kvferry serve` child, SIGKILLed on drop if still running.
struct Serve {
    child: Child,
    listen: String,
    metrics: SocketAddr,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve() -> Serve {
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
            "--arena",
            "16MiB",
        ])
        .args(["--model", "tiny", "--blocks", "64", "--copy-threads", "1"])
        .env_remove("RUST_LOG")
        .env_remove("KVFERRY_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let (mut listen, mut metrics) = (None, None);
    while listen.is_none() || metrics.is_none() {
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("serve did not print its addresses; stderr: {err}");
            }
        };
        if let Some(rest) = line.strip_prefix("kvferry serve: listening on ") {
            listen = rest.split(' ').next().map(str::to_string);
        } else if let Some(rest) = line.strip_prefix("kvferry serve: metrics on ") {
            metrics = rest.split(' ').next().map(|a| a.parse().unwrap());
        }
    }
    Serve {
        child,
        listen: listen.unwrap(),
        metrics: metrics.unwrap(),
    }
}

/// A raw HTTP/1.1 GET: `(status, body)`.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: kvferry\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    if status == 200 {
        assert!(head.contains("Content-Type: text/plain; version=0.0.4"), "{head}");
    }
    (status, body.to_string())
}

/// The value of the sample line named exactly `series`.
fn sample(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in\n{body}"))
        .parse()
        .unwrap()
}

#[test]
fn serve_exposes_metrics_that_move_with_put_and_get() {
    let mut s = serve();
    let (status, body) = http_get(s.metrics, "/metrics");
    assert_eq!(status, 200);
    // 16 MiB of 2 MiB pages, all free; nothing moved yet.
    assert_eq!(
        sample(&body, r#"kvferry_arena_pages{role="producer",state="free"}"#),
        8.0
    );
    assert_eq!(
        sample(&body, r#"kvferry_arena_pages{role="producer",state="leased"}"#),
        0.0
    );
    assert_eq!(
        sample(&body, r#"kvferry_bytes_total{role="producer",direction="sent"}"#),
        0.0
    );
    assert_eq!(sample(&body, "kvferry_connections_accepted_total"), 0.0);
    assert!(body.contains("# TYPE kvferry_copy_queue_depth gauge\n"));
    assert_eq!(http_get(s.metrics, "/").0, 404);

    // Push a chunk, then fetch it: with RUST_LOG and --log-json, `get` logs its
    // transfer span as JSON; at the default level it logs nothing.
    let dir = std::env::temp_dir().join(format!("kvferry-serve-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("chunk");
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &data).unwrap();
    let put = Command::new(BIN)
        .args([
            "put",
            "--peer",
            &s.listen,
            "--key",
            "k1",
            "--file",
            file.to_str().unwrap(),
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(put.status.success(), "{}", String::from_utf8_lossy(&put.stderr));
    let get = |rust_log: Option<&str>| {
        let mut cmd = Command::new(BIN);
        cmd.args([
            "--log-json",
            "get",
            "--peer",
            &s.listen,
            "--key",
            "k1",
            "--model",
            "tiny",
        ])
        .env_remove("RUST_LOG");
        if let Some(filter) = rust_log {
            cmd.env("RUST_LOG", filter);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("got 5000 bytes"));
        String::from_utf8(out.stderr).unwrap()
    };
    let quiet = get(None);
    assert_eq!(quiet, "", "a successful transfer logs nothing at the default level");
    let logged = get(Some("kvferry::peer=debug"));
    let event = logged
        .lines()
        .find(|l| l.contains("transfer ended"))
        .unwrap_or_else(|| panic!("no transfer event in {logged:?}"));
    let v: serde_json::Value = serde_json::from_str(event).unwrap();
    assert_eq!(v["fields"]["outcome"], "completed", "{event}");
    assert_eq!(v["span"]["name"], "transfer", "{event}");
    assert_eq!(v["span"]["kind"], "get", "{event}");
    assert_eq!(v["span"]["chunks"], 1, "{event}");
    assert_eq!(v["span"]["peer"], s.listen.as_str(), "{event}");
    assert!(v["span"]["request"].is_u64(), "{event}");
    let _ = std::fs::remove_dir_all(&dir);

    let (status, body) = http_get(s.metrics, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(
        sample(&body, r#"kvferry_bytes_total{role="producer",direction="sent"}"#),
        10_000.0
    );
    assert_eq!(
        sample(&body, r#"kvferry_chunks_total{role="producer",direction="sent"}"#),
        2.0
    );
    assert_eq!(
        sample(&body, r#"kvferry_bytes_total{role="producer",direction="received"}"#),
        5000.0
    );
    assert_eq!(
        sample(&body, r#"kvferry_chunks_total{role="producer",direction="received"}"#),
        1.0
    );
    assert_eq!(sample(&body, r#"kvferry_leases_staged_total{role="producer"}"#), 2.0);
    assert!(sample(&body, "kvferry_connections_accepted_total") >= 3.0);
    assert!(sample(&body, "kvferry_requests_total") >= 3.0);
    assert!(sample(&body, r#"kvferry_copy_bytes_total{role="producer"}"#) >= 15_000.0);
    let pages: f64 = ["free", "leased", "quarantined"]
        .iter()
        .map(|st| {
            sample(
                &body,
                &format!(r#"kvferry_arena_pages{{role="producer",state="{st}"}}"#),
            )
        })
        .sum();
    assert_eq!(pages, 8.0);

    // SIGTERM: a clean shutdown with the endpoint running.
    // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) }, 0);
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "serve did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    let mut err = String::new();
    s.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(
        err.contains("arena closed: 0 pages outstanding, 0 quarantined"),
        "{err}"
    );
    assert!(
        TcpStream::connect(s.metrics).is_err(),
        "the endpoint stopped with the daemon"
    );
}

#[test]
fn serve_refuses_an_unusable_metrics_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            &addr,
            "--arena",
            "4MiB",
        ])
        .args(["--model", "tiny", "--blocks", "8"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot serve metrics on {addr}")), "{err}");
}
