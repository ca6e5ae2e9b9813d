//! The peer-to-peer control protocol: every [`Message`] a control frame can carry.
//!
//! Flows (the client is the side that connected; request ids pair requests with replies
//! and with the bulk frames belonging to them):
//!
//! - Handshake: `Hello` → `Challenge` → `Auth` → `Welcome` (or `Error`); with a
//!   shared secret the last reply is `WelcomeAuth`, which carries the server's proof
//!   (see `net::handshake`).
//! - Lookup: `Lookup` → `LookupReply`.
//! - Delayed pull: `Stage` → `Staged`; later `Pull` → one bulk frame per staged chunk →
//!   `PullDone`; finally `Done` → `DoneAck`.
//! - Eager get: `Get` → `Staged` → bulk frames → `PullDone`; then `Done` → `DoneAck`.
//! - Partial (selected) get or stage: `GetSelected` / `StageSelected` →
//!   `StagedSelected` (then as above); see [`super::selection`]. A selection that does
//!   not fit is answered `Error { kind: BadSelection }`, the connection kept.
//! - Push: `Put` + one bulk frame → `PutAck`.
//! - Mover probe: `MoverHello` → `MoverOffer` (which movers besides the socket the
//!   producer offers this consumer; see `peer::movers`).
//! - Device IPC (same host, device memory): `DeviceIpcHello` → `DeviceIpcOffer`, and
//!   `GetDeviceMapped` → `StagedDeviceMapped` (the lease, checksums, the export of the
//!   producer's device cache, and `(buffer, offset, length)` runs in it; with a
//!   selection, the selected ranges only, and the stream's shape).
//! - Mapped get (the CMA mover): `GetMapped` → `StagedMapped` (the lease and where its
//!   bytes are); the consumer reads them itself, then `Done` → `DoneAck`. A delayed
//!   pull by CMA: `PullMapped` (a lease from `Staged`) → `StagedMapped`, read, `Done`.
//! - Liveness: `Ping` → `Pong`.
//! - Release without pulling: `Release` → `ReleaseAck` (a consumer that will not pull
//!   `once` publications tells the producer to free them; nothing is staged).
//!
//! Decoding bounds every message by the control-frame size; [`Message::validate`] then
//! enforces the finer [`Limits`] (key counts, string lengths, chunk sizes). Receivers
//! must validate every message before acting on it; [`read_message`] does both.
//!
//! Encoding is postcard, which numbers enum variants by position: the order of the
//! variants of [`Message`] and [`ErrorKind`] is part of the wire format. Add new
//! variants at the end only, and bump [`VERSION`](super::VERSION) for anything else.
//!
//! # Cancellation
//!
//! [`read_message`] may be dropped at any await. Bytes of a frame it already consumed
//! are lost with it, so the stream is then at an unknown position in the framing: the
//! connection must be closed, not read again (the `net` layer does so for every
//! dropped or failed read).

use serde::{Deserialize, Serialize};
use tokio::io::AsyncRead;

use super::selection::{SelectedShape, SelectionError, WireSelection};
use super::{read_control, ChunkKey, Limits, WireError};

/// Longest accepted `peer_id`, in bytes.
pub const MAX_PEER_ID_BYTES: usize = 256;
/// Longest accepted error message, in bytes.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;

/// A staging lease's id: 128 random bits from a CSPRNG (`rand`'s thread-local
/// ChaCha12, seeded by the operating system; 0 means "nothing staged"). Encoded as a postcard varint, like the 64-bit ids of earlier
/// builds, so small ids decode either way.
pub type LeaseId = u128;

/// Size and checksum of one staged chunk, announced before its bytes are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkMeta {
    /// The chunk's key.
    pub key: ChunkKey,
    /// Its length in bytes (the length of its bulk frame).
    pub len: u64,
    /// crc32c of its bytes.
    pub checksum: u32,
}

