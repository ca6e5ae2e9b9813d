//! A tiny HTTP/1.1 endpoint for Prometheus: `GET /metrics` (or `HEAD`) answers `200`
//! with the registry rendered in the text format; any other path is `404`, another
//! method on `/metrics` is `405`, and anything unparsable is `400`.
//!
//! One request per connection (`Connection: close`), one task per connection, at most
//! `max_connections` at once (more are closed unanswered). The request head is read
//! with a size cap (`431` beyond it) and the whole exchange with a deadline (`408`
//! when the head does not arrive in time), so slow or hostile clients cannot hold a
//! task or memory. Request bodies are never read. Garbage never panics: every byte
//! sequence maps to one of the answers above or to a closed connection.
//!
//! # Cancellation
//!
//! Dropping the [`MetricsServer`] stops accepting and aborts every connection task;
//! [`MetricsServer::shutdown`] does the same and waits until they have ended. Nothing
//! else is owned by a connection task, so aborting one at any await point is harmless.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{MetricsError, Registry, CONTENT_TYPE};

/// Settings of the endpoint.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// Largest request head (request line and headers) read.
    pub max_request_bytes: usize,
    /// Bound on receiving the request head.
    pub read_timeout: Duration,
    /// Bound on writing the response.
    pub write_timeout: Duration,
    /// Connections served at once; more are closed at once.
    pub max_connections: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            max_request_bytes: 8 << 10,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            max_connections: 64,
        }
    }
}

impl HttpConfig {
    fn validate(&self) -> Result<(), MetricsError> {
        if self.max_request_bytes < 16 || self.max_connections == 0 {
            return Err(MetricsError::InvalidConfig(
                "max_request_bytes must be at least 16 and max_connections at least 1".into(),
            ));
        }
        if self.read_timeout.is_zero() || self.write_timeout.is_zero() {
            return Err(MetricsError::InvalidConfig("timeouts must be greater than zero".into()));
        }
        Ok(())
    }
}

/// A running metrics endpoint. Dropping it stops it.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (e.g. `127.0.0.1:9090`, or port 0 for any) and serves `registry`
    /// with default settings. Must be called inside a tokio runtime.
    pub async fn bind(addr: &str, registry: Arc<Registry>) -> Result<MetricsServer, MetricsError> {
        MetricsServer::bind_with(addr, registry, HttpConfig::default()).await
    }

    /// As [`MetricsServer::bind`], with explicit settings.
    pub async fn bind_with(
        addr: &str,
        registry: Arc<Registry>,
        cfg: HttpConfig,
    ) -> Result<MetricsServer, MetricsError> {
        cfg.validate()?;
        let bind_err = |source| MetricsError::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_loop(listener, registry, Arc::new(cfg), stop.clone()));
        Ok(MetricsServer {
            addr: local,
            stop,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, aborts every connection and waits for the tasks to end.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, registry: Arc<Registry>, cfg: Arc<HttpConfig>, stop: CancellationToken) {
    // Dropping the set (on abort) aborts every connection task.
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) if conns.len() >= cfg.max_connections => drop(stream),
                Ok((stream, peer)) => {
                    conns.spawn(serve_connection(stream, peer, registry.clone(), cfg.clone()));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(target: "kvferry::metrics", "accept failed: {e}");
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    }
                }
            },
        }
    }
    conns.shutdown().await;
}

/// What a request head turned out to be.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// The complete head (or all the client sent before closing its side).
    Complete(Vec<u8>),
    /// Over the size cap.
    TooLarge,
    /// Closed without sending anything.
    Empty,
}

async fn read_head(stream: &mut TcpStream, cap: usize) -> std::io::Result<Head> {
    let mut buf = Vec::with_capacity(1024.min(cap));
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(if buf.is_empty() {
                Head::Empty
            } else {
                Head::Complete(buf)
            });
        }
        let scan_from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if head_end(&buf[scan_from..]) {
            return Ok(Head::Complete(buf));
        }
        if buf.len() > cap {
            return Ok(Head::TooLarge);
        }
    }
}

fn head_end(b: &[u8]) -> bool {
    b.windows(4).any(|w| w == b"\r\n\r\n") || b.windows(2).any(|w| w == b"\n\n")
}

/// A response: status line and body (headers are derived).
#[derive(Debug, PartialEq, Eq)]
struct Response {
    status: u16,
    reason: &'static str,
    content_type: &'static str,
    body: String,
    /// Whether to send the body (not for `HEAD`).
    send_body: bool,
    allow: bool,
}

