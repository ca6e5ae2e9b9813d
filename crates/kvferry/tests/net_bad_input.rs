//! Hostile and malformed input against a running server, spoken as raw bytes over TCP:
//! garbage, broken headers, truncated frames, absurd lengths, floods of oversize
//! headers, slow-loris clients, a thousand idle connections, the connection cap, bad
//! secrets and protocol misuse after a valid handshake.
//!
//! Each case proves three things: the bad connection gets a typed error (a
//! `Message::Error` control frame where the server can still send one) and is closed
//! (or, for a refused request, stays usable: a `Ping` still gets a `Pong`); the server
//! keeps serving a well-behaved consumer whose gets land intact bytes; and memory stays
//! bounded (the process RSS does not jump).
//!
//! Tests that measure the RSS take [`GATE`] exclusively, so no other test of this file
//! allocates in the same process while they measure; the others share it.

mod common;

use std::io::ErrorKind as IoKind;
use std::time::Duration;

use common::eventually;
use common::p2p::*;
use common::raw::{connect, recv, send, WAIT};
use kvferry::wire::auth::{self, Keys, Role, Transcript};
use kvferry::wire::{self, ChunkKey, ErrorKind, FrameHeader, FrameKind, Limits, Message, WireError, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::RwLock;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Shared by every test; taken exclusively by the ones that measure the process RSS.
static GATE: RwLock<()> = RwLock::const_new(());

/// How much the process RSS may grow across a hostile burst.
const RSS_SLACK: u64 = 64 << 20;
const MAX_CONTROL: u64 = Limits::DEFAULT_MAX_CONTROL_BYTES;
const MAX_BULK: u64 = Limits::DEFAULT_MAX_BULK_BYTES;
const MAX_KEYS: usize = Limits::DEFAULT_MAX_KEYS;

// ---------------------------------------------------------------------------------
// Raw protocol helpers.

/// Resident set size of this process (the server runs in it), in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// Raises the soft open-files limit to at least `want` (up to the hard limit); returns
/// the soft limit now in force.
fn raise_nofile(want: libc::rlim_t) -> libc::rlim_t {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read or write the struct passed to them.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        if r.rlim_cur < want {
            r.rlim_cur = want.min(r.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        }
    }
    r.rlim_cur
}

/// A well-formed header of `kind`.
fn header(kind: FrameKind, request_id: u64, len: u64, checksum: u32) -> [u8; HEADER_LEN] {
    FrameHeader {
        kind,
        request_id,
        len,
        checksum,
    }
    .encode()
}

/// `h` with its header crc recomputed, so that checks after the crc are reached.
fn reseal(mut h: [u8; HEADER_LEN]) -> [u8; HEADER_LEN] {
    let crc = crc32c::crc32c(&h[..28]);
    h[28..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// One control frame carrying `payload` as is (checksum over it unless `checksum`).
fn control_frame(request_id: u64, payload: &[u8], checksum: Option<u32>) -> Vec<u8> {
    let crc = checksum.unwrap_or_else(|| crc32c::crc32c(payload));
    let mut f = header(FrameKind::Control, request_id, payload.len() as u64, crc).to_vec();
    f.extend_from_slice(payload);
    f
}

/// `msg` as one control frame.
async fn encode(id: u64, msg: &Message) -> Vec<u8> {
    let mut f = Vec::new();
    wire::write_control(&mut f, id, msg).await.unwrap();
    f
}

/// Reads one reply: an `Error` of `kind` whose message mentions `needle`. Returns its
/// request id.
async fn expect_error(s: &mut TcpStream, kind: ErrorKind, needle: &str) -> u64 {
    match recv(s).await {
        (id, Message::Error { kind: k, message }) => {
            assert_eq!(k, kind, "error kind (message: {message:?})");
            assert!(
                message.contains(needle),
                "error message {message:?} does not mention {needle:?}"
            );
            id
        }
        (_, other) => panic!("expected Error({kind:?}), got {other:?}"),
    }
}

/// The server closed the connection: the next read is end of stream (or a reset,
/// when bytes we sent were left unread), within [`WAIT`].
async fn expect_closed(s: &mut TcpStream) {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
        Ok(Ok(0)) => {}
        Ok(Err(e)) if matches!(e.kind(), IoKind::ConnectionReset | IoKind::ConnectionAborted) => {}
        Ok(Ok(n)) => panic!("expected a close, got {n} more bytes: {:02x?}", &buf[..n]),
        Ok(Err(e)) => panic!("expected a close, got {e}"),
        Err(_) => panic!("connection still open after {WAIT:?}"),
    }
}

/// The server closed the connection, possibly after an `Error` of `kind` mentioning
/// `needle` (for cases where the peer is gone or timed out, a reply is optional).
async fn expect_closed_maybe_error(s: &mut TcpStream, kind: ErrorKind, needle: &str) {
    match tokio::time::timeout(WAIT, wire::read_control::<_, Message>(s, &Limits::default())).await {
        Err(_) => panic!("connection still open after {WAIT:?}"),
        Ok(Err(WireError::Closed)) => {}
        Ok(Err(WireError::Io(e))) if e.kind() == IoKind::ConnectionReset => {}
        Ok(Err(e)) => panic!("expected a close or an Error frame, got {e}"),
        Ok(Ok((_, Message::Error { kind: k, message }))) => {
            assert_eq!(k, kind, "error kind (message: {message:?})");
            assert!(
                message.contains(needle),
                "error message {message:?} does not mention {needle:?}"
            );
            expect_closed(s).await;
        }
        Ok(Ok((_, other))) => panic!("expected a close or an Error frame, got {other:?}"),
    }
}

/// The connection is still in sync and served: a `Ping` gets a `Pong`.
async fn expect_pong(s: &mut TcpStream, id: u64) {
    send(s, id, &Message::Ping).await;
    assert_eq!(recv(s).await, (id, Message::Pong));
}

fn hello(wants_auth: bool, nonce: [u8; 32]) -> Message {
    Message::Hello {
        peer_id: "raw-client".into(),
        incarnation: 0x5eed,
        nonce,
        wants_auth,
    }
}

/// Sends `Hello`, returns the server's nonce, incarnation and proof from `Challenge`.
async fn hello_challenge(s: &mut TcpStream, wants_auth: bool, nonce: [u8; 32]) -> ([u8; 32], u64, Option<[u8; 32]>) {
    send(s, 1, &hello(wants_auth, nonce)).await;
    match recv(s).await {
        (
            1,
            Message::Challenge {
                nonce,
                incarnation,
                proof,
                ..
            },
        ) => (nonce, incarnation, proof),
        other => panic!("expected Challenge for request 1, got {other:?}"),
    }
}

/// A connection handshaken by hand (no secret): Hello / Challenge / Auth / Welcome.
/// Returns the stream and the server's incarnation.
async fn handshake(addr: &str) -> (TcpStream, u64) {
    let mut s = connect(addr).await;
    let (_, incarnation, proof) = hello_challenge(&mut s, false, auth::nonce()).await;
    assert_eq!(proof, None, "no secret configured: no proof");
    send(&mut s, 2, &Message::Auth { proof: None }).await;
    assert_eq!(recv(&mut s).await, (2, Message::Welcome));
    (s, incarnation)
}

/// A raw connection: before the handshake (`false`) or right after it (`true`).
async fn open(addr: &str, handshaken: bool) -> TcpStream {
    if handshaken {
        handshake(addr).await.0
    } else {
        connect(addr).await
    }
}

// ---------------------------------------------------------------------------------
// The well-behaved client.

/// A consumer whose producer holds two chunks of two blocks under request `req`.
struct Good {
    node: ConsumerNode,
    keys: Vec<ChunkKey>,
    req: u64,
}

impl Good {
    fn new(p: &ProducerNode, req: u64, secret: Option<Vec<u8>>) -> Good {
        let keys = fill(&p.producer, req, 2, 2);
        let engine = kvferry::copy::CopyEngine::new(kvferry::copy::CopyConfig {
            threads: 2,
            slice_bytes: 256 << 10,
        })
        .unwrap();
        Good {
            node: consumer_with_engine(engine, 16, 16, secret),
            keys,
            req,
        }
    }

    /// One lookup and one get whose landed bytes must be exactly the producer's.
    async fn round(&self, addr: &str) {
        let c = &self.node;
        let deadline = Instant::now() + Duration::from_secs(10);
        assert_eq!(
            c.consumer.lookup(addr, &self.keys, deadline).await.unwrap(),
            2,
            "lookup"
        );
        c.region.fill(0, c.layout.region_bytes(), 0xEE).unwrap();
        let landed = c
            .consumer
            .get(addr, &self.keys, c.dst(0, 2, 2), deadline)
            .await
            .unwrap();
        assert_eq!(landed.chunks, 2);
        assert_eq!(c.corrupted_bytes(self.req, 0, &[0, 1]), 0, "chunk 0 landed intact");
        assert_eq!(c.corrupted_bytes(self.req, 1, &[2, 3]), 0, "chunk 1 landed intact");
    }
}

/// Waits until the server holds no connection at all.
async fn all_closed(p: &ProducerNode) {
    eventually("every connection closed on the server", || p.server.stats().active == 0).await;
}

// ---------------------------------------------------------------------------------
// 1. Garbage instead of a Hello.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_hello_is_refused_and_closed() {
    let _g = GATE.read().await;
    let p = producer_node(NodeOpts::default()).await;
    let good = Good::new(&p, 1, None);
    let mut http = b"GET /kv HTTP/1.1\r\nHost: kvferry\r\n\r\n".to_vec();
    http.truncate(HEADER_LEN);
    let mut kvf_noise = b"KVF1".to_vec();
    kvf_noise.push(wire::VERSION);
    kvf_noise.resize(HEADER_LEN, 0x5A);
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("zeros", vec![0u8; HEADER_LEN], "bad frame magic"),
        ("0xAB noise", vec![0xAB; HEADER_LEN], "bad frame magic"),
        ("an HTTP request", http, "bad frame magic"),
        ("magic then noise", kvf_noise, "header crc mismatch"),
    ];
    for (what, bytes, needle) in &cases {
        let mut s = connect(&p.addr).await;
        s.write_all(bytes).await.unwrap();
        let id = expect_error(&mut s, ErrorKind::BadRequest, needle).await;
        assert_eq!(id, 0, "{what}: header errors are answered with request id 0");
        expect_closed(&mut s).await;
    }
    // A long burst of garbage: the server reads one header's worth, answers and closes
    // with the rest unread (the close may then surface as a reset).
    let mut s = connect(&p.addr).await;
    let _ = s.write_all(&vec![0xC3u8; 256 << 10]).await;
    expect_closed_maybe_error(&mut s, ErrorKind::BadRequest, "bad frame magic").await;
    drop(s);

    all_closed(&p).await;
    assert_eq!(p.server.stats().handshake_failures, cases.len() as u64 + 1);
    good.round(&p.addr).await;
}

