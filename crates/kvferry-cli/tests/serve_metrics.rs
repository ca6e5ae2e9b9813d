//! `kvferry serve --metrics`: the daemon's Prometheus endpoint, scraped over HTTP while
//! `kvferry put` and `kvferry get` move a chunk through it and parsed with an
//! independent text-format parser (`prometheus-parse`); the endpoint's loopback
//! default, bearer token, `/healthz` and connection budget; and the `transfer` tracing
//! span of `kvferry get`, filtered by `RUST_LOG`, as JSON lines.

mod common;
#[path = "../../kvferry/tests/common/samples.rs"]
mod samples;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Serve;
use prometheus_parse::{Scrape, Value};
use samples::{find, val};

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

fn serve() -> Serve {
    serve_with(&["--metrics", "127.0.0.1:0"])
}

/// `kvferry serve` on ephemeral ports with `extra` arguments (which give `--metrics`).
fn serve_with(extra: &[&str]) -> Serve {
    Serve::start(
        Serve::command()
            .args(["--arena", "16MiB"])
            .args(extra)
            .args(["--blocks", "64", "--copy-threads", "1"])
            .env_remove("RUST_LOG")
            .env_remove("KVFERRY_SECRET")
            .stdin(Stdio::null())
            .stderr(Stdio::piped()),
        Duration::from_secs(30),
        true,
    )
}

/// A raw HTTP/1.1 GET: `(status, body)`.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    http_get_with(addr, path, "")
}

/// A raw HTTP/1.1 GET with extra header lines: `(status, body)`.
fn http_get_with(addr: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: kvferry\r\n{headers}\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    if status == 200 && path == "/metrics" {
        let head = head.to_ascii_lowercase();
        assert!(
            head.contains("content-type: application/openmetrics-text; version=1.0.0"),
            "{head}"
        );
    }
    (status, body.to_string())
}

/// A GET that tolerates the endpoint closing on it: the status, or `None` when the
/// connection was closed or reset without an answer.
fn try_http_get(addr: SocketAddr, path: &str, headers: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: kvferry\r\n{headers}\r\n");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    raw.split(' ').nth(1).and_then(|s| s.parse().ok())
}

/// Parses a scrape with `prometheus-parse`.
fn scrape(body: &str) -> Scrape {
    assert!(body.ends_with("# EOF\n"), "{body}");
    Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap()
}

/// The `+Inf` bucket of a histogram series (its count).
fn histogram_count(m: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let Value::Histogram(buckets) = &find(m, name, labels).value else {
        panic!("{name} is not a histogram")
    };
    let inf = buckets.iter().find(|b| b.less_than == f64::INFINITY).unwrap().count;
    assert_eq!(inf, val(m, &format!("{name}_count"), labels));
    inf
}

/// Runs `kvferry ARGS` and returns its output.
fn kvferry(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).env_remove("RUST_LOG").output().unwrap()
}

/// Writes a `len`-byte chunk file under a fresh temp dir; returns (dir, file).
fn chunk_file(tag: &str, len: u32) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvferry-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("chunk");
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &data).unwrap();
    (dir, file)
}

