//! The connection handshake.
//!
//! Both sides exchange their peer id and **incarnation** (random per process start),
//! and, with a shared secret configured, prove that they hold it:
//!
//! ```text
//! client                                   server
//!   Hello { id_c, inc_c, nonce N_c, wants_auth }  →
//!                                         ←  Challenge { "", 0, nonce N_s }      (secret)
//!                                            Challenge { id_s, inc_s, nonce N_s } (no secret)
//!   Auth { proof_c }                      →      (server checks proof_c)
//!                                         ←  Challenge { id_s, inc_s, N_s }      (secret:
//!                                            WelcomeAuth { proof_s }             identity, then proof)
//!                                            Welcome                             (no secret)
//!                                            Error { AuthFailed | AuthRequired | Busy }
//! ```
//!
//! `proof_c = HMAC(K_client, T0)` and `proof_s = HMAC(K_server, T1)`, where the keys are
//! derived from the secret with HKDF-SHA256 (one label per role) and the transcripts
//! bind both ids, both incarnations and both nonces (see [`crate::wire::auth`]): `T1`
//! with the server's real id and incarnation, `T0` with what the first `Challenge`
//! said (with a secret: an empty id and incarnation 0, since the server tells its
//! identity only to a client that proved the secret).
//!
//! # What a connection reveals
//!
//! - **Every proof covers both nonces**, so neither side ever proves anything over
//!   values the other side chose alone, and no proof is valid in another handshake.
//!   Distinct keys per role make a reflected proof fail.
//! - **The client proves first; the server proves (and names itself) only to a client
//!   that proved.** A stranger who connects to a server with a secret gets a
//!   `Challenge` (a random nonce, no peer id, no incarnation) and then an `Error`:
//!   nothing computed from the secret, so nothing it could test guesses against
//!   offline, and not the server's peer id (which names its pid by default) or
//!   incarnation. A server without a secret tells its identity in the first
//!   `Challenge` (anyone may complete that handshake anyway). To obtain the server's proof it must first
//!   contribute a valid proof of its own, i.e. already hold the secret.
//! - The client's proof goes to whatever listens at the address it was configured to
//!   dial; that party could test guesses against it offline. This is why secrets
//!   shorter than 32 bytes ([`MIN_SECRET_BYTES`](crate::wire::auth::MIN_SECRET_BYTES))
//!   are refused at configuration time: guessing 256 random bits is hopeless. A client
//!   with a secret never sends a proof to a server that says it has none (such a
//!   server refuses `Hello { wants_auth: true }` at once), and refuses a server that
//!   proves in `Challenge` (the handshake of older builds).
//!
//! # Bounds
//!
//! Until the handshake completes, frames are limited to
//! [`Limits::max_handshake_bytes`](crate::wire::Limits::max_handshake_bytes) (a
//! stranger's oversize frame is refused from its header, nothing allocated), and the
//! whole handshake, on both sides, is bounded by the handshake timeout. A wrong or
//! missing secret fails on both sides with a clear error. The server's budget of
//! handshaking connections, its connection cap (checked once the client proved
//! itself, answered with `Busy` in place of the welcome) and its per-address limit on
//! failed authentications are in [`server`](super::server).
//!
//! # TLS
//!
//! With [`NetConfig::tls`] set, a mutual TLS handshake ([`tls`](super::tls)) runs
//! first, under the same timeout, and everything above runs inside it. The client's
//! certificate identity is recorded in [`PeerInfo::tls_identity`]. A TLS failure on the
//! server (no client certificate, an untrusted one) is an authentication failure; a
//! plaintext kvferry client is recognised by its first byte (the frame magic's) and
//! told in plaintext that the server requires TLS.
//!
//! # Cancellation
//!
//! [`connect`] and [`accept`] may be dropped at any await (a caller's deadline, the
//! server's silent-connection budget closing the oldest, shutdown). They hold only the
//! socket being handshaken and register nothing until they return: dropping one
//! closes that socket, and no peer table, quota or pool has seen the connection. Both
//! bound themselves (`connect_timeout`, then `handshake_timeout`), so a peer that stops
//! answering half-way never holds a caller past those bounds.

