//! The metrics endpoint over real sockets: an in-process producer, its server and a
//! consumer are registered, transfers run (successes, a timeout, a checksum failure),
//! and the endpoint is scraped with a raw HTTP/1.1 GET. Also: 404, 405, garbage,
//! oversize and silent clients.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::eventually;
use common::p2p::*;
use kvferry::metrics::sources::server_metrics;
use kvferry::metrics::{Encoder, HttpConfig, MetricsServer, Registry};
use kvferry::peer::PeerError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

fn soon(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

/// Sends `request` raw, reads until the server closes; returns the whole response
/// (empty if the connection was reset).
async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the endpoint must answer or close within its timeouts");
    String::from_utf8_lossy(&out).into_owned()
}

/// `(status, headers, body)` of a GET.
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String, String) {
    let raw = exchange(addr, format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes()).await;
    split(&raw)
}

fn split(raw: &str) -> (u16, String, String) {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {raw:?}"));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.parse().ok())
        .expect("Content-Length");
    assert_eq!(len, body.len(), "Content-Length matches the body");
    (status, head.to_string(), body.to_string())
}

/// Parses the text format strictly enough to catch malformed output: every sample's
/// family has `# HELP` and `# TYPE` before it, no series repeats, every value parses.
fn parse(body: &str) -> HashMap<String, f64> {
    let mut typed: HashMap<String, String> = HashMap::new();
    let mut helped = HashSet::new();
    let mut samples = HashMap::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(helped.insert(name.to_string()), "HELP twice for {name}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(helped.contains(name), "TYPE before HELP: {line}");
            assert!(
                typed.insert(name.to_string(), kind.to_string()).is_none(),
                "TYPE twice: {line}"
            );
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "stray line {line:?}");
        let (series, value) = line.rsplit_once(' ').unwrap();
        let name = series.split('{').next().unwrap();
        let family = match typed.get(name) {
            Some(_) => name,
            None => ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    name.strip_suffix(s)
                        .filter(|f| typed.get(*f).is_some_and(|k| k == "histogram"))
                })
                .unwrap_or_else(|| panic!("sample without TYPE: {line}")),
        };
        assert!(typed.contains_key(family));
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        assert!(
            samples.insert(series.to_string(), v).is_none(),
            "series twice: {series}"
        );
    }
    samples
}

