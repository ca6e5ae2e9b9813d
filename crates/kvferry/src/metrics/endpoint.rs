//! The HTTP endpoint (hyper, HTTP/1.1): `GET /metrics` answers the registry in the
//! OpenMetrics text format; `GET /healthz` answers `200 ok` while the process runs
//! (liveness); `GET /readyz` (or `/healthz?ready`) answers `200 ready` while the
//! endpoint is listening and not closing, `503` once [`Readiness::set`] said otherwise
//! (readiness). Any other path is `404`; another method on a known path is `405`.
//!
//! # Access
//!
//! - [`listen_address`] maps a bare port (`9090` or `:9090`) to `127.0.0.1:PORT`: the
//!   endpoint is on loopback unless an address names another interface.
//! - With a bearer token configured, `/metrics` needs `Authorization: Bearer TOKEN`;
//!   anything else gets `401` (with `WWW-Authenticate: Bearer`). The comparison is of
//!   SHA-256 digests in constant time, so neither the token nor its length leaks
//!   through timing. `/healthz` and `/readyz` reveal only up/ready and need no token,
//!   so probes work without the secret.
//!
//! # Budget
//!
//! Liveness never shares a budget with scrapes. At most `max_connections` `/metrics`
//! requests are answered at once (16 by default; more get `503`), while `/healthz` and
//! `/readyz` take no such place. Connections are kept open at most
//! [`CONNECTIONS_PER_PLACE`] × `max_connections` at once: when that many are open, a
//! new one closes at once the oldest whose request has not arrived (an idle
//! connection cannot hold a place that a probe needs: a probe's request arrives
//! within a round trip of its connect), and only when every open one is being
//! answered is the newcomer answered `503` from a static buffer without waiting for
//! its request. All of this is apart from the data port's connections and limits, and
//! never delays it. Each connection carries one request (`Connection: close`) with a
//! head of at most 8 KiB, which must arrive within `header_timeout`; the whole
//! exchange must end within `header_timeout + write_timeout`, or the connection is
//! closed.
//!
//! # Cancellation
//!
//! Dropping the [`MetricsServer`] stops accepting and aborts every connection task;
//! [`MetricsServer::shutdown`] does the same and waits until they have ended. A
//! connection task owns only its socket and a rendered body, so aborting it at any
//! await point leaves nothing behind.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{MetricsError, Registry, CONTENT_TYPE};

/// Settings of the endpoint.
#[derive(Clone)]
pub struct HttpConfig {
    /// Bound on receiving a request head.
    pub header_timeout: Duration,
    /// Bound on writing the response once the head arrived.
    pub write_timeout: Duration,
    /// `/metrics` requests answered at once (more are answered `503`); connections are
    /// kept open up to [`CONNECTIONS_PER_PLACE`] times this.
    pub max_connections: usize,
    /// When set, `/metrics` requires `Authorization: Bearer <token>`.
    pub bearer_token: Option<String>,
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("header_timeout", &self.header_timeout)
            .field("write_timeout", &self.write_timeout)
            .field("max_connections", &self.max_connections)
            .field("bearer_token", &self.bearer_token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            max_connections: 16,
            bearer_token: None,
        }
    }
}

impl HttpConfig {
    fn validate(&self) -> Result<(), MetricsError> {
        if self.max_connections == 0 {
            return Err(MetricsError::InvalidConfig("max_connections must be at least 1".into()));
        }
        if self.header_timeout.is_zero() || self.write_timeout.is_zero() {
            return Err(MetricsError::InvalidConfig("timeouts must be greater than zero".into()));
        }
        if let Some(t) = &self.bearer_token {
            check_token(t).map_err(MetricsError::InvalidConfig)?;
        }
        Ok(())
    }
}

/// Why a token cannot be used in an `Authorization` header, if it cannot.
fn check_token(t: &str) -> Result<(), String> {
    if t.is_empty() {
        return Err("the bearer token is empty".into());
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the bearer token must be printable ASCII without spaces".into());
    }
    Ok(())
}

/// The address to listen on for a `--metrics` value: a bare port (`9090`, `:9090`)
/// means `127.0.0.1:PORT`; anything else (`0.0.0.0:9090`, `[::1]:9090`,
/// `host:9090`) is used as given.
pub fn listen_address(spec: &str) -> Result<String, MetricsError> {
    let spec = spec.trim();
    let port = spec.strip_prefix(':').unwrap_or(spec);
    if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) {
        return match port.parse::<u16>() {
            Ok(p) => Ok(format!("127.0.0.1:{p}")),
            Err(_) => Err(MetricsError::InvalidConfig(format!("{spec:?}: port out of range"))),
        };
    }
    if spec.is_empty() || !spec.contains(':') {
        return Err(MetricsError::InvalidConfig(format!(
            "{spec:?}: expected PORT or HOST:PORT (e.g. 9090 or 0.0.0.0:9090)"
        )));
    }
    Ok(spec.to_string())
}

