//! Hostile but well-framed clients against a running `kvferry serve` process, speaking
//! the wire protocol directly (handshaken connections, hand-written requests):
//!
//! - keys crafted to collide with the store's old internal tombstone keys, while a
//!   chunk is replaced under a pinned stage,
//! - a stage listing one key 4096 times, and a TTL of `u32::MAX` milliseconds,
//! - one peer staging until refused by its quota while another peer still gets,
//! - a `Done` (and a `Pull`) for a lease granted to another peer,
//! - a put whose bulk frame carries another request id (or is not a bulk frame);
//! - 2,000 silent connections, reopened when closed, against clients with the secret
//!   (from one address, and over 100 addresses);
//! - a stranger keeping 200 `Hello`s open from an address where an honest client
//!   proved the secret, against clients from new addresses; a neighbour making a
//!   peer's address suspect (11 wrong secrets) while strangers elsewhere keep 200
//!   `Hello`s open, against that peer;
//! - a stranger reading the server's identity from its `Challenge`;
//! - one client claiming eight peer ids to stage the whole arena without TLS, and a
//!   client claiming another's peer id to release or pull its lease;
//! - ten puts stalled after their bulk header (a byte every 500 ms), and a control
//!   frame trickled after the handshake;
//! - 100 idle connections to the metrics endpoint against liveness probes.
//!
//! Each test kills its server when dropped.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Serve;
use kvferry::net::{NetConfig, NetError, Pool};
use kvferry::wire::{ChunkKey, ChunkMeta, ErrorKind, Message};

/// Bytes of one block of the `tiny` model (2 layers x K/V x 4 tokens x 64 dims x 2 B).
const BLOCK: usize = 2048;

/// A `kvferry serve` child, killed on drop.
/// Starts `kvferry serve` for the `tiny` model on an ephemeral port with `args`
/// (with `--metrics 127.0.0.1:0` when `metrics`), and waits for its addresses.
fn serve(args: &[&str], metrics: bool) -> Serve {
    let mut cmd = Serve::command();
    cmd.args(args)
        .env_remove("RUST_LOG")
        .env_remove("KVFERRY_SECRET")
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    if metrics {
        cmd.args(["--metrics", "127.0.0.1:0"]);
    }
    Serve::start(&mut cmd, Duration::from_secs(30), metrics)
}

/// One sample of the server's metrics endpoint, by exact series name.
fn metric(addr: SocketAddr, series: &str) -> f64 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: kvferry\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let body = raw.split_once("\r\n\r\n").expect("an HTTP response").1;
    body.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in\n{body}"))
        .parse()
        .unwrap()
}

const FREE_PAGES: &str = r#"kvferry_arena_pages{role="producer",state="free"}"#;
/// Staging pages charged to peers' quotas: what a staged lease or a put being received
/// holds (store chunks are served and landed in place, so they take no arena pages,
/// but they are charged as if they did).
const CHARGED: &str = r#"kvferry_quota_pages_charged{role="producer"}"#;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(10)
}

/// A client identity: a pool of handshaken connections as `peer_id`.
fn peer(addr: &str, peer_id: &str) -> Pool {
    Pool::new(addr, NetConfig::new(peer_id)).unwrap()
}

/// The chunk bytes for `key`: `blocks` blocks of a pattern seeded by `seed`.
fn chunk(blocks: usize, seed: u8) -> Vec<u8> {
    (0..blocks * BLOCK).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// One request and its reply on a pooled connection (an `Error` reply is
/// `NetError::Remote`; the connection is reused only when it is in sync).
async fn request(pool: &Pool, msg: &Message) -> Result<Message, NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let r = conn.request(msg).await;
    if matches!(r, Ok(_) | Err(NetError::Remote { .. })) {
        conn.finish();
    }
    r
}

/// The kind of a refused request's error, or a panic naming what came instead.
fn refused(r: Result<Message, NetError>) -> (ErrorKind, String) {
    match r {
        Err(NetError::Remote { kind, message }) => (kind, message),
        Ok(m) => panic!("expected a refusal, got {}", m.name()),
        Err(e) => panic!("expected a refusal, got {e}"),
    }
}

/// A well-behaved put: `Put`, then the bytes in one bulk frame with the same id.
async fn put(pool: &Pool, key: ChunkKey, data: &[u8]) -> Result<(), NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let id = conn.next_request_id();
    conn.send(
        id,
        &Message::Put {
            key,
            len: data.len() as u64,
        },
    )
    .await?;
    conn.send_bulk(id, &[data]).await?;
    let reply = conn.recv_reply(id).await;
    if matches!(reply, Ok(_) | Err(NetError::Remote { .. })) {
        conn.finish();
    }
    match reply? {
        Message::PutAck { key: k } if k == key => Ok(()),
        other => panic!("expected PutAck, got {other:?}"),
    }
}

/// A granted stage: lease id, producer incarnation, staged chunks, granted TTL (ms).
struct Staged {
    lease_id: u128,
    incarnation: u64,
    chunks: Vec<ChunkMeta>,
    ttl_ms: u32,
}