use std::fmt;
use std::net::SocketAddr;

use tokio::net::TcpStream;

use super::stream::Stream;
use super::tls::AcceptError;
use super::{Connection, NetConfig, NetError};
use crate::wire::auth::{self, Keys, Role, Transcript};
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
    /// The identity its TLS certificate names (subject CN, else a subject alternative
    /// name), verified against the CA; `None` without TLS. On a server, this is what
    /// the peer is authenticated as.
    pub tls_identity: Option<String>,
}

impl PeerInfo {
    /// The identity resources (leases, quotas) are bound to: the certificate's
    /// identity under TLS (a peer cannot claim another's), else the claimed peer id
    /// (authenticated only as a holder of the shared secret).
    pub fn authenticated_id(&self) -> &str {
        self.tls_identity.as_deref().unwrap_or(&self.peer_id)
    }
}

impl fmt::Display for PeerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.peer_id)?;
        if let Some(id) = &self.tls_identity {
            write!(f, "[cert {id}]")?;
        }
        match self.addr {
            Some(a) => write!(f, "@{a}"),
            None => Ok(()),
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

/// TCP connect to `addr`, from `local` when given.
async fn dial(addr: &str, local: Option<std::net::IpAddr>) -> std::io::Result<TcpStream> {
    let Some(local) = local else {
        return TcpStream::connect(addr).await;
    };
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        if a.is_ipv4() != local.is_ipv4() {
            continue;
        }
        let sock = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        sock.bind(SocketAddr::new(local, 0))?;
        match sock.connect(a).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{addr}: no address of the family of {local}"),
        )
    }))
}

/// Connects to `addr` and runs the client side of the handshake.
pub(crate) async fn connect(addr: &str, cfg: &NetConfig) -> Result<Connection, NetError> {
    let stream = match tokio::time::timeout(cfg.connect_timeout, dial(addr, cfg.local_addr)).await {
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
        tls_identity: None,
    };
    let handshake = async {
        let mut peer = unknown;
        let stream = match &cfg.tls {
            None => Stream::Plain(stream),
            Some(tls) => {
                let (s, id) = tls
                    .connect(addr, stream)
                    .await
                    .map_err(|e| NetError::Auth(format!("TLS handshake with {addr} failed: {e}")))?;
                peer.tls_identity = id;
                Stream::Tls(Box::new(s.into()))
            }
        };
        let conn = Connection::new(stream, peer, cfg.limits.handshake(), cfg.handshake_timeout);
        client_side(conn, addr, cfg).await
    };
    match tokio::time::timeout(cfg.handshake_timeout, handshake).await {
        Ok(r) => r,
        Err(_) => Err(NetError::Timeout {
            op: "handshake",
            waited: cfg.handshake_timeout,
        }),
    }
}

/// What the error of a server that failed to prove the shared secret to this client
/// says ([`NetError::server_unproven`]): the client proved the secret, the server did
/// not. A server that refused *the client* says nothing about the server.
pub(crate) const SERVER_UNPROVEN: &str = "did not prove the shared secret";

/// An authentication refusal from the server becomes [`NetError::Auth`]: a refusal
/// message, or a fatal TLS alert on the first read. In TLS 1.3 the client's handshake
/// completes before the server has checked the client's certificate, so a server that
/// rejects it (another CA, no certificate) says so with an alert that arrives only
/// when the client reads its first reply.
fn refused_by(server: &str, e: NetError) -> NetError {
    match e {
        NetError::Remote {
            kind: ErrorKind::AuthFailed | ErrorKind::AuthRequired,
            message,
        } => NetError::Auth(format!("server {server} refused us: {message}")),
        NetError::Lost { reason, .. } if reason.contains("received fatal alert") => {
            NetError::Auth(format!("server {server} refused our TLS certificate: {reason}"))
        }
        e => e,
    }
}