/// Most runs one [`Message::StagedMapped`] may name: at most about 20 bytes each, so a
/// reply with its chunk list stays well inside the default 1 MiB control frame. A
/// grant that needs more is refused `TooLarge`, and the consumer gets it over the
/// socket.
pub const MAX_MAPPED_RUNS: usize = 1 << 15;
/// Most device-IPC kinds one hello or offer names.
pub const MAX_DEVICE_IPC_KINDS: usize = 8;
/// Longest device-IPC kind name, in bytes.
pub const MAX_DEVICE_IPC_KIND_BYTES: usize = 32;
/// Longest device-IPC handle, in bytes (a CUDA IPC memory handle is 64).
pub const MAX_DEVICE_IPC_HANDLE_BYTES: usize = 128;
/// Most buffers one device export names (a cache's buffers: one per layer, say).
pub const MAX_EXPORTED_BUFFERS: usize = 4096;
/// Longest accepted boot id, in bytes.
pub const MAX_BOOT_ID_BYTES: usize = 64;

/// What a producer offers a consumer on the same host for reading its granted bytes
/// with cross-memory attach (`process_vm_readv`), carried by [`Message::MoverOffer`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmaOffer {
    /// The producer's process id, as the producer sees it.
    pub pid: u32,
    /// Where 32 bytes of the producer's probe pattern live in its memory.
    pub probe_addr: u64,
    /// The probe pattern: a read of `probe_addr` must return exactly these bytes.
    pub probe: [u8; 32],
}

/// Why a request failed, carried by [`Message::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The peer's proof did not verify.
    AuthFailed,
    /// This side requires authentication and the peer offered none.
    AuthRequired,
    /// No lease with that id exists (never staged, or already released).
    UnknownLease,
    /// The lease's TTL ran out and its pages were released.
    LeaseExpired,
    /// The request names an incarnation of the producer that is no longer running.
    StaleIncarnation,
    /// Out of staging capacity or concurrency; retry later.
    Busy,
    /// The request or a chunk exceeds a configured limit.
    TooLarge,
    /// The request is malformed or not valid in the current state.
    BadRequest,
    /// An internal failure on the replying side.
    Internal,
    /// None of the requested chunks is held.
    NotFound,
    /// The replying side is shutting down and accepts no new work.
    ShuttingDown,
    /// A selection (`GetSelected`, `StageSelected`) does not fit the publication; the
    /// message names the mismatch.
    BadSelection,
}

impl ErrorKind {
    /// The stable code of a peer's refusal of this kind.
    pub fn code(self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            ErrorKind::AuthFailed => C::AuthFailed,
            ErrorKind::AuthRequired => C::AuthRequired,
            ErrorKind::UnknownLease => C::UnknownLease,
            ErrorKind::LeaseExpired => C::LeaseExpired,
            ErrorKind::StaleIncarnation => C::StaleIncarnation,
            ErrorKind::Busy => C::Busy,
            ErrorKind::TooLarge => C::TooLarge,
            ErrorKind::BadRequest => C::InvalidArgument,
            ErrorKind::Internal => C::Internal,
            ErrorKind::NotFound => C::NotFound,
            ErrorKind::ShuttingDown => C::PeerShuttingDown,
            ErrorKind::BadSelection => C::Selection,
        }
    }
}