// ---------------------------------------------------------------------------------
// 2. Broken headers, before and after the handshake.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_headers_get_typed_errors_before_and_after_the_handshake() {
    let _g = GATE.read().await;
    let p = producer_node(NodeOpts::default()).await;
    let good = Good::new(&p, 2, None);
    let ok = header(FrameKind::Control, 3, 1, 0);
    let mut wrong_magic = ok;
    wrong_magic[..4].copy_from_slice(b"KVF2");
    let mut wrong_version = ok;
    wrong_version[4] = 2;
    let mut unknown_kind = ok;
    unknown_kind[5] = 9;
    let mut kind_zero = ok;
    kind_zero[5] = 0;
    let mut reserved = ok;
    reserved[7] = 1;
    let mut bad_crc = ok;
    bad_crc[30] ^= 0xFF;
    let mut bad_crc_len = ok;
    bad_crc_len[16] ^= 0x01; // a flipped length bit is caught by the header crc
    let cases = [
        ("wrong magic", reseal(wrong_magic), "bad frame magic"),
        (
            "wrong version",
            reseal(wrong_version),
            "unsupported wire version 2 (supported: 1)",
        ),
        ("unknown kind", reseal(unknown_kind), "unknown frame kind 9"),
        ("kind zero", reseal(kind_zero), "unknown frame kind 0"),
        (
            "nonzero reserved",
            reseal(reserved),
            "reserved field is 0x0100, must be 0",
        ),
        ("bad header crc", bad_crc, "header crc mismatch"),
        ("flipped length bit", bad_crc_len, "header crc mismatch"),
    ];
    for handshaken in [false, true] {
        for (what, bytes, needle) in &cases {
            let mut s = open(&p.addr, handshaken).await;
            s.write_all(bytes).await.unwrap();
            let id = expect_error(&mut s, ErrorKind::BadRequest, needle).await;
            assert_eq!(id, 0, "{what}");
            expect_closed(&mut s).await;
        }
    }
    all_closed(&p).await;
    let st = p.server.stats();
    assert_eq!(st.handshake_failures, cases.len() as u64, "{st:?}");
    assert_eq!(st.protocol_errors, cases.len() as u64, "{st:?}");
    good.round(&p.addr).await;
}