async fn client_side(mut conn: Connection, addr: &str, cfg: &NetConfig) -> Result<Connection, NetError> {
    let ours = auth::nonce();
    let hello = Message::Hello {
        peer_id: cfg.peer_id.clone(),
        incarnation: cfg.incarnation,
        nonce: ours,
        wants_auth: cfg.secret.is_some(),
    };
    let reply = conn.request(&hello).await.map_err(|e| refused_by(addr, e))?;
    let Message::Challenge {
        peer_id: first_id,
        incarnation: first_incarnation,
        nonce: theirs,
        proof,
    } = reply
    else {
        return Err(NetError::Unexpected {
            expected: "Challenge",
            got: reply.name(),
        });
    };
    if proof.is_some() {
        return Err(NetError::Auth(format!(
            "server {first_id} at {addr} speaks the handshake of an older kvferry (it proves first); \
             upgrade it"
        )));
    }
    let keys = cfg.secret.as_deref().map(Keys::derive);
    let t0 = Transcript {
        client_id: &cfg.peer_id,
        client_incarnation: cfg.incarnation,
        client_nonce: &ours,
        server_id: &first_id,
        server_incarnation: first_incarnation,
        server_nonce: &theirs,
    };
    let my_proof = keys.as_ref().map(|k| k.proof(Role::Client, &t0));
    let name = if first_id.is_empty() { addr } else { &first_id };
    let mut reply = conn
        .request(&Message::Auth { proof: my_proof })
        .await
        .map_err(|e| refused_by(name, e))?;
    // A server with a secret names itself only now that we proved it.
    let (mut peer_id, mut incarnation) = (first_id.clone(), first_incarnation);
    if let Message::Challenge {
        peer_id: id,
        incarnation: inc,
        nonce,
        proof: None,
    } = &reply
    {
        if !peer_id.is_empty() || *nonce != theirs || id.is_empty() {
            return Err(NetError::Protocol(format!(
                "server at {addr} sent a second Challenge that does not complete the first"
            )));
        }
        (peer_id, incarnation) = (id.clone(), *inc);
        let (_, next) = conn.recv().await.map_err(|e| refused_by(&peer_id, e))?;
        reply = next;
    }
    let t = Transcript {
        server_id: &peer_id,
        server_incarnation: incarnation,
        ..t0
    };
    match (&keys, reply) {
        (None, Message::Welcome) => {}
        (Some(k), Message::WelcomeAuth { proof }) => {
            if !k.verify(Role::Server, &t, &proof) {
                return Err(NetError::Auth(format!(
                    "server {peer_id} at {addr} {SERVER_UNPROVEN} (a different secret there, or not \
                     the server it claims to be)"
                )));
            }
        }
        (Some(_), Message::Welcome) => {
            return Err(NetError::Auth(format!(
                "server {peer_id} at {addr} {SERVER_UNPROVEN} (none configured there)"
            )))
        }
        (_, other) => {
            return Err(NetError::Unexpected {
                expected: if keys.is_some() { "WelcomeAuth" } else { "Welcome" },
                got: other.name(),
            })
        }
    }
    Ok(established(conn, peer_id, incarnation, cfg))
}

/// Why the server side of a handshake did not produce a connection.
#[derive(Debug)]
pub(crate) enum Rejected {
    /// The handshake failed: timeout, I/O, a malformed or unexpected frame.
    Failed(NetError),
    /// The client did not prove the shared secret, or failed TLS authentication.
    Auth {
        /// Why, for the server's log ("wrong secret", "no secret offered", the TLS
        /// error).
        why: String,
        /// The peer id the client claimed.
        claimed: String,
    },
    /// The client proved itself but was not admitted (connection cap); it was told so.
    Full(String),
}

impl From<NetError> for Rejected {
    fn from(e: NetError) -> Rejected {
        Rejected::Failed(e)
    }
}