/// A control message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Client → server, first frame: who the client is and its challenge nonce.
    Hello {
        /// The client's stable identity.
        peer_id: String,
        /// Changes every time the client process restarts.
        incarnation: u64,
        /// The client's fresh random nonce.
        nonce: [u8; 32],
        /// Whether the client has a secret configured and expects mutual auth.
        wants_auth: bool,
    },
    /// Server → client: the server's identity and nonce.
    Challenge {
        /// The server's stable identity.
        peer_id: String,
        /// Changes every time the server process restarts.
        incarnation: u64,
        /// The server's fresh random nonce.
        nonce: [u8; 32],
        /// Always `None`: the server proves the secret only in [`Message::WelcomeAuth`],
        /// after the client proved it. (Builds before handshake v2 put a proof here; a
        /// client refuses such a server with a clear error.)
        proof: Option<[u8; 32]>,
    },
    /// Client → server: the client's proof of the shared secret over both nonces, if a
    /// secret is configured.
    Auth {
        /// The client's proof (HMAC with the client key over the transcript), if any.
        proof: Option<[u8; 32]>,
    },
    /// Server → client: handshake complete (no shared secret configured).
    Welcome,
    /// Asks how many leading `keys` the peer holds.
    Lookup {
        /// Keys, in prefix order.
        keys: Vec<ChunkKey>,
    },
    /// Reply to [`Message::Lookup`].
    LookupReply {
        /// Number of leading keys the peer holds.
        hits: u32,
    },
    /// Asks the producer to stage chunks and advertise them, for a later pull.
    Stage {
        /// Keys, in prefix order.
        keys: Vec<ChunkKey>,
        /// How long the producer keeps them staged without a pull or `Done`.
        ttl_ms: u32,
    },
    /// Reply to [`Message::Stage`] or [`Message::Get`]: what was staged under a lease.
    /// `chunks` may cover only a prefix of the keys (partial stage); empty means a miss.
    Staged {
        /// The lease holding the staged pages.
        lease_id: LeaseId,
        /// The producer incarnation the lease belongs to.
        incarnation: u64,
        /// The staged chunks, in key order.
        chunks: Vec<ChunkMeta>,
        /// The lease's TTL as granted by the producer.
        ttl_ms: u32,
    },
    /// Asks for the bytes of a staged lease: one bulk frame per chunk follows, with the
    /// same request id, then [`Message::PullDone`].
    Pull {
        /// The lease to pull.
        lease_id: LeaseId,
        /// The producer incarnation the lease was granted by.
        incarnation: u64,
    },
    /// All bulk frames of a lease were sent.
    PullDone {
        /// The lease that was pulled.
        lease_id: LeaseId,
    },
    /// Eager get: stage and send in one round trip. Replies are `Staged`, bulk frames,
    /// then `PullDone`.
    Get {
        /// Keys, in prefix order.
        keys: Vec<ChunkKey>,
        /// TTL of the lease, should the consumer not send `Done`.
        ttl_ms: u32,
    },
    /// The consumer is finished with a lease: the producer releases its pages.
    Done {
        /// The lease to release.
        lease_id: LeaseId,
    },
    /// Reply to [`Message::Done`].
    DoneAck,
    /// Pushes one chunk: a bulk frame with its bytes follows.
    Put {
        /// The chunk's key.
        key: ChunkKey,
        /// Its length (the length of the following bulk frame).
        len: u64,
    },
    /// Reply to [`Message::Put`]: the chunk is stored.
    PutAck {
        /// The stored chunk's key.
        key: ChunkKey,
    },
    /// A request failed.
    Error {
        /// Machine-readable reason.
        kind: ErrorKind,
        /// Human-readable detail.
        message: String,
    },
    /// Liveness probe.
    Ping,
    /// Reply to [`Message::Ping`].
    Pong,
    /// Server → client, in place of [`Message::Welcome`] when a shared secret is
    /// configured: the client's proof verified, handshake complete, and here is the
    /// server's own proof (HMAC with the server key over the same transcript).
    WelcomeAuth {
        /// The server's proof.
        proof: [u8; 32],
    },
    /// The consumer will not pull these keys: the producer retires the ones that are
    /// `once` publications (published for a single consumer), without staging
    /// anything. Any other chunk (a publication many may read, a store chunk) is left
    /// alone. Refused with `StaleIncarnation` when `incarnation` is not the
    /// producer's.
    Release {
        /// Keys to release.
        keys: Vec<ChunkKey>,
        /// The producer incarnation that published them.
        incarnation: u64,
    },
    /// Reply to [`Message::Release`]: per key, in order, whether a publication was
    /// released by this request.
    ReleaseAck {
        /// `released[i]`: key `i` was a `once` publication and is released now.
        released: Vec<bool>,
    },
    /// Eager get of part of the keys' published blocks (see [`super::selection`]).
    /// Replies are `StagedSelected`, one bulk frame per announced frame, then
    /// `PullDone`. A producer that cannot serve the selection answers `Error` with
    /// [`ErrorKind::BadSelection`].
    GetSelected {
        /// Keys, in prefix order; all must be published.
        keys: Vec<ChunkKey>,
        /// TTL of the lease, should the consumer not send `Done`.
        ttl_ms: u32,
        /// What to send.
        select: WireSelection,
    },
    /// Stages part of the keys' published blocks for a later pull (only the selected
    /// bytes are staged). Reply: `StagedSelected`.
    StageSelected {
        /// Keys, in prefix order; all must be published.
        keys: Vec<ChunkKey>,
        /// How long the producer keeps them staged without a pull or `Done`.
        ttl_ms: u32,
        /// What to stage.
        select: WireSelection,
    },
    /// Reply to `GetSelected` and `StageSelected`: as [`Message::Staged`], but
    /// `chunks` are the frames of the selected stream (cut at block boundaries, each
    /// named by the key of its first block), and `shape` says what the stream holds.
    /// Empty `chunks` (lease 0) is a miss.
    StagedSelected {
        /// The lease holding the staged bytes.
        lease_id: LeaseId,
        /// The producer incarnation the lease belongs to.
        incarnation: u64,
        /// The frames, in stream order.
        chunks: Vec<ChunkMeta>,
        /// The lease's TTL as granted by the producer.
        ttl_ms: u32,
        /// Selected blocks and per-piece bytes of the stream.
        shape: SelectedShape,
    },
    /// Consumer → producer: which bulk movers besides the socket could carry this
    /// pair's bytes. Reply: [`Message::MoverOffer`].
    MoverHello {
        /// The consumer's boot id (`/proc/sys/kernel/random/boot_id`), empty when
        /// unknown: equal boot ids mean the same running kernel, so the same host.
        boot_id: String,
    },
    /// Producer → consumer: the movers it offers this consumer.
    MoverOffer {
        /// The producer incarnation the offer belongs to.
        incarnation: u64,
        /// Cross-memory attach, when on the same host and allowed here.
        cma: Option<CmaOffer>,
        /// Why `cma` is not offered (empty when it is).
        refused: String,
    },
    /// Eager get whose bytes the consumer reads itself from the producer's memory
    /// (the CMA mover), optionally of a selection. Reply: [`Message::StagedMapped`];
    /// the consumer then reads the named runs and sends `Done`.
    GetMapped {
        /// Keys, in prefix order.
        keys: Vec<ChunkKey>,
        /// TTL of the lease: the runs stay valid until `Done` or this.
        ttl_ms: u32,
        /// What to read, for a selected get.
        select: Option<WireSelection>,
    },
    /// Reply to [`Message::GetMapped`]: the lease, its chunks (or frames of a
    /// selected stream) with their checksums, and where their bytes are in the
    /// producer's memory. Empty `chunks` (lease 0) is a miss.
    StagedMapped {
        /// The lease pinning the runs until `Done` or its TTL.
        lease_id: LeaseId,
        /// The producer incarnation the lease belongs to.
        incarnation: u64,
        /// The chunks or frames, in stream order.
        chunks: Vec<ChunkMeta>,
        /// A selected stream's shape (`None` for whole chunks).
        shape: Option<SelectedShape>,
        /// `(address, length)` runs in the producer's memory whose concatenation is
        /// the stream (the chunks' bytes, in order).
        runs: Vec<(u64, u64)>,
    },
    /// Consumer → producer (after CMA was chosen): which device-IPC kinds the consumer
    /// can open (`"sim-shm"`, `"cuda-ipc"`). Reply: [`Message::DeviceIpcOffer`]. An
    /// older producer refuses it: no device IPC.
    DeviceIpcHello {
        /// Kinds the consumer speaks.
        kinds: Vec<String>,
    },
    /// Producer → consumer: the device-IPC kinds it will grant device memory by.
    DeviceIpcOffer {
        /// The producer incarnation the offer belongs to.
        incarnation: u64,
        /// Kinds offered (empty: none).
        kinds: Vec<String>,
        /// Why none is offered (empty when some is).
        refused: String,
    },
    /// Eager get of published device blocks that the consumer copies device to device
    /// from the producer's exported memory. Reply: [`Message::StagedDeviceMapped`], or
    /// [`Message::StagedMapped`] when the leading keys are not exportable device
    /// memory (then read as for `GetMapped`); the consumer then sends `Done`.
    GetDeviceMapped {
        /// Keys, in prefix order.
        keys: Vec<ChunkKey>,
        /// TTL of the lease: the blocks stay published and pinned until `Done` or this.
        ttl_ms: u32,
        /// The device-IPC kind of the consumer's destination.
        kind: String,
        /// A partial get: the ranges of the published blocks to copy (see
        /// [`Message::GetSelected`]); the reply then carries the stream's shape.
        select: Option<WireSelection>,
    },
    /// Reply to [`Message::GetDeviceMapped`]: the lease, its chunks with checksums
    /// taken at the grant, the export of the device cache they live in (made once per
    /// registration), and where each chunk's bytes are in it.
    StagedDeviceMapped {
        /// The lease pinning the publications until `Done` or its TTL.
        lease_id: LeaseId,
        /// The producer incarnation the lease belongs to.
        incarnation: u64,
        /// The chunks, in stream order.
        chunks: Vec<ChunkMeta>,
        /// Names the export (one registration of the producer).
        export_id: u64,
        /// The export's device-IPC kind.
        kind: String,
        /// Each exported buffer's handle and length.
        buffers: Vec<(Vec<u8>, u64)>,
        /// A selected stream's shape (`None` for whole chunks): its frames are the
        /// chunks above.
        shape: Option<SelectedShape>,
        /// `(buffer, offset, length)` runs whose concatenation is the stream.
        runs: Vec<(u32, u64, u64)>,
    },
    /// Delayed pull of a staged lease (from [`Message::Staged`], whole chunks) whose
    /// bytes the consumer reads itself from the producer's memory (the CMA mover).
    /// Reply: [`Message::StagedMapped`] naming where the lease's bytes are (its chunks
    /// as staged); the consumer reads them and sends `Done`. A lease of a selection is
    /// refused (`BadRequest`): it is pulled over the socket.
    PullMapped {
        /// The staged lease.
        lease_id: LeaseId,
        /// The producer incarnation that granted it.
        incarnation: u64,
    },
    /// Asks the producer to answer once `key` is published (or in its store), or
    /// after `wait_ms` (capped by the producer) if it is still not. Reply:
    /// [`Message::LookupReply`] with `hits` 1 (it is there now) or 0. A consumer whose
    /// get missed a key the producer is about to publish (a prefill publishes a step
    /// after it answered) sends this instead of retrying on a timer: the producer's
    /// publication wakes the waiting request, so the retried get starts one round trip
    /// after the key appears.
    AwaitPublished {
        /// The key to wait for.
        key: ChunkKey,
        /// The longest the producer holds the request before answering 0.
        wait_ms: u32,
    },
}

