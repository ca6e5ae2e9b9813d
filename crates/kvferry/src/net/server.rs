//! The accepting side: a TCP listener that handshakes each connection and hands its
//! requests, one at a time, to a [`Handler`].
//!
//! Each connection is served by its own task. A malformed, oversize, truncated or
//! unauthenticated connection gets a typed error, is closed, and affects no other
//! connection.
//!
//! Before authentication (see [`handshake`](super::handshake)):
//!
//! - the accept loop never waits: a new connection is *silent* until its first byte
//!   is seen, and silent connections have a budget of their own
//!   ([`SILENT_PER_PLACE`] × `max_unauthenticated`); when it is full, the
//!   longest-silent connection is closed **at once**. Before closing one, the accept
//!   loop looks into its socket (a non-blocking peek): a connection whose first bytes
//!   have arrived but whose task has not yet run (a loaded machine, thousands of
//!   connections churning) has spoken and is passed over, as is every such one among
//!   the [`SILENT_SCAN`] longest held; only where all of those have spoken is the
//!   oldest closed regardless (a flood of speakers, which the handshaking places below
//!   then share out). A client that speaks first (every kvferry and TLS client sends
//!   its hello right after connecting) is therefore never the one closed while silent
//!   strangers are held, however fast they are reopened: they only close each other;
//! - a connection that has spoken takes one of `max_unauthenticated` handshaking
//!   places, not one of the `max_connections`. When all are taken, a newcomer closes at
//!   once a connection of the source holding at least two places more than its own
//!   (one address, or one NAT, never holds more than its share while others wait,
//!   however its connections are ranked), else the lowest-ranked, oldest place held
//!   for an eighth of the handshake timeout (until then it waits, within its own
//!   handshake timeout), so a burst of honest peers waits its turn instead of closing
//!   each other; ranks (suspect sources, strangers, and one place per source that
//!   proved the secret within [`PROVEN_MEMORY`](super::admission::PROVEN_MEMORY)) only
//!   order who goes first. The rules, without I/O, are [`admission`](super::admission)'s;
//! - its frames are limited to `Limits::max_handshake_bytes`, and the whole handshake
//!   to the handshake timeout;
//! - a failed authentication is counted (`auth_failures`), logged with the peer's
//!   address, and charged to its source address: after `auth_failure_limit` failures
//!   within `auth_failure_window`, connections from that address are *suspect* for that
//!   window (`rate_limited`): they still handshake (a peer behind the same NAT that
//!   proves the secret is served, and its success lifts the block), but their stale
//!   places are the first closed when places run out, and their failures are no longer
//!   logged one by one.
//!
//! A client that proves itself while `max_connections` authenticated connections are
//! open gets `Busy` in place of the welcome. An idle connection is closed quietly after
//! the idle timeout; a frame that has started fails once no byte moved for the I/O
//! timeout.
//!
//! # Cancellation
//!
//! Dropping the [`Server`] stops accepting and aborts every connection task; a
//! handler's future is dropped at an await point, so whatever it owns (leases being
//! written) is released after the socket write stopped.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::admission::{AuthLimiter, Class, Places, ProvenSources};
use super::handshake::{self, Rejected};
use super::{Connection, NetConfig, NetError};
use crate::wire::auth::Keys;
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

    /// Called when an authenticated connection ends, however it ends (closed by the
    /// peer, broken, idle, or closed after an error), once no request of it runs any
    /// more; not when the server is dropped. For cleanup tied to the connection
    /// ([`Connection::id`]) or its peer.
    fn disconnected(&self, _conn: &Connection) {}
}