/// Runs the server side of the handshake on an accepted stream, within the handshake
/// timeout. `keys` are derived from the server's secret, if any. Once the client has
/// proved itself, `admit` decides whether it may stay: `Ok(slot)` is returned with the
/// connection (dropping it releases the place), `Err(message)` is sent to the client
/// as a `Busy` error in place of the welcome.
pub(crate) async fn accept<T>(
    stream: TcpStream,
    cfg: &NetConfig,
    keys: Option<&Keys>,
    admit: impl FnOnce() -> Result<T, String>,
) -> Result<(Connection, T), Rejected> {
    tune(&stream, cfg);
    let addr = stream.peer_addr().ok();
    let unknown = PeerInfo {
        peer_id: "(handshaking)".into(),
        incarnation: 0,
        addr,
        tls_identity: None,
    };
    let handshake = async {
        let (stream, identity) = match &cfg.tls {
            None => (Stream::Plain(stream), None),
            Some(tls) => {
                let (s, id) = tls_accept(tls, stream, cfg).await?;
                (Stream::Tls(Box::new(s.into())), Some(id))
            }
        };
        let mut conn = Connection::new(stream, unknown, cfg.limits.handshake(), cfg.handshake_timeout);
        if let Some(id) = identity {
            tracing::info!(target: "kvferry::net", peer_addr = ?addr, identity = %id, "TLS client authenticated");
            let mut peer = conn.peer().clone();
            peer.tls_identity = Some(id);
            conn.set_peer(peer);
        }
        let (mut conn, slot) = server_side(conn, cfg, keys, admit).await?;
        // Hostile clients: a frame trickled below the minimum rate ends the connection.
        conn.set_min_rate(cfg.min_rate());
        Ok((conn, slot))
    };
    match tokio::time::timeout(cfg.handshake_timeout, handshake).await {
        Ok(r) => r,
        Err(_) => Err(Rejected::Failed(NetError::Timeout {
            op: "handshake",
            waited: cfg.handshake_timeout,
        })),
    }
}

/// The server's TLS handshake. A plaintext kvferry client (its first byte is the frame
/// magic's; a TLS record starts with a content type, 0x14..=0x18) is told, in
/// plaintext, that this server requires TLS.
async fn tls_accept(
    tls: &super::TlsConfig,
    stream: TcpStream,
    cfg: &NetConfig,
) -> Result<(tokio_rustls::server::TlsStream<super::stream::TlsTcp>, String), Rejected> {
    let mut first = [0u8; 1];
    let n = stream
        .peek(&mut first)
        .await
        .map_err(|e| Rejected::Failed(NetError::Wire(WireError::Io(e))))?;
    if n == 1 && first[0] == crate::wire::MAGIC[0] {
        let msg = Message::Error {
            kind: ErrorKind::AuthRequired,
            message: "this server requires TLS; configure a certificate, key and CA (--tls-cert, --tls-key,                       --tls-ca)"
                .into(),
        };
        let mut conn = Connection::new(
            Stream::Plain(stream),
            PeerInfo {
                peer_id: "(plaintext)".into(),
                incarnation: 0,
                addr: None,
                tls_identity: None,
            },
            cfg.limits.handshake(),
            cfg.handshake_timeout,
        );
        // Read its Hello first (so closing does not reset the reply away), then refuse.
        let _ = conn.recv().await;
        let _ = conn.send(0, &msg).await;
        conn.shutdown().await;
        return Err(Rejected::Auth {
            why: "plaintext client on a TLS port".into(),
            claimed: "(plaintext)".into(),
        });
    }
    tls.accept(stream).await.map_err(|e| match e {
        AcceptError::Refused(why) => Rejected::Auth {
            why: format!("TLS: {why}"),
            claimed: "(tls)".into(),
        },
        AcceptError::Other(why) => Rejected::Failed(NetError::Protocol(format!("TLS handshake: {why}"))),
    })
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
        refuse(conn, 0, kind, e.to_string()).await;
    }
    r
}

/// Tells the client why it is refused (best effort: it is closed next either way).
async fn refuse(conn: &mut Connection, id: u64, kind: ErrorKind, message: String) {
    let _ = conn.send(id, &Message::Error { kind, message }).await;
}

