//! The connection handshake: `Hello` → `Challenge` → `Auth` → `Welcome`.
//!
//! Both sides exchange their peer id and **incarnation** (random per process start).
//! With a shared secret, each side proves it with an HMAC over both nonces; the server
//! proves first, so a client never sends a proof to a server that could not make one.
//! A wrong or missing secret fails on both sides with a clear error; the whole
//! handshake is bounded by the handshake timeout.

use std::fmt;
use std::net::SocketAddr;

use tokio::net::TcpStream;

use super::{Connection, NetConfig, NetError};
use crate::wire::auth::{self, CLIENT_LABEL, SERVER_LABEL};
use crate::wire::{ErrorKind, Message, WireError};

/// The identity of the other side of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Its stable identity.
    pub peer_id: String,
    /// Its incarnation (changes when it restarts).
    pub incarnation: u64,
    /// Its socket address.
    pub addr: Option<SocketAddr>,
}

impl fmt::Display for PeerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            Some(a) => write!(f, "{}@{a}", self.peer_id),
            None => f.write_str(&self.peer_id),
        }
    }
}

fn tune(stream: &TcpStream, cfg: &NetConfig) {
    let _ = stream.set_nodelay(true);
    let sock = socket2::SockRef::from(stream);
    let ka = socket2::TcpKeepalive::new()
        .with_time(cfg.keepalive)
        .with_interval(cfg.keepalive);
    let _ = sock.set_tcp_keepalive(&ka);
    let _ = sock.set_send_buffer_size(4 << 20);
    let _ = sock.set_recv_buffer_size(4 << 20);
}

/// Connects to `addr` and runs the client side of the handshake.
pub(crate) async fn connect(addr: &str, cfg: &NetConfig) -> Result<Connection, NetError> {
    let stream = match tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(addr)).await {
        Err(_) => {
            return Err(NetError::Connect {
                addr: addr.into(),
                reason: format!("timed out after {:?}", cfg.connect_timeout),
            })
        }
        Ok(Err(e)) => {
            return Err(NetError::Connect {
                addr: addr.into(),
                reason: e.to_string(),
            })
        }
        Ok(Ok(s)) => s,
    };
    tune(&stream, cfg);
    let peer_addr = stream.peer_addr().ok();
    let unknown = PeerInfo {
        peer_id: addr.to_string(),
        incarnation: 0,
        addr: peer_addr,
    };
    let conn = Connection::new(stream, unknown, cfg.limits.clone(), cfg.handshake_timeout);
    match tokio::time::timeout(cfg.handshake_timeout, client_side(conn, cfg)).await {
        Ok(r) => r,
        Err(_) => Err(NetError::Timeout {
            op: "handshake",
            waited: cfg.handshake_timeout,
        }),
    }
}

async fn client_side(mut conn: Connection, cfg: &NetConfig) -> Result<Connection, NetError> {
    let ours = auth::nonce();
    let hello = Message::Hello {
        peer_id: cfg.peer_id.clone(),
        incarnation: cfg.incarnation,
        nonce: ours,
        wants_auth: cfg.secret.is_some(),
    };
    let reply = conn.request(&hello).await?;
    let Message::Challenge {
        peer_id,
        incarnation,
        nonce: theirs,
        proof,
    } = reply
    else {
        return Err(NetError::Protocol(format!("expected Challenge, got {reply:?}")));
    };
    let my_proof = match &cfg.secret {
        Some(secret) => {
            let ok = proof.is_some_and(|p| auth::verify(secret, SERVER_LABEL, &theirs, &ours, &p));
            if !ok {
                return Err(NetError::Auth(format!(
                    "server {peer_id} did not prove the shared secret (wrong secret, or none configured there)"
                )));
            }
            Some(auth::proof(secret, CLIENT_LABEL, &ours, &theirs))
        }
        None => None,
    };
    match conn.request(&Message::Auth { proof: my_proof }).await {
        Ok(Message::Welcome) => {}
        Ok(other) => return Err(NetError::Protocol(format!("expected Welcome, got {other:?}"))),
        Err(NetError::Remote {
            kind: ErrorKind::AuthFailed | ErrorKind::AuthRequired,
            message,
        }) => return Err(NetError::Auth(format!("server {peer_id} refused us: {message}"))),
        Err(e) => return Err(e),
    }
    Ok(established(conn, peer_id, incarnation, cfg))
}

