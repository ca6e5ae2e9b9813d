//! The accepting side: a TCP listener that handshakes each connection and hands its
//! requests, one at a time, to a [`Handler`].
//!
//! Each connection is served by its own task. A malformed, oversize, truncated or
//! unauthenticated connection gets a typed error, is closed, and affects no other
//! connection. Connections beyond `max_connections` get a `Busy` error and are closed
//! at once. An idle connection is closed quietly after the idle timeout; a frame that
//! has started must finish within the I/O timeout (slow clients cannot hold a task
//! forever).
//!
//! # Cancellation
//!
//! Dropping the [`Server`] stops accepting and aborts every connection task; a
//! handler's future is dropped at an await point, so whatever it owns (leases being
//! written) is released after the socket write stopped.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::net::{TcpListener, TcpSocket};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{handshake, Connection, NetConfig, NetError};
use crate::wire::{ErrorKind, FrameKind, Message, WireError};

/// Serves requests on accepted connections.
pub trait Handler: Send + Sync + 'static {
    /// Handles one request. Replies (and any bulk frames) are written to `conn`. An
    /// `Err` closes the connection; reply with [`Message::Error`] and return `Ok` to
    /// keep it open.
    fn handle<'a>(
        &'a self,
        conn: &'a mut Connection,
        request_id: u64,
        msg: Message,
    ) -> BoxFuture<'a, Result<(), NetError>>;

    /// Called when a connection ends (for cleanup tied to a peer).
    fn disconnected(&self, _peer: &super::PeerInfo) {}
}

/// Counters of a server.
#[derive(Debug, Default, serde::Serialize, Clone, Copy)]
pub struct ServerStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections open now.
    pub active: usize,
    /// Connections refused because `max_connections` were open.
    pub refused: u64,
    /// Handshakes that failed (including authentication).
    pub handshake_failures: u64,
    /// Handshakes that failed authentication.
    pub auth_failures: u64,
    /// Connections closed for a protocol or frame error.
    pub protocol_errors: u64,
    /// Requests handled.
    pub requests: u64,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    active: AtomicUsize,
    refused: AtomicU64,
    handshake_failures: AtomicU64,
    auth_failures: AtomicU64,
    protocol_errors: AtomicU64,
    requests: AtomicU64,
}

/// A running server. Dropping it stops it.
pub struct Server {
    addr: SocketAddr,
    stop: CancellationToken,
    counters: Arc<Counters>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Binds `addr` (e.g. `127.0.0.1:0`) and starts serving with `handler`.
    pub async fn bind(addr: &str, cfg: NetConfig, handler: Arc<dyn Handler>) -> Result<Server, NetError> {
        cfg.validate()?;
        let listener = listen(addr).await.map_err(|e| NetError::Connect {
            addr: addr.into(),
            reason: format!("bind: {e}"),
        })?;
        let local = listener.local_addr().map_err(|e| NetError::Connect {
            addr: addr.into(),
            reason: e.to_string(),
        })?;
        let stop = CancellationToken::new();
        let counters = Arc::new(Counters::default());
        let task = tokio::spawn(accept_loop(
            listener,
            Arc::new(cfg),
            handler,
            stop.clone(),
            counters.clone(),
        ));
        Ok(Server {
            addr: local,
            stop,
            counters,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        let c = &self.counters;
        ServerStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            active: c.active.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            handshake_failures: c.handshake_failures.load(Ordering::Relaxed),
            auth_failures: c.auth_failures.load(Ordering::Relaxed),
            protocol_errors: c.protocol_errors.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
        }
    }

    /// Stops accepting, closes every connection and waits for the tasks to end.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Pending connections the kernel queues before `accept` (the std/mio default of 128
/// overflows under a burst of connects, which then stall a second on SYN retry).
const LISTEN_BACKLOG: u32 = 1024;

/// Binds the first address `addr` resolves to that can be bound, and listens.
async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let sock = if a.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        sock.set_reuseaddr(true)?;
        match sock.bind(a) {
            Ok(()) => return sock.listen(LISTEN_BACKLOG),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "resolves to no address")))
}