impl Message {
    /// Checks the bounds decoding alone does not: key and chunk counts within
    /// `limits.max_keys`, `peer_id` within [`MAX_PEER_ID_BYTES`], error messages within
    /// [`MAX_ERROR_MESSAGE_BYTES`], chunk lengths within `limits.max_bulk_bytes`.
    pub fn validate(&self, limits: &Limits) -> Result<(), WireError> {
        match self {
            Message::Hello { peer_id, .. } | Message::Challenge { peer_id, .. } => {
                check("peer id", peer_id.len(), MAX_PEER_ID_BYTES)
            }
            Message::Lookup { keys }
            | Message::Stage { keys, .. }
            | Message::Get { keys, .. }
            | Message::Release { keys, .. } => check("key list", keys.len(), limits.max_keys),
            Message::ReleaseAck { released } => check("release list", released.len(), limits.max_keys),
            Message::GetSelected { keys, select, .. } | Message::StageSelected { keys, select, .. } => {
                check("key list", keys.len(), limits.max_keys)?;
                select.check_bounds().map_err(selection_oversize)
            }
            Message::StagedSelected { chunks, shape, .. } => {
                shape.validate().map_err(selection_oversize)?;
                check("chunk list", chunks.len(), limits.max_keys)?;
                chunks
                    .iter()
                    .try_for_each(|c| check_u64("chunk", c.len, limits.max_bulk_bytes))
            }
            Message::Staged { chunks, .. } => {
                check("chunk list", chunks.len(), limits.max_keys)?;
                chunks
                    .iter()
                    .try_for_each(|c| check_u64("chunk", c.len, limits.max_bulk_bytes))
            }
            Message::Put { len, .. } => check_u64("chunk", *len, limits.max_bulk_bytes),
            Message::Error { message, .. } => check("error message", message.len(), MAX_ERROR_MESSAGE_BYTES),
            Message::MoverHello { boot_id } => check("boot id", boot_id.len(), MAX_BOOT_ID_BYTES),
            Message::MoverOffer { refused, .. } => check("mover refusal", refused.len(), MAX_ERROR_MESSAGE_BYTES),
            Message::GetMapped { keys, select, .. } => {
                check("key list", keys.len(), limits.max_keys)?;
                match select {
                    Some(s) => s.check_bounds().map_err(selection_oversize),
                    None => Ok(()),
                }
            }
            Message::StagedMapped {
                chunks, shape, runs, ..
            } => {
                if let Some(shape) = shape {
                    shape.validate().map_err(selection_oversize)?;
                }
                check("chunk list", chunks.len(), limits.max_keys)?;
                check("mapped runs", runs.len(), MAX_MAPPED_RUNS)?;
                chunks
                    .iter()
                    .try_for_each(|c| check_u64("chunk", c.len, limits.max_bulk_bytes))
            }
            Message::DeviceIpcHello { kinds } | Message::DeviceIpcOffer { kinds, .. } => {
                check("device IPC kinds", kinds.len(), MAX_DEVICE_IPC_KINDS)?;
                kinds
                    .iter()
                    .try_for_each(|k| check("device IPC kind", k.len(), MAX_DEVICE_IPC_KIND_BYTES))?;
                match self {
                    Message::DeviceIpcOffer { refused, .. } => {
                        check("device IPC refusal", refused.len(), MAX_ERROR_MESSAGE_BYTES)
                    }
                    _ => Ok(()),
                }
            }
            Message::GetDeviceMapped { keys, kind, select, .. } => {
                check("key list", keys.len(), limits.max_keys)?;
                check("device IPC kind", kind.len(), MAX_DEVICE_IPC_KIND_BYTES)?;
                match select {
                    Some(s) => s.check_bounds().map_err(selection_oversize),
                    None => Ok(()),
                }
            }
            Message::StagedDeviceMapped {
                chunks,
                kind,
                buffers,
                shape,
                runs,
                ..
            } => {
                if let Some(shape) = shape {
                    shape.validate().map_err(selection_oversize)?;
                }
                check("chunk list", chunks.len(), limits.max_keys)?;
                check("device IPC kind", kind.len(), MAX_DEVICE_IPC_KIND_BYTES)?;
                check("exported buffers", buffers.len(), MAX_EXPORTED_BUFFERS)?;
                buffers
                    .iter()
                    .try_for_each(|b| check("device IPC handle", b.0.len(), MAX_DEVICE_IPC_HANDLE_BYTES))?;
                check("mapped runs", runs.len(), MAX_MAPPED_RUNS)?;
                chunks
                    .iter()
                    .try_for_each(|c| check_u64("chunk", c.len, limits.max_bulk_bytes))
            }
            Message::Auth { .. }
            | Message::Welcome
            | Message::LookupReply { .. }
            | Message::Pull { .. }
            | Message::PullMapped { .. }
            | Message::PullDone { .. }
            | Message::Done { .. }
            | Message::DoneAck
            | Message::PutAck { .. }
            | Message::Ping
            | Message::Pong
            | Message::WelcomeAuth { .. }
            | Message::AwaitPublished { .. } => Ok(()),
        }
    }

