//! A stateful protocol driver: arbitrary sequences of requests, well-formed and not,
//! spoken as raw frames over real TCP connections to a real [`Engine`]'s server, and
//! the accounting check run once they are over.
//!
//! Shared (through `#[path]`) by `tests/protocol_fuzz.rs` (a proptest state machine in
//! the normal suite) and `fuzz/fuzz_targets/protocol_sequence.rs` (cargo-fuzz), which
//! only differ in how they choose the [`Op`]s.
//!
//! What a run checks:
//!
//! - **While it runs**: every well-formed request gets its reply (right request id,
//!   right kind) within [`WAIT`] and leaves its connection open; every staged chunk's
//!   announced checksum and every received byte match what was stored under its key
//!   (never corrupt); granted TTLs are capped; a bad frame closes its connection within
//!   [`WAIT`] (never hang).
//! - **After it** ([`Fixture::settle_and_check`]): once every connection closed and the
//!   TTLs passed, every staging page is free and no lease is outstanding; no store chunk
//!   is retired and every store block can be taken again (a put of the whole store
//!   succeeds); every connection task ended (a panicked one never decrements the
//!   server's `active` count); a fresh honest client of each fuzzed peer id is served
//!   its whole staging quota (the per-peer quota bookkeeping came back to zero) and
//!   gets intact bytes; the engine closes clean.
//!
//! Lease ids appear in one place, [`lease_id_from_bits`] and [`LeaseId`], so a change of
//! their width on the wire needs a one-line change here.
//!
//! # Cancellation
//!
//! Every wait is bounded; dropping a run's future drops its sockets, which the server
//! sees as abrupt closes (one more thing it must survive).
#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use kvferry::copy::CopyConfig;
use kvferry::engine::{Engine, EngineConfig, StoreConfig};
use kvferry::peer::ProducerConfig;
use kvferry::wire::{self, ChunkKey, ChunkMeta, ErrorKind, FrameHeader, FrameKind, Limits, Message, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// The lease id as the wire carries it.
pub use kvferry::wire::LeaseId;

/// A lease id from arbitrary bits (truncated to the wire's width).
pub fn lease_id_from_bits(bits: u128) -> LeaseId {
    bits as LeaseId
}

/// Staging page size, and the store's block size.
pub const PAGE: usize = 16 << 10;
/// Staging pages in the arena.
pub const PAGES: usize = 64;
/// Blocks in the store.
pub const BLOCKS: usize = 64;
/// Staging pages one peer may hold.
pub const QUOTA: usize = 24;
/// Default and maximum TTL of a staged lease.
pub const TTL: Duration = Duration::from_millis(150);
/// Distinct chunk keys requests draw from.
pub const KEYS: u8 = 6;
/// Distinct peer ids the connections use (connection `c` is peer `c % PEERS`).
pub const PEERS: usize = 2;
/// Connections open at once at most.
pub const CONNS: usize = 3;
/// How long any reply or close may take.
pub const WAIT: Duration = Duration::from_secs(5);
/// The most keys a request may list.
pub const MAX_KEYS: usize = Limits::DEFAULT_MAX_KEYS;

/// The TTL a staging request asks for.
#[derive(Clone, Copy, Debug)]
pub enum Ttl {
    /// 0: the server's default.
    Zero,
    /// A few milliseconds to a minute.
    Ms(u16),
    /// `u32::MAX` ms: must be capped.
    Max,
}

impl Ttl {
    fn ms(self) -> u32 {
        match self {
            Ttl::Zero => 0,
            Ttl::Ms(ms) => ms as u32,
            Ttl::Max => u32::MAX,
        }
    }
}

/// How long a pushed chunk is.
#[derive(Clone, Copy, Debug)]
pub enum PutLen {
    /// One byte.
    Byte,
    /// `n` whole blocks (1 ..= 8) and a few bytes more when `ragged`.
    Blocks(u8, bool),
    /// Exactly the whole store.
    Whole,
    /// One block more than the store holds (refused: too large).
    TooBig,
}

impl PutLen {
    fn bytes(self) -> usize {
        match self {
            PutLen::Byte => 1,
            PutLen::Blocks(n, ragged) => (n.clamp(1, 8) as usize) * PAGE + if ragged { 123 } else { 0 },
            PutLen::Whole => BLOCKS * PAGE,
            PutLen::TooBig => (BLOCKS + 1) * PAGE,
        }
    }
}

/// How a push's bulk frame is sent.
#[derive(Clone, Copy, Debug)]
pub enum Bulk {
    /// As it should be.
    Valid,
    /// Its length differs from the `Put`'s by this much (never 0, never below 1 byte).
    LenOff(i8),
    /// It carries another request's id.
    WrongId,
    /// A `Ping` control frame comes instead.
    ControlInstead,
    /// Its checksum does not match its bytes (the connection is closed).
    BadChecksum,
}

/// Which lease a `Pull` or `Done` names.
#[derive(Clone, Copy, Debug)]
pub enum LeaseRef {
    /// One granted to this connection's peer (the `n`th, modulo), if any.
    Own(u8),
    /// One granted to another peer, if any.
    Foreign(u8),
    /// Arbitrary bits.
    Random(u128),
}

/// One step of a sequence. `conn` is taken modulo [`CONNS`]; keys modulo [`KEYS`].
#[derive(Clone, Debug)]
pub enum Op {
    /// Pushes a chunk under `key`.
    Put {
        /// Connection.
        conn: u8,
        /// Key index.
        key: u8,
        /// Length.
        len: PutLen,
        /// How its bulk frame is sent.
        bulk: Bulk,
    },
    /// Eager get of `keys` (duplicates allowed: refused).
    Get {
        /// Connection.
        conn: u8,
        /// Key indices.
        keys: Vec<u8>,
        /// Requested TTL.
        ttl: Ttl,
    },
    /// Stages `keys` for a later pull.
    Stage {
        /// Connection.
        conn: u8,
        /// Key indices.
        keys: Vec<u8>,
        /// Requested TTL.
        ttl: Ttl,
    },
    /// Pulls a lease; `stale` names another incarnation.
    Pull {
        /// Connection.
        conn: u8,
        /// The lease.
        lease: LeaseRef,
        /// Names a wrong incarnation.
        stale: bool,
    },
    /// Releases a lease.
    Done {
        /// Connection.
        conn: u8,
        /// The lease.
        lease: LeaseRef,
    },
    /// Asks how many leading keys are held.
    Lookup {
        /// Connection.
        conn: u8,
        /// Key indices.
        keys: Vec<u8>,
    },
    /// Liveness probe.
    Ping {
        /// Connection.
        conn: u8,
    },
    /// A get or stage listing one key `count` times (up to one over the key limit).
    Repeated {
        /// Connection.
        conn: u8,
        /// Key index.
        key: u8,
        /// Copies (taken modulo `MAX_KEYS + 2`).
        count: u16,
        /// Stage instead of get.
        stage: bool,
        /// Requested TTL.
        ttl: Ttl,
    },
    /// A message only a server sends (or a second `Hello`) sent as a request.
    Misplaced {
        /// Connection.
        conn: u8,
        /// Which message (modulo the list).
        which: u8,
    },
    /// A bulk frame outside any request (closes the connection).
    StrayBulk {
        /// Connection.
        conn: u8,
        /// Its length.
        len: u16,
    },
    /// Arbitrary bytes, then a half-close.
    Garbage {
        /// Connection.
        conn: u8,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// A header announcing more than the limits allow (closes the connection).
    Oversize {
        /// Connection.
        conn: u8,
        /// A bulk frame instead of a control frame.
        bulk: bool,
        /// How much over the limit.
        over: u64,
    },
    /// The first `at` bytes of a well-formed `Lookup` frame, then a half-close.
    Cut {
        /// Connection.
        conn: u8,
        /// Where the frame is cut (modulo its length).
        at: u16,
    },
    /// A `Put` whose bulk frame is cut after `sent` bytes, then a half-close.
    HalfBulk {
        /// Connection.
        conn: u8,
        /// Key index.
        key: u8,
        /// Length.
        len: PutLen,
        /// Bytes of the bulk frame (header included) sent (modulo its length).
        sent: u32,
    },
    /// Drops the connection abruptly (a new one is opened when next used).
    Close {
        /// Connection.
        conn: u8,
    },
    /// Two well-formed requests on two connections at once.
    Pair(Box<Op>, Box<Op>),
}

impl Op {
    fn conn(&self) -> usize {
        let c = match self {
            Op::Put { conn, .. }
            | Op::Get { conn, .. }
            | Op::Stage { conn, .. }
            | Op::Pull { conn, .. }
            | Op::Done { conn, .. }
            | Op::Lookup { conn, .. }
            | Op::Ping { conn }
            | Op::Repeated { conn, .. }
            | Op::Misplaced { conn, .. }
            | Op::StrayBulk { conn, .. }
            | Op::Garbage { conn, .. }
            | Op::Oversize { conn, .. }
            | Op::Cut { conn, .. }
            | Op::HalfBulk { conn, .. }
            | Op::Close { conn } => *conn,
            Op::Pair(a, _) => return a.conn(),
        };
        c as usize % CONNS
    }

    /// A request that must be answered and leave the connection open.
    fn well_formed(&self) -> bool {
        match self {
            Op::Put { bulk, len, .. } => matches!(bulk, Bulk::Valid) && !matches!(len, PutLen::TooBig),
            Op::Get { .. }
            | Op::Stage { .. }
            | Op::Pull { .. }
            | Op::Done { .. }
            | Op::Lookup { .. }
            | Op::Ping { .. } => true,
            _ => false,
        }
    }
}

/// The key with index `i` (modulo [`KEYS`]).
pub fn key(i: u8) -> ChunkKey {
    ChunkKey::from_name(&format!("protocol-fuzz/key{}", i % KEYS))
}

/// The peer id connection `conn` uses.
pub fn peer_id(conn: usize) -> String {
    format!("protocol-fuzz-peer-{}", conn % PEERS)
}

/// The bytes of version `version` of key `key`, `len` long.
pub fn content(key: u8, version: u32, len: usize) -> Vec<u8> {
    let seed = (key as u64) << 32 | version as u64;
    (0..len)
        .map(|i| {
            let x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64 / 7).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
            (x ^ (x >> 31) ^ i as u64) as u8
        })
        .collect()
}

/// A frame read back from the server.
enum Frame {
    Control(u64, Message),
    Bulk(u64, Vec<u8>, u32),
}

/// One client connection (opened lazily, handshaken by hand).
struct Conn {
    stream: Option<TcpStream>,
    next_id: u64,
}

/// A lease granted during the run.
#[derive(Clone)]
struct Granted {
    id: LeaseId,
    peer: usize,
    chunks: Vec<ChunkMeta>,
}

/// A well-formed request about to be sent.
struct Request<'a> {
    /// Its request id.
    id: u64,
    /// The request.
    op: &'a Op,
    /// The lease a `Pull` or `Done` names.
    lease: LeaseId,
    /// What was granted under that lease, if it was granted in this run.
    granted: Option<&'a Granted>,
    /// The server's incarnation.
    incarnation: u64,
    /// The version a `Put` stores.
    version: u32,
}