#[test]
fn serve_exposes_metrics_that_move_with_put_and_get() {
    let mut s = serve();
    let (status, body) = http_get(s.metrics_addr(), "/metrics");
    assert_eq!(status, 200);
    let m = scrape(&body);
    // 16 MiB of 2 MiB pages, all free; nothing moved yet.
    let p = ("role", "producer");
    assert_eq!(val(&m, "kvferry_arena_pages", &[p, ("state", "free")]), 8.0);
    assert_eq!(val(&m, "kvferry_arena_pages", &[p, ("state", "leased")]), 0.0);
    assert_eq!(val(&m, "kvferry_bytes_total", &[p, ("direction", "sent")]), 0.0);
    assert_eq!(
        val(&m, "kvferry_connections_accepted_total", &[("role", "server")]),
        0.0
    );
    assert_eq!(val(&m, "kvferry_peer_connections", &[("role", "client")]), 0.0);
    assert!(body.contains("# TYPE kvferry_copy_queue_depth gauge\n"));
    // Build and backing: the arena's 16 MiB under the backing the start-up line named.
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(val(&m, "kvferry_build_info", &[("version", version)]), 1.0);
    let pinned = val(&m, "kvferry_arena_backing_bytes", &[p, ("backing", "pinned")]);
    let unpinned = val(&m, "kvferry_arena_backing_bytes", &[p, ("backing", "unpinned")]);
    assert_eq!(pinned + unpinned, 16.0 * 1024.0 * 1024.0);
    assert_eq!(pinned > 0.0, s.line.contains("(pinned)"), "{}", s.line);
    assert_eq!(unpinned > 0.0, s.line.contains("(unpinned)"), "{}", s.line);
    assert_eq!(http_get(s.metrics_addr(), "/").0, 404);

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
            &s.addr,
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
        cmd.args(["--log-json", "get", "--peer", &s.addr, "--key", "k1", "--model", "tiny"])
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
    assert_eq!(v["span"]["peer"], s.addr.as_str(), "{event}");
    assert!(v["span"]["request"].is_u64(), "{event}");
    let _ = std::fs::remove_dir_all(&dir);

    // A miss: the daemon does not hold this key.
    let miss = kvferry(&["get", "--peer", &s.addr, "--key", "absent", "--model", "tiny"]);
    assert!(!miss.status.success());
    assert!(String::from_utf8_lossy(&miss.stderr).contains("miss"), "{miss:?}");

    let (status, body) = http_get(s.metrics_addr(), "/metrics");
    assert_eq!(status, 200);
    let m = scrape(&body);
    assert_eq!(val(&m, "kvferry_bytes_total", &[p, ("direction", "sent")]), 10_000.0);
    assert_eq!(val(&m, "kvferry_chunks_total", &[p, ("direction", "sent")]), 2.0);
    assert_eq!(val(&m, "kvferry_bytes_total", &[p, ("direction", "received")]), 5000.0);
    assert_eq!(val(&m, "kvferry_chunks_total", &[p, ("direction", "received")]), 1.0);
    assert_eq!(val(&m, "kvferry_leases_staged_total", &[p]), 2.0);
    assert!(val(&m, "kvferry_connections_accepted_total", &[("role", "server")]) >= 4.0);
    // Store chunks are landed (put) and served (get) in place: the copy engine moved
    // none of these bytes.
    assert_eq!(val(&m, "kvferry_copy_bytes_total", &[p]), 0.0);
    let pages: f64 = ["free", "leased", "quarantined"]
        .iter()
        .map(|st| val(&m, "kvferry_arena_pages", &[p, ("state", st)]))
        .sum();
    assert_eq!(pages, 8.0);
    // The requests `serve` handled, by kind and outcome, and their latency by kind.
    let req = |kind: &str, outcome: &str| val(&m, "kvferry_requests_total", &[("kind", kind), ("outcome", outcome)]);
    assert_eq!(req("put", "ok"), 1.0);
    assert_eq!(req("get", "hit"), 2.0);
    assert_eq!(req("get", "miss"), 1.0);
    assert_eq!(req("get", "busy") + req("get", "refused") + req("get", "error"), 0.0);
    assert_eq!(
        histogram_count(&m, "kvferry_serve_request_seconds", &[("kind", "get")]),
        3.0
    );
    assert_eq!(
        histogram_count(&m, "kvferry_serve_request_seconds", &[("kind", "put")]),
        1.0
    );
    assert!(val(&m, "kvferry_serve_request_seconds_sum", &[("kind", "get")]) > 0.0);
    assert_eq!(
        histogram_count(&m, "kvferry_serve_request_seconds", &[("kind", "pull")]),
        0.0
    );

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
        TcpStream::connect(s.metrics_addr()).is_err(),
        "the endpoint stopped with the daemon"
    );
}

