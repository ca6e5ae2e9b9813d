//! `io_timeout` is a progress timeout, over real loopback sockets: a bulk frame that
//! keeps moving at about 1 MiB/s passes a 1 s I/O timeout however long it takes in all
//! (sent by a slow writer, or pulled through a slow relay), while a writer or a reader
//! that stalls completely is cut about 1 s after its last byte.
//!
//! The server runs a small [`TestHandler`] (put and pull of patterned bytes, reporting
//! how each bulk transfer went); raw clients speak the protocol byte by byte.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::raw::{connect, deadline, eventually, expect_closed, recv, send, unexpected, WAIT};
use futures::future::BoxFuture;
use kvferry::net::{Connection, Handler, NetConfig, NetError, Pool, Server};
use kvferry::wire::{ChunkKey, FrameHeader, FrameKind, Message};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

// ---------------------------------------------------------------------------------
// A server with a small handler.

/// What the handler saw of one bulk transfer: the operation, its outcome, how long.
type Event = (&'static str, Result<(), String>, Duration);

struct TestHandler {
    events: mpsc::UnboundedSender<Event>,
}

/// Byte `i` of a patterned payload.
fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(0x9E37_79B9).rotate_right(13) as u8)
        .collect()
}

impl Handler for TestHandler {
    fn handle<'a>(&'a self, conn: &'a mut Connection, id: u64, msg: Message) -> BoxFuture<'a, Result<(), NetError>> {
        Box::pin(async move {
            match msg {
                Message::Put { key, len } => {
                    let mut buf = vec![0u8; len as usize];
                    let t = Instant::now();
                    let r = conn.recv_bulk(id, &mut [&mut buf[..]]).await;
                    let _ = self
                        .events
                        .send(("put", r.as_ref().map(|_| ()).map_err(|e| e.to_string()), t.elapsed()));
                    r?;
                    assert!(buf == pattern(len as usize), "pushed bytes differ");
                    conn.send(id, &Message::PutAck { key }).await
                }
                // `lease_id` is the number of bytes to send.
                Message::Pull { lease_id, .. } => {
                    let data = pattern(lease_id as usize);
                    let t = Instant::now();
                    let r = conn.send_bulk(id, &[&data]).await;
                    let _ = self
                        .events
                        .send(("pull", r.as_ref().map(|_| ()).map_err(|e| e.to_string()), t.elapsed()));
                    r?;
                    conn.send(id, &Message::PullDone { lease_id }).await
                }
                other => conn.send(id, &unexpected(&other)).await,
            }
        })
    }
}

struct Node {
    server: Server,
    addr: String,
    events: mpsc::UnboundedReceiver<Event>,
}

async fn server(cfg: NetConfig) -> Node {
    let (tx, events) = mpsc::unbounded_channel();
    let server = Server::bind("127.0.0.1:0", cfg, Arc::new(TestHandler { events: tx }))
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    Node { server, addr, events }
}

// ---------------------------------------------------------------------------------
// Raw protocol helpers.

/// A raw handshake (no secret) as "raw-client".
async fn raw_handshake(mut s: TcpStream) -> TcpStream {
    let hello = Message::Hello {
        peer_id: "raw-client".into(),
        incarnation: 0x5eed,
        nonce: [1; 32],
        wants_auth: false,
    };
    send(&mut s, 1, &hello).await;
    match recv(&mut s).await {
        (1, Message::Challenge { proof: None, .. }) => {}
        other => panic!("expected Challenge, got {other:?}"),
    }
    send(&mut s, 2, &Message::Auth { proof: None }).await;
    assert_eq!(recv(&mut s).await, (2, Message::Welcome));
    s
}

// ---------------------------------------------------------------------------------
// The tests.

const TRICKLE_BYTES: usize = 6 << 20;
const PIECE: usize = 64 << 10;
/// One piece per this long: about 1 MiB/s.
const PIECE_EVERY: Duration = Duration::from_micros(62_500);

fn io_timeout_1s(peer_id: &str) -> NetConfig {
    let mut c = NetConfig::new(peer_id);
    c.io_timeout = Duration::from_secs(1);
    c
}