async fn accept_loop(
    listener: TcpListener,
    cfg: Arc<NetConfig>,
    handler: Arc<dyn Handler>,
    stop: CancellationToken,
    counters: Arc<Counters>,
) {
    let mut tasks = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(target: "kvferry::net", "accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                continue;
            }
        };
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        if counters.active.load(Ordering::Relaxed) >= cfg.max_connections {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "kvferry::net", %peer, "refusing connection: {} already open", cfg.max_connections);
            refuse_busy(&stream, cfg.max_connections).await;
            drop(stream);
            continue;
        }
        counters.active.fetch_add(1, Ordering::Relaxed);
        let (cfg, handler, counters, stop) = (cfg.clone(), handler.clone(), counters.clone(), stop.clone());
        tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = serve_connection(stream, &cfg, &*handler, &counters) => {}
            }
            counters.active.fetch_sub(1, Ordering::Relaxed);
        });
    }
    tasks.shutdown().await;
}

async fn serve_connection(stream: tokio::net::TcpStream, cfg: &NetConfig, handler: &dyn Handler, counters: &Counters) {
    let mut conn = match handshake::accept(stream, cfg).await {
        Ok(c) => c,
        Err(e) => {
            counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
            if matches!(e, NetError::Auth(_)) {
                counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            }
            tracing::warn!(target: "kvferry::net", "handshake failed: {e}");
            return;
        }
    };
    let peer = conn.peer().clone();
    tracing::debug!(target: "kvferry::net", %peer, "connection established");
    loop {
        let header = match conn.read_header(cfg.idle_timeout).await {
            Ok(h) => h,
            Err(NetError::Lost { .. }) => break,
            // An idle close is not an error: close quietly, so that a pooled client
            // sees a closed connection (and reconnects), not a stale `Error` reply.
            Err(NetError::Timeout {
                op: super::conn::IDLE_OP,
                ..
            }) => {
                tracing::debug!(target: "kvferry::net", %peer, "closing idle connection");
                break;
            }
            Err(e) => {
                note_protocol_error(counters, &peer, &e);
                reply_error(&mut conn, 0, &e).await;
                break;
            }
        };
        if header.kind != FrameKind::Control {
            let e = NetError::Protocol("unexpected bulk frame outside a request".into());
            note_protocol_error(counters, &peer, &e);
            reply_error(&mut conn, header.request_id, &e).await;
            break;
        }
        let msg = match conn.read_control_body(&header).await {
            Ok(m) => m,
            Err(e) => {
                note_protocol_error(counters, &peer, &e);
                reply_error(&mut conn, header.request_id, &e).await;
                break;
            }
        };
        counters.requests.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = handler.handle(&mut conn, header.request_id, msg).await {
            if !matches!(e, NetError::Lost { .. }) {
                note_protocol_error(counters, &peer, &e);
            }
            // A frame the handler read was malformed (a push's bulk frame): say why.
            // Write failures surface as `Lost` or `Timeout` and get no reply.
            if matches!(e, NetError::Wire(_) | NetError::Protocol(_)) {
                reply_error(&mut conn, header.request_id, &e).await;
            }
            break;
        }
    }
    handler.disconnected(&peer);
}

fn note_protocol_error(counters: &Counters, peer: &super::PeerInfo, e: &NetError) {
    counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(target: "kvferry::net", %peer, "closing connection: {e}");
}

/// Tells a connection over `max_connections` why it is closed, without waiting: the
/// frame fits in a fresh socket's send buffer, and a peer that cannot take it at once
/// gets only the close.
async fn refuse_busy(stream: &tokio::net::TcpStream, max: usize) {
    let msg = Message::Error {
        kind: ErrorKind::Busy,
        message: format!("server is at its limit of {max} connections; retry later"),
    };
    let mut frame = Vec::new();
    if crate::wire::write_control(&mut frame, 0, &msg).await.is_ok() {
        let _ = stream.try_write(&frame);
    }
}

async fn reply_error(conn: &mut Connection, request_id: u64, e: &NetError) {
    let kind = match e {
        NetError::Wire(WireError::Oversize { .. }) => ErrorKind::TooLarge,
        NetError::Timeout { .. } => ErrorKind::BadRequest,
        _ => ErrorKind::BadRequest,
    };
    let _ = tokio::time::timeout(
        std::time::Duration::from_millis(200),
        conn.send(
            request_id,
            &Message::Error {
                kind,
                message: e.to_string(),
            },
        ),
    )
    .await;
}
