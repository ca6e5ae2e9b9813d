//! Hostile but well-framed clients against a running `kvferry serve` process, speaking
//! the wire protocol directly (handshaken connections, hand-written requests):
//!
//! - keys crafted to collide with the store's old internal tombstone keys, while a
//!   chunk is replaced under a pinned stage,
//! - a stage listing one key 4096 times, and a TTL of `u32::MAX` milliseconds,
//! - one peer staging until refused by its quota while another peer still gets,
//! - a `Done` (and a `Pull`) for a lease granted to another peer,
//! - a put whose bulk frame carries another request id (or is not a bulk frame).
//!
//! Each test kills its server when dropped.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvferry::net::{NetConfig, NetError, Pool};
use kvferry::wire::{ChunkKey, ChunkMeta, ErrorKind, Message};

/// Bytes of one block of the `tiny` model (2 layers x K/V x 4 tokens x 64 dims x 2 B).
const BLOCK: usize = 2048;

/// A `kvferry serve` child, killed on drop.
struct Serve {
    child: Child,
    addr: String,
    metrics: Option<SocketAddr>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvferry serve` for the `tiny` model on an ephemeral port with `args`
/// (with `--metrics 127.0.0.1:0` when `metrics`), and waits for its addresses.
fn serve(args: &[&str], metrics: bool) -> Serve {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--model", "tiny"])
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("KVFERRY_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if metrics {
        cmd.args(["--metrics", "127.0.0.1:0"]);
    }
    let mut child = cmd.spawn().expect("spawn kvferry serve");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let (mut addr, mut metrics_addr) = (None, None);
    while addr.is_none() || (metrics && metrics_addr.is_none()) {
        let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("serve did not print its addresses; stderr: {err}");
        };
        if let Some(rest) = line.strip_prefix("kvferry serve: listening on ") {
            addr = rest.split_whitespace().next().map(str::to_string);
        } else if let Some(rest) = line.strip_prefix("kvferry serve: metrics on ") {
            metrics_addr = rest.split_whitespace().next().map(|a| a.parse().unwrap());
        }
    }
    Serve {
        child,
        addr: addr.unwrap(),
        metrics: metrics_addr,
    }
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
        assert_eq!(metric(metrics, FREE_PAGES), total - 1.0);
        // No Done: the pages come back when the TTL runs out.
        while metric(metrics, FREE_PAGES) < total {
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