async fn stage(pool: &Pool, keys: Vec<ChunkKey>, ttl_ms: u32) -> Result<Staged, NetError> {
    match request(pool, &Message::Stage { keys, ttl_ms }).await? {
        Message::Staged {
            lease_id,
            incarnation,
            chunks,
            ttl_ms,
        } => Ok(Staged {
            lease_id,
            incarnation,
            chunks,
            ttl_ms,
        }),
        other => panic!("expected Staged, got {}", other.name()),
    }
}

async fn done(pool: &Pool, lease_id: u128) -> Result<Message, NetError> {
    request(pool, &Message::Done { lease_id }).await
}

async fn lookup(pool: &Pool, key: ChunkKey) -> u32 {
    match request(pool, &Message::Lookup { keys: vec![key] }).await.unwrap() {
        Message::LookupReply { hits } => hits,
        other => panic!("expected LookupReply, got {}", other.name()),
    }
}

/// Pulls a staged lease: one bulk frame per chunk, then `PullDone`.
async fn pull(pool: &Pool, s: &Staged) -> Result<Vec<Vec<u8>>, NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let id = conn.next_request_id();
    conn.send(
        id,
        &Message::Pull {
            lease_id: s.lease_id,
            incarnation: s.incarnation,
        },
    )
    .await?;
    let mut out = Vec::new();
    for c in &s.chunks {
        let mut buf = vec![0u8; c.len as usize];
        let crc = conn.recv_bulk(id, &mut [&mut buf[..]]).await?;
        assert_eq!(crc, c.checksum, "bulk frame checksum is the advertised one");
        out.push(buf);
    }
    match conn.recv_reply(id).await? {
        Message::PullDone { lease_id } => assert_eq!(lease_id, s.lease_id),
        other => panic!("expected PullDone, got {}", other.name()),
    }
    conn.finish();
    Ok(out)
}

/// An honest eager get of one key: `Get`, `Staged`, the bytes, `PullDone`, then `Done`.
async fn get(pool: &Pool, key: ChunkKey) -> Result<Vec<u8>, NetError> {
    let mut conn = pool.checkout(deadline()).await?;
    let id = conn.next_request_id();
    conn.send(
        id,
        &Message::Get {
            keys: vec![key],
            ttl_ms: 0,
        },
    )
    .await?;
    let (lease_id, chunks) = match conn.recv_reply(id).await {
        Ok(Message::Staged { lease_id, chunks, .. }) => (lease_id, chunks),
        Ok(other) => panic!("expected Staged, got {}", other.name()),
        Err(e) => {
            if matches!(e, NetError::Remote { .. }) {
                conn.finish();
            }
            return Err(e);
        }
    };
    assert_ne!(lease_id, 0, "the key is held: a hit");
    assert_eq!(chunks.len(), 1);
    let mut buf = vec![0u8; chunks[0].len as usize];
    conn.recv_bulk(id, &mut [&mut buf[..]]).await?;
    match conn.recv_reply(id).await? {
        Message::PullDone { .. } => {}
        other => panic!("expected PullDone, got {}", other.name()),
    }
    match conn.request(&Message::Done { lease_id }).await? {
        Message::DoneAck => {}
        other => panic!("expected DoneAck, got {}", other.name()),
    }
    conn.finish();
    Ok(buf)
}

/// The store's former internal key for `key`'s chunk of generation `gen` replaced
/// while pinned (which any client could also choose).
fn old_tombstone(key: &ChunkKey, gen: u64) -> ChunkKey {
    let mut k = key.0;
    k[0] ^= 0xA5;
    k[24..32].copy_from_slice(&gen.to_le_bytes());
    ChunkKey(k)
}