    /// The variant's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "Hello",
            Message::Challenge { .. } => "Challenge",
            Message::Auth { .. } => "Auth",
            Message::Welcome => "Welcome",
            Message::Lookup { .. } => "Lookup",
            Message::LookupReply { .. } => "LookupReply",
            Message::Stage { .. } => "Stage",
            Message::Staged { .. } => "Staged",
            Message::Pull { .. } => "Pull",
            Message::PullDone { .. } => "PullDone",
            Message::Get { .. } => "Get",
            Message::Done { .. } => "Done",
            Message::DoneAck => "DoneAck",
            Message::Put { .. } => "Put",
            Message::PutAck { .. } => "PutAck",
            Message::Error { .. } => "Error",
            Message::Ping => "Ping",
            Message::Pong => "Pong",
            Message::WelcomeAuth { .. } => "WelcomeAuth",
            Message::Release { .. } => "Release",
            Message::ReleaseAck { .. } => "ReleaseAck",
            Message::GetSelected { .. } => "GetSelected",
            Message::StageSelected { .. } => "StageSelected",
            Message::StagedSelected { .. } => "StagedSelected",
            Message::MoverHello { .. } => "MoverHello",
            Message::MoverOffer { .. } => "MoverOffer",
            Message::GetMapped { .. } => "GetMapped",
            Message::StagedMapped { .. } => "StagedMapped",
            Message::DeviceIpcHello { .. } => "DeviceIpcHello",
            Message::DeviceIpcOffer { .. } => "DeviceIpcOffer",
            Message::GetDeviceMapped { .. } => "GetDeviceMapped",
            Message::StagedDeviceMapped { .. } => "StagedDeviceMapped",
            Message::PullMapped { .. } => "PullMapped",
            Message::AwaitPublished { .. } => "AwaitPublished",
        }
    }
}