/// Reads a bearer token from `path`: its content with surrounding whitespace removed;
/// it must be non-empty printable ASCII.
pub fn read_token_file(path: &std::path::Path) -> Result<String, MetricsError> {
    let err = |reason: String| MetricsError::Token {
        path: path.display().to_string(),
        reason,
    };
    let raw = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let token = raw.trim().to_string();
    check_token(&token).map_err(err)?;
    Ok(token)
}

/// The readiness `/readyz` reports: ready from bind until set otherwise. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Sets whether `/readyz` answers `200` (true) or `503` (false).
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    /// Whether `/readyz` answers `200` now.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A running metrics endpoint. Dropping it stops it.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: CancellationToken,
    ready: Readiness,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Open connections kept per `/metrics` place.
pub const CONNECTIONS_PER_PLACE: usize = 4;

/// What a connection task needs.
struct Shared {
    registry: Arc<Registry>,
    cfg: HttpConfig,
    token_digest: Option<[u8; 32]>,
    ready: Readiness,
    /// `/metrics` answers at once.
    scrapes: Semaphore,
    /// Open connections whose request has not arrived, by accept order (closing one is
    /// cancelling its token).
    unread: parking_lot::Mutex<std::collections::BTreeMap<u64, CancellationToken>>,
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
        let ready = Readiness(Arc::new(AtomicBool::new(true)));
        let shared = Arc::new(Shared {
            scrapes: Semaphore::new(cfg.max_connections),
            unread: parking_lot::Mutex::new(std::collections::BTreeMap::new()),
            token_digest: cfg.bearer_token.as_deref().map(digest),
            registry,
            cfg,
            ready: ready.clone(),
        });
        let task = tokio::spawn(accept_loop(listener, shared, stop.clone()));
        Ok(MetricsServer {
            addr: local,
            stop,
            ready,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The readiness `/readyz` reports (set it false when the process starts closing).
    pub fn readiness(&self) -> Readiness {
        self.ready.clone()
    }

    /// Stops accepting, aborts every connection and waits for the tasks to end.
    pub async fn shutdown(mut self) {
        self.ready.set(false);
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.ready.set(false);
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// The read buffer of a connection: a request head larger than this is refused
/// (hyper's minimum; a scrape's head is a few hundred bytes).
const MAX_REQUEST_BYTES: usize = 8192;

/// The answer to a connection over the budget, written without reading its request.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n\
Content-Length: 35\r\nRetry-After: 1\r\nConnection: close\r\n\r\nmetrics endpoint busy; retry later\n";

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    let cap = shared.cfg.max_connections.saturating_mul(CONNECTIONS_PER_PLACE);
    // Dropping the set (on abort) aborts every connection task.
    let mut conns = JoinSet::new();
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Make room by closing the oldest connection still waiting for its
                    // request; if every open one is being answered, refuse this one.
                    let room = {
                        let mut unread = shared.unread.lock();
                        let open = conns.len();
                        if open >= cap {
                            match unread.pop_first() {
                                Some((_, oldest)) => {
                                    oldest.cancel();
                                    true
                                }
                                None => false,
                            }
                        } else {
                            true
                        }
                    };
                    if !room {
                        // Whatever of the request already arrived is discarded (so the
                        // close is less likely to reset the answer away), then a fresh
                        // socket's send buffer takes the whole answer; a peer that
                        // cannot take it gets only the close. Nothing here waits.
                        let mut discard = [0u8; 1024];
                        let _ = stream.try_read(&mut discard);
                        let _ = stream.try_write(BUSY);
                        tracing::debug!(target: "kvferry::metrics", %peer, "metrics connection over budget: 503");
                        continue;
                    }
                    seq += 1;
                    let (id, token) = (seq, CancellationToken::new());
                    shared.unread.lock().insert(id, token.clone());
                    let shared = shared.clone();
                    conns.spawn(async move {
                        tokio::select! {
                            _ = token.cancelled() => {}
                            _ = serve_connection(stream, peer, id, shared.clone()) => {}
                        }
                        shared.unread.lock().remove(&id);
                    });
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

async fn serve_connection(stream: TcpStream, peer: SocketAddr, id: u64, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let bound = shared.cfg.header_timeout + shared.cfg.write_timeout;
    let service_shared = shared.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        // Its request arrived: no longer closed to make room.
        service_shared.unread.lock().remove(&id);
        let response = if req.uri().path() == "/metrics" {
            match service_shared.scrapes.try_acquire() {
                Ok(_permit) => route(&req, &service_shared),
                Err(_) => busy(),
            }
        } else {
            route(&req, &service_shared)
        };
        async move { Ok::<_, Infallible>(response) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(shared.cfg.header_timeout)
        .max_buf_size(MAX_REQUEST_BYTES)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(bound, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(target: "kvferry::metrics", %peer, "metrics connection: {e}"),
        Err(_) => tracing::debug!(target: "kvferry::metrics", %peer, "metrics connection timed out"),
    }
}

/// `503` for a scrape over the budget.
fn busy() -> Response<Full<Bytes>> {
    let mut r = plain(StatusCode::SERVICE_UNAVAILABLE, "metrics endpoint busy; retry later\n");
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `req` carries the configured bearer token (always, when none is set).
fn authorized(req: &Request<Incoming>, shared: &Shared) -> bool {
    let Some(expected) = &shared.token_digest else {
        return true;
    };
    // The scheme is case-insensitive (RFC 9110); the token is compared as sent.
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map_or("", |(_, token)| token);
    bool::from(digest(given.trim()).ct_eq(expected))
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn route(req: &Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let query = req.uri().query().unwrap_or("");
    let known = matches!(path, "/metrics" | "/healthz" | "/readyz");
    if !known {
        return plain(StatusCode::NOT_FOUND, "not found; try /metrics, /healthz or /readyz\n");
    }
    let head = req.method() == Method::HEAD;
    if req.method() != Method::GET && !head {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let readiness = path == "/readyz" || query.split('&').any(|q| q == "ready");
    let mut response = match path {
        "/metrics" if !authorized(req, shared) => {
            let mut r = plain(StatusCode::UNAUTHORIZED, "unauthorized: a bearer token is required\n");
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
        "/metrics" => {
            let mut r = Response::new(Full::new(Bytes::from(shared.registry.render())));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
            r
        }
        _ if readiness && shared.ready.get() => plain(StatusCode::OK, "ready\n"),
        _ if readiness => plain(StatusCode::SERVICE_UNAVAILABLE, "not ready: closing\n"),
        _ => plain(StatusCode::OK, "ok\n"),
    };
    if head {
        // hyper keeps Content-Length and drops the body of a HEAD answer.
        response.headers_mut().remove(header::TRANSFER_ENCODING);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_means_loopback() {
        assert_eq!(listen_address("9090").unwrap(), "127.0.0.1:9090");
        assert_eq!(listen_address(":0").unwrap(), "127.0.0.1:0");
        assert_eq!(listen_address("0.0.0.0:9090").unwrap(), "0.0.0.0:9090");
        assert_eq!(listen_address("[::1]:9090").unwrap(), "[::1]:9090");
        assert_eq!(listen_address("localhost:9090").unwrap(), "localhost:9090");
        assert!(listen_address("70000").is_err());
        assert!(listen_address("").is_err());
        assert!(listen_address("metrics").is_err());
    }

    #[test]
    fn tokens_are_checked() {
        let dir = std::env::temp_dir().join(format!(
            "kvferry-token-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t");
        std::fs::write(&f, "s3cret-token\n").unwrap();
        assert_eq!(read_token_file(&f).unwrap(), "s3cret-token");
        std::fs::write(&f, "  \n").unwrap();
        assert!(matches!(read_token_file(&f), Err(MetricsError::Token { .. })));
        std::fs::write(&f, "two words").unwrap();
        assert!(matches!(read_token_file(&f), Err(MetricsError::Token { .. })));
        assert!(read_token_file(&dir.join("missing")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = HttpConfig {
            bearer_token: Some(String::new()),
            ..HttpConfig::default()
        };
        assert!(cfg.validate().is_err());
        let cfg = HttpConfig {
            max_connections: 0,
            ..HttpConfig::default()
        };
        assert!(cfg.validate().is_err());
        assert!(format!(
            "{:?}",
            HttpConfig {
                bearer_token: Some("x".into()),
                ..HttpConfig::default()
            }
        )
        .contains("<set>"));
    }

    #[test]
    fn the_busy_answer_is_well_formed() {
        let s = std::str::from_utf8(BUSY).unwrap();
        let (head, body) = s.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())), "{s}");
    }
}