/// Counters of a server.
#[derive(Debug, Default, serde::Serialize, Clone, Copy)]
pub struct ServerStats {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections open now (handshaking or authenticated).
    pub active: usize,
    /// Connections handshaking now (not yet authenticated), silent ones included.
    pub handshaking: usize,
    /// Authenticated connections open now (at most `max_connections`).
    pub authenticated: usize,
    /// Clients that completed their handshake while `max_connections` were open, and
    /// were refused with `Busy`.
    pub refused: u64,
    /// Handshakes that failed (including authentication and evictions).
    pub handshake_failures: u64,
    /// Handshakes that failed authentication (wrong or missing secret).
    pub auth_failures: u64,
    /// Handshaking connections closed to make room for a new one
    /// (`max_unauthenticated` were handshaking).
    pub evicted: u64,
    /// Connections accepted as suspect (lowest priority for handshaking places)
    /// because their source address failed authentication too often
    /// (`auth_failure_limit`).
    pub rate_limited: u64,
    /// Connections closed while silent (no byte yet) to make room for a new one.
    pub evicted_silent: u64,
    /// Connections closed for a protocol or frame error.
    pub protocol_errors: u64,
    /// Requests handled.
    pub requests: u64,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    active: AtomicUsize,
    authenticated: AtomicUsize,
    refused: AtomicU64,
    handshake_failures: AtomicU64,
    auth_failures: AtomicU64,
    evicted: AtomicU64,
    rate_limited: AtomicU64,
    evicted_silent: AtomicU64,
    protocol_errors: AtomicU64,
    requests: AtomicU64,
}

/// State shared by the accept loop and the connection tasks.
struct Shared {
    cfg: NetConfig,
    /// Proof keys derived from the secret, once.
    keys: Option<Keys>,
    counters: Counters,
    /// Connections that have sent nothing yet, by accept order: closing one is
    /// cancelling its token.
    silent: Mutex<BTreeMap<u64, Silent>>,
    /// Connections handshaking (they have spoken), by accept order.
    places: Mutex<Places>,
    /// Signalled when a connection leaves `places`.
    left_pending: Notify,
    limiter: Mutex<AuthLimiter>,
    /// Source addresses that completed a handshake recently.
    proven: Mutex<ProvenSources>,
}

/// Silent connections kept per handshaking place (`max_unauthenticated`).
pub const SILENT_PER_PLACE: usize = 16;

/// How many of the longest-held silent connections the accept loop looks into (one
/// non-blocking peek each) for one that has really sent nothing, before it closes the
/// oldest regardless: bounds the work a flood of speakers can cost each accept.
pub const SILENT_SCAN: usize = 64;

/// A connection that had sent nothing when last looked at: closing it is cancelling
/// its token; its socket is shared with its task so that the accept loop can look for
/// bytes that arrived before the task ran.
struct Silent {
    token: CancellationToken,
    stream: Arc<tokio::net::TcpStream>,
}

impl Silent {
    /// Whether bytes are waiting in its socket (false if none yet, or if it is closed
    /// or broken, which leaves it nothing to lose).
    fn has_spoken(&self) -> bool {
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        // tokio's sockets are non-blocking, so an empty buffer is `WouldBlock`, not a
        // wait; peeking consumes nothing, so the connection's task reads these bytes.
        matches!(socket2::SockRef::from(&*self.stream).peek(&mut byte), Ok(n) if n > 0)
    }
}