fn val(m: &HashMap<String, f64>, series: &str) -> f64 {
    *m.get(series)
        .unwrap_or_else(|| panic!("no series {series}; have {:#?}", m.keys().collect::<Vec<_>>()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_shows_transfers_timeouts_checksum_failures_and_pages() {
    let ProducerNode {
        producer, server, addr, ..
    } = producer_node(NodeOpts::default()).await;
    let server = Arc::new(server);
    let c = consumer_node(64, 64);
    let registry = Arc::new(Registry::new());
    registry.register(producer.clone());
    registry.register(c.consumer.clone());
    let s = Arc::downgrade(&server);
    registry.register(move |out: &mut Encoder| {
        if let Some(s) = s.upgrade() {
            server_metrics(out, &s.stats());
        }
    });
    let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await.unwrap();
    let maddr = endpoint.local_addr();

    // Before any transfer: everything present, nothing moved.
    let (status, head, body) = get(maddr, "/metrics").await;
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("Content-Type: text/plain; version=0.0.4"), "{head}");
    let m = parse(&body);
    assert_eq!(val(&m, r#"kvferry_bytes_total{role="producer",direction="sent"}"#), 0.0);
    assert_eq!(
        val(
            &m,
            r#"kvferry_transfer_seconds_count{role="consumer",outcome="completed"}"#
        ),
        0.0
    );

    // Two transfers land: an eager get and a delayed pull, 2 chunks of 2 blocks each.
    let k1 = fill(&producer, 1, 2, 2);
    let k2 = fill(&producer, 2, 2, 2);
    let landed = c.consumer.get(&addr, &k1, c.dst(0, 2, 2), soon(5000)).await.unwrap();
    assert_eq!(landed.chunks, 2);
    let handle = c.consumer.stage(&addr, &k2, soon(5000)).await.unwrap();
    c.consumer.resolve(handle, c.dst(4, 2, 2), soon(5000)).await.unwrap();
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

    let (status, _, body) = get(maddr, "/metrics").await;
    assert_eq!(status, 200);
    let m = parse(&body);
    let cs = c.consumer.stats();
    // Bytes and chunks per direction.
    assert!(val(&m, r#"kvferry_bytes_total{role="producer",direction="sent"}"#) >= 4.0 * chunk_bytes);
    assert!(val(&m, r#"kvferry_chunks_total{role="producer",direction="sent"}"#) >= 5.0);
    assert!(val(&m, r#"kvferry_bytes_total{role="consumer",direction="received"}"#) >= 5.0 * chunk_bytes);
    assert_eq!(
        val(&m, r#"kvferry_bytes_total{role="consumer",direction="landed"}"#),
        4.0 * chunk_bytes
    );
    assert_eq!(
        val(&m, r#"kvferry_chunks_total{role="consumer",direction="landed"}"#),
        4.0
    );
    assert_eq!(cs.bytes as f64, 4.0 * chunk_bytes, "the scrape shows the stats");
    // Failures.
    assert_eq!(val(&m, r#"kvferry_checksum_failures_total{role="consumer"}"#), 1.0);
    assert_eq!(val(&m, r#"kvferry_timeouts_total{role="consumer"}"#), 1.0);
    assert_eq!(
        val(&m, r#"kvferry_cancellations_total{role="consumer"}"#),
        cs.cancelled as f64
    );
    assert_eq!(
        val(&m, r#"kvferry_transfers_total{role="consumer",outcome="completed"}"#),
        2.0
    );
    // Latency: one observation per transfer, buckets cumulative up to +Inf == count.
    let mut observed = 0.0;
    for outcome in ["completed", "failed", "cancelled"] {
        let count = val(
            &m,
            &format!(r#"kvferry_transfer_seconds_count{{role="consumer",outcome="{outcome}"}}"#),
        );
        let inf = val(
            &m,
            &format!(r#"kvferry_transfer_seconds_bucket{{role="consumer",outcome="{outcome}",le="+Inf"}}"#),
        );
        assert_eq!(count, inf, "{outcome}");
        let mut last = 0.0;
        for line in body.lines().filter(|l| {
            l.starts_with(&format!(
                r#"kvferry_transfer_seconds_bucket{{role="consumer",outcome="{outcome}""#
            ))
        }) {
            let v: f64 = line.rsplit_once(' ').unwrap().1.parse().unwrap();
            assert!(v >= last, "buckets are cumulative: {line}");
            last = v;
        }
        observed += count;
    }
    assert_eq!(observed, 4.0, "one latency observation per transfer");
    assert_eq!(
        val(
            &m,
            r#"kvferry_transfer_seconds_count{role="consumer",outcome="completed"}"#
        ),
        2.0
    );
    assert!(
        val(
            &m,
            r#"kvferry_transfer_seconds_sum{role="consumer",outcome="completed"}"#
        ) > 0.0
    );
    // Arena pages add up on both sides.
    for (role, total) in [("producer", 256.0), ("consumer", 64.0)] {
        let pages: f64 = ["free", "leased", "quarantined"]
            .iter()
            .map(|st| val(&m, &format!(r#"kvferry_arena_pages{{role="{role}",state="{st}"}}"#)))
            .sum();
        assert_eq!(pages, total, "{role}");
    }
    assert_eq!(val(&m, r#"kvferry_arena_pages{role="consumer",state="free"}"#), 64.0);
    // Copy engine, server, leases.
    assert_eq!(val(&m, r#"kvferry_copy_queue_depth{role="consumer"}"#), 0.0);
    assert!(val(&m, r#"kvferry_copy_bytes_total{role="consumer"}"#) >= 4.0 * chunk_bytes);
    assert!(m.contains_key(r#"kvferry_copy_jobs_in_flight{role="producer"}"#));
    assert!(val(&m, "kvferry_connections_accepted_total") >= 1.0);
    assert!(m.contains_key("kvferry_peer_connections"));
    assert!(val(&m, "kvferry_requests_total") >= 5.0);
    assert!(m.contains_key(r#"kvferry_staged_leases{role="producer"}"#));
    assert_eq!(
        val(&m, r#"kvferry_leases_staged_total{role="producer"}"#),
        producer.stats().staged as f64
    );
    assert!(m.contains_key(r#"kvferry_leases_expired_total{role="producer"}"#));

    endpoint.shutdown().await;
    assert!(TcpStream::connect(maddr).await.is_err(), "stopped listening");
    Arc::try_unwrap(server).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_methods_and_garbage_get_errors_and_the_endpoint_survives() {
    let registry = Arc::new(Registry::new());
    registry.register(|out: &mut Encoder| out.gauge("kvferry_test_up", "Up.", &[], 1));
    let endpoint = MetricsServer::bind("127.0.0.1:0", registry).await.unwrap();
    let a = endpoint.local_addr();

    assert_eq!(get(a, "/").await.0, 404);
    assert_eq!(get(a, "/metrics/extra").await.0, 404);
    assert_eq!(get(a, "/metrics?format=text").await.0, 200);
    let (status, head, _) = split(&exchange(a, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").await);
    assert_eq!(status, 405);
    assert!(head.contains("Allow: GET, HEAD"));
    let raw = exchange(a, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
    assert!(
        raw.starts_with("HTTP/1.1 200 OK\r\n") && raw.ends_with("\r\n\r\n"),
        "{raw}"
    );
    for garbage in [
        &b"\x00\x01\x02\xff\r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"GET /metrics FTP/9\r\n\r\n",
        b"\r\n\r\n",
        b"\xc3\x28 /metrics HTTP/1.1\n\n",
    ] {
        assert_eq!(split(&exchange(a, garbage).await).0, 400, "{garbage:?}");
    }
    // A head over the size cap: 431, or a reset if the rest of it was still unread.
    let raw = exchange(a, &[b'A'; 9216]).await;
    assert!(raw.is_empty() || raw.starts_with("HTTP/1.1 431 "), "{raw}");
    // A client that sends part of a request and closes its side still gets an answer.
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
    s.shutdown().await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    // A client that connects and says nothing, then leaves.
    drop(TcpStream::connect(a).await.unwrap());
    // Many at once.
    let scrapes: Vec<_> = (0..16).map(|_| tokio::spawn(get(a, "/metrics"))).collect();
    for s in scrapes {
        let (status, _, body) = s.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            body,
            "# HELP kvferry_test_up Up.\n# TYPE kvferry_test_up gauge\nkvferry_test_up 1\n"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_gets_408_within_the_read_timeout() {
    let cfg = HttpConfig {
        read_timeout: Duration::from_millis(200),
        ..HttpConfig::default()
    };
    let endpoint = MetricsServer::bind_with("127.0.0.1:0", Arc::new(Registry::new()), cfg)
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let mut s = TcpStream::connect(endpoint.local_addr()).await.unwrap();
    s.write_all(b"GET /metr").await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 408 "), "{out}");
    assert!(t.elapsed() >= Duration::from_millis(200), "{:?}", t.elapsed());
    // Dropping the endpoint stops it.
    let a = endpoint.local_addr();
    drop(endpoint);
    eventually("the listener closed", || std::net::TcpStream::connect(a).is_err()).await;
}
