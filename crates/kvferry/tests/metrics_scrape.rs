//! The metrics endpoint over real sockets: an in-process producer, its server and a
//! consumer are registered, transfers run (successes, a miss, a timeout, a checksum
//! failure), and the endpoint is scraped with raw HTTP/1.1 requests and parsed with an
//! independent Prometheus text-format parser (`prometheus-parse`). Also: the bearer
//! token, `/healthz` and `/readyz`, the connection budget, 404, 405, garbage and silent
//! clients.

mod common;
#[path = "common/samples.rs"]
mod samples;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::eventually;
use common::p2p::*;
use kvferry::metrics::sources::server_metrics;
use kvferry::metrics::{HttpConfig, MetricsServer, Registry, Samples, CONTENT_TYPE};
use kvferry::peer::PeerError;
use prometheus_parse::{Scrape, Value};
use samples::{find, val};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

/// Sends `request` raw, reads until the server closes; returns the whole response
/// (empty if the connection was closed or reset unanswered).
async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(request).await;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the endpoint must answer or close within its timeouts");
    String::from_utf8_lossy(&out).into_owned()
}

/// `(status, head, body)` of a GET with extra header lines.
async fn get_with(addr: std::net::SocketAddr, path: &str, headers: &str) -> (u16, String, String) {
    let raw = exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: test\r\n{headers}\r\n").as_bytes(),
    )
    .await;
    split(&raw)
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String, String) {
    get_with(addr, path, "").await
}

fn split(raw: &str) -> (u16, String, String) {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {raw:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length").then(|| v.trim().to_string())
        })
        .and_then(|v| v.parse().ok())
        .expect("Content-Length");
    assert_eq!(len, body.len(), "Content-Length matches the body");
    (status, head.to_string(), body.to_string())
}

/// Parses a scrape with `prometheus-parse`, after checking the OpenMetrics framing the
/// parser does not: each family's `# HELP` then `# TYPE` once, `# EOF` last.
fn parse(body: &str) -> Scrape {
    assert!(body.ends_with("# EOF\n"), "OpenMetrics ends with # EOF: {body}");
    let mut typed = HashSet::new();
    let mut last_help = None;
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            last_help = Some(rest.split(' ').next().unwrap().to_string());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram", "info"].contains(&kind), "{line}");
            assert_eq!(last_help.as_deref(), Some(name), "TYPE right after its HELP: {line}");
            assert!(typed.insert(name.to_string()), "family twice: {line}");
        } else {
            assert!(line == "# EOF" || !line.starts_with('#'), "stray line {line:?}");
        }
    }
    let scrape = Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).unwrap();
    let mut seen = HashSet::new();
    for s in &scrape.samples {
        let mut labels: Vec<_> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        assert!(seen.insert((s.metric.clone(), labels)), "series twice: {s:?}");
    }
    scrape
}