/// A running server. Dropping it stops it.
pub struct Server {
    addr: SocketAddr,
    stop: CancellationToken,
    shared: Arc<Shared>,
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
        if cfg.tls.as_ref().is_some_and(|t| !t.can_serve()) {
            return Err(NetError::InvalidConfig(
                "a TLS server needs its own certificate and key".into(),
            ));
        }
        let listener = listen(addr).await.map_err(|e| NetError::Connect {
            addr: addr.into(),
            reason: format!("bind: {e}"),
        })?;
        let local = listener.local_addr().map_err(|e| NetError::Connect {
            addr: addr.into(),
            reason: e.to_string(),
        })?;
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared {
            keys: cfg.secret.as_deref().map(Keys::derive),
            limiter: Mutex::new(AuthLimiter::new(cfg.auth_failure_limit, cfg.auth_failure_window)),
            places: Mutex::new(Places::new(cfg.max_unauthenticated, stale_after(&cfg))),
            cfg,
            counters: Counters::default(),
            silent: Mutex::new(BTreeMap::new()),
            left_pending: Notify::new(),
            proven: Mutex::new(ProvenSources::default()),
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone(), handler, stop.clone()));
        Ok(Server {
            addr: local,
            stop,
            shared,
            task: Some(task),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.counters;
        ServerStats {
            accepted: c.accepted.load(Ordering::Relaxed),
            active: c.active.load(Ordering::Relaxed),
            handshaking: self.shared.places.lock().len() + self.shared.silent.lock().len(),
            authenticated: c.authenticated.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            handshake_failures: c.handshake_failures.load(Ordering::Relaxed),
            auth_failures: c.auth_failures.load(Ordering::Relaxed),
            evicted: c.evicted.load(Ordering::Relaxed),
            rate_limited: c.rate_limited.load(Ordering::Relaxed),
            evicted_silent: c.evicted_silent.load(Ordering::Relaxed),
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

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, handler: Arc<dyn Handler>, stop: CancellationToken) {
    let mut tasks = JoinSet::new();
    let mut seq = 0u64;
    let counters = &shared.counters;
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
        let now = Instant::now();
        let suspect = shared.limiter.lock().blocked(peer.ip(), now).is_some();
        if suspect {
            counters.rate_limited.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(target: "kvferry::net", %peer, "suspect connection: too many failed authentications");
        }
        // Silent until its first byte: the longest-silent one goes at once when full.
        let token = stop.child_token();
        seq += 1;
        let stream = Arc::new(stream);
        shared.admit_silent(seq, &token, &stream);
        counters.active.fetch_add(1, Ordering::Relaxed);
        let (shared, handler, id) = (shared.clone(), handler.clone(), seq);
        tasks.spawn(async move {
            tokio::select! {
                _ = token.cancelled() => {}
                _ = serve_connection(stream, peer, id, suspect, &shared, &*handler) => {}
            }
            shared.leave_silent(id);
            shared.leave_pending(id);
            shared.counters.active.fetch_sub(1, Ordering::Relaxed);
        });
    }
    tasks.shutdown().await;
}

/// How long a connection may handshake before a newcomer may close it to take its
/// place: an eighth of the handshake timeout, so that a burst of peers (each done in a
/// round trip or two) waits its turn instead of closing each other.
fn stale_after(cfg: &NetConfig) -> Duration {
    cfg.handshake_timeout / 8
}

impl Shared {
    /// Enters connection `id` among the silent ones; if they are full, closes the
    /// longest-held one that has really sent nothing among the [`SILENT_SCAN`] longest
    /// held (the oldest of all where every one of those has spoken).
    fn admit_silent(&self, id: u64, token: &CancellationToken, stream: &Arc<tokio::net::TcpStream>) {
        let cap = self.cfg.max_unauthenticated.saturating_mul(SILENT_PER_PLACE);
        let mut silent = self.silent.lock();
        while silent.len() >= cap {
            let victim = silent
                .iter()
                .take(SILENT_SCAN)
                .find(|(_, c)| !c.has_spoken())
                .or_else(|| silent.first_key_value())
                .map(|(id, _)| *id);
            let Some(closed) = victim.and_then(|v| silent.remove(&v)) else {
                break;
            };
            closed.token.cancel();
            self.counters.evicted_silent.fetch_add(1, Ordering::Relaxed);
            self.counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
        }
        silent.insert(
            id,
            Silent {
                token: token.clone(),
                stream: stream.clone(),
            },
        );
    }

    fn leave_silent(&self, id: u64) {
        self.silent.lock().remove(&id);
    }

    /// The class a connection from `ip` takes a place with (see [`admission`](super::admission)).
    fn class_of(&self, ip: IpAddr, suspect: bool, now: Instant) -> Class {
        let proven = self.proven.lock().is_proven(ip, now);
        self.places.lock().class_for(ip, suspect, proven)
    }

    /// Remembers that `ip` completed a handshake (and lifts its block, if any).
    fn note_proven(&self, ip: IpAddr, now: Instant) {
        self.limiter.lock().forgive(ip);
        self.proven.lock().note(ip, now);
    }

    /// Enters connection `id` among the handshaking ones if there is room, closing
    /// others by the rules of [`admission`](super::admission); otherwise returns when to try again.
    fn admit_handshaking(
        &self,
        id: u64,
        ip: IpAddr,
        class: Class,
        token: &CancellationToken,
        now: Instant,
    ) -> Option<Instant> {
        let closed = match self.places.lock().admit(id, ip, class, token, now) {
            Ok(closed) => closed,
            Err(until) => return Some(until),
        };
        for c in closed {
            self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            self.counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(target: "kvferry::net", class = ?c.class, source = %c.source, reason = ?c.reason,
                "closing a handshaking connection to make room");
        }
        None
    }

    fn leave_pending(&self, id: u64) {
        if self.places.lock().leave(id) {
            self.left_pending.notify_waiters();
        }
    }

    /// Waits (within `deadline`) for a handshaking place for connection `id`; false if
    /// none came in time.
    async fn wait_for_place(
        &self,
        id: u64,
        ip: IpAddr,
        class: Class,
        token: &CancellationToken,
        deadline: Instant,
    ) -> bool {
        loop {
            let notified = self.left_pending.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let Some(until) = self.admit_handshaking(id, ip, class, token, Instant::now()) else {
                return true;
            };
            if Instant::now() >= deadline {
                return false;
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(until.min(deadline).into()) => {}
            }
        }
    }
}

/// A place among the `max_connections` authenticated connections; dropping it frees it.
struct Slot<'a>(&'a Counters);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.authenticated.fetch_sub(1, Ordering::Relaxed);
    }
}