/// What a key may hold: (version, length) candidates (more than one while two
/// requests raced on it).
type Model = HashMap<u8, Vec<(u32, usize)>>;

/// The server under test and the client side's state.
pub struct Fixture {
    /// The engine whose server is fuzzed.
    pub engine: Engine,
    addr: String,
    conns: Vec<Conn>,
    leases: Vec<Granted>,
    model: Model,
    version: u32,
    /// Requests answered, for a summary.
    pub answered: u64,
    /// Connections the server closed after bad input.
    pub closed: u64,
}

type Check = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// Reads one frame within [`WAIT`].
async fn read_frame(s: &mut TcpStream) -> Result<Frame, String> {
    let limits = Limits::default();
    let f = async {
        let h = wire::read_frame_header(s, &limits).await.map_err(|e| e.to_string())?;
        match h.kind {
            FrameKind::Control => {
                let m = wire::read_control_body::<_, Message>(s, &h, &limits)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Frame::Control(h.request_id, m))
            }
            FrameKind::Bulk => {
                let mut b = vec![0u8; h.len as usize];
                s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
                Ok(Frame::Bulk(h.request_id, b, h.checksum))
            }
        }
    };
    match tokio::time::timeout(WAIT, f).await {
        Ok(r) => r,
        Err(_) => Err(format!("no frame within {WAIT:?}: the server hangs")),
    }
}