/// `(count, +Inf bucket, buckets cumulative)` of a histogram series.
fn histogram(m: &Scrape, name: &str, labels: &[(&str, &str)]) -> (f64, f64) {
    let count = val(m, &format!("{name}_count"), labels);
    let Value::Histogram(buckets) = &find(m, name, labels).value else {
        panic!("{name} is not a histogram")
    };
    assert!(
        buckets.windows(2).all(|w| w[0].count <= w[1].count),
        "cumulative: {buckets:?}"
    );
    let inf = buckets
        .iter()
        .find(|b| b.less_than == f64::INFINITY)
        .expect("+Inf bucket")
        .count;
    (count, inf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_shows_transfers_requests_connections_and_pages() {
    let ProducerNode {
        producer, server, addr, ..
    } = producer_node(NodeOpts::default()).await;
    let server = Arc::new(server);
    let c = consumer_node(64, 64);
    let registry = Arc::new(Registry::new());
    registry.register(producer.clone());
    registry.register(c.consumer.clone());
    let s = Arc::downgrade(&server);
    registry.register(move |out: &mut Samples| {
        if let Some(s) = s.upgrade() {
            server_metrics(out, &s.stats());
        }
    });
    let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await.unwrap();
    let maddr = endpoint.local_addr();

    // Before any transfer: everything present, nothing moved.
    let (status, head, body) = get(maddr, "/metrics").await;
    assert_eq!(status, 200, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-type: {CONTENT_TYPE}")),
        "{head}"
    );
    let m = parse(&body);
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(val(&m, "kvferry_build_info", &[("version", version)]), 1.0);
    assert_eq!(
        val(
            &m,
            "kvferry_bytes_total",
            &[("role", "producer"), ("direction", "sent")]
        ),
        0.0
    );
    assert_eq!(
        histogram(
            &m,
            "kvferry_transfer_seconds",
            &[("role", "consumer"), ("outcome", "completed")]
        )
        .0,
        0.0
    );
    assert_eq!(
        val(&m, "kvferry_requests_total", &[("kind", "get"), ("outcome", "hit")]),
        0.0
    );
    assert_eq!(val(&m, "kvferry_peer_connections", &[("role", "client")]), 0.0);

    // Two transfers land: an eager get and a delayed pull, 2 chunks of 2 blocks each;
    // a lookup of a key the producer lacks misses.
    let k1 = fill(&producer, 1, 2, 2);
    let k2 = fill(&producer, 2, 2, 2);
    let landed = c.consumer.get(&addr, &k1, c.dst(0, 2, 2), soon(5000)).await.unwrap();
    assert_eq!(landed.chunks, 2);
    let handle = c.consumer.stage(&addr, &k2, soon(5000)).await.unwrap();
    c.consumer.resolve(handle, c.dst(4, 2, 2), soon(5000)).await.unwrap();
    assert_eq!(c.consumer.lookup(&addr, &[key(99, 0)], soon(5000)).await.unwrap(), 0);
    let chunk_bytes = producer.store().layout().chunk_bytes(2) as f64;

    // A checksum failure.
    producer.faults().corrupt_next_sends.store(1, Ordering::SeqCst);
    let e = c
        .consumer
        .get(&addr, &k1, c.dst(8, 2, 2), soon(5000))
        .await
        .unwrap_err();
    assert!(matches!(e.error, PeerError::ChecksumMismatch { .. }), "{}", e.error);

    // A timeout: the producer is slower than the caller's deadline.
    producer.faults().send_delay_us.store(300_000, Ordering::SeqCst);
    let e = c.consumer.get(&addr, &k1, c.dst(8, 2, 2), soon(150)).await.unwrap_err();
    assert!(matches!(e.error, PeerError::Timeout { .. }), "{}", e.error);
    assert!(e.fence.wait_until(soon(5000)).await);
    producer.faults().send_delay_us.store(0, Ordering::SeqCst);
    eventually("the timed-out transfer drained", || c.consumer.stats().draining == 0).await;
    // Every request the server read has been handled and recorded.
    eventually("every request recorded", || {
        producer.request_stats().total() == server.stats().requests
    })
    .await;

    let (status, _, body) = get(maddr, "/metrics").await;
    assert_eq!(status, 200);
    let m = parse(&body);
    let cs = c.consumer.stats();
    // Bytes and chunks per direction.
    let p = ("role", "producer");
    let cr = ("role", "consumer");
    assert!(val(&m, "kvferry_bytes_total", &[p, ("direction", "sent")]) >= 4.0 * chunk_bytes);
    assert!(val(&m, "kvferry_chunks_total", &[p, ("direction", "sent")]) >= 5.0);
    assert!(val(&m, "kvferry_bytes_total", &[cr, ("direction", "received")]) >= 5.0 * chunk_bytes);
    assert_eq!(
        val(&m, "kvferry_bytes_total", &[cr, ("direction", "landed")]),
        4.0 * chunk_bytes
    );
    assert_eq!(val(&m, "kvferry_chunks_total", &[cr, ("direction", "landed")]), 4.0);
    assert_eq!(cs.bytes as f64, 4.0 * chunk_bytes, "the scrape shows the stats");
    // Failures.
    assert_eq!(val(&m, "kvferry_checksum_failures_total", &[cr]), 1.0);
    assert_eq!(val(&m, "kvferry_timeouts_total", &[cr]), 1.0);
    assert_eq!(val(&m, "kvferry_cancellations_total", &[cr]), cs.cancelled as f64);
    assert_eq!(val(&m, "kvferry_transfers_total", &[cr, ("outcome", "completed")]), 2.0);
    // Transfer latency: one observation per transfer, +Inf == count.
    let mut observed = 0.0;
    for outcome in ["completed", "failed", "cancelled"] {
        let (count, inf) = histogram(&m, "kvferry_transfer_seconds", &[cr, ("outcome", outcome)]);
        assert_eq!(count, inf, "{outcome}");
        observed += count;
    }
    assert_eq!(observed, 4.0, "one latency observation per transfer");
    assert!(val(&m, "kvferry_transfer_seconds_sum", &[cr, ("outcome", "completed")]) > 0.0);

    // Requests by kind and outcome, as the producer handled them.
    let req = |kind: &str, outcome: &str| val(&m, "kvferry_requests_total", &[("kind", kind), ("outcome", outcome)]);
    assert!(req("get", "hit") >= 2.0, "the first get and the corrupted one");
    assert_eq!(req("stage", "hit"), 1.0);
    assert_eq!(req("pull", "ok"), 1.0);
    assert_eq!(req("lookup", "miss"), 1.0);
    assert_eq!(req("lookup", "hit"), 0.0);
    assert_eq!(req("get", "busy") + req("get", "refused") + req("get", "miss"), 0.0);
    let total: f64 = m
        .samples
        .iter()
        .filter(|s| s.metric == "kvferry_requests_total")
        .map(|s| match s.value {
            Value::Counter(v) | Value::Untyped(v) => v,
            _ => panic!("{s:?}"),
        })
        .sum();
    assert_eq!(total, server.stats().requests as f64, "every request counted once");
    // Request latency by kind: one observation per get.
    let gets: f64 = ["ok", "hit", "miss", "busy", "refused", "error"]
        .iter()
        .map(|o| req("get", o))
        .sum();
    let (count, inf) = histogram(&m, "kvferry_serve_request_seconds", &[("kind", "get")]);
    assert_eq!((count, inf), (gets, gets));
    assert!(val(&m, "kvferry_serve_request_seconds_sum", &[("kind", "get")]) > 0.0);
    assert_eq!(
        histogram(&m, "kvferry_serve_request_seconds", &[("kind", "put")]).0,
        0.0
    );

    // Arena pages add up on both sides; the backing is reported in bytes.
    for (role, total) in [("producer", 256.0), ("consumer", 64.0)] {
        let pages: f64 = ["free", "leased", "quarantined"]
            .iter()
            .map(|st| val(&m, "kvferry_arena_pages", &[("role", role), ("state", st)]))
            .sum();
        assert_eq!(pages, total, "{role}");
        let page = val(&m, "kvferry_arena_page_bytes", &[("role", role)]);
        let pinned = val(
            &m,
            "kvferry_arena_backing_bytes",
            &[("role", role), ("backing", "pinned")],
        );
        let unpinned = val(
            &m,
            "kvferry_arena_backing_bytes",
            &[("role", role), ("backing", "unpinned")],
        );
        assert_eq!(pinned + unpinned, total * page, "{role}");
        assert!(pinned == 0.0 || unpinned == 0.0, "one backing per arena");
    }
    assert_eq!(
        val(
            &m,
            "kvferry_arena_backing_bytes",
            &[("role", "producer"), ("backing", "pinned")]
        ) > 0.0,
        producer.arena().stats().backing != kvferry::mem::BackingKind::Unlocked
    );
    assert_eq!(val(&m, "kvferry_arena_pages", &[cr, ("state", "free")]), 64.0);
    // Copy engine, connections on both sides, leases.
    assert_eq!(val(&m, "kvferry_copy_queue_depth", &[cr]), 0.0);
    assert!(val(&m, "kvferry_copy_bytes_total", &[cr]) >= 4.0 * chunk_bytes);
    val(&m, "kvferry_copy_jobs_in_flight", &[p]);
    let server_side = ("role", "server");
    assert!(val(&m, "kvferry_connections_accepted_total", &[server_side]) >= 1.0);
    assert!(
        val(&m, "kvferry_peer_connections", &[server_side]) >= 1.0,
        "the pool keeps one open"
    );
    assert_eq!(val(&m, "kvferry_auth_failures_total", &[server_side]), 0.0);
    let opened = val(&m, "kvferry_connections_opened_total", &[("role", "client")]);
    assert!(opened >= 1.0);
    assert_eq!(
        opened,
        val(&m, "kvferry_connections_accepted_total", &[server_side]),
        "one process on each side"
    );
    assert!(val(&m, "kvferry_peer_connections", &[("role", "client")]) >= 1.0);
    val(&m, "kvferry_staged_leases", &[p]);
    assert_eq!(
        val(&m, "kvferry_leases_staged_total", &[p]),
        producer.stats().staged as f64
    );
    val(&m, "kvferry_leases_expired_total", &[p]);

    endpoint.shutdown().await;
    assert!(TcpStream::connect(maddr).await.is_err(), "stopped listening");
    Arc::try_unwrap(server).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_methods_health_and_garbage_and_the_endpoint_survives() {
    let registry = Arc::new(Registry::new());
    registry.register(|out: &mut Samples| out.gauge("kvferry_test_up", "Up.", &[], 1));
    // A short header deadline: heads that never complete (blank lines) end quickly.
    let cfg = HttpConfig {
        header_timeout: Duration::from_millis(300),
        ..HttpConfig::default()
    };
    let endpoint = MetricsServer::bind_with("127.0.0.1:0", registry, cfg).await.unwrap();
    let a = endpoint.local_addr();

    assert_eq!(get(a, "/").await.0, 404);
    assert_eq!(get(a, "/metrics/extra").await.0, 404);
    assert_eq!(get(a, "/metrics?format=text").await.0, 200);
    // Liveness and readiness.
    assert_eq!(
        get(a, "/healthz").await,
        (200, get(a, "/healthz").await.1, "ok\n".into())
    );
    assert_eq!(get(a, "/readyz").await.2, "ready\n");
    assert_eq!(get(a, "/healthz?ready").await.2, "ready\n");
    endpoint.readiness().set(false);
    assert_eq!(get(a, "/readyz").await.0, 503);
    assert_eq!(get(a, "/healthz?ready").await.0, 503);
    assert_eq!(get(a, "/healthz").await.0, 200, "alive while not ready");
    endpoint.readiness().set(true);
    assert_eq!(get(a, "/readyz").await.0, 200);

    let (status, head, _) =
        split(&exchange(a, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").await);
    assert_eq!(status, 405);
    assert!(head.to_ascii_lowercase().contains("allow: get, head"), "{head}");
    let raw = exchange(a, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        raw.starts_with("HTTP/1.1 200 OK\r\n") && raw.ends_with("\r\n\r\n"),
        "{raw}"
    );
    // Garbage: a 400 or a closed connection, never a hang or a crash.
    for garbage in [
        &b"\x00\x01\x02\xff\r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"GET /metrics FTP/9\r\n\r\n",
        b"\r\n\r\n",
        b"\xc3\x28 /metrics HTTP/1.1\n\n",
        &[b'A'; 70_000],
    ] {
        let raw = exchange(a, garbage).await;
        assert!(raw.is_empty() || raw.starts_with("HTTP/1.1 4"), "{garbage:?}: {raw}");
    }
    // A client that connects and says nothing, then leaves.
    drop(TcpStream::connect(a).await.unwrap());
    // Many at once, within the budget.
    let scrapes: Vec<_> = (0..8).map(|_| tokio::spawn(get(a, "/metrics"))).collect();
    for s in scrapes {
        let (status, _, body) = s.await.unwrap();
        assert_eq!(status, 200);
        assert!(
            body.ends_with("# HELP kvferry_test_up Up.\n# TYPE kvferry_test_up gauge\nkvferry_test_up 1\n# EOF\n"),
            "{body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bearer_token_guards_metrics_but_not_health() {
    let cfg = HttpConfig {
        bearer_token: Some("correct-horse-battery-staple".into()),
        ..HttpConfig::default()
    };
    let endpoint = MetricsServer::bind_with("127.0.0.1:0", Arc::new(Registry::new()), cfg)
        .await
        .unwrap();
    let a = endpoint.local_addr();
    let (status, head, _) = get(a, "/metrics").await;
    assert_eq!(status, 401);
    assert!(head.to_ascii_lowercase().contains("www-authenticate: bearer"), "{head}");
    for wrong in [
        "Authorization: Bearer correct-horse-battery-stapl\r\n",
        "Authorization: Bearer correct-horse-battery-staple-and-more\r\n",
        "Authorization: Basic Y29ycmVjdC1ob3JzZS1iYXR0ZXJ5LXN0YXBsZQ==\r\n",
        "Authorization: Basic correct-horse-battery-staple\r\n",
        "Authorization: correct-horse-battery-staple\r\n",
        "Authorization: Bearer \r\n",
    ] {
        assert_eq!(get_with(a, "/metrics", wrong).await.0, 401, "{wrong}");
    }
    let (status, _, body) = get_with(a, "/metrics", "Authorization: Bearer correct-horse-battery-staple\r\n").await;
    assert_eq!(status, 200);
    assert!(body.contains("kvferry_build_info{"), "{body}");
    // The scheme is case-insensitive.
    let lower = "authorization: bearer correct-horse-battery-staple\r\n";
    assert_eq!(get_with(a, "/metrics", lower).await.0, 200);
    assert_eq!(get(a, "/healthz").await.0, 200, "probes need no token");
    assert_eq!(get(a, "/readyz").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_hold_the_endpoint_nor_touch_the_data_port() {
    let ProducerNode {
        producer, server, addr, ..
    } = producer_node(NodeOpts::default()).await;
    let c = consumer_node(64, 64);
    let registry = Arc::new(Registry::new());
    registry.register(producer.clone());
    let cfg = HttpConfig {
        max_connections: 4,
        header_timeout: Duration::from_secs(30),
        ..HttpConfig::default()
    };
    let endpoint = MetricsServer::bind_with("127.0.0.1:0", registry, cfg).await.unwrap();
    let a = endpoint.local_addr();
    // Idle connections (each sends half a request head), more than the 16 kept open
    // (4 per place) cannot hold the endpoint: newcomers close the oldest of them, and
    // a scrape is answered at once.
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(b"GET /metr").await.unwrap();
        held.push(s);
    }
    let t = std::time::Instant::now();
    let raw = exchange(a, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n").await;
    assert_eq!(split(&raw).0, 200, "{raw}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(5), held[0].read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the oldest idle connection is still open"
    );
    // The data port serves meanwhile.
    let k = fill(&producer, 7, 1, 2);
    let landed = c.consumer.get(&addr, &k, c.dst(0, 1, 2), soon(5000)).await.unwrap();
    assert_eq!(landed.chunks, 1);
    // Once they go, metrics answers again.
    drop(held);
    let mut status = 0;
    for _ in 0..200 {
        status = get(a, "/metrics").await.0;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(status, 200, "the budget came back");
    let (_, _, body) = get(a, "/metrics").await;
    let m = parse(&body);
    assert_eq!(
        val(&m, "kvferry_requests_total", &[("kind", "get"), ("outcome", "hit")]),
        1.0
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_closed_within_the_header_timeout() {
    let cfg = HttpConfig {
        header_timeout: Duration::from_millis(200),
        ..HttpConfig::default()
    };
    let endpoint = MetricsServer::bind_with("127.0.0.1:0", Arc::new(Registry::new()), cfg)
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let mut s = TcpStream::connect(endpoint.local_addr()).await.unwrap();
    s.write_all(b"GET /metr").await.unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "closed within the bound");
    let out = String::from_utf8_lossy(&out);
    assert!(out.is_empty() || out.starts_with("HTTP/1.1 408"), "{out}");
    assert!(t.elapsed() >= Duration::from_millis(200), "{:?}", t.elapsed());
    // Dropping the endpoint stops it.
    let a = endpoint.local_addr();
    drop(endpoint);
    eventually("the listener closed", || std::net::TcpStream::connect(a).is_err()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_and_refused_requests_are_told_apart() {
    let ProducerNode {
        producer, server, addr, ..
    } = producer_node(NodeOpts {
        max_gets: 1,
        ..NodeOpts::default()
    })
    .await;
    let c = consumer_node(64, 64);
    let registry = Arc::new(Registry::new());
    registry.register(producer.clone());
    let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await.unwrap();
    let k = fill(&producer, 3, 1, 2);

    // One get holds the only staging slot (its send is slowed); a second is Busy.
    producer.faults().send_delay_us.store(400_000, Ordering::SeqCst);
    let slow = {
        let (consumer, addr, k, dst) = (c.consumer.clone(), addr.clone(), k.clone(), c.dst(0, 1, 2));
        tokio::spawn(async move { consumer.get(&addr, &k, dst, soon(5000)).await.map(|l| l.chunks) })
    };
    eventually("the slow get is being served", || producer.stats().staged >= 1).await;
    let e = c.consumer.get(&addr, &k, c.dst(4, 1, 2), soon(5000)).await.unwrap_err();
    assert!(
        matches!(
            e.error,
            PeerError::Remote {
                kind: kvferry::wire::ErrorKind::Busy,
                ..
            }
        ),
        "{}",
        e.error
    );
    assert_eq!(slow.await.unwrap().unwrap(), 1);
    producer.faults().send_delay_us.store(0, Ordering::SeqCst);
    // A stage listing a key twice is refused.
    let twice = [k[0], k[0]];
    let e = c.consumer.stage(&addr, &twice, soon(5000)).await.unwrap_err();
    assert!(matches!(e, PeerError::Remote { .. }), "{e}");
    eventually("every request recorded", || {
        producer.request_stats().total() == server.stats().requests
    })
    .await;

    let (status, _, body) = get(endpoint.local_addr(), "/metrics").await;
    assert_eq!(status, 200);
    let m = parse(&body);
    let req = |kind: &str, outcome: &str| val(&m, "kvferry_requests_total", &[("kind", kind), ("outcome", outcome)]);
    assert_eq!(req("get", "busy"), 1.0);
    assert_eq!(req("get", "hit"), 1.0);
    assert_eq!(req("stage", "refused"), 1.0);
    assert_eq!(req("stage", "hit") + req("stage", "miss") + req("stage", "busy"), 0.0);
    assert_eq!(val(&m, "kvferry_busy_total", &[("role", "producer")]), 1.0);
    let (count, _) = histogram(&m, "kvferry_serve_request_seconds", &[("kind", "get")]);
    assert_eq!(count, 2.0);
    server.shutdown().await;
}