fn admit(counters: &Counters, max: usize) -> Result<Slot<'_>, String> {
    let n = &counters.authenticated;
    let mut cur = n.load(Ordering::Relaxed);
    loop {
        if cur >= max {
            return Err(format!("server is at its limit of {max} connections; retry later"));
        }
        match n.compare_exchange_weak(cur, cur + 1, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Ok(Slot(counters)),
            Err(now) => cur = now,
        }
    }
}

async fn serve_connection(
    stream: Arc<tokio::net::TcpStream>,
    addr: SocketAddr,
    id: u64,
    suspect: bool,
    shared: &Shared,
    handler: &dyn Handler,
) {
    let (cfg, counters) = (&shared.cfg, &shared.counters);
    // Silent until its first byte (within the handshake timeout).
    let deadline = Instant::now() + cfg.handshake_timeout;
    let mut first = [0u8; 1];
    match tokio::time::timeout_at(deadline.into(), stream.peek(&mut first)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => {
            counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(target: "kvferry::net", "closing a connection silent for the handshake timeout from {addr}");
            return;
        }
    }
    shared.leave_silent(id);
    // The silent set held the only other handle, and only under its lock: out of it,
    // this task owns the socket alone.
    let Ok(stream) = Arc::try_unwrap(stream) else {
        counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(target: "kvferry::net", "closing a connection from {addr}: its socket is still shared");
        return;
    };
    let class = shared.class_of(addr.ip(), suspect, Instant::now());
    let token = CancellationToken::new();
    if !shared.wait_for_place(id, addr.ip(), class, &token, deadline).await {
        counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let accepted = tokio::select! {
        // Closed to make room for another.
        _ = token.cancelled() => return,
        a = handshake::accept(stream, cfg, shared.keys.as_ref(), || {
            admit(counters, cfg.max_connections)
        }) => a,
    };
    // Authenticated or not, it no longer takes a handshaking place.
    shared.leave_pending(id);
    let (mut conn, _slot) = match accepted {
        Ok(c) => {
            shared.note_proven(addr.ip(), Instant::now());
            c
        }
        Err(Rejected::Failed(e)) => {
            counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "kvferry::net", "handshake failed from {addr}: {e}");
            return;
        }
        Err(Rejected::Auth { why, claimed }) => {
            counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
            counters.auth_failures.fetch_add(1, Ordering::Relaxed);
            if suspect {
                tracing::debug!(target: "kvferry::net", claimed_peer_id = %claimed, "authentication failed from {addr} (suspect source): {why}");
            } else {
                tracing::warn!(target: "kvferry::net", claimed_peer_id = %claimed, "authentication failed from {addr}: {why}");
            }
            let limit = shared.cfg.auth_failure_limit;
            if shared.limiter.lock().record_failure(addr.ip(), Instant::now()) {
                tracing::warn!(
                    target: "kvferry::net",
                    "deprioritising handshakes from {} for {:?}: {limit} failed authentications",
                    addr.ip(),
                    shared.cfg.auth_failure_window
                );
            }
            return;
        }
        Err(Rejected::Full(why)) => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "kvferry::net", "refusing connection from {addr}: {why}");
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
    handler.disconnected(&conn);
}