impl Response {
    fn plain(status: u16, reason: &'static str, body: &str) -> Response {
        Response {
            status,
            reason,
            content_type: "text/plain; charset=utf-8",
            body: format!("{body}\n"),
            send_body: true,
            allow: false,
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.reason,
            self.content_type,
            self.body.len()
        );
        if self.allow {
            head.push_str("Allow: GET, HEAD\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        if self.send_body {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

/// Routes one request head (only its request line matters).
fn route(head: &[u8], registry: &Registry) -> Response {
    let line_end = head.iter().position(|b| *b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Response::plain(400, "Bad Request", "bad request");
    };
    let mut parts = line.split_ascii_whitespace();
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Response::plain(400, "Bad Request", "bad request");
    };
    if !version.starts_with("HTTP/1.") {
        return Response::plain(400, "Bad Request", "bad request");
    }
    let path = target.split(['?', '#']).next().unwrap_or("");
    if path != "/metrics" {
        return Response::plain(404, "Not Found", "not found; metrics are at /metrics");
    }
    match method {
        "GET" | "HEAD" => Response {
            status: 200,
            reason: "OK",
            content_type: CONTENT_TYPE,
            body: registry.render(),
            send_body: method == "GET",
            allow: false,
        },
        _ => Response {
            allow: true,
            ..Response::plain(405, "Method Not Allowed", "method not allowed")
        },
    }
}

async fn serve_connection(mut stream: TcpStream, peer: SocketAddr, registry: Arc<Registry>, cfg: Arc<HttpConfig>) {
    let _ = stream.set_nodelay(true);
    let response = match tokio::time::timeout(cfg.read_timeout, read_head(&mut stream, cfg.max_request_bytes)).await {
        Ok(Ok(Head::Complete(head))) => route(&head, &registry),
        Ok(Ok(Head::TooLarge)) => Response::plain(431, "Request Header Fields Too Large", "request too large"),
        Ok(Ok(Head::Empty)) | Ok(Err(_)) => return,
        Err(_) => Response::plain(408, "Request Timeout", "request timeout"),
    };
    if response.status != 200 {
        tracing::debug!(target: "kvferry::metrics", %peer, status = response.status, "metrics request refused");
    }
    let bytes = response.to_bytes();
    let _ = tokio::time::timeout(cfg.write_timeout, async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Encoder;

    fn registry() -> Registry {
        let r = Registry::new();
        r.register(|e: &mut Encoder| e.gauge("up", "Up.", &[], 1));
        r
    }

    #[test]
    fn routes() {
        let r = registry();
        let ok = route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &r);
        assert_eq!((ok.status, ok.content_type), (200, CONTENT_TYPE));
        assert!(ok.body.contains("up 1\n"));
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\n\n", &r).status, 200);
        let head = route(b"HEAD /metrics HTTP/1.1\r\n\r\n", &r);
        assert_eq!(head.status, 200);
        let bytes = String::from_utf8(head.to_bytes()).unwrap();
        assert!(bytes.ends_with("\r\n\r\n") && bytes.contains(&format!("Content-Length: {}", head.body.len())));
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n", &r).status, 404);
        assert_eq!(route(b"GET /metricsx HTTP/1.1\r\n\r\n", &r).status, 404);
        let post = route(b"POST /metrics HTTP/1.1\r\n\r\n", &r);
        assert_eq!(post.status, 405);
        assert!(String::from_utf8(post.to_bytes())
            .unwrap()
            .contains("Allow: GET, HEAD\r\n"));
        for garbage in [
            &b""[..],
            b"\r\n\r\n",
            b"GET\r\n\r\n",
            b"GET /metrics\r\n\r\n",
            b"GET /metrics SPDY/3\r\n\r\n",
            b"GET /metrics HTTP/1.1 extra\r\n\r\n",
            b"\xff\xfe /metrics HTTP/1.1\r\n\r\n",
            b"\x00\x01\x02\x03",
        ] {
            assert_eq!(route(garbage, &r).status, 400, "{garbage:?}");
        }
    }

    #[test]
    fn head_end_is_found_across_reads() {
        assert!(head_end(b"x\r\n\r\n"));
        assert!(head_end(b"\n\n"));
        assert!(!head_end(b"GET / HTTP/1.1\r\n"));
    }

    #[test]
    fn bad_config_is_rejected() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let cfg = HttpConfig {
            read_timeout: Duration::ZERO,
            ..HttpConfig::default()
        };
        let r = rt.block_on(MetricsServer::bind_with("127.0.0.1:0", Arc::new(Registry::new()), cfg));
        assert!(matches!(r, Err(MetricsError::InvalidConfig(_))));
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let r = rt.block_on(MetricsServer::bind(&addr, Arc::new(Registry::new())));
        assert!(matches!(r, Err(MetricsError::Bind { .. })));
    }
}