/// Reads one control frame for request `id`.
async fn read_reply(s: &mut TcpStream, id: u64, what: &str) -> Result<Message, String> {
    match read_frame(s).await.map_err(|e| format!("{what}: {e}"))? {
        Frame::Control(rid, m) => {
            ensure!(rid == id, "{what}: reply {} for request {rid}, expected {id}", m.name());
            Ok(m)
        }
        Frame::Bulk(rid, b, _) => Err(format!(
            "{what}: unexpected bulk frame ({} bytes, request {rid})",
            b.len()
        )),
    }
}

/// Waits (bounded) until the server closed `s`, discarding what it still sends.
async fn expect_close(s: &mut TcpStream, what: &str) -> Check {
    let deadline = Instant::now() + WAIT;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return Err(format!("{what}: connection still open after {WAIT:?}")),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(()),
            Ok(Ok(_)) => {}
        }
    }
}

fn header(kind: FrameKind, request_id: u64, len: u64, checksum: u32) -> [u8; HEADER_LEN] {
    FrameHeader {
        kind,
        request_id,
        len,
        checksum,
    }
    .encode()
}

async fn encode(id: u64, msg: &Message) -> Vec<u8> {
    let mut f = Vec::new();
    wire::write_control(&mut f, id, msg).await.expect("encoding to a Vec");
    f
}

fn misplaced(which: u8) -> Message {
    let all = [
        Message::Hello {
            peer_id: "again".into(),
            incarnation: 1,
            nonce: [7; 32],
            wants_auth: false,
        },
        Message::Challenge {
            peer_id: "x".into(),
            incarnation: 1,
            nonce: [1; 32],
            proof: None,
        },
        Message::Auth { proof: Some([3; 32]) },
        Message::Welcome,
        Message::LookupReply { hits: 9 },
        Message::Staged {
            lease_id: lease_id_from_bits(1),
            incarnation: 1,
            chunks: Vec::new(),
            ttl_ms: 1,
        },
        Message::PullDone {
            lease_id: lease_id_from_bits(1),
        },
        Message::DoneAck,
        Message::PutAck { key: key(0) },
        Message::Error {
            kind: ErrorKind::Internal,
            message: "from a client".into(),
        },
        Message::Pong,
        Message::WelcomeAuth { proof: [0; 32] },
        Message::ReleaseAck { released: vec![true] },
    ];
    all[which as usize % all.len()].clone()
}

impl Fixture {
    /// Starts an engine with a small arena and store and short TTLs, seeded with three
    /// chunks.
    pub async fn start() -> Fixture {
        let mut cfg = EngineConfig::default()
            .peer_id("protocol-fuzz-server")
            .arena(PAGES * PAGE, PAGE);
        cfg.pinned = false;
        cfg.copy = CopyConfig {
            threads: 2,
            slice_bytes: 64 << 10,
        };
        cfg.store = StoreConfig::Bytes {
            bytes: BLOCKS * PAGE,
            block_bytes: PAGE,
        };
        cfg.store_capacity = 16;
        cfg.producer = ProducerConfig::default();
        cfg.producer.default_ttl = TTL;
        cfg.producer.max_ttl = TTL;
        cfg.producer.max_concurrent_gets = 4;
        cfg.producer.max_staged_pages_per_peer = Some(QUOTA);
        cfg.net.io_timeout = Duration::from_secs(2);
        let engine = Engine::start(cfg).await.expect("engine starts");
        let addr = engine.address().expect("listening").to_string();
        let mut f = Fixture {
            engine,
            addr,
            conns: (0..CONNS)
                .map(|_| Conn {
                    stream: None,
                    next_id: 10,
                })
                .collect(),
            leases: Vec::new(),
            model: HashMap::new(),
            version: 0,
            answered: 0,
            closed: 0,
        };
        for (k, len) in [(0u8, 2 * PAGE), (1, PAGE + 77), (2, 3 * PAGE)] {
            f.version += 1;
            f.engine.put(key(k), &content(k, f.version, len)).expect("seed put");
            f.model.insert(k, vec![(f.version, len)]);
        }
        f
    }

    /// Runs `ops` in order; the first broken promise is the error.
    pub async fn run(&mut self, ops: &[Op]) -> Check {
        for (i, op) in ops.iter().enumerate() {
            self.step(op).await.map_err(|e| format!("op {i} ({op:?}): {e}"))?;
        }
        Ok(())
    }