fn note_protocol_error(counters: &Counters, peer: &super::PeerInfo, e: &NetError) {
    counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(target: "kvferry::net", %peer, "closing connection: {e}");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shared(places: usize) -> Shared {
        let mut cfg = NetConfig::new("s");
        cfg.max_unauthenticated = places;
        Shared {
            keys: None,
            limiter: Mutex::new(AuthLimiter::new(cfg.auth_failure_limit, cfg.auth_failure_window)),
            places: Mutex::new(Places::new(places, stale_after(&cfg))),
            cfg,
            counters: Counters::default(),
            silent: Mutex::new(BTreeMap::new()),
            left_pending: Notify::new(),
            proven: Mutex::new(ProvenSources::default()),
        }
    }

    #[test]
    fn a_proven_address_ranks_one_place_and_yields_its_excess_to_a_newcomer() {
        let s = shared(3);
        let t0 = Instant::now();
        let shared_nat: IpAddr = "10.0.0.2".parse().unwrap();
        let newcomer: IpAddr = "10.0.0.3".parse().unwrap();
        s.note_proven(shared_nat, t0);
        assert_eq!(s.class_of(shared_nat, true, t0), Class::Suspect);
        assert_eq!(s.class_of(newcomer, false, t0), Class::Stranger);
        let tokens: Vec<CancellationToken> = (0..5).map(|_| CancellationToken::new()).collect();
        for (i, token) in tokens.iter().enumerate().take(3) {
            let class = s.class_of(shared_nat, false, t0);
            assert_eq!(class, if i == 0 { Class::Proven } else { Class::Stranger });
            assert!(s.admit_handshaking(i as u64, shared_nat, class, token, t0).is_none());
        }
        // The newcomer is not locked out by the address's past: it takes the excess.
        assert!(s
            .admit_handshaking(3, newcomer, Class::Stranger, &tokens[3], t0)
            .is_none());
        assert!(tokens[1].is_cancelled() && !tokens[0].is_cancelled());
        // The address's next connection waits for a stale place instead of closing it.
        let until = s.admit_handshaking(4, shared_nat, Class::Stranger, &tokens[4], t0);
        assert_eq!(until, Some(t0 + stale_after(&s.cfg)));
        assert!(!tokens[3].is_cancelled());
        assert_eq!(s.counters.evicted.load(Ordering::Relaxed), 1);
        s.leave_pending(3);
        assert!(s
            .admit_handshaking(4, shared_nat, Class::Stranger, &tokens[4], t0)
            .is_none());
    }

    /// `n` accepted server-side sockets, with their clients (kept open); the first
    /// `speaking` clients have sent a byte, which has reached the server's socket.
    async fn accepted(n: usize, speaking: usize) -> Vec<(Arc<tokio::net::TcpStream>, tokio::net::TcpStream)> {
        use tokio::io::AsyncWriteExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut out = Vec::new();
        for i in 0..n {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (server, _) = listener.accept().await.unwrap();
            if i < speaking {
                client.write_all(b"h").await.unwrap();
                let mut b = [0u8; 1];
                assert_eq!(server.peek(&mut b).await.unwrap(), 1);
            }
            out.push((Arc::new(server), client));
        }
        out
    }

    #[tokio::test]
    async fn the_oldest_silent_connection_goes_at_once() {
        let s = shared(1);
        let conns = accepted(SILENT_PER_PLACE + 1, 0).await;
        let tokens: Vec<CancellationToken> = conns.iter().map(|_| CancellationToken::new()).collect();
        for (i, (t, (server, _))) in tokens.iter().zip(&conns).enumerate() {
            s.admit_silent(i as u64, t, server);
        }
        assert!(tokens[0].is_cancelled());
        assert!(tokens[1..].iter().all(|t| !t.is_cancelled()));
        assert_eq!(s.silent.lock().len(), SILENT_PER_PLACE);
        assert_eq!(s.counters.evicted_silent.load(Ordering::Relaxed), 1);
    }

    /// Issue 61: a client whose hello had reached the server, but whose task had not
    /// run yet, was the oldest "silent" connection and was closed by the next stranger.
    #[tokio::test]
    async fn a_connection_whose_bytes_arrived_is_not_closed_as_silent() {
        let s = shared(1);
        // The oldest connection has spoken; every later one is silent.
        let conns = accepted(SILENT_PER_PLACE + 3, 1).await;
        let tokens: Vec<CancellationToken> = conns.iter().map(|_| CancellationToken::new()).collect();
        for (i, (t, (server, _))) in tokens.iter().zip(&conns).enumerate() {
            s.admit_silent(i as u64, t, server);
        }
        assert!(
            !tokens[0].is_cancelled(),
            "the speaking connection was closed as silent"
        );
        // The longest-silent strangers went instead, oldest first.
        assert!(tokens[1].is_cancelled() && tokens[2].is_cancelled() && tokens[3].is_cancelled());
        assert!(tokens[4..].iter().all(|t| !t.is_cancelled()));
        assert_eq!(s.counters.evicted_silent.load(Ordering::Relaxed), 3);
        // Its task takes it out of the silent set and owns the socket alone.
        s.leave_silent(0);
        let (server, _client) = conns.into_iter().next().unwrap();
        assert!(Arc::try_unwrap(server).is_ok());
    }

    #[tokio::test]
    async fn where_every_scanned_connection_has_spoken_the_oldest_goes() {
        let s = shared(8);
        let cap = 8 * SILENT_PER_PLACE;
        assert!(cap > SILENT_SCAN);
        // The SILENT_SCAN longest held have spoken, the rest are silent: the scan
        // stops there and the oldest goes (a flood of speakers costs each accept at
        // most SILENT_SCAN peeks).
        let conns = accepted(cap + 1, SILENT_SCAN).await;
        let tokens: Vec<CancellationToken> = conns.iter().map(|_| CancellationToken::new()).collect();
        for (i, (t, (server, _))) in tokens.iter().zip(&conns).enumerate() {
            s.admit_silent(i as u64, t, server);
        }
        assert!(tokens[0].is_cancelled());
        assert!(tokens[1..].iter().all(|t| !t.is_cancelled()));
    }

    #[test]
    fn proving_the_secret_lifts_a_block() {
        let s = shared(1);
        let ip: IpAddr = "10.0.0.9".parse().unwrap();
        let now = Instant::now();
        for _ in 0..s.cfg.auth_failure_limit {
            s.limiter.lock().record_failure(ip, now);
        }
        assert!(s.limiter.lock().blocked(ip, now).is_some());
        s.note_proven(ip, now);
        assert!(s.limiter.lock().blocked(ip, now).is_none());
    }
}