/// Reads one control frame as a [`Message`] and validates it against `limits`.
///
/// Returns the frame's request id and the message. A message that decodes but fails
/// validation is [`WireError::Oversize`]; the frame was consumed in full, so the stream
/// is still at a frame boundary.
pub async fn read_message<R: AsyncRead + Unpin>(r: &mut R, limits: &Limits) -> Result<(u64, Message), WireError> {
    let (request_id, msg) = read_control::<R, Message>(r, limits).await?;
    msg.validate(limits)?;
    Ok((request_id, msg))
}

/// A selection over its bounds, as the wire reports oversize input (the connection
/// is then refused with `TooLarge` and closed). Only list lengths are checked here;
/// other defects (an empty or overflowing range, a position past the end) are refused
/// by the producer with [`ErrorKind::BadSelection`], the connection kept.
fn selection_oversize(e: SelectionError) -> WireError {
    match e {
        SelectionError::TooMany { what, len, limit } => WireError::Oversize {
            what,
            len: len as u64,
            limit: limit as u64,
        },
        other => WireError::Decode(other.to_string()),
    }
}

fn check(what: &'static str, len: usize, limit: usize) -> Result<(), WireError> {
    check_u64(what, len as u64, limit as u64)
}

fn check_u64(what: &'static str, len: u64, limit: u64) -> Result<(), WireError> {
    if len > limit {
        return Err(WireError::Oversize { what, len, limit });
    }
    Ok(())
}