    async fn connect(addr: &str, conn: usize) -> Result<TcpStream, String> {
        let mut s = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        let hello = Message::Hello {
            peer_id: peer_id(conn),
            // One incarnation per peer: its connections are one process (leases are
            // bound to the peer id and, without TLS, its incarnation).
            incarnation: 0x5eed + (conn % PEERS) as u64,
            nonce: wire::auth::nonce(),
            wants_auth: false,
        };
        wire::write_control(&mut s, 1, &hello)
            .await
            .map_err(|e| e.to_string())?;
        match read_reply(&mut s, 1, "handshake").await? {
            Message::Challenge { proof: None, .. } => {}
            other => return Err(format!("handshake: expected Challenge, got {}", other.name())),
        }
        wire::write_control(&mut s, 2, &Message::Auth { proof: None })
            .await
            .map_err(|e| e.to_string())?;
        match read_reply(&mut s, 2, "handshake").await? {
            Message::Welcome => Ok(s),
            other => Err(format!("handshake: expected Welcome, got {}", other.name())),
        }
    }

    /// The stream of connection `c` (opened and handshaken if need be) and a fresh
    /// request id.
    async fn stream(&mut self, c: usize) -> Result<(TcpStream, u64), String> {
        let s = match self.conns[c].stream.take() {
            Some(s) => s,
            None => Self::connect(&self.addr, c).await?,
        };
        self.conns[c].next_id += 1;
        Ok((s, self.conns[c].next_id))
    }

    fn pick_lease(&self, c: usize, r: LeaseRef) -> LeaseId {
        let peer = c % PEERS;
        let pick = |own: bool, n: u8| {
            let l: Vec<LeaseId> = self
                .leases
                .iter()
                .filter(|g| (g.peer == peer) == own)
                .map(|g| g.id)
                .collect();
            (!l.is_empty()).then(|| l[n as usize % l.len()])
        };
        match r {
            LeaseRef::Own(n) => pick(true, n),
            LeaseRef::Foreign(n) => pick(false, n),
            LeaseRef::Random(bits) => Some(lease_id_from_bits(bits)),
        }
        .unwrap_or_else(|| lease_id_from_bits(0x1234_5678_9abc_def0))
    }

    /// The lease a `Pull` or `Done` names (0 for other requests).
    fn lease_of(&self, op: &Op) -> LeaseId {
        match op {
            Op::Pull { lease, .. } | Op::Done { lease, .. } => self.pick_lease(op.conn(), *lease),
            _ => lease_id_from_bits(0),
        }
    }

    /// Whether `bytes` received for `k` are something `k` held.
    fn check_content(model: &Model, k: &ChunkKey, bytes: &[u8]) -> Check {
        let i = (0..KEYS)
            .find(|i| key(*i) == *k)
            .ok_or_else(|| format!("received a chunk under a key never requested: {k}"))?;
        let ok = model.get(&i).is_some_and(|c| {
            c.iter()
                .any(|(v, len)| *len == bytes.len() && content(i, *v, *len) == bytes)
        });
        ensure!(
            ok,
            "chunk of key {i} ({} bytes) matches nothing it ever held: corrupt",
            bytes.len()
        );
        Ok(())
    }

    /// Checks a `Staged` reply against the request.
    fn check_staged(model: &Model, keys: &[ChunkKey], chunks: &[ChunkMeta], lease: LeaseId, ttl_ms: u32) -> Check {
        ensure!(
            ttl_ms as u128 <= TTL.as_millis(),
            "granted TTL {ttl_ms} ms exceeds the cap {TTL:?}"
        );
        ensure!(
            (lease == lease_id_from_bits(0)) == chunks.is_empty(),
            "lease {lease} with {} chunks",
            chunks.len()
        );
        ensure!(chunks.len() <= keys.len(), "more chunks than keys");
        for (c, k) in chunks.iter().zip(keys) {
            ensure!(c.key == *k, "staged chunks are not a prefix of the keys");
            let i = (0..KEYS).find(|i| key(*i) == *k).expect("requested keys are pool keys");
            let ok = model.get(&i).is_some_and(|cands| {
                cands
                    .iter()
                    .any(|(v, len)| *len as u64 == c.len && crc32c::crc32c(&content(i, *v, *len)) == c.checksum)
            });
            ensure!(ok, "staged chunk of key {i} announces a length/checksum it never held");
        }
        Ok(())
    }

    /// Reads the bulk frames of `chunks` for request `id`, then `PullDone`.
    /// With `model`, each chunk's bytes must also be something its key holds now (an
    /// eager get); without, only what was staged (a later pull sends a snapshot the
    /// key may have moved on from; its checksum was checked against the key then).
    async fn read_chunks(
        model: Option<&Model>,
        s: &mut TcpStream,
        id: u64,
        chunks: &[ChunkMeta],
        lease: LeaseId,
    ) -> Check {
        for (n, meta) in chunks.iter().enumerate() {
            match read_frame(s).await.map_err(|e| format!("chunk {n}: {e}"))? {
                Frame::Bulk(rid, bytes, crc) => {
                    ensure!(rid == id, "bulk frame for request {rid}, expected {id}");
                    ensure!(
                        bytes.len() as u64 == meta.len,
                        "chunk {n}: {} bytes, announced {}",
                        bytes.len(),
                        meta.len
                    );
                    ensure!(
                        crc32c::crc32c(&bytes) == crc,
                        "chunk {n}: frame checksum does not match its bytes"
                    );
                    ensure!(crc == meta.checksum, "chunk {n}: bytes differ from what was staged");
                    if let Some(model) = model {
                        Self::check_content(model, &meta.key, &bytes)?;
                    }
                }
                Frame::Control(rid, m) => {
                    return Err(format!(
                        "chunk {n}: got {} (request {rid}) instead of a bulk frame",
                        m.name()
                    ))
                }
            }
        }
        match read_reply(s, id, "after the chunks").await? {
            Message::PullDone { lease_id } if lease_id == lease => Ok(()),
            other => Err(format!("expected PullDone for lease {lease}, got {other:?}")),
        }
    }

