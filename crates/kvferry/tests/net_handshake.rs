//! Pre-authentication limits and the handshake, over real loopback sockets:
//!
//! 1. before the handshake completes, frames are small (`Limits::max_handshake_bytes`)
//!    and handshaking connections have their own budget (`max_unauthenticated`), not
//!    counted against `max_connections`: idle strangers cannot keep peers with the
//!    secret out, and a burst of honest peers waits its turn;
//! 2. the client proves the secret first, the server proves nothing to a stranger,
//!    mismatched configurations fail clearly, failed authentications are counted,
//!    logged with the peer address and rate limited per source address, and secrets
//!    shorter than 32 bytes are refused at start-up.
//!
//! The server runs a small [`TestHandler`] (ping and lookup); raw clients speak the
//! protocol byte by byte where a test needs to misbehave.

mod common;

use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use common::raw::{connect, deadline, eventually, expect_closed, recv, send, unexpected, WAIT};
use futures::future::BoxFuture;
use kvferry::net::{Connection, Handler, NetConfig, NetError, Pool, Server};
use kvferry::wire::auth::{self, Keys, Role, Transcript};
use kvferry::wire::{self, ChunkKey, ErrorKind, FrameHeader, FrameKind, Limits, Message};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
const WRONG: &[u8] = b"fedcba9876543210fedcba9876543210";

// ---------------------------------------------------------------------------------
// A server with a small handler.

struct TestHandler;

impl Handler for TestHandler {
    fn handle<'a>(&'a self, conn: &'a mut Connection, id: u64, msg: Message) -> BoxFuture<'a, Result<(), NetError>> {
        Box::pin(async move {
            match msg {
                Message::Ping => conn.send(id, &Message::Pong).await,
                Message::Lookup { keys } => {
                    let hits = keys.len() as u32;
                    conn.send(id, &Message::LookupReply { hits }).await
                }
                other => conn.send(id, &unexpected(&other)).await,
            }
        })
    }
}

struct Node {
    server: Server,
    addr: String,
}

async fn server(cfg: NetConfig) -> Node {
    let server = Server::bind("127.0.0.1:0", cfg, Arc::new(TestHandler)).await.unwrap();
    let addr = server.local_addr().to_string();
    Node { server, addr }
}

fn config(peer_id: &str, secret: Option<&[u8]>) -> NetConfig {
    let mut c = NetConfig::new(peer_id);
    c.secret = secret.map(|s| s.to_vec());
    c
}

async fn ping(pool: &Pool) -> Result<(), NetError> {
    let mut c = pool.checkout(deadline(WAIT)).await?;
    assert_eq!(c.request(&Message::Ping).await?, Message::Pong);
    c.finish();
    Ok(())
}

// ---------------------------------------------------------------------------------
// Raw protocol helpers.

/// A raw connection from `source` (another loopback address, e.g. 127.0.0.2).
async fn connect_from(source: &str, addr: &str) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let s = sock.connect(addr.parse().unwrap()).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

async fn expect_error(s: &mut TcpStream, kind: ErrorKind, needle: &str) {
    match recv(s).await {
        (_, Message::Error { kind: k, message }) => {
            assert_eq!(k, kind, "{message}");
            assert!(message.contains(needle), "{message:?} does not mention {needle:?}");
        }
        (_, other) => panic!("expected Error({kind:?}), got {other:?}"),
    }
}

fn hello(peer_id: &str, wants_auth: bool, nonce: [u8; 32]) -> Message {
    Message::Hello {
        peer_id: peer_id.into(),
        incarnation: 0x5eed,
        nonce,
        wants_auth,
    }
}