/// A server with a 1 s I/O timeout, a raw handshaken connection to it, and on that
/// connection a `Put` (request 7) of [`TRICKLE_BYTES`] patterned bytes under `name`
/// followed by its bulk frame's header alone. Returns the key and the bytes to send.
async fn put_header_sent(name: &str) -> (Node, TcpStream, ChunkKey, Vec<u8>) {
    let node = server(io_timeout_1s("server")).await;
    let mut s = raw_handshake(connect(&node.addr).await).await;
    let key = ChunkKey::from_name(name);
    send(
        &mut s,
        7,
        &Message::Put {
            key,
            len: TRICKLE_BYTES as u64,
        },
    )
    .await;
    let data = pattern(TRICKLE_BYTES);
    let header = FrameHeader {
        kind: FrameKind::Bulk,
        request_id: 7,
        len: TRICKLE_BYTES as u64,
        checksum: crc32c::crc32c(&data),
    };
    s.write_all(&header.encode()).await.unwrap();
    (node, s, key, data)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_steady_bulk_frame_passes_the_io_timeout() {
    let (mut node, mut s, key, data) = put_header_sent("slow").await;
    let started = Instant::now();
    for piece in data.chunks(PIECE) {
        s.write_all(piece).await.unwrap();
        tokio::time::sleep(PIECE_EVERY).await;
    }
    assert_eq!(recv(&mut s).await, (7, Message::PutAck { key }));
    let took = started.elapsed();
    assert!(
        took > Duration::from_secs(5),
        "the frame took {took:?}, five io timeouts"
    );
    let (op, r, _) = node.events.recv().await.unwrap();
    assert_eq!((op, r), ("put", Ok(())));
}

/// Forwards connections to `upstream`, the replies at about 1 MiB/s.
async fn slow_relay(upstream: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (down, _) = listener.accept().await.unwrap();
            let up = TcpStream::connect(upstream).await.unwrap();
            let (mut down_rd, mut down_wr) = down.into_split();
            let (mut up_rd, mut up_wr) = up.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut down_rd, &mut up_wr).await;
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; PIECE];
                loop {
                    let n = match up_rd.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if down_wr.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(PIECE_EVERY.mul_f64(n as f64 / PIECE as f64)).await;
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_frame_through_a_slow_link_passes_the_io_timeout() {
    let mut node = server(io_timeout_1s("server")).await;
    let relay = slow_relay(node.server.local_addr()).await;
    let pool = Pool::new(relay.to_string(), io_timeout_1s("client")).unwrap();
    let mut c = pool.checkout(deadline(WAIT)).await.unwrap();
    let id = c.next_request_id();
    let started = Instant::now();
    c.send(
        id,
        &Message::Pull {
            lease_id: TRICKLE_BYTES as u128,
            incarnation: 0,
        },
    )
    .await
    .unwrap();
    let mut got = vec![0u8; TRICKLE_BYTES];
    c.recv_bulk(id, &mut [&mut got[..]]).await.unwrap();
    assert!(got == pattern(TRICKLE_BYTES), "pulled bytes differ");
    assert_eq!(
        c.recv_reply(id).await.unwrap(),
        Message::PullDone {
            lease_id: TRICKLE_BYTES as u128
        }
    );
    let took = started.elapsed();
    assert!(
        took > Duration::from_secs(5),
        "the frame took {took:?}, five io timeouts"
    );
    c.finish();
    let (op, r, _) = node.events.recv().await.unwrap();
    assert_eq!((op, r), ("pull", Ok(())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_stalls_is_cut_after_the_io_timeout() {
    let (mut node, mut s, _, data) = put_header_sent("stalled").await;
    s.write_all(&data[..1 << 20]).await.unwrap();
    let stalled = Instant::now();
    let (op, r, _) = tokio::time::timeout(WAIT, node.events.recv()).await.unwrap().unwrap();
    let waited = stalled.elapsed();
    assert_eq!(op, "put");
    assert_eq!(r, Err("read bulk frame timed out after 1s".to_string()));
    assert!(waited >= Duration::from_millis(900), "cut after {waited:?}");
    assert!(waited < Duration::from_millis(2500), "cut only after {waited:?}");
    expect_closed(&mut s).await;
    assert_eq!(node.server.stats().protocol_errors, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stalls_is_cut_after_the_io_timeout() {
    let mut node = server(io_timeout_1s("server")).await;
    let mut s = raw_handshake(connect(&node.addr).await).await;
    // Far more than the socket buffers hold; never read.
    let len = 128u64 << 20;
    send(
        &mut s,
        9,
        &Message::Pull {
            lease_id: len as u128,
            incarnation: 0,
        },
    )
    .await;
    let (op, r, took) = tokio::time::timeout(WAIT, node.events.recv()).await.unwrap().unwrap();
    assert_eq!(op, "pull");
    assert_eq!(r, Err("send bulk frame timed out after 1s".to_string()));
    assert!(took >= Duration::from_millis(900), "cut after {took:?}");
    assert!(took < Duration::from_millis(3000), "cut only after {took:?}");
    drop(s);
    eventually("the connection closed", || node.server.stats().active == 0).await;
}