    /// Sends well-formed request `op` on `s` and checks its reply. Returns the lease
    /// granted, if any.
    async fn request(s: &mut TcpStream, model: &Model, r: Request<'_>) -> Result<Option<Granted>, String> {
        let Request {
            id,
            op,
            lease,
            granted,
            incarnation,
            version,
        } = r;
        let c = op.conn();
        let send = |m: Message| async move { encode(id, &m).await };
        match op {
            Op::Ping { .. } => {
                s.write_all(&send(Message::Ping).await)
                    .await
                    .map_err(|e| e.to_string())?;
                match read_reply(s, id, "ping").await? {
                    Message::Pong => Ok(None),
                    other => Err(format!("expected Pong, got {other:?}")),
                }
            }
            Op::Lookup { keys, .. } => {
                let keys: Vec<ChunkKey> = keys.iter().map(|k| key(*k)).collect();
                let n = keys.len();
                s.write_all(&send(Message::Lookup { keys }).await)
                    .await
                    .map_err(|e| e.to_string())?;
                match read_reply(s, id, "lookup").await? {
                    Message::LookupReply { hits } if hits as usize <= n => Ok(None),
                    other => Err(format!("expected LookupReply of at most {n}, got {other:?}")),
                }
            }
            Op::Get { keys, ttl, .. } | Op::Stage { keys, ttl, .. } => {
                let eager = matches!(op, Op::Get { .. });
                let keys: Vec<ChunkKey> = keys.iter().map(|k| key(*k)).collect();
                let distinct = keys.iter().collect::<std::collections::HashSet<_>>().len() == keys.len();
                let m = if eager {
                    Message::Get {
                        keys: keys.clone(),
                        ttl_ms: ttl.ms(),
                    }
                } else {
                    Message::Stage {
                        keys: keys.clone(),
                        ttl_ms: ttl.ms(),
                    }
                };
                s.write_all(&send(m).await).await.map_err(|e| e.to_string())?;
                match read_reply(s, id, "stage").await? {
                    Message::Staged {
                        lease_id,
                        chunks,
                        ttl_ms,
                        ..
                    } => {
                        ensure!(
                            !keys.is_empty() && distinct,
                            "staged {} keys, duplicates or none",
                            keys.len()
                        );
                        Self::check_staged(model, &keys, &chunks, lease_id, ttl_ms)?;
                        if chunks.is_empty() {
                            return Ok(None);
                        }
                        if eager {
                            Self::read_chunks(Some(model), s, id, &chunks, lease_id).await?;
                        }
                        Ok(Some(Granted {
                            id: lease_id,
                            peer: c % PEERS,
                            chunks,
                        }))
                    }
                    Message::Error { kind, message } => {
                        let expected = if keys.is_empty() || !distinct {
                            kind == ErrorKind::BadRequest
                        } else {
                            kind == ErrorKind::Busy
                        };
                        ensure!(
                            expected,
                            "stage of {} keys refused with {kind:?}: {message}",
                            keys.len()
                        );
                        Ok(None)
                    }
                    other => Err(format!("expected Staged, got {}", other.name())),
                }
            }
            Op::Pull { stale, .. } => {
                let inc = if *stale { incarnation ^ 0x55 } else { incarnation };
                s.write_all(
                    &send(Message::Pull {
                        lease_id: lease,
                        incarnation: inc,
                    })
                    .await,
                )
                .await
                .map_err(|e| e.to_string())?;
                match read_frame(s).await? {
                    Frame::Bulk(rid, bytes, crc) => {
                        ensure!(rid == id, "bulk frame for request {rid}, expected {id}");
                        ensure!(!stale, "a pull naming a stale incarnation was served");
                        let g = granted.ok_or_else(|| format!("lease {lease} was served but never granted"))?;
                        ensure!(g.peer == c % PEERS, "lease {lease} of another peer was served");
                        let first = g.chunks.first().ok_or("a lease without chunks was served")?;
                        ensure!(
                            bytes.len() as u64 == first.len,
                            "pulled chunk 0: {} bytes, staged {}",
                            bytes.len(),
                            first.len
                        );
                        ensure!(
                            crc32c::crc32c(&bytes) == crc,
                            "pulled bytes do not match their frame checksum"
                        );
                        ensure!(crc == first.checksum, "pulled chunk 0 differs from what was staged");
                        Self::read_chunks(None, s, id, &g.chunks[1..], lease).await?;
                        Ok(None)
                    }
                    Frame::Control(rid, Message::Error { kind, message }) => {
                        ensure!(rid == id, "error for request {rid}, expected {id}");
                        let ok = matches!(
                            kind,
                            ErrorKind::UnknownLease | ErrorKind::LeaseExpired | ErrorKind::StaleIncarnation
                        );
                        ensure!(ok, "pull refused with {kind:?}: {message}");
                        ensure!(
                            !stale || kind == ErrorKind::StaleIncarnation,
                            "stale pull refused with {kind:?}"
                        );
                        Ok(None)
                    }
                    Frame::Control(rid, m) => Err(format!("pull: got {} for request {rid}", m.name())),
                }
            }
            Op::Done { .. } => {
                s.write_all(&send(Message::Done { lease_id: lease }).await)
                    .await
                    .map_err(|e| e.to_string())?;
                match read_reply(s, id, "done").await? {
                    Message::DoneAck => Ok(None),
                    Message::Error {
                        kind: ErrorKind::UnknownLease,
                        ..
                    } => Ok(None),
                    other => Err(format!("expected DoneAck, got {other:?}")),
                }
            }
            Op::Put { key: k, len, .. } => {
                let k = &(*k % KEYS);
                let len = len.bytes();
                let data = content(*k, version, len);
                let mut frames = send(Message::Put {
                    key: key(*k),
                    len: len as u64,
                })
                .await;
                frames.extend_from_slice(&header(FrameKind::Bulk, id, len as u64, crc32c::crc32c(&data)));
                frames.extend_from_slice(&data);
                s.write_all(&frames).await.map_err(|e| e.to_string())?;
                match read_reply(s, id, "put").await? {
                    Message::PutAck { key: got } if got == key(*k) => Ok(Some(Granted {
                        id: lease_id_from_bits(0),
                        peer: usize::MAX, // marks a stored put
                        chunks: Vec::new(),
                    })),
                    Message::Error {
                        kind: ErrorKind::Busy, ..
                    } => Ok(None),
                    other => Err(format!("expected PutAck, got {other:?}")),
                }
            }
            _ => unreachable!("only well-formed requests"),
        }
    }