/// Runs the server side of the handshake on an accepted stream.
pub(crate) async fn accept(stream: TcpStream, cfg: &NetConfig) -> Result<Connection, NetError> {
    tune(&stream, cfg);
    let addr = stream.peer_addr().ok();
    let unknown = PeerInfo {
        peer_id: "(handshaking)".into(),
        incarnation: 0,
        addr,
    };
    let conn = Connection::new(stream, unknown, cfg.limits.clone(), cfg.handshake_timeout);
    match tokio::time::timeout(cfg.handshake_timeout, server_side(conn, cfg)).await {
        Ok(r) => r,
        Err(_) => Err(NetError::Timeout {
            op: "handshake",
            waited: cfg.handshake_timeout,
        }),
    }
}

/// Receives one handshake frame; a malformed or oversize one is answered with an
/// `Error` (before the connection is closed) so the peer learns why.
async fn recv_or_refuse(conn: &mut Connection) -> Result<(u64, Message), NetError> {
    let r = conn.recv().await;
    if let Err(e @ (NetError::Wire(_) | NetError::Protocol(_))) = &r {
        let kind = match e {
            NetError::Wire(WireError::Oversize { .. }) => ErrorKind::TooLarge,
            _ => ErrorKind::BadRequest,
        };
        let _ = conn
            .send(
                0,
                &Message::Error {
                    kind,
                    message: e.to_string(),
                },
            )
            .await;
    }
    r
}

async fn server_side(mut conn: Connection, cfg: &NetConfig) -> Result<Connection, NetError> {
    let (id, hello) = recv_or_refuse(&mut conn).await?;
    let Message::Hello {
        peer_id,
        incarnation,
        nonce: theirs,
        ..
    } = hello
    else {
        let m = Message::Error {
            kind: ErrorKind::BadRequest,
            message: "expected Hello".into(),
        };
        let _ = conn.send(id, &m).await;
        return Err(NetError::Protocol(format!("expected Hello, got {hello:?}")));
    };
    let ours = auth::nonce();
    let proof = cfg
        .secret
        .as_ref()
        .map(|s| auth::proof(s, SERVER_LABEL, &ours, &theirs));
    let challenge = Message::Challenge {
        peer_id: cfg.peer_id.clone(),
        incarnation: cfg.incarnation,
        nonce: ours,
        proof,
    };
    conn.send(id, &challenge).await?;
    let (id, msg) = recv_or_refuse(&mut conn).await?;
    let Message::Auth { proof } = msg else {
        let m = Message::Error {
            kind: ErrorKind::BadRequest,
            message: format!("expected Auth, got {}", msg.name()),
        };
        let _ = conn.send(id, &m).await;
        return Err(NetError::Protocol(format!("expected Auth, got {msg:?}")));
    };
    if let Some(secret) = &cfg.secret {
        let refusal = match proof {
            None => Some((
                ErrorKind::AuthRequired,
                "this server requires a shared secret and none was offered",
            )),
            Some(p) if !auth::verify(secret, CLIENT_LABEL, &theirs, &ours, &p) => {
                Some((ErrorKind::AuthFailed, "wrong shared secret"))
            }
            Some(_) => None,
        };
        if let Some((kind, why)) = refusal {
            let _ = conn
                .send(
                    id,
                    &Message::Error {
                        kind,
                        message: why.into(),
                    },
                )
                .await;
            return Err(NetError::Auth(format!("client {peer_id}: {why}")));
        }
    }
    conn.send(id, &Message::Welcome).await?;
    Ok(established(conn, peer_id, incarnation, cfg))
}

/// A handshaken connection: records who the peer is and switches from the handshake
/// timeout to the I/O timeout.
fn established(mut conn: Connection, peer_id: String, incarnation: u64, cfg: &NetConfig) -> Connection {
    let addr = conn.peer().addr;
    conn.set_peer(PeerInfo {
        peer_id,
        incarnation,
        addr,
    });
    conn.set_io_timeout(cfg.io_timeout);
    conn
}