// ---------------------------------------------------------------------------------
// 3. Truncated frames.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_frames_close_the_connection() {
    let _g = GATE.read().await;
    let p = producer_node(NodeOpts::default()).await;
    let good = Good::new(&p, 3, None);
    let mut ping = Vec::new();
    wire::write_control(
        &mut ping,
        5,
        &Message::Lookup {
            keys: vec![ChunkKey::from_name("k"); 3],
        },
    )
    .await
    .unwrap();
    let body_len = ping.len() - HEADER_LEN;
    let cuts = [
        ("half a header", HEADER_LEN / 2),
        ("a header, no payload", HEADER_LEN),
        ("a header and half the payload", HEADER_LEN + body_len / 2),
        ("all but the last byte", ping.len() - 1),
    ];
    for handshaken in [false, true] {
        for (what, cut) in cuts {
            let mut s = open(&p.addr, handshaken).await;
            s.write_all(&ping[..cut]).await.unwrap();
            // Half-close: the server sees the end of stream mid-frame, we can still read.
            s.shutdown().await.unwrap();
            let t = std::time::Instant::now();
            expect_closed_maybe_error(&mut s, ErrorKind::BadRequest, "mid-frame").await;
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "{what}: closed promptly, not at a timeout"
            );
        }
    }
    // A push whose bulk frame is cut short.
    let (mut s, _) = handshake(&p.addr).await;
    send(
        &mut s,
        7,
        &Message::Put {
            key: ChunkKey::from_name("cut"),
            len: 1000,
        },
    )
    .await;
    s.write_all(&header(FrameKind::Bulk, 7, 1000, 0)).await.unwrap();
    s.write_all(&[1u8; 500]).await.unwrap();
    s.shutdown().await.unwrap();
    expect_closed_maybe_error(&mut s, ErrorKind::BadRequest, "mid-frame").await;
    drop(s);

    all_closed(&p).await;
    assert_eq!(p.producer.stats().pushed, 0);
    assert_eq!(
        p.producer.arena().stats().free_pages,
        256,
        "the cut push returned its staging pages"
    );
    assert_eq!(p.server.stats().handshake_failures, cuts.len() as u64);
    good.round(&p.addr).await;
}