    /// One well-formed request on connection `c`.
    async fn well_formed(&mut self, op: &Op) -> Check {
        let c = op.conn();
        let (mut s, id) = self.stream(c).await?;
        let lease = self.lease_of(op);
        self.version += 1;
        let version = self.version;
        let incarnation = self.engine.incarnation();
        let g = self.leases.iter().find(|g| g.id == lease).cloned();
        let granted = Self::request(
            &mut s,
            &self.model,
            Request {
                id,
                op,
                lease,
                granted: g.as_ref(),
                incarnation,
                version,
            },
        )
        .await?;
        self.record(op, version, granted);
        self.answered += 1;
        self.conns[c].stream = Some(s);
        Ok(())
    }

    fn record(&mut self, op: &Op, version: u32, granted: Option<Granted>) {
        match (op, granted) {
            (Op::Put { key: k, len, .. }, Some(_)) => {
                self.model.insert(*k % KEYS, vec![(version, len.bytes())]);
            }
            (_, Some(g)) if g.peer != usize::MAX => self.leases.push(g),
            _ => {}
        }
    }

    /// Two well-formed requests on two connections at once.
    async fn pair(&mut self, a: &Op, b: &Op) -> Check {
        let (ca, cb) = (a.conn(), b.conn());
        if ca == cb || !a.well_formed() || !b.well_formed() {
            self.step(a).await?;
            return self.step(b).await;
        }
        let (mut sa, ia) = self.stream(ca).await?;
        let (mut sb, ib) = self.stream(cb).await?;
        let (la, lb) = (self.lease_of(a), self.lease_of(b));
        let ga = self.leases.iter().find(|g| g.id == la).cloned();
        let gb = self.leases.iter().find(|g| g.id == lb).cloned();
        let (va, vb) = (self.version + 1, self.version + 2);
        self.version += 2;
        // While both run, a key either of them puts may hold either version.
        let mut model = self.model.clone();
        for (op, v) in [(a, va), (b, vb)] {
            if let Op::Put { key: k, len, .. } = op {
                model.entry(*k % KEYS).or_default().push((v, len.bytes()));
            }
        }
        let inc = self.engine.incarnation();
        let (ra, rb) = tokio::join!(
            Self::request(
                &mut sa,
                &model,
                Request {
                    id: ia,
                    op: a,
                    lease: la,
                    granted: ga.as_ref(),
                    incarnation: inc,
                    version: va,
                }
            ),
            Self::request(
                &mut sb,
                &model,
                Request {
                    id: ib,
                    op: b,
                    lease: lb,
                    granted: gb.as_ref(),
                    incarnation: inc,
                    version: vb,
                }
            )
        );
        let (ga, gb) = (ra?, rb?);
        match (a, &ga, b, &gb) {
            // Both puts of one key stored: either may have won.
            (Op::Put { key: x, len: lx, .. }, Some(_), Op::Put { key: y, len: ly, .. }, Some(_))
                if x % KEYS == y % KEYS =>
            {
                self.model.insert(x % KEYS, vec![(va, lx.bytes()), (vb, ly.bytes())]);
            }
            _ => {
                self.record(a, va, ga);
                self.record(b, vb, gb);
            }
        }
        self.answered += 2;
        self.conns[ca].stream = Some(sa);
        self.conns[cb].stream = Some(sb);
        Ok(())
    }

    /// Bad input on connection `c`: send `bytes`, half-close if `half_close`, and expect
    /// the server to close the connection.
    async fn bad(&mut self, c: usize, bytes: &[u8], half_close: bool, what: &str) -> Check {
        let (mut s, _) = self.stream(c).await?;
        // The server may close before taking everything: a failed write is fine.
        let _ = tokio::time::timeout(WAIT, s.write_all(bytes)).await;
        if half_close {
            let _ = s.shutdown().await;
        }
        expect_close(&mut s, what).await?;
        self.closed += 1;
        Ok(())
    }