/// Runs a small `serve` with `extra` flags that must make it refuse to start; returns
/// its standard error.
fn serve_refused(extra: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--arena", "4MiB"])
        .args(extra)
        .args(["--model", "tiny", "--blocks", "8"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve {extra:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn serve_refuses_an_unusable_metrics_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let err = serve_refused(&["--metrics", &addr]);
    assert!(err.contains(&format!("cannot serve metrics on {addr}")), "{err}");
}

#[test]
fn a_bare_port_binds_loopback_and_a_token_and_a_budget_guard_the_endpoint() {
    let (dir, token_file) = chunk_file("metrics-token", 0);
    std::fs::write(&token_file, "metrics-token-0123456789abcdef\n").unwrap();
    let s = serve_with(&["--metrics", "0", "--metrics-token-file", token_file.to_str().unwrap()]);
    assert!(
        s.metrics_addr().ip().is_loopback(),
        "a bare port means loopback: {}",
        s.metrics_addr()
    );
    assert_eq!(s.metrics_addr().ip().to_string(), "127.0.0.1");

    // The token: refused without it or with another, served with it; probes need none.
    let auth = "Authorization: Bearer metrics-token-0123456789abcdef\r\n";
    assert_eq!(http_get(s.metrics_addr(), "/metrics").0, 401);
    assert_eq!(
        http_get_with(
            s.metrics_addr(),
            "/metrics",
            "Authorization: Bearer metrics-token-0123456789abcdeF\r\n"
        )
        .0,
        401
    );
    let (status, body) = http_get_with(s.metrics_addr(), "/metrics", auth);
    assert_eq!(status, 200);
    assert_eq!(
        val(&scrape(&body), "kvferry_peer_connections", &[("role", "server")]),
        0.0
    );
    assert_eq!(http_get(s.metrics_addr(), "/healthz"), (200, "ok\n".to_string()));
    assert_eq!(http_get(s.metrics_addr(), "/readyz"), (200, "ready\n".to_string()));

    // The budget: idle connections (a request head never finished) cannot hold the
    // metrics port: past the 64 kept open, a newcomer closes the oldest of them, so
    // probes and scrapes are still answered, quickly...
    let (dir2, file) = chunk_file("metrics-budget", 3000);
    let mut held: Vec<TcpStream> = (0..100)
        .map(|_| {
            let mut c = TcpStream::connect(s.metrics_addr()).unwrap();
            c.write_all(b"GET /metr").unwrap();
            c
        })
        .collect();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        assert_eq!(try_http_get(s.metrics_addr(), "/metrics", auth), Some(200));
        assert_eq!(http_get(s.metrics_addr(), "/healthz").0, 200);
        assert!(t.elapsed() < Duration::from_secs(2), "answered after {:?}", t.elapsed());
    }
    // ...and the oldest idle ones were closed.
    held[0].set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    assert!(
        matches!(std::io::Read::read(&mut held[0], &mut buf), Ok(0) | Err(_)),
        "the oldest idle connection is still open"
    );
    // ...while the data port serves a put and a get...
    let put = kvferry(&[
        "put",
        "--peer",
        &s.addr,
        "--key",
        "kb",
        "--file",
        file.to_str().unwrap(),
    ]);
    assert!(put.status.success(), "{put:?}");
    let got = kvferry(&["get", "--peer", &s.addr, "--key", "kb", "--model", "tiny"]);
    assert!(got.status.success(), "{got:?}");
    assert!(String::from_utf8_lossy(&got.stdout).starts_with("got 3000 bytes"));
    // ...and once they go, metrics answers again and saw the transfer.
    drop(held);
    let mut answer = (0, String::new());
    for _ in 0..200 {
        answer = http_get_with(s.metrics_addr(), "/metrics", auth);
        if answer.0 == 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(answer.0, 200, "the budget came back");
    let m = scrape(&answer.1);
    assert_eq!(
        val(&m, "kvferry_requests_total", &[("kind", "get"), ("outcome", "hit")]),
        1.0
    );
    assert_eq!(
        val(&m, "kvferry_requests_total", &[("kind", "put"), ("outcome", "ok")]),
        1.0
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

#[test]
fn serve_refuses_an_unusable_token_file() {
    let (dir, token_file) = chunk_file("metrics-bad-token", 0);
    std::fs::write(&token_file, "  \n").unwrap();
    let err = serve_refused(&["--metrics", "0", "--metrics-token-file", token_file.to_str().unwrap()]);
    assert!(
        err.contains("cannot use metrics token file") && err.contains("empty"),
        "{err}"
    );
    // A token file without --metrics is a usage error.
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-token-file",
            token_file.to_str().unwrap(),
        ])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn binding_beyond_loopback_is_explicit_and_warned_about_without_a_token() {
    let mut s = serve_with(&["--metrics", "0.0.0.0:0"]);
    assert!(s.metrics_addr().ip().is_unspecified(), "as given: {}", s.metrics_addr());
    let local = SocketAddr::from(([127, 0, 0, 1], s.metrics_addr().port()));
    assert_eq!(http_get(local, "/healthz").0, 200);
    let _ = s.child.kill();
    let _ = s.child.wait();
    let mut err = String::new();
    s.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(
        err.contains("warning: metrics on 0.0.0.0:") && err.contains("without --metrics-token-file"),
        "{err}"
    );
}