#[test]
fn crafted_tombstone_keys_survive_a_replace_under_pinned_stages() {
    // 8192 blocks of 2 KiB (16 MiB): the victim (1024 blocks), its replacement (3072)
    // and eight crafted chunks of 500 blocks fit without evicting anything. A chunk is
    // pinned while its stage's gather is queued or running; with one copy thread and
    // stagers looping on the victim, gathers queue up behind the replacement's long
    // landing copy, so the victim is pinned when the replacement replaces it.
    let p = serve(
        &[
            "--blocks",
            "8192",
            "--arena",
            "64MiB",
            "--page-size",
            "64KiB",
            "--copy-threads",
            "1",
        ],
        false,
    );
    let rt = runtime();
    let attacker = peer(&p.addr, "attacker");
    let victim = ChunkKey::from_name("victim");
    let crafted: Vec<ChunkKey> = (1..=8).map(|g| old_tombstone(&victim, g)).collect();
    rt.block_on(async {
        // The victim is the first chunk stored (generation 1), the crafted ones next.
        put(&attacker, victim, &chunk(1024, 1)).await.unwrap();
        for (i, k) in crafted.iter().enumerate() {
            put(&attacker, *k, &chunk(500, 10 + i as u8)).await.unwrap();
        }
        // A stage of the victim before the replacement, on its own connection.
        let first = peer(&p.addr, "stager-first");
        let before = stage(&first, vec![victim], 0).await.unwrap();
        assert_eq!(before.chunks.len(), 1);

        // Stagers pin the victim over and over (stage, Done) while it is replaced.
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let mut stagers = Vec::new();
        for n in 0..16 {
            let pool = peer(&p.addr, &format!("stager-{n}"));
            let (stop, rounds) = (stop.clone(), rounds.clone());
            stagers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let s = match stage(&pool, vec![victim], 0).await {
                        Ok(s) => s,
                        // Sixteen stages of the (larger) replacement may not all fit.
                        Err(NetError::Remote {
                            kind: ErrorKind::Busy, ..
                        }) => continue,
                        Err(e) => panic!("stage failed: {e}"),
                    };
                    assert_eq!(s.chunks.len(), 1, "the victim (old or new) is always held");
                    assert!(matches!(done(&pool, s.lease_id).await.unwrap(), Message::DoneAck));
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        let t = Instant::now();
        while rounds.load(Ordering::Relaxed) < 16 {
            assert!(t.elapsed() < Duration::from_secs(10), "stagers make no progress");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let replacement = chunk(3072, 2);
        put(&attacker, victim, &replacement).await.unwrap();
        stop.store(true, Ordering::Relaxed);
        for s in stagers {
            s.await.unwrap();
        }

        // A stage after the replacement, on another connection; then Done both.
        let second = peer(&p.addr, "stager-second");
        let after = stage(&second, vec![victim], 0).await.unwrap();
        assert_eq!(after.chunks.len(), 1);
        assert!(matches!(done(&first, before.lease_id).await.unwrap(), Message::DoneAck));
        assert!(matches!(done(&second, after.lease_id).await.unwrap(), Message::DoneAck));

        // Every crafted chunk is still there, and the victim holds its new bytes.
        for (i, k) in crafted.iter().enumerate() {
            assert_eq!(
                lookup(&attacker, *k).await,
                1,
                "crafted chunk of generation {} was lost",
                i + 1
            );
        }
        let honest = peer(&p.addr, "honest");
        assert_eq!(get(&honest, victim).await.unwrap(), replacement);
        // All capacity comes back: a put of the whole region evicts everything else.
        put(&attacker, ChunkKey::from_name("big"), &chunk(8192, 3))
            .await
            .expect("a put of the whole store succeeds once nothing is pinned");
        assert_eq!(lookup(&attacker, ChunkKey::from_name("big")).await, 1);
    });
}

#[test]
fn duplicate_keys_are_refused_and_client_ttls_are_capped() {
    let p = serve(
        &[
            "--blocks",
            "256",
            "--arena",
            "16MiB",
            "--page-size",
            "64KiB",
            "--ttl",
            "1s",
        ],
        true,
    );
    let metrics = p.metrics.unwrap();
    let total = metric(metrics, FREE_PAGES);
    assert_eq!(total, 256.0);
    let rt = runtime();
    let client = peer(&p.addr, "hostile");
    let key = ChunkKey::from_name("one");
    rt.block_on(async {
        put(&client, key, &chunk(8, 7)).await.unwrap();

        // 4096 copies of one key in one stage: refused whole, nothing leased.
        let (kind, message) = refused(
            request(
                &client,
                &Message::Stage {
                    keys: vec![key; 4096],
                    ttl_ms: 0,
                },
            )
            .await,
        );
        assert_eq!(kind, ErrorKind::BadRequest, "{message}");
        assert_eq!(metric(metrics, CHARGED), 0.0, "a refused stage holds nothing");
        assert_eq!(metric(metrics, FREE_PAGES), total, "a refused stage leases nothing");

        // A TTL of 49 days is granted as the server's 1 s.
        let s = stage(&client, vec![key], u32::MAX).await.unwrap();
        let granted = Instant::now();
        assert_eq!(s.chunks.len(), 1);
        assert!(
            s.ttl_ms > 0 && s.ttl_ms <= 1000,
            "asked u32::MAX ms, granted {} ms",
            s.ttl_ms
        );
        assert_eq!(metric(metrics, CHARGED), 1.0, "the staged chunk is charged its page");
        // No Done: the charge is returned when the TTL runs out.
        while metric(metrics, CHARGED) > 0.0 {
            assert!(
                granted.elapsed() < Duration::from_secs(3),
                "staged pages still leased {:?} after a 1 s TTL",
                granted.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            granted.elapsed() >= Duration::from_millis(800),
            "released after {:?}, before its TTL",
            granted.elapsed()
        );
        let (kind, message) = refused(
            request(
                &client,
                &Message::Pull {
                    lease_id: s.lease_id,
                    incarnation: s.incarnation,
                },
            )
            .await,
        );
        assert_eq!(kind, ErrorKind::LeaseExpired, "{message}");
        // The server still serves honest gets.
        assert_eq!(get(&peer(&p.addr, "honest"), key).await.unwrap(), chunk(8, 7));
    });
}

#[test]
fn one_peer_cannot_stage_past_its_quota_and_lock_out_others() {
    // 16 pages of 64 KiB; each peer may hold half of them.
    let p = serve(&["--blocks", "1024", "--arena", "1MiB", "--page-size", "64KiB"], false);
    let rt = runtime();
    let greedy = peer(&p.addr, "greedy");
    let honest = peer(&p.addr, "honest");
    // Chunks of 32 blocks: one page each.
    let keys: Vec<ChunkKey> = (0..16).map(|i| ChunkKey::from_name(&format!("k{i}"))).collect();
    let mine = ChunkKey::from_name("mine");
    rt.block_on(async {
        for (i, k) in keys.iter().enumerate() {
            put(&greedy, *k, &chunk(32, i as u8)).await.unwrap();
        }
        put(&honest, mine, &chunk(32, 99)).await.unwrap();

        // All sixteen at once: a partial stage, within the quota.
        let s = stage(&greedy, keys.clone(), 0).await.unwrap();
        let mut held = s.chunks.len();
        assert!((1..=8).contains(&held), "staged {held} pages, quota is 8");
        // Then one by one, until refused as Busy (the quota).
        let mut refusal = None;
        for k in &keys[held..] {
            match stage(&greedy, vec![*k], 0).await {
                Ok(s) => {
                    assert_eq!(s.chunks.len(), 1);
                    held += 1;
                }
                Err(e) => {
                    refusal = Some(refused(Err(e)));
                    break;
                }
            }
        }
        let (kind, message) = refusal.expect("staging never refused: no quota");
        assert_eq!(kind, ErrorKind::Busy, "{message}");
        assert!(message.contains("quota"), "{message}");
        assert!(held <= 8, "greedy peer holds {held} pages, quota is 8");

        // Another peer still gets its chunk.
        assert_eq!(get(&honest, mine).await.unwrap(), chunk(32, 99));
    });
}

#[test]
fn a_lease_cannot_be_released_or_pulled_by_another_peer() {
    let p = serve(&["--blocks", "256", "--arena", "4MiB", "--page-size", "64KiB"], false);
    let rt = runtime();
    let a = peer(&p.addr, "peer-a");
    let b = peer(&p.addr, "peer-b");
    let key = ChunkKey::from_name("a's chunk");
    let data = chunk(16, 5);
    rt.block_on(async {
        put(&a, key, &data).await.unwrap();
        let s = stage(&a, vec![key], 0).await.unwrap();
        assert_eq!(s.chunks.len(), 1);

        let (kind, message) = refused(done(&b, s.lease_id).await);
        assert_eq!(kind, ErrorKind::UnknownLease, "foreign Done: {message}");
        let (kind, message) = refused(
            request(
                &b,
                &Message::Pull {
                    lease_id: s.lease_id,
                    incarnation: s.incarnation,
                },
            )
            .await,
        );
        assert_eq!(kind, ErrorKind::UnknownLease, "foreign Pull: {message}");

        // The owner still pulls its lease and releases it.
        assert_eq!(pull(&a, &s).await.unwrap(), vec![data.clone()]);
        assert!(matches!(done(&a, s.lease_id).await.unwrap(), Message::DoneAck));
        // Lease ids are not guessable from one another.
        let s2 = stage(&a, vec![key], 0).await.unwrap();
        assert!(
            s2.lease_id.abs_diff(s.lease_id) > 1 << 20,
            "lease ids {} then {}: sequential",
            s.lease_id,
            s2.lease_id
        );
        assert!(matches!(done(&a, s2.lease_id).await.unwrap(), Message::DoneAck));
    });
}

#[test]
fn a_put_whose_bulk_frame_is_not_its_own_is_refused() {
    let p = serve(&["--blocks", "256", "--arena", "4MiB", "--page-size", "64KiB"], false);
    let rt = runtime();
    let client = peer(&p.addr, "mismatch");
    let key = ChunkKey::from_name("never stored");
    let data = chunk(4, 9);
    rt.block_on(async {
        let mut conn = client.checkout(deadline()).await.unwrap();
        // The bytes come in a bulk frame of another request id.
        let id = conn.next_request_id();
        let put_msg = Message::Put {
            key,
            len: data.len() as u64,
        };
        conn.send(id, &put_msg).await.unwrap();
        conn.send_bulk(id + 1000, &[&data]).await.unwrap();
        let (kind, message) = refused(conn.recv_reply(id).await);
        assert_eq!(kind, ErrorKind::BadRequest, "{message}");
        // The connection is still in sync.
        assert!(matches!(conn.request(&Message::Ping).await.unwrap(), Message::Pong));

        // A control frame instead of the bytes: refused too, the request it carries
        // is dropped, and the connection stays in sync.
        let id = conn.next_request_id();
        conn.send(id, &put_msg).await.unwrap();
        conn.send(id, &Message::Ping).await.unwrap();
        let (kind, message) = refused(conn.recv_reply(id).await);
        assert_eq!(kind, ErrorKind::BadRequest, "{message}");
        assert!(matches!(conn.request(&Message::Ping).await.unwrap(), Message::Pong));
        conn.finish();

        assert_eq!(lookup(&client, key).await, 0, "a refused put stores nothing");
        // The same put done right is stored.
        put(&client, key, &data).await.unwrap();
        assert_eq!(lookup(&client, key).await, 1);
    });
}

// ---------------------------------------------------------------------------------
// Strangers, claimed identities and trickles (issue 21).

/// A 32-byte shared secret in a fresh file, for `--secret-file`.
fn secret_file() -> (std::path::PathBuf, Vec<u8>) {
    let secret: Vec<u8> = (0..44u32).map(|i| b'a' + ((i * 7) % 26) as u8).collect();
    let path = std::env::temp_dir().join(format!("kvferry-hostile-secret-{}-{}", std::process::id(), rand_u64()));
    std::fs::write(&path, &secret).unwrap();
    (path, secret)
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish()
}

/// A client identity with the secret.
fn peer_with_secret(addr: &str, peer_id: &str, secret: &[u8]) -> Pool {
    Pool::new(addr, NetConfig::new(peer_id).with_secret(secret.to_vec())).unwrap()
}

/// A client identity connecting from another loopback address (another host, as far
/// as the server can tell).
fn peer_from(addr: &str, peer_id: &str, source: &str, secret: Option<&[u8]>) -> Pool {
    let mut cfg = NetConfig::new(peer_id);
    cfg.secret = secret.map(<[u8]>::to_vec);
    cfg.local_addr = Some(source.parse().unwrap());
    Pool::new(addr, cfg).unwrap()
}

/// A raw handshaken session without a secret (Hello, Challenge, Auth, Welcome).
async fn raw_session(addr: &str, peer_id: &str) -> tokio::net::TcpStream {
    use kvferry::wire::{read_control, write_control, Limits};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let hello = Message::Hello {
        peer_id: peer_id.into(),
        incarnation: 7,
        nonce: [1; 32],
        wants_auth: false,
    };
    write_control(&mut s, 1, &hello).await.unwrap();
    let (_, m) = read_control::<_, Message>(&mut s, &Limits::default()).await.unwrap();
    assert!(matches!(m, Message::Challenge { .. }), "{m:?}");
    write_control(&mut s, 2, &Message::Auth { proof: None }).await.unwrap();
    let (_, m) = read_control::<_, Message>(&mut s, &Limits::default()).await.unwrap();
    assert!(matches!(m, Message::Welcome), "{m:?}");
    s
}

/// Writes `bytes` one at a time every `every` until the server closes the connection;
/// returns how long that took (or `None` if all were written).
async fn trickle(s: &mut tokio::net::TcpStream, bytes: &[u8], every: Duration) -> Option<Duration> {
    use tokio::io::AsyncWriteExt;
    let start = Instant::now();
    for b in bytes {
        if s.write_all(&[*b]).await.is_err() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(every).await;
    }
    None
}

/// Connections held open against a server, each reopened as soon as the server closes
/// it, until [`Flood::stop`].
struct Flood {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Flood {
    /// `n` connections from each of `sources` that each say `Hello` (asking to
    /// authenticate) when `hello`, or nothing at all, and then nothing more; returns
    /// once `opened` connections were opened in all (the flood is on).
    async fn start(addr: &str, sources: &[std::net::IpAddr], n: usize, hello: bool, opened: u64) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let count = Arc::new(AtomicU64::new(0));
        let addr: SocketAddr = addr.parse().unwrap();
        let tasks = sources
            .iter()
            .flat_map(|source| (0..n).map(move |i| (*source, i)))
            .map(|(source, i)| {
                let (stop, count) = (stop.clone(), count.clone());
                tokio::spawn(hold(addr, source, format!("stranger-{i}"), hello, stop, count))
            })
            .collect();
        let t = Instant::now();
        while count.load(Ordering::Relaxed) < opened {
            assert!(t.elapsed() < Duration::from_secs(30), "the flood never built up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Flood { stop, tasks }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// One connection of a [`Flood`], reopened until `stop`.
async fn hold(
    addr: SocketAddr,
    source: std::net::IpAddr,
    peer_id: String,
    hello: bool,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
) {
    use kvferry::wire::write_control;
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        let connected = match sock.bind(SocketAddr::new(source, 0)) {
            Ok(()) => sock.connect(addr).await,
            Err(e) => Err(e),
        };
        let Ok(mut s) = connected else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        opened.fetch_add(1, Ordering::Relaxed);
        if hello {
            let hello = Message::Hello {
                peer_id: peer_id.clone(),
                incarnation: 1,
                nonce: [3; 32],
                wants_auth: true,
            };
            if write_control(&mut s, 1, &hello).await.is_err() {
                continue;
            }
        }
        loop {
            tokio::select! {
                r = s.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                },
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    if stop.load(Ordering::Relaxed) { break; }
                }
            }
        }
    }
}

/// Honest gets of `key` from each of `sources` (`None`: the default loopback address),
/// each a fresh client with `secret` and default timeouts (3 s connect and handshake);
/// returns how many were served with the right bytes, printing why others failed.
async fn honest_gets(addr: &str, secret: &[u8], sources: &[Option<&str>], key: ChunkKey, want: &[u8]) -> usize {
    let mut served = 0;
    for (i, source) in sources.iter().enumerate() {
        let honest = match source {
            Some(src) => peer_from(addr, &format!("honest-{i}"), src, Some(secret)),
            None => peer_with_secret(addr, &format!("honest-{i}"), secret),
        };
        let started = Instant::now();
        match get(&honest, key).await {
            Ok(bytes) => {
                assert_eq!(bytes, want);
                served += 1;
            }
            Err(e) => eprintln!(
                "honest get {i} from {source:?} failed after {:?}: {e}",
                started.elapsed()
            ),
        }
    }
    served
}

/// A `kvferry serve` with a secret, holding chunk `wanted` put by a client from the
/// default loopback address (which thereby proved the secret).
fn serve_with_secret_and_chunk(metrics: bool) -> (Serve, std::path::PathBuf, Vec<u8>, ChunkKey) {
    let (file, secret) = secret_file();
    let p = serve(
        &[
            "--blocks",
            "256",
            "--arena",
            "4MiB",
            "--page-size",
            "64KiB",
            "--secret-file",
            file.to_str().unwrap(),
        ],
        metrics,
    );
    let key = ChunkKey::from_name("wanted");
    runtime().block_on(async {
        let owner = peer_with_secret(&p.addr, "owner", &secret);
        put(&owner, key, &chunk(8, 3)).await.unwrap();
    });
    (p, file, secret, key)
}

#[test]
fn silent_strangers_cannot_starve_clients_with_the_secret() {
    let (p, file, secret, key) = serve_with_secret_and_chunk(false);
    let rt = runtime();
    rt.block_on(async {
        // 2,000 silent connections, each reopened as soon as it is closed.
        let flood = Flood::start(&p.addr, &["127.0.0.1".parse().unwrap()], 2000, false, 3000).await;
        let served = honest_gets(&p.addr, &secret, &[None, None, None], key, &chunk(8, 3)).await;
        flood.stop().await;
        assert_eq!(
            served, 3,
            "{served} of 3 honest gets served under 2,000 silent strangers"
        );
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn silent_strangers_from_many_addresses_cannot_starve_old_or_new_clients() {
    let (p, file, secret, key) = serve_with_secret_and_chunk(false);
    let rt = runtime();
    rt.block_on(async {
        // 2,000 silent connections over 100 source addresses (127.0.1.0-99).
        let sources: Vec<std::net::IpAddr> = (0..100u8).map(|a| [127, 0, 1, a].into()).collect();
        let flood = Flood::start(&p.addr, &sources, 20, false, 3000).await;
        // From the address that proved the secret before, and from never-seen ones.
        let sources = [None, Some("127.0.2.1"), None, Some("127.0.2.2"), Some("127.0.1.7")];
        let served = honest_gets(&p.addr, &secret, &sources, key, &chunk(8, 3)).await;
        flood.stop().await;
        assert_eq!(
            served,
            sources.len(),
            "{served} of {} honest gets served",
            sources.len()
        );
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn a_stranger_behind_a_proven_address_cannot_starve_newcomers() {
    let (p, file, secret, key) = serve_with_secret_and_chunk(true);
    let rt = runtime();
    rt.block_on(async {
        // An honest client proves the secret from 127.0.0.2 ...
        let proven = ["127.0.0.2"];
        assert_eq!(
            honest_gets(&p.addr, &secret, &[Some(proven[0])], key, &chunk(8, 3)).await,
            1
        );
        // ... then a stranger there keeps 200 Hellos open (more than the 64 places).
        let flood = Flood::start(&p.addr, &["127.0.0.2".parse().unwrap()], 200, true, 400).await;
        // Clients with the secret from addresses never seen before are all served, and
        // so is the honest client behind the stranger's address.
        let sources = [Some("127.0.0.3"), Some("127.0.0.4"), Some("127.0.0.5"), Some(proven[0])];
        let started = Instant::now();
        let served = honest_gets(&p.addr, &secret, &sources, key, &chunk(8, 3)).await;
        let took = started.elapsed();
        let evicted = metric(
            p.metrics.unwrap(),
            r#"kvferry_connections_evicted_total{role="server"}"#,
        );
        flood.stop().await;
        assert_eq!(
            served,
            sources.len(),
            "{served} of {} honest gets served beside a stranger at a proven address",
            sources.len()
        );
        assert!(evicted > 0.0, "the places were never full: the flood tested nothing");
        assert!(took < Duration::from_secs(12), "four honest gets took {took:?}");
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn a_neighbour_cannot_lock_out_a_peer_by_making_its_address_suspect() {
    let (p, file, secret, key) = serve_with_secret_and_chunk(true);
    let rt = runtime();
    rt.block_on(async {
        let home = "127.0.0.6";
        assert_eq!(honest_gets(&p.addr, &secret, &[Some(home)], key, &chunk(8, 3)).await, 1);
        // A neighbour on the same host fails the secret 11 times: the address is suspect.
        let wrong: Vec<u8> = secret.iter().map(|b| b ^ 1).collect();
        for i in 0..11 {
            let neighbour = peer_from(&p.addr, &format!("neighbour-{i}"), home, Some(&wrong));
            assert!(matches!(get(&neighbour, key).await, Err(NetError::Auth(_))));
        }
        // Strangers elsewhere keep 200 Hellos open.
        let flood = Flood::start(&p.addr, &["127.0.0.7".parse().unwrap()], 200, true, 400).await;
        // The peer (right secret, suspect address) is served, as is a never-seen address.
        let sources = [Some(home), Some(home), Some(home), Some("127.0.0.8")];
        let served = honest_gets(&p.addr, &secret, &sources, key, &chunk(8, 3)).await;
        let suspect = metric(
            p.metrics.unwrap(),
            r#"kvferry_connections_rate_limited_total{role="server"}"#,
        );
        flood.stop().await;
        assert!(
            suspect >= 1.0,
            "the address never became suspect: the test tested nothing"
        );
        assert_eq!(
            served,
            sources.len(),
            "{served} of {} honest gets served from a suspect address under a flood",
            sources.len()
        );
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn the_challenge_names_no_one_to_a_stranger() {
    use kvferry::wire::{read_control, write_control, Limits};
    let (file, _) = secret_file();
    let p = serve(&["--blocks", "64", "--secret-file", file.to_str().unwrap()], false);
    runtime().block_on(async {
        let mut s = tokio::net::TcpStream::connect(&p.addr).await.unwrap();
        let hello = Message::Hello {
            peer_id: "stranger".into(),
            incarnation: 1,
            nonce: [2; 32],
            wants_auth: true,
        };
        write_control(&mut s, 1, &hello).await.unwrap();
        match read_control::<_, Message>(&mut s, &Limits::default()).await.unwrap() {
            (
                _,
                Message::Challenge {
                    peer_id,
                    incarnation,
                    proof,
                    ..
                },
            ) => {
                assert_eq!(peer_id, "", "the peer id (with its pid) told to a stranger");
                assert_eq!(incarnation, 0, "the incarnation told to a stranger");
                assert_eq!(proof, None);
            }
            (_, other) => panic!("expected Challenge, got {other:?}"),
        }
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn claimed_peer_ids_cannot_bypass_the_quota_without_tls() {
    // 32 pages of 64 KiB; chunks of 32 blocks are one page each.
    let (file, secret) = secret_file();
    let p = serve(
        &[
            "--blocks",
            "2048",
            "--arena",
            "2MiB",
            "--page-size",
            "64KiB",
            "--secret-file",
            file.to_str().unwrap(),
        ],
        false,
    );
    let rt = runtime();
    let keys: Vec<ChunkKey> = (0..32).map(|i| ChunkKey::from_name(&format!("h{i}"))).collect();
    let mine = ChunkKey::from_name("mine");
    rt.block_on(async {
        let loader = peer_with_secret(&p.addr, "loader", &secret);
        for (i, k) in keys.iter().enumerate() {
            put(&loader, *k, &chunk(32, i as u8)).await.unwrap();
        }
        put(&loader, mine, &chunk(32, 77)).await.unwrap();
        // One client, eight claimed ids, staging one page at a time until refused.
        let hogs: Vec<Pool> = (0..8)
            .map(|i| {
                peer_with_secret(
                    &p.addr,
                    &if i == 0 { "hog".to_string() } else { format!("hog-{i}") },
                    &secret,
                )
            })
            .collect();
        let mut held = 0;
        let mut refusal = None;
        'outer: for k in &keys {
            for (h, hog) in hogs.iter().enumerate() {
                match stage(hog, vec![*k], 0).await {
                    Ok(s) => {
                        assert_eq!(s.chunks.len(), 1);
                        held += 1;
                        continue 'outer;
                    }
                    Err(e) => {
                        let (kind, message) = refused(Err(e));
                        assert_eq!(kind, ErrorKind::Busy, "{message}");
                        if h == hogs.len() - 1 {
                            refusal = Some(message);
                            break 'outer;
                        }
                    }
                }
            }
        }
        let message = refusal.expect("eight claimed ids staged the whole arena");
        assert!(message.contains("quota"), "{message}");
        assert!(
            held <= 24,
            "one client holds {held} of 32 pages under eight claimed ids"
        );
        // Clients on other hosts are still served.
        for i in 0..3 {
            let honest = peer_from(&p.addr, &format!("honest-{i}"), "127.0.0.2", Some(&secret));
            assert_eq!(get(&honest, mine).await.unwrap(), chunk(32, 77));
        }
    });
    let _ = std::fs::remove_file(file);
}

#[test]
fn a_claimed_peer_id_cannot_release_or_pull_that_peers_lease() {
    let p = serve(&["--blocks", "256", "--arena", "4MiB", "--page-size", "64KiB"], false);
    let rt = runtime();
    let a = peer(&p.addr, "peer-a");
    let key = ChunkKey::from_name("a's chunk");
    let data = chunk(16, 5);
    rt.block_on(async {
        put(&a, key, &data).await.unwrap();
        let s = stage(&a, vec![key], 0).await.unwrap();
        // Another process claiming the same peer id (another incarnation).
        let impostor = peer(&p.addr, "peer-a");
        let (kind, message) = refused(done(&impostor, s.lease_id).await);
        assert_eq!(kind, ErrorKind::UnknownLease, "Done under a claimed id: {message}");
        let pull_msg = Message::Pull {
            lease_id: s.lease_id,
            incarnation: s.incarnation,
        };
        let (kind, message) = refused(request(&impostor, &pull_msg).await);
        assert_eq!(kind, ErrorKind::UnknownLease, "Pull under a claimed id: {message}");
        // The owner still pulls and releases it.
        assert_eq!(pull(&a, &s).await.unwrap(), vec![data.clone()]);
        assert!(matches!(done(&a, s.lease_id).await.unwrap(), Message::DoneAck));
    });
}

#[test]
fn stalled_puts_and_trickles_hold_nothing_for_long() {
    use kvferry::wire::{write_bulk, write_control, HEADER_LEN};
    // 64 pages of 64 KiB; each stalled put claims 1 MiB (16 pages).
    let p = serve(&["--blocks", "2048", "--arena", "4MiB", "--page-size", "64KiB"], true);
    let metrics = p.metrics.unwrap();
    let total = metric(metrics, FREE_PAGES);
    assert_eq!(total, 64.0);
    let rt = runtime();
    let mine = ChunkKey::from_name("mine");
    rt.block_on(async {
        put(&peer(&p.addr, "loader"), mine, &chunk(32, 9)).await.unwrap();
        // Ten connections: Put{1 MiB}, the bulk header, then a byte every 500 ms.
        let len = 1 << 20;
        let mut frame = Vec::new();
        write_bulk(&mut frame, 1, &[&vec![0u8; len]]).await.unwrap();
        let frame = Arc::new(frame);
        let mut stalls = Vec::new();
        for i in 0..10 {
            let (addr, frame) = (p.addr.clone(), frame.clone());
            stalls.push(tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut s = raw_session(&addr, &format!("staller-{i}")).await;
                let put = Message::Put {
                    key: ChunkKey::from_name(&format!("stalled-{i}")),
                    len: len as u64,
                };
                write_control(&mut s, 1, &put).await.unwrap();
                s.write_all(&frame[..HEADER_LEN]).await.unwrap();
                trickle(&mut s, &frame[HEADER_LEN..HEADER_LEN + 60], Duration::from_millis(500)).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The puts being received are charged before their bodies are read, and the
        // gauge shows it: 16 pages each, up to the source's quota (3/4 of 64 pages:
        // three puts); the others are refused without being charged (their bodies
        // are read and dropped, holding nothing).
        let charged = metric(metrics, CHARGED);
        assert_eq!(
            charged, 48.0,
            "pages charged while ten 1 MiB puts trickle in from one source"
        );
        // Meanwhile clients elsewhere are served.
        for i in 0..3 {
            let honest = peer_from(&p.addr, &format!("honest-{i}"), "127.0.0.2", None);
            assert_eq!(get(&honest, mine).await.unwrap(), chunk(32, 9), "honest get {i}");
        }
        // Every stalled put is closed soon after the grace (5 s), and its pages come back.
        for s in stalls {
            let closed = s.await.unwrap().expect("a stalled put was never closed");
            assert!(closed < Duration::from_secs(10), "closed after {closed:?}");
        }
        let t = Instant::now();
        while metric(metrics, CHARGED) > 0.0 || metric(metrics, FREE_PAGES) < total {
            assert!(t.elapsed() < Duration::from_secs(5), "pages still held by closed puts");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A control frame trickled at 2 B/s after the handshake is closed too (after the
        // grace: the progress timeout alone never trips).
        let mut s = raw_session(&p.addr, "trickler").await;
        let mut ping = Vec::new();
        write_control(&mut ping, 9, &Message::Ping).await.unwrap();
        let mut slow = ping.clone();
        slow.resize(4096, 0); // more than the header: never completes at this pace
        let closed = trickle(&mut s, &slow, Duration::from_millis(500)).await;
        let closed = closed.expect("a 2 B/s trickle was never closed");
        assert!(closed < Duration::from_secs(10), "closed after {closed:?}");
    });
}

/// The status code of `GET path` on the metrics endpoint.
fn http_status(addr: SocketAddr, path: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: kvferry\r\n\r\n").unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {raw:?}"))
}

#[test]
fn idle_connections_do_not_fail_liveness_probes() {
    let p = serve(&["--blocks", "64"], true);
    let metrics = p.metrics.unwrap();
    // Far more idle connections than the endpoint serves at once.
    let idle: Vec<TcpStream> = (0..100).map(|_| TcpStream::connect(metrics).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        assert_eq!(http_status(metrics, "/healthz"), 200, "liveness");
        assert_eq!(http_status(metrics, "/readyz"), 200, "readiness");
        assert_eq!(http_status(metrics, "/metrics"), 200, "a scrape");
    }
    drop(idle);
}