    /// Runs one op.
    pub async fn step(&mut self, op: &Op) -> Check {
        let c = op.conn();
        match op {
            _ if op.well_formed() => self.well_formed(op).await,
            Op::Pair(a, b) => Box::pin(self.pair(a, b)).await,
            Op::Put { key: k, len, bulk, .. } => {
                let (mut s, id) = self.stream(c).await?;
                let n = len.bytes();
                let data = content(*k, 0, n);
                let mut f = encode(
                    id,
                    &Message::Put {
                        key: key(*k),
                        len: n as u64,
                    },
                )
                .await;
                let crc = crc32c::crc32c(&data);
                match bulk {
                    Bulk::Valid => {
                        f.extend_from_slice(&header(FrameKind::Bulk, id, n as u64, crc));
                        f.extend_from_slice(&data);
                    }
                    Bulk::LenOff(d) => {
                        let d = if *d == 0 { 1 } else { *d as i64 };
                        let m = (n as i64 + d).max(1) as usize;
                        let m = if m == n { n + 1 } else { m };
                        let other = content(*k, 0, m);
                        f.extend_from_slice(&header(FrameKind::Bulk, id, m as u64, crc32c::crc32c(&other)));
                        f.extend_from_slice(&other);
                    }
                    Bulk::WrongId => {
                        f.extend_from_slice(&header(FrameKind::Bulk, id + 1000, n as u64, crc));
                        f.extend_from_slice(&data);
                    }
                    Bulk::ControlInstead => f.extend_from_slice(&encode(id + 1, &Message::Ping).await),
                    Bulk::BadChecksum => {
                        f.extend_from_slice(&header(FrameKind::Bulk, id, n as u64, crc ^ 1));
                        f.extend_from_slice(&data);
                    }
                }
                s.write_all(&f).await.map_err(|e| e.to_string())?;
                let refused = match read_reply(&mut s, id, "bad put").await? {
                    Message::Error { kind, .. } => kind,
                    other => return Err(format!("a malformed put got {other:?}")),
                };
                if matches!(bulk, Bulk::BadChecksum) {
                    // Bytes read and found corrupt end the connection; bytes skipped
                    // unread (the put was refused first: busy, too large) do not.
                    ensure!(
                        matches!(refused, ErrorKind::BadRequest | ErrorKind::Busy | ErrorKind::TooLarge),
                        "a put with a bad checksum refused with {refused:?}"
                    );
                    s.write_all(&encode(id + 1, &Message::Ping).await)
                        .await
                        .map_err(|e| e.to_string())?;
                    match read_frame(&mut s).await {
                        Ok(Frame::Control(rid, Message::Pong)) if rid == id + 1 => {}
                        Ok(_) => return Err("after a corrupt put: neither a Pong nor a close".into()),
                        Err(e) if e.contains("within") => return Err(e),
                        Err(_) => {
                            self.closed += 1;
                            return Ok(());
                        }
                    }
                } else {
                    ensure!(
                        matches!(refused, ErrorKind::BadRequest | ErrorKind::TooLarge),
                        "a malformed put refused with {refused:?}"
                    );
                }
                self.conns[c].stream = Some(s);
                Ok(())
            }
            Op::Repeated {
                key: k,
                count,
                stage,
                ttl,
                ..
            } => {
                let (mut s, id) = self.stream(c).await?;
                let n = *count as usize % (MAX_KEYS + 2);
                let keys = vec![key(*k); n];
                let m = if *stage {
                    Message::Stage { keys, ttl_ms: ttl.ms() }
                } else {
                    Message::Get { keys, ttl_ms: ttl.ms() }
                };
                s.write_all(&encode(id, &m).await).await.map_err(|e| e.to_string())?;
                if n > MAX_KEYS {
                    // Over the limit: refused as too large, and the connection closed.
                    expect_close(&mut s, "a request over the key limit").await?;
                    self.closed += 1;
                    return Ok(());
                }
                match read_reply(&mut s, id, "repeated keys").await? {
                    Message::Error {
                        kind: ErrorKind::BadRequest,
                        ..
                    } if n != 1 => {}
                    Message::Staged {
                        lease_id,
                        chunks,
                        ttl_ms,
                        ..
                    } if n == 1 => {
                        Self::check_staged(&self.model, &[key(*k)], &chunks, lease_id, ttl_ms)?;
                        if !*stage && !chunks.is_empty() {
                            Self::read_chunks(Some(&self.model), &mut s, id, &chunks, lease_id).await?;
                        }
                        if !chunks.is_empty() {
                            self.leases.push(Granted {
                                id: lease_id,
                                peer: c % PEERS,
                                chunks,
                            });
                        }
                    }
                    Message::Error {
                        kind: ErrorKind::Busy, ..
                    } if n == 1 => {}
                    other => return Err(format!("{n} copies of one key got {other:?}")),
                }
                self.conns[c].stream = Some(s);
                Ok(())
            }
            Op::Misplaced { which, .. } => {
                let (mut s, id) = self.stream(c).await?;
                let m = misplaced(*which);
                s.write_all(&encode(id, &m).await).await.map_err(|e| e.to_string())?;
                match read_reply(&mut s, id, "misplaced").await? {
                    Message::Error {
                        kind: ErrorKind::BadRequest,
                        ..
                    } => {}
                    other => return Err(format!("{} as a request got {other:?}", m.name())),
                }
                self.conns[c].stream = Some(s);
                Ok(())
            }
            Op::StrayBulk { len, .. } => {
                let mut f = header(FrameKind::Bulk, 77, *len as u64, 0).to_vec();
                f.resize(HEADER_LEN + *len as usize, 0xB0);
                self.bad(c, &f, false, "stray bulk frame").await
            }
            Op::Garbage { bytes, .. } => self.bad(c, bytes, true, "garbage").await,
            Op::Oversize { bulk, over, .. } => {
                let l = Limits::default();
                let (kind, limit) = if *bulk {
                    (FrameKind::Bulk, l.max_bulk_bytes)
                } else {
                    (FrameKind::Control, l.max_control_bytes)
                };
                let h = header(kind, 5, limit.saturating_add((*over).max(1)), 0);
                self.bad(c, &h, false, "oversize header").await
            }
            Op::Cut { at, .. } => {
                let f = encode(
                    9,
                    &Message::Lookup {
                        keys: vec![key(0), key(1), key(2)],
                    },
                )
                .await;
                let at = *at as usize % f.len();
                self.bad(c, &f[..at], true, "frame cut short").await
            }
            Op::HalfBulk { key: k, len, sent, .. } => {
                let n = len.bytes().min(BLOCKS * PAGE);
                let (s, id) = self.stream(c).await?;
                self.conns[c].stream = Some(s);
                let data = content(*k, 0, n);
                let mut f = encode(
                    id,
                    &Message::Put {
                        key: key(*k),
                        len: n as u64,
                    },
                )
                .await;
                let put_len = f.len();
                f.extend_from_slice(&header(FrameKind::Bulk, id, n as u64, crc32c::crc32c(&data)));
                f.extend_from_slice(&data);
                let cut = put_len + (*sent as usize % (f.len() - put_len));
                self.bad(c, &f[..cut], true, "bulk frame cut short").await
            }
            Op::Close { .. } => {
                self.conns[c].stream = None;
                Ok(())
            }
            _ => unreachable!("every op is handled"),
        }
    }