async fn server_side<T>(
    mut conn: Connection,
    cfg: &NetConfig,
    keys: Option<&Keys>,
    admit: impl FnOnce() -> Result<T, String>,
) -> Result<(Connection, T), Rejected> {
    let (id, hello) = recv_or_refuse(&mut conn).await?;
    let Message::Hello {
        peer_id,
        incarnation,
        nonce: theirs,
        wants_auth,
    } = hello
    else {
        refuse(&mut conn, id, ErrorKind::BadRequest, "expected Hello".into()).await;
        return Err(NetError::Protocol(format!("expected Hello, got {}", hello.name())).into());
    };
    if wants_auth && keys.is_none() {
        // Say so now, before the client sends a proof to a server that cannot check it.
        let why = "this server has no shared secret configured, and the client expects one";
        refuse(&mut conn, id, ErrorKind::AuthRequired, why.into()).await;
        return Err(NetError::Auth(format!("client {peer_id}: {why}")).into());
    }
    let ours = auth::nonce();
    // With a secret, who we are is told only to a client that proved it.
    let (told_id, told_incarnation) = match keys {
        Some(_) => (String::new(), 0),
        None => (cfg.peer_id.clone(), cfg.incarnation),
    };
    let challenge = Message::Challenge {
        peer_id: told_id.clone(),
        incarnation: told_incarnation,
        nonce: ours,
        proof: None,
    };
    conn.send(id, &challenge).await?;
    let (id, msg) = recv_or_refuse(&mut conn).await?;
    let Message::Auth { proof } = msg else {
        let why = format!("expected Auth, got {}", msg.name());
        refuse(&mut conn, id, ErrorKind::BadRequest, why.clone()).await;
        return Err(NetError::Protocol(why).into());
    };
    let welcome = match keys {
        None => Message::Welcome,
        Some(k) => {
            let t0 = Transcript {
                client_id: &peer_id,
                client_incarnation: incarnation,
                client_nonce: &theirs,
                server_id: &told_id,
                server_incarnation: told_incarnation,
                server_nonce: &ours,
            };
            let refusal = match proof {
                None => Some((
                    ErrorKind::AuthRequired,
                    "this server requires a shared secret and none was offered",
                    "no secret offered",
                )),
                Some(p) if !k.verify(Role::Client, &t0, &p) => {
                    Some((ErrorKind::AuthFailed, "wrong shared secret", "wrong secret"))
                }
                Some(_) => None,
            };
            if let Some((kind, message, why)) = refusal {
                refuse(&mut conn, id, kind, message.into()).await;
                return Err(Rejected::Auth {
                    why: why.into(),
                    claimed: peer_id,
                });
            }
            let t = Transcript {
                server_id: &cfg.peer_id,
                server_incarnation: cfg.incarnation,
                ..t0
            };
            Message::WelcomeAuth {
                proof: k.proof(Role::Server, &t),
            }
        }
    };
    let slot = match admit() {
        Ok(slot) => slot,
        Err(message) => {
            refuse(&mut conn, id, ErrorKind::Busy, message.clone()).await;
            return Err(Rejected::Full(message));
        }
    };
    if keys.is_some() {
        let identity = Message::Challenge {
            peer_id: cfg.peer_id.clone(),
            incarnation: cfg.incarnation,
            nonce: ours,
            proof: None,
        };
        conn.send(id, &identity).await?;
    }
    conn.send(id, &welcome).await?;
    Ok((established(conn, peer_id, incarnation, cfg), slot))
}

/// A handshaken connection: records who the peer is and switches from the handshake
/// timeout and limits to the I/O timeout and the full limits.
fn established(mut conn: Connection, peer_id: String, incarnation: u64, cfg: &NetConfig) -> Connection {
    let addr = conn.peer().addr;
    let tls_identity = conn.peer().tls_identity.clone();
    conn.set_peer(PeerInfo {
        peer_id,
        incarnation,
        addr,
        tls_identity,
    });
    conn.set_io_timeout(cfg.io_timeout);
    conn.set_limits(cfg.limits.clone());
    conn
}