// ---------------------------------------------------------------------------------
// 4. Absurd lengths.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_lengths_are_rejected_from_the_header_alone() {
    let _g = GATE.write().await;
    // A long I/O timeout: an answer within WAIT proves the server did not wait for (or
    // allocate) the announced payload.
    let opts = NodeOpts {
        io_timeout: Some(Duration::from_secs(60)),
        ..NodeOpts::default()
    };
    let p = producer_node(opts).await;
    let good = Good::new(&p, 4, None);
    good.round(&p.addr).await;
    let pooled = p.server.stats().active;
    let before = rss_bytes();
    let lens = [
        (FrameKind::Control, 1u64 << 63),
        (FrameKind::Control, u64::MAX),
        (FrameKind::Control, MAX_CONTROL + 1),
        (FrameKind::Bulk, 1u64 << 63),
        (FrameKind::Bulk, u64::MAX),
        (FrameKind::Bulk, MAX_BULK + 1),
    ];
    for round in 0..4 {
        for handshaken in [false, true] {
            for (kind, len) in lens {
                let mut s = open(&p.addr, handshaken).await;
                s.write_all(&header(kind, 9, len, 0)).await.unwrap();
                let t = std::time::Instant::now();
                let needle = format!("of {len} bytes exceeds limit");
                expect_error(&mut s, ErrorKind::TooLarge, &needle).await;
                expect_closed(&mut s).await;
                assert!(
                    t.elapsed() < WAIT,
                    "round {round}: {kind:?} of {len} answered from the header"
                );
            }
        }
        // Inside a push: an absurd declared length, and an absurd bulk frame after a
        // sane declaration.
        for put_len in [u64::MAX, 1 << 63, MAX_BULK + 1] {
            let (mut s, _) = handshake(&p.addr).await;
            send(
                &mut s,
                11,
                &Message::Put {
                    key: ChunkKey::from_name("huge"),
                    len: put_len,
                },
            )
            .await;
            expect_error(
                &mut s,
                ErrorKind::TooLarge,
                &format!("chunk of {put_len} bytes exceeds limit"),
            )
            .await;
            expect_closed(&mut s).await;
        }
        for bulk_len in [u64::MAX, 1 << 63, MAX_BULK + 1] {
            let (mut s, _) = handshake(&p.addr).await;
            send(
                &mut s,
                12,
                &Message::Put {
                    key: ChunkKey::from_name("sane"),
                    len: 1000,
                },
            )
            .await;
            s.write_all(&header(FrameKind::Bulk, 12, bulk_len, 0)).await.unwrap();
            let id = expect_error(&mut s, ErrorKind::TooLarge, &format!("bulk frame of {bulk_len} bytes")).await;
            assert_eq!(id, 12);
            expect_closed(&mut s).await;
        }
    }
    let grew = rss_bytes().saturating_sub(before);
    assert!(grew < RSS_SLACK, "RSS grew by {} MiB", grew >> 20);
    eventually("the bad connections closed", || p.server.stats().active == pooled).await;
    assert_eq!(p.producer.arena().stats().free_pages, 256);
    good.round(&p.addr).await;
}