/// A raw handshake as "raw-client" with `secret` (or none) against server "server".
async fn raw_handshake(mut s: TcpStream, secret: Option<&[u8]>) -> TcpStream {
    let ours = auth::nonce();
    send(&mut s, 1, &hello("raw-client", secret.is_some(), ours)).await;
    let (theirs, told_id, told_inc) = match recv(&mut s).await {
        (
            1,
            Message::Challenge {
                nonce,
                incarnation,
                proof,
                peer_id,
            },
        ) => {
            assert_eq!(proof, None, "the server proves nothing first");
            (nonce, peer_id, incarnation)
        }
        other => panic!("expected Challenge, got {other:?}"),
    };
    // With a secret the server names itself only after our proof.
    if secret.is_some() {
        assert_eq!((told_id.as_str(), told_inc), ("", 0), "identity told to a stranger");
    } else {
        assert_eq!(told_id, "server");
    }
    let t0 = Transcript {
        client_id: "raw-client",
        client_incarnation: 0x5eed,
        client_nonce: &ours,
        server_id: &told_id,
        server_incarnation: told_inc,
        server_nonce: &theirs,
    };
    let keys = secret.map(Keys::derive);
    let proof = keys.as_ref().map(|k| k.proof(Role::Client, &t0));
    send(&mut s, 2, &Message::Auth { proof }).await;
    let mut t = t0;
    if keys.is_some() {
        match recv(&mut s).await {
            (
                2,
                Message::Challenge {
                    peer_id,
                    incarnation,
                    nonce,
                    proof: None,
                },
            ) => {
                assert_eq!(peer_id, "server");
                assert_eq!(nonce, theirs);
                let id: &'static str = Box::leak(peer_id.into_boxed_str());
                t = Transcript {
                    server_id: id,
                    server_incarnation: incarnation,
                    ..t0
                };
            }
            other => panic!("expected the server's identity, got {other:?}"),
        }
    }
    match (recv(&mut s).await, &keys) {
        ((2, Message::Welcome), None) => {}
        ((2, Message::WelcomeAuth { proof }), Some(k)) => assert!(k.verify(Role::Server, &t, &proof)),
        (other, _) => panic!("expected a welcome, got {other:?}"),
    }
    s
}

// ---------------------------------------------------------------------------------
// Log capture.

/// Every event of the `kvferry` targets, rendered as "LEVEL message field=value…".
static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

#[derive(Default)]
struct Render {
    message: String,
    fields: String,
}

impl tracing::field::Visit for Render {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        m.target().starts_with("kvferry")
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut r = Render::default();
        e.record(&mut r);
        let line = format!("{} {}{}", e.metadata().level(), r.message, r.fields);
        LOGS.lock().unwrap().push(line);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn capture_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| tracing::subscriber::set_global_default(Capture).unwrap());
}

fn logged(pred: impl Fn(&str) -> bool) -> Vec<String> {
    LOGS.lock().unwrap().iter().filter(|l| pred(l)).cloned().collect()
}