    /// Closes every connection, waits past the TTLs, and checks that everything came
    /// back; then that a fresh honest client is served, and the engine closes clean.
    pub async fn settle_and_check(mut self) -> Check {
        for c in &mut self.conns {
            c.stream = None;
        }
        let e = &self.engine;
        let deadline = Instant::now() + WAIT;
        while e.stats().server.active > 0 {
            ensure!(
                Instant::now() < deadline,
                "{} connection tasks still running {WAIT:?} after every client left (a panicked task never ends): {:?}",
                e.stats().server.active,
                e.stats().server
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let settled = |e: &Engine| {
            let st = e.stats();
            let a = st.arena;
            a.free_pages == a.total_pages
                && a.leased_pages == 0
                && a.quarantined_pages == 0
                && a.outstanding_leases == 0
                && a.waiters == 0
                && st.producer.staged_now == 0
                && st.store.retired == 0
        };
        let deadline = Instant::now() + TTL + WAIT;
        while !settled(e) {
            ensure!(
                Instant::now() < deadline,
                "not everything came back {:?} past the TTL: {:?}",
                WAIT,
                e.stats()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A fresh honest client of each fuzzed peer: a put, a lookup, and a get of a
        // whole quota of staging pages, with intact bytes.
        let quota_chunk = QUOTA / 3 * PAGE;
        for p in 0..PEERS {
            let mut s = Self::connect(&self.addr, p)
                .await
                .map_err(|e| format!("honest client: {e}"))?;
            self.version += 1;
            let v = self.version;
            let data = content(5, v, PAGE + 5);
            let mut f = encode(
                100,
                &Message::Put {
                    key: key(5),
                    len: data.len() as u64,
                },
            )
            .await;
            f.extend_from_slice(&header(FrameKind::Bulk, 100, data.len() as u64, crc32c::crc32c(&data)));
            f.extend_from_slice(&data);
            s.write_all(&f).await.map_err(|e| e.to_string())?;
            match read_reply(&mut s, 100, "honest put").await? {
                Message::PutAck { .. } => {}
                other => return Err(format!("honest put refused: {other:?}")),
            }
            self.model.insert(5, vec![(v, data.len())]);
            let mut keys = Vec::new();
            for k in [3u8, 4, 0] {
                self.version += 1;
                e.put(key(k), &content(k, self.version, quota_chunk))
                    .map_err(|e| format!("local put: {e}"))?;
                self.model.insert(k, vec![(self.version, quota_chunk)]);
                keys.push(key(k));
            }
            keys.insert(0, key(5));
            s.write_all(&encode(101, &Message::Lookup { keys: keys.clone() }).await)
                .await
                .map_err(|e| e.to_string())?;
            match read_reply(&mut s, 101, "honest lookup").await? {
                Message::LookupReply { hits: 4 } => {}
                other => return Err(format!("honest lookup: {other:?}")),
            }
            keys.remove(0);
            s.write_all(
                &encode(
                    102,
                    &Message::Get {
                        keys: keys.clone(),
                        ttl_ms: 0,
                    },
                )
                .await,
            )
            .await
            .map_err(|e| e.to_string())?;
            let lease = match read_reply(&mut s, 102, "honest get").await? {
                Message::Staged {
                    lease_id,
                    chunks,
                    ttl_ms,
                    ..
                } => {
                    ensure!(
                        chunks.len() == 3,
                        "peer {p}: a whole quota ({QUOTA} pages) was not staged ({} of 3 chunks): quota not refunded",
                        chunks.len()
                    );
                    Self::check_staged(&self.model, &keys, &chunks, lease_id, ttl_ms)?;
                    Self::read_chunks(Some(&self.model), &mut s, 102, &chunks, lease_id).await?;
                    lease_id
                }
                other => return Err(format!("peer {p}: honest get refused: {other:?}")),
            };
            s.write_all(&encode(103, &Message::Done { lease_id: lease }).await)
                .await
                .map_err(|e| e.to_string())?;
            match read_reply(&mut s, 103, "honest done").await? {
                Message::DoneAck => {}
                other => return Err(format!("honest done: {other:?}")),
            }
        }
        let a = e.stats().arena;
        ensure!(
            a.free_pages == a.total_pages,
            "pages out after the honest clients' Done: {a:?}"
        );
        // Every store block can be taken again: a chunk as large as the store fits.
        e.put(key(1), &content(1, 0, BLOCKS * PAGE))
            .map_err(|e| format!("store blocks lost: a whole-store put fails: {e}"))?;
        let st = e.stats().store;
        ensure!(
            st.free_blocks == 0 && st.chunks == 1 && st.retired == 0,
            "store miscounted after a whole-store put: {st:?}"
        );
        let report = e.close(Instant::now() + WAIT).await;
        ensure!(report.is_clean(), "engine close not clean: {report:?}");
        Ok(())
    }
}