// ---------------------------------------------------------------------------------
// 5. A flood of oversize headers on many connections.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_oversize_headers_does_not_disturb_a_good_client() {
    let _g = GATE.write().await;
    raise_nofile(1024);
    let p = producer_node(NodeOpts {
        io_timeout: Some(Duration::from_secs(60)),
        ..NodeOpts::default()
    })
    .await;
    let good = Good::new(&p, 5, None);
    good.round(&p.addr).await;
    let before = rss_bytes();
    const N: usize = 200;
    let addr = p.addr.clone();
    let flood = tokio::spawn(async move {
        let mut set = JoinSet::new();
        for i in 0..N {
            let addr = addr.clone();
            set.spawn(async move {
                let (kind, len) = match i % 4 {
                    0 => (FrameKind::Control, u64::MAX),
                    1 => (FrameKind::Bulk, u64::MAX),
                    2 => (FrameKind::Control, MAX_CONTROL + 1 + i as u64),
                    _ => (FrameKind::Bulk, (1 << 63) + i as u64),
                };
                let mut s = open(&addr, i % 2 == 1).await;
                s.write_all(&header(kind, i as u64, len, 0)).await.unwrap();
                expect_error(&mut s, ErrorKind::TooLarge, "exceeds limit").await;
                expect_closed(&mut s).await;
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    });
    let mut rounds = 0;
    while !flood.is_finished() || rounds < 3 {
        good.round(&p.addr).await;
        rounds += 1;
    }
    flood.await.unwrap();
    let grew = rss_bytes().saturating_sub(before);
    assert!(grew < RSS_SLACK, "RSS grew by {} MiB", grew >> 20);
    drop(good);
    all_closed(&p).await;
    let st = p.server.stats();
    assert_eq!(st.handshake_failures, N as u64 / 2, "{st:?}");
    assert_eq!(st.protocol_errors, N as u64 / 2, "{st:?}");
    assert_eq!(st.refused, 0, "{st:?}");
}

// ---------------------------------------------------------------------------------
// 6. Slow-loris clients.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_frames_are_cut_once_they_stall_for_the_io_timeout() {
    let _g = GATE.read().await;
    let io = Duration::from_millis(300);
    let p = producer_node(NodeOpts {
        io_timeout: Some(io),
        ..NodeOpts::default()
    })
    .await;
    let good = Good::new(&p, 6, None);
    let mut lookup = Vec::new();
    wire::write_control(
        &mut lookup,
        5,
        &Message::Lookup {
            keys: vec![ChunkKey::from_name("k")],
        },
    )
    .await
    .unwrap();
    // A header that trickles in, and a payload that trickles in after a whole header,
    // a byte per 40 ms (well within the progress timeout), each stopping one byte
    // short: each is cut once no byte came for the I/O timeout.
    let trickles = [
        ("read frame header timed out", lookup[..HEADER_LEN - 1].to_vec(), 0),
        (
            "read control frame timed out",
            lookup[..lookup.len() - 1].to_vec(),
            HEADER_LEN,
        ),
    ];
    let mut set = JoinSet::new();
    for (needle, bytes, at_once) in trickles {
        let (s, _) = handshake(&p.addr).await;
        // When the last byte goes out.
        let trickle = Duration::from_millis(40) * (bytes.len() - at_once - 1) as u32;
        set.spawn(async move {
            let (mut rd, mut wr) = s.into_split();
            let started = std::time::Instant::now();
            let writer = tokio::spawn(async move {
                let _ = wr.write_all(&bytes[..at_once]).await;
                for b in &bytes[at_once..] {
                    if wr.write_all(&[*b]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
                std::future::pending::<()>().await;
            });
            let reply = tokio::time::timeout(WAIT, wire::read_control::<_, Message>(&mut rd, &Limits::default())).await;
            let waited = started.elapsed();
            match reply {
                Ok(Ok((
                    _,
                    Message::Error {
                        kind: ErrorKind::BadRequest,
                        message,
                    },
                ))) => {
                    assert!(message.contains(needle), "{message:?} does not mention {needle:?}")
                }
                other => panic!("expected a timeout error, got {other:?}"),
            }
            assert!(
                waited >= trickle + io - Duration::from_millis(50),
                "cut after {waited:?}, before {io:?} without progress"
            );
            assert!(
                waited < trickle + io + Duration::from_secs(3),
                "cut only after {waited:?}"
            );
            let mut buf = [0u8; 8];
            let end = tokio::time::timeout(WAIT, rd.read(&mut buf))
                .await
                .expect("closed after the error");
            assert!(matches!(end, Ok(0)) || end.is_err(), "{end:?}");
            writer.abort();
        });
    }
    // Meanwhile the server serves a good client.
    good.round(&p.addr).await;
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    assert_eq!(p.server.stats().protocol_errors, 2);
    good.round(&p.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_slow_handshakes_are_cut_at_the_handshake_timeout() {
    let _g = GATE.read().await;
    let hs = Duration::from_millis(400);
    let p = producer_node(NodeOpts {
        handshake_timeout: Some(hs),
        ..NodeOpts::default()
    })
    .await;
    let good = Good::new(&p, 7, None);
    let mut hello_bytes = Vec::new();
    wire::write_control(&mut hello_bytes, 1, &hello(false, [7; 32]))
        .await
        .unwrap();
    let mut set = JoinSet::new();
    for slow in [false, true] {
        let (addr, hello_bytes) = (p.addr.clone(), hello_bytes.clone());
        set.spawn(async move {
            let s = connect(&addr).await;
            let started = std::time::Instant::now();
            let (mut rd, mut wr) = s.into_split();
            let writer = tokio::spawn(async move {
                if slow {
                    for b in &hello_bytes[..hello_bytes.len() - 1] {
                        if wr.write_all(&[*b]).await.is_err() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                }
                std::future::pending::<()>().await;
            });
            let mut buf = [0u8; 256];
            let n = tokio::time::timeout(WAIT, rd.read(&mut buf))
                .await
                .expect("closed at the handshake timeout");
            let waited = started.elapsed();
            assert!(matches!(n, Ok(0)) || n.is_err(), "slow={slow}: {n:?}");
            assert!(
                waited >= hs - Duration::from_millis(50),
                "slow={slow}: cut after {waited:?}"
            );
            assert!(
                waited < hs + Duration::from_secs(3),
                "slow={slow}: cut only after {waited:?}"
            );
            writer.abort();
        });
    }
    good.round(&p.addr).await;
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
    // The socket closes as the handshake future is dropped, just before the count.
    eventually("both handshakes counted as failed", || {
        p.server.stats().handshake_failures == 2
    })
    .await;
    good.round(&p.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_at_the_idle_timeout_and_pools_recover() {
    let _g = GATE.read().await;
    let idle = Duration::from_millis(300);
    let p = producer_node(NodeOpts {
        idle_timeout: Some(idle),
        ..NodeOpts::default()
    })
    .await;
    let good = Good::new(&p, 8, None);
    good.round(&p.addr).await;
    let (mut s, _) = handshake(&p.addr).await;
    let started = std::time::Instant::now();
    expect_closed_maybe_error(&mut s, ErrorKind::BadRequest, "timed out").await;
    let waited = started.elapsed();
    assert!(waited >= idle - Duration::from_millis(50), "closed after {waited:?}");
    assert!(waited < idle + Duration::from_secs(3), "closed only after {waited:?}");
    // The good client's pooled connections were closed as idle too: its next requests
    // reconnect and succeed.
    all_closed(&p).await;
    good.round(&p.addr).await;
    assert_eq!(
        p.server.stats().protocol_errors,
        0,
        "an idle close is not a protocol error"
    );
}

// ---------------------------------------------------------------------------------
// 7. Many idle connections, and the connection cap.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_connections_do_not_starve_a_good_client() {
    let _g = GATE.write().await;
    const N: usize = 1000;
    // Both ends of every connection live in this process.
    let limit = raise_nofile(2 * N as u64 + 512);
    let n = if limit >= 2 * N as u64 + 256 {
        N
    } else {
        (limit as usize).saturating_sub(256) / 2
    };
    assert!(n >= 100, "open-files limit {limit} too low for this test");
    let opts = NodeOpts {
        handshake_timeout: Some(Duration::from_secs(60)),
        // Room for all of them (the default budget closes the oldest beyond 64; see
        // net_preauth.rs).
        max_unauthenticated: Some(2 * N),
        ..NodeOpts::default()
    };
    let p = producer_node(opts).await;
    let good = Good::new(&p, 9, None);
    good.round(&p.addr).await;
    let base = p.server.stats();
    let before = rss_bytes();
    // Three in four sit before their Hello; one in four idles after a full handshake.
    let mut idle = Vec::with_capacity(n);
    for i in 0..n {
        idle.push(open(&p.addr, i % 4 == 0).await);
    }
    eventually("all idle connections open", || {
        p.server.stats().active >= base.active + n
    })
    .await;
    assert_eq!(
        p.server.stats().accepted,
        base.accepted + n as u64,
        "{:?}",
        p.server.stats()
    );
    for _ in 0..3 {
        good.round(&p.addr).await;
    }
    let grew = rss_bytes().saturating_sub(before);
    assert!(
        grew < RSS_SLACK,
        "RSS grew by {} MiB with {n} idle connections",
        grew >> 20
    );
    // The handshaken ones are still served.
    for (i, s) in idle.iter_mut().enumerate().step_by(4).take(10) {
        expect_pong(s, 100 + i as u64).await;
    }
    let st = p.server.stats();
    assert_eq!(
        (st.refused, st.handshake_failures, st.protocol_errors),
        (0, 0, 0),
        "{st:?}"
    );
    drop(idle);
    drop(good);
    all_closed(&p).await;
    let st = p.server.stats();
    assert_eq!(
        st.handshake_failures,
        (n - n.div_ceil(4)) as u64,
        "closed mid-handshake: {st:?}"
    );
    assert_eq!(st.protocol_errors, 0, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_refused_with_busy() {
    let _g = GATE.read().await;
    let opts = NodeOpts {
        max_connections: Some(3),
        handshake_timeout: Some(Duration::from_secs(60)),
        ..NodeOpts::default()
    };
    let p = producer_node(opts).await;
    let good = Good::new(&p, 10, None);
    // Connections still handshaking take no place among the three.
    let _strangers = [
        open(&p.addr, false).await,
        open(&p.addr, false).await,
        open(&p.addr, false).await,
    ];
    let mut held = vec![
        open(&p.addr, true).await,
        open(&p.addr, true).await,
        open(&p.addr, true).await,
    ];
    eventually("three authenticated, three handshaking", || {
        let st = p.server.stats();
        (st.authenticated, st.handshaking) == (3, 3)
    })
    .await;
    // A fourth client is refused once it has completed its part of the handshake.
    for _ in 0..2 {
        let mut s = connect(&p.addr).await;
        hello_challenge(&mut s, false, auth::nonce()).await;
        send(&mut s, 2, &Message::Auth { proof: None }).await;
        assert_eq!(expect_error(&mut s, ErrorKind::Busy, "3 connections").await, 2);
        expect_closed(&mut s).await;
    }
    // A consumer over the cap gets a clear, typed refusal.
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = good
        .node
        .consumer
        .lookup(&p.addr, &good.keys, deadline)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            kvferry::peer::PeerError::Remote {
                kind: ErrorKind::Busy,
                ..
            }
        ),
        "expected a Busy refusal, got {err}"
    );
    let st = p.server.stats();
    assert_eq!((st.refused, st.authenticated, st.handshaking), (3, 3, 3), "{st:?}");
    // The held connections are unaffected.
    expect_pong(&mut held[0], 50).await;
    // Freeing a slot lets the consumer in.
    held.truncate(1);
    eventually("slots freed", || p.server.stats().authenticated == 1).await;
    good.round(&p.addr).await;
}

// ---------------------------------------------------------------------------------
// 8. Wrong and missing secrets.

/// At least 32 bytes, as `NetConfig::validate` requires.
const SECRET: &[u8] = b"s3cret-s3cret-s3cret-s3cret-s3cret";

/// The transcript of a raw handshake (client "raw-client", incarnation 0x5eed, as in
/// [`hello`]) with the producer node, as its first `Challenge` told it: with a secret,
/// no server id (the server names itself only after the client's proof).
fn transcript<'a>(ours: &'a [u8; 32], theirs: &'a [u8; 32], server_incarnation: u64) -> Transcript<'a> {
    Transcript {
        client_id: "raw-client",
        client_incarnation: 0x5eed,
        client_nonce: ours,
        server_id: "",
        server_incarnation,
        server_nonce: theirs,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_and_missing_secrets_are_refused_by_the_handshake() {
    let _g = GATE.read().await;
    let p = producer_node(NodeOpts {
        secret: Some(SECRET.to_vec()),
        ..NodeOpts::default()
    })
    .await;
    let good = Good::new(&p, 11, Some(SECRET.to_vec()));
    // (wants_auth, the proof we send for the handshake's transcript, expected refusal)
    type Prove = fn(&Transcript<'_>) -> Option<[u8; 32]>;
    let cases: [(bool, Prove, ErrorKind, &str); 5] = [
        (false, |_| None, ErrorKind::AuthRequired, "requires a shared secret"),
        (true, |_| None, ErrorKind::AuthRequired, "requires a shared secret"),
        (
            true,
            |t| Some(Keys::derive(b"wrong-wrong-wrong-wrong-wrong-wrong").proof(Role::Client, t)),
            ErrorKind::AuthFailed,
            "wrong shared secret",
        ),
        // The right secret, but the server's proof (another key) sent back at it.
        (
            true,
            |t| Some(Keys::derive(SECRET).proof(Role::Server, t)),
            ErrorKind::AuthFailed,
            "wrong shared secret",
        ),
        // The right secret over a transcript without the server's nonce.
        (
            true,
            |t| {
                let t = Transcript {
                    server_nonce: t.client_nonce,
                    ..*t
                };
                Some(Keys::derive(SECRET).proof(Role::Client, &t))
            },
            ErrorKind::AuthFailed,
            "wrong shared secret",
        ),
    ];
    for (wants_auth, prove, kind, needle) in cases {
        let mut s = connect(&p.addr).await;
        let ours = auth::nonce();
        let (theirs, inc, proof) = hello_challenge(&mut s, wants_auth, ours).await;
        assert_eq!(proof, None, "the server proves nothing before the client has");
        send(
            &mut s,
            2,
            &Message::Auth {
                proof: prove(&transcript(&ours, &theirs, inc)),
            },
        )
        .await;
        assert_eq!(expect_error(&mut s, kind, needle).await, 2);
        expect_closed(&mut s).await;
    }
    // The right proof: the server proves the secret over the same transcript.
    let mut s = connect(&p.addr).await;
    let ours = auth::nonce();
    let (theirs, inc, _) = hello_challenge(&mut s, true, ours).await;
    let t = transcript(&ours, &theirs, inc);
    let keys = Keys::derive(SECRET);
    send(
        &mut s,
        2,
        &Message::Auth {
            proof: Some(keys.proof(Role::Client, &t)),
        },
    )
    .await;
    assert_eq!(inc, 0, "no incarnation told before the client's proof");
    // Now the server names itself, then proves the secret over its real identity.
    let real_inc = match recv(&mut s).await {
        (
            2,
            Message::Challenge {
                peer_id,
                incarnation,
                nonce,
                proof: None,
            },
        ) => {
            assert_eq!((peer_id.as_str(), nonce), ("producer", theirs));
            incarnation
        }
        other => panic!("expected the server's identity, got {other:?}"),
    };
    let t = Transcript {
        server_id: "producer",
        server_incarnation: real_inc,
        ..t
    };
    match recv(&mut s).await {
        (2, Message::WelcomeAuth { proof }) => {
            assert!(keys.verify(Role::Server, &t, &proof), "the server's proof verifies");
            assert!(!keys.verify(Role::Client, &t, &proof), "and is not a client proof");
        }
        other => panic!("expected WelcomeAuth, got {other:?}"),
    }
    expect_pong(&mut s, 3).await;
    drop(s);
    // Skipping Auth altogether.
    let mut s = connect(&p.addr).await;
    hello_challenge(&mut s, true, auth::nonce()).await;
    send(
        &mut s,
        2,
        &Message::Lookup {
            keys: good.keys.clone(),
        },
    )
    .await;
    assert_eq!(expect_error(&mut s, ErrorKind::BadRequest, "expected Auth").await, 2);
    expect_closed(&mut s).await;
    // Anything but Hello first.
    let mut s = connect(&p.addr).await;
    send(
        &mut s,
        1,
        &Message::Lookup {
            keys: good.keys.clone(),
        },
    )
    .await;
    assert_eq!(expect_error(&mut s, ErrorKind::BadRequest, "expected Hello").await, 1);
    expect_closed(&mut s).await;

    all_closed(&p).await;
    let st = p.server.stats();
    assert_eq!((st.auth_failures, st.handshake_failures), (5, 7), "{st:?}");
    good.round(&p.addr).await;
}

// ---------------------------------------------------------------------------------
// 9. Protocol misuse after a valid handshake.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_keep_the_connection_in_sync() {
    let _g = GATE.read().await;
    let p = producer_node(NodeOpts::default()).await;
    let good = Good::new(&p, 12, None);
    let (mut s, inc) = handshake(&p.addr).await;
    let key = ChunkKey::from_name("misuse");
    let refused: Vec<(Message, ErrorKind, String)> = vec![
        (
            Message::Welcome,
            ErrorKind::BadRequest,
            "unexpected request Welcome".into(),
        ),
        (
            Message::PullDone { lease_id: 1 },
            ErrorKind::BadRequest,
            "unexpected request PullDone".into(),
        ),
        (
            hello(false, [0; 32]),
            ErrorKind::BadRequest,
            "unexpected request Hello".into(),
        ),
        (
            Message::Auth { proof: None },
            ErrorKind::BadRequest,
            "unexpected request Auth".into(),
        ),
        (Message::Pong, ErrorKind::BadRequest, "unexpected request Pong".into()),
        (
            Message::Error {
                kind: ErrorKind::Internal,
                message: "x".into(),
            },
            ErrorKind::BadRequest,
            "unexpected request Error".into(),
        ),
        (
            Message::Stage {
                keys: vec![],
                ttl_ms: 100,
            },
            ErrorKind::BadRequest,
            "empty key list".into(),
        ),
        (
            Message::Get {
                keys: vec![],
                ttl_ms: 100,
            },
            ErrorKind::BadRequest,
            "empty key list".into(),
        ),
        (
            Message::Pull {
                lease_id: 999_999,
                incarnation: inc,
            },
            ErrorKind::UnknownLease,
            "no lease 999999".into(),
        ),
        (
            Message::Pull {
                lease_id: 1,
                incarnation: inc ^ 1,
            },
            ErrorKind::StaleIncarnation,
            "incarnation".into(),
        ),
        (
            Message::PullMapped {
                lease_id: 999_999,
                incarnation: inc,
            },
            ErrorKind::UnknownLease,
            "no lease 999999".into(),
        ),
        (
            Message::PullMapped {
                lease_id: 1,
                incarnation: inc ^ 1,
            },
            ErrorKind::StaleIncarnation,
            "incarnation".into(),
        ),
    ];
    for (i, (msg, kind, needle)) in refused.iter().enumerate() {
        let id = 100 + i as u64;
        send(&mut s, id, msg).await;
        assert_eq!(expect_error(&mut s, *kind, needle).await, id, "{}", msg.name());
        expect_pong(&mut s, 1000 + id).await;
    }
    // Done of an unknown lease is acknowledged: release is idempotent (a retried Done,
    // or one racing the TTL sweep, must not fail the consumer).
    send(&mut s, 200, &Message::Done { lease_id: 424_242 }).await;
    assert_eq!(recv(&mut s).await, (200, Message::DoneAck));
    // A push whose bulk frame disagrees with its declared length: the frame is skipped
    // and the push refused.
    for (declared, actual) in [(1000u64, 2000usize), (2000, 1000), (0, 0)] {
        send(&mut s, 201, &Message::Put { key, len: declared }).await;
        wire::write_bulk(&mut s, 201, &[&vec![7u8; actual]]).await.unwrap();
        assert_eq!(
            expect_error(&mut s, ErrorKind::TooLarge, "does not fit a chunk").await,
            201
        );
        expect_pong(&mut s, 202).await;
    }
    // Exactly max_keys keys is fine.
    send(
        &mut s,
        203,
        &Message::Lookup {
            keys: vec![key; MAX_KEYS],
        },
    )
    .await;
    assert_eq!(recv(&mut s).await, (203, Message::LookupReply { hits: 0 }));
    // A well-formed push by hand is stored.
    let data = chunk_bytes(77, 0, 20_000);
    send(
        &mut s,
        204,
        &Message::Put {
            key,
            len: data.len() as u64,
        },
    )
    .await;
    wire::write_bulk(&mut s, 204, &[&data]).await.unwrap();
    assert_eq!(recv(&mut s).await, (204, Message::PutAck { key }));
    send(&mut s, 205, &Message::Lookup { keys: vec![key] }).await;
    assert_eq!(recv(&mut s).await, (205, Message::LookupReply { hits: 1 }));
    assert_eq!(p.server.stats().protocol_errors, 0);
    drop(s);
    good.round(&p.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_requests_after_the_handshake_are_answered_and_closed() {
    let _g = GATE.read().await;
    let p = producer_node(NodeOpts::default()).await;
    let good = Good::new(&p, 13, None);
    let key = ChunkKey::from_name("broken");
    let mut ping = Vec::new();
    wire::write_control(&mut ping, 0, &Message::Ping).await.unwrap();
    let ping_payload = ping[HEADER_LEN..].to_vec();
    let mut trailing = ping_payload.clone();
    trailing.push(0);
    let mut bulk_bad_crc = encode(21, &Message::Put { key, len: 100 }).await;
    bulk_bad_crc.extend_from_slice(&header(FrameKind::Bulk, 21, 100, 0xDEAD_BEEF));
    bulk_bad_crc.extend_from_slice(&[3u8; 100]);
    let mut control_for_bulk = encode(
        21,
        &Message::Put {
            key,
            len: ping_payload.len() as u64,
        },
    )
    .await;
    control_for_bulk.extend_from_slice(&control_frame(21, &ping_payload, None));
    let mut too_many_keys = Vec::new();
    wire::write_control(
        &mut too_many_keys,
        21,
        &Message::Lookup {
            keys: vec![key; MAX_KEYS + 1],
        },
    )
    .await
    .unwrap();
    let mut long_peer = Vec::new();
    let long_hello = Message::Hello {
        peer_id: "p".repeat(300),
        incarnation: 1,
        nonce: [0; 32],
        wants_auth: false,
    };
    wire::write_control(&mut long_peer, 21, &long_hello).await.unwrap();
    let cases: Vec<(&str, Vec<u8>, ErrorKind, &str)> = vec![
        (
            "a bulk frame outside a request",
            header(FrameKind::Bulk, 21, 16, 0).to_vec(),
            ErrorKind::BadRequest,
            "unexpected bulk frame outside a request",
        ),
        ("too many keys", too_many_keys, ErrorKind::TooLarge, "key list of 4097"),
        ("a peer id too long", long_peer, ErrorKind::TooLarge, "peer id of 300"),
        (
            "a bad payload checksum",
            control_frame(21, &ping_payload, Some(0x1234_5678)),
            ErrorKind::BadRequest,
            "payload checksum mismatch",
        ),
        (
            "an unknown message variant",
            control_frame(21, &[100], None),
            ErrorKind::BadRequest,
            "cannot decode",
        ),
        (
            "an empty control payload",
            control_frame(21, &[], None),
            ErrorKind::BadRequest,
            "cannot decode",
        ),
        (
            "trailing bytes",
            control_frame(21, &trailing, None),
            ErrorKind::BadRequest,
            "trailing bytes",
        ),
        (
            "a push with a corrupt bulk frame",
            bulk_bad_crc,
            ErrorKind::BadRequest,
            "payload checksum mismatch",
        ),
    ];
    for (what, bytes, kind, needle) in &cases {
        let (mut s, _) = handshake(&p.addr).await;
        s.write_all(bytes).await.unwrap();
        let id = expect_error(&mut s, *kind, needle).await;
        assert!(id == 21 || id == 0, "{what}: reply for request {id}");
        expect_closed(&mut s).await;
    }
    // A push followed by a control frame: refused, that frame skipped, and the
    // connection stays in sync (not a protocol error).
    let (mut s, _) = handshake(&p.addr).await;
    s.write_all(&control_for_bulk).await.unwrap();
    let id = expect_error(
        &mut s,
        ErrorKind::BadRequest,
        "expects its bulk frame, got a Control frame",
    )
    .await;
    assert_eq!(id, 21);
    expect_pong(&mut s, 22).await;
    drop(s);
    all_closed(&p).await;
    let st = p.server.stats();
    assert_eq!(st.protocol_errors, cases.len() as u64, "{st:?}");
    assert_eq!(p.producer.stats().pushed, 0);
    assert_eq!(
        p.producer.arena().stats().free_pages,
        256,
        "refused pushes returned their staging pages"
    );
    good.round(&p.addr).await;
}