// ---------------------------------------------------------------------------------
// 1. Pre-authentication limits.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_hello_from_a_stranger_is_refused_from_its_header() {
    let node = server(config("server", Some(SECRET))).await;
    // 1 MiB is within the control-frame limit, but not within a handshake's.
    let mut s = connect(&node.addr).await;
    let len = Limits::DEFAULT_MAX_CONTROL_BYTES;
    let header = FrameHeader {
        kind: FrameKind::Control,
        request_id: 1,
        len,
        checksum: 0,
    };
    s.write_all(&header.encode()).await.unwrap();
    // Answered from the header alone: the payload is never sent, so the server
    // neither waited for it nor allocated a buffer for it.
    let started = Instant::now();
    expect_error(
        &mut s,
        ErrorKind::TooLarge,
        &format!("control frame of {len} bytes exceeds limit 1024"),
    )
    .await;
    expect_closed(&mut s).await;
    assert!(started.elapsed() < Duration::from_secs(2));
    // The same with the payload following (the server closes with it unread).
    let mut s = connect(&node.addr).await;
    let mut frame = header.encode().to_vec();
    frame.extend(std::iter::repeat_n(0x42u8, len as usize));
    let _ = s.write_all(&frame).await;
    expect_closed(&mut s).await;
    // A frame at the handshake limit is read (and refused for what it says).
    let mut s = connect(&node.addr).await;
    let payload = vec![0u8; 1024];
    let mut frame = FrameHeader {
        kind: FrameKind::Control,
        request_id: 1,
        len: 1024,
        checksum: crc32c::crc32c(&payload),
    }
    .encode()
    .to_vec();
    frame.extend_from_slice(&payload);
    s.write_all(&frame).await.unwrap();
    expect_error(&mut s, ErrorKind::BadRequest, "trailing bytes").await;
    expect_closed(&mut s).await;
    eventually("three handshakes failed", || {
        node.server.stats().handshake_failures == 3
    })
    .await;
    // After the handshake, the full control limit applies: a 128 KiB lookup is served.
    let mut s = raw_handshake(connect(&node.addr).await, Some(SECRET)).await;
    let keys = vec![ChunkKey::from_name("k"); 4000];
    send(&mut s, 3, &Message::Lookup { keys }).await;
    assert_eq!(recv(&mut s).await, (3, Message::LookupReply { hits: 4000 }));
    let st = node.server.stats();
    assert_eq!((st.auth_failures, st.protocol_errors), (0, 0), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_strangers_cannot_keep_a_client_with_the_secret_out() {
    let mut cfg = config("server", Some(SECRET));
    cfg.max_unauthenticated = 8;
    cfg.max_connections = 2;
    cfg.handshake_timeout = Duration::from_secs(8); // a newcomer may close one after 1 s
    let node = server(cfg).await;
    // A peer with the secret already connected keeps working throughout.
    let mut client = config("client", Some(SECRET));
    client.handshake_timeout = Duration::from_secs(8);
    let early = Pool::new(node.addr.clone(), client.clone()).unwrap();
    ping(&early).await.unwrap();
    // Strangers fill the handshake budget with idle sockets, and more wait behind.
    let mut strangers = Vec::new();
    for _ in 0..8 {
        strangers.push(connect(&node.addr).await);
    }
    eventually("the budget is full", || node.server.stats().handshaking == 8).await;
    let st = node.server.stats();
    assert_eq!(
        (st.authenticated, st.active),
        (1, 9),
        "strangers take no authenticated place: {st:?}"
    );
    ping(&early).await.unwrap();
    // More silent strangers than the silent budget (16 per place): the oldest are
    // closed at once, never waited for.
    for _ in 0..(8 * 16) {
        strangers.push(connect(&node.addr).await);
    }
    let t = Instant::now();
    while node.server.stats().evicted_silent < 8 {
        assert!(
            t.elapsed() < WAIT,
            "the oldest strangers were not closed: {:?}",
            node.server.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    expect_closed(&mut strangers[0]).await;
    // A new client with the secret is served at once: it spoke first.
    let started = Instant::now();
    let late = Pool::new(node.addr.clone(), client.clone()).unwrap();
    ping(&late).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "served after {:?}",
        started.elapsed()
    );
    let st = node.server.stats();
    assert_eq!(st.authenticated, 2, "{st:?}");
    // Authenticated peers are capped by `max_connections`, strangers or not.
    let third = Pool::new(node.addr.clone(), client).unwrap();
    match ping(&third).await {
        Err(NetError::Remote {
            kind: ErrorKind::Busy,
            message,
        }) => assert!(message.contains("2 connections"), "{message}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert_eq!(node.server.stats().refused, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_handshake_budget_waits_its_turn() {
    let mut cfg = config("server", Some(SECRET));
    cfg.max_unauthenticated = 4;
    cfg.handshake_timeout = Duration::from_secs(8);
    let node = server(cfg).await;
    let mut client = config("client", Some(SECRET));
    client.handshake_timeout = Duration::from_secs(8);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..48 {
        let pool = Pool::new(node.addr.clone(), client.clone()).unwrap();
        set.spawn(async move { ping(&pool).await });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    let st = node.server.stats();
    assert_eq!((st.evicted, st.handshake_failures, st.refused), (0, 0, 0), "{st:?}");
}

// ---------------------------------------------------------------------------------
// 2. The handshake.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_gets_nothing_computed_from_the_secret() {
    let node = server(config("server", Some(SECRET))).await;
    for wants_auth in [false, true] {
        let mut s = connect(&node.addr).await;
        send(&mut s, 1, &hello("stranger", wants_auth, [7; 32])).await;
        match recv(&mut s).await {
            (1, Message::Challenge { proof: None, .. }) => {}
            other => panic!("expected a Challenge without proof, got {other:?}"),
        }
        // Any proof but a right one: the reply is an error, never the server's proof.
        send(&mut s, 2, &Message::Auth { proof: Some([0; 32]) }).await;
        expect_error(&mut s, ErrorKind::AuthFailed, "wrong shared secret").await;
        expect_closed(&mut s).await;
    }
    assert_eq!(node.server.stats().auth_failures, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_secrets_are_refused_at_start_up() {
    let e = Server::bind("127.0.0.1:0", config("s", Some(b"hunter2")), Arc::new(TestHandler))
        .await
        .unwrap_err();
    let m = e.to_string();
    assert!(m.contains("7 bytes") && m.contains("at least 32"), "{m}");
    assert!(m.contains("head -c 32 /dev/urandom | base64"), "{m}");
    assert!(Pool::new("127.0.0.1:1", config("c", Some(&[1u8; 31]))).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_secrets_fail_clearly_on_the_client() {
    // A server without a secret refuses a client that expects one before any proof.
    let open = server(config("server", None)).await;
    let e = ping(&Pool::new(open.addr.clone(), config("c", Some(SECRET))).unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, NetError::Auth(m) if m.contains("no shared secret configured")),
        "{e}"
    );
    let mut s = connect(&open.addr).await;
    send(&mut s, 1, &hello("raw-client", true, [1; 32])).await;
    expect_error(&mut s, ErrorKind::AuthRequired, "no shared secret configured").await;
    // Fake servers: one proving first (older handshake), one with a bad proof, one
    // welcoming without a proof.
    for (reply_to_hello, reply_to_auth, needle) in [
        (Some([9u8; 32]), None, "older kvferry"),
        (
            None,
            Some(Message::WelcomeAuth { proof: [9; 32] }),
            "did not prove the shared secret",
        ),
        (None, Some(Message::Welcome), "none configured there"),
    ] {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (id, _) = wire::read_control::<_, Message>(&mut s, &Limits::default())
                .await
                .unwrap();
            let challenge = Message::Challenge {
                peer_id: "fake".into(),
                incarnation: 1,
                nonce: [3; 32],
                proof: reply_to_hello,
            };
            wire::write_control(&mut s, id, &challenge).await.unwrap();
            if let Ok((id, _)) = wire::read_control::<_, Message>(&mut s, &Limits::default()).await {
                wire::write_control(&mut s, id, &reply_to_auth.unwrap()).await.unwrap();
            }
        });
        let e = ping(&Pool::new(addr.to_string(), config("c", Some(SECRET))).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(&e, NetError::Auth(m) if m.contains(needle)), "{e}");
        fake.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_authentications_are_counted_logged_and_rate_limited() {
    capture_logs();
    let mut cfg = config("server", Some(SECRET));
    cfg.auth_failure_limit = 3;
    cfg.auth_failure_window = Duration::from_secs(2);
    let node = server(cfg).await;
    let port = node.server.local_addr().port();
    // A wrong secret, then none: both refused, counted, logged with the address.
    let e = ping(&Pool::new(node.addr.clone(), config("rl-client", Some(WRONG))).unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, NetError::Auth(m) if m.contains("wrong shared secret")),
        "{e}"
    );
    eventually("one failure", || node.server.stats().auth_failures == 1).await;
    let e = ping(&Pool::new(node.addr.clone(), config("rl-client", None)).unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, NetError::Auth(m) if m.contains("requires a shared secret")),
        "{e}"
    );
    eventually("two failures", || node.server.stats().auth_failures == 2).await;
    let failed = |why: &'static str| {
        move |l: &str| {
            // Other tests log failures too: ours are told apart by the claimed id.
            l.starts_with("WARN authentication failed from 127.0.0.1:")
                && l.ends_with(&format!(": {why} claimed_peer_id=rl-client"))
                && !l.contains(&format!("127.0.0.1:{port}:"))
        }
    };
    assert_eq!(logged(failed("wrong secret")).len(), 1, "{:?}", logged(|_| true));
    assert_eq!(logged(failed("no secret offered")).len(), 1, "{:?}", logged(|_| true));
    // A third failure starts a block of this source address.
    let mut s = connect(&node.addr).await;
    send(&mut s, 1, &hello("raw-client", true, [5; 32])).await;
    recv(&mut s).await;
    send(&mut s, 2, &Message::Auth { proof: Some([0; 32]) }).await;
    expect_error(&mut s, ErrorKind::AuthFailed, "wrong shared secret").await;
    eventually("three failures", || node.server.stats().auth_failures == 3).await;
    eventually("the block is logged", || {
        !logged(|l| l.contains("deprioritising handshakes from 127.0.0.1")).is_empty()
    })
    .await;
    // The address is suspect now, but a peer there that proves the secret (a NAT
    // neighbour of the guesser) is still served, and its success lifts the block.
    let started = Instant::now();
    ping(&Pool::new(node.addr.clone(), config("rl-client", Some(SECRET))).unwrap())
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "served after {:?}",
        started.elapsed()
    );
    assert_eq!(node.server.stats().rate_limited, 1);
    // Another source address is not affected.
    let s = raw_handshake(connect_from("127.0.0.2", &node.addr).await, Some(SECRET)).await;
    drop(s);
    // The block was lifted: this address is no longer suspect.
    ping(&Pool::new(node.addr.clone(), config("rl-client", Some(SECRET))).unwrap())
        .await
        .unwrap();
    let st = node.server.stats();
    assert_eq!((st.auth_failures, st.rate_limited), (3, 1), "{st:?}");
}
