//! The consumer's public types: settings, destinations, results, failures, handles and
//! counters.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::super::error::PeerError;
use super::super::selection::Selection;
use crate::copy::DrainFence;
use crate::device::KvCacheRef;
use crate::layout::{BlockMap, KvCache, KvLayout};
use crate::mem::Region;
use crate::net::NetConfig;
use crate::peer::movers::Transport;
use crate::wire::{ChunkMeta, SelectedShape, WireSelection};

/// Consumer settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Transport settings (peer id, secret, timeouts, connections per peer).
    pub net: NetConfig,
    /// TTL asked for staged leases.
    pub lease_ttl: Duration,
    /// Resolving a delayed-pull handle is refused when less than this is left.
    pub lease_guard: Duration,
    /// Bound on sending `Done` after a transfer.
    pub done_timeout: Duration,
    /// Which movers to use: with [`Transport::Auto`] (the default), a producer on the
    /// same host is read with `process_vm_readv` (see [`crate::peer::movers`]).
    pub transport: Transport,
}

impl ConsumerConfig {
    /// Defaults around a transport config.
    pub fn new(net: NetConfig) -> ConsumerConfig {
        ConsumerConfig {
            net,
            lease_ttl: Duration::from_secs(10),
            lease_guard: Duration::from_millis(100),
            done_timeout: Duration::from_secs(1),
            transport: Transport::Auto,
        }
    }
}

/// How received bytes reach the destination blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferPath {
    /// Zero-copy: the socket reads straight into the destination blocks (vectored
    /// reads), each chunk's crc32c verified as it arrives. A failed transfer leaves the
    /// blocks dirty (reported in [`GetFailure::dirty`]).
    #[default]
    Direct,
    /// Through receiver staging pages: the bytes land (one copy) only after every
    /// chunk arrived and verified, so a failed receive never touches the destination.
    Staged,
}

impl std::fmt::Display for TransferPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransferPath::Direct => "direct",
            TransferPath::Staged => "staged",
        })
    }
}

impl std::str::FromStr for TransferPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "direct" => Ok(TransferPath::Direct),
            "staged" => Ok(TransferPath::Staged),
            _ => Err(format!("unknown transfer path {s:?} (expected direct or staged)")),
        }
    }
}

/// Where landed chunks go: a KV cache, the block ids of each chunk, and the path.
#[derive(Clone, Debug)]
pub struct Destination {
    /// The consumer's KV cache, host or device memory. A device cache is always
    /// received through staging pages, then landed by a host-to-device scatter on the
    /// cache's copy stream (bounded wait).
    pub target: KvCacheRef,
    /// For each requested chunk, in key order, the blocks it lands in.
    pub chunks: Vec<Vec<u32>>,
    /// How the bytes get there (a device target is always staged).
    pub path: TransferPath,
    /// The producer incarnation an eager get expects: a connection to any other
    /// incarnation (the peer restarted) fails with `StaleIncarnation` before anything
    /// is staged or sent. `None` accepts any.
    pub incarnation: Option<u64>,
    /// Part of the publication to move (a partial get; see
    /// [`selection`](crate::peer::selection)). With a selection, the destination
    /// blocks are `chunks` concatenated (one list is enough): the selected blocks land
    /// into them in order. `None`: every chunk whole, chunk `i` into `chunks[i]`.
    pub select: Option<Selection>,
    /// How long an eager get that misses its first key waits for the producer to
    /// publish it (zero, the default: a miss is answered at once). The producer holds
    /// an `AwaitPublished` request and answers when the key arrives, and the get is
    /// sent again then: no retry timer on either side. Bounded by the transfer's
    /// deadline. For a prefill that publishes a step after it answered (vLLM).
    pub await_published: std::time::Duration,
    /// The registration hold the engine took for this transfer: released with the
    /// transfer's drain signal, once nothing writes the blocks.
    pub(crate) hold: Option<Arc<crate::peer::Hold>>,
}

impl Destination {
    /// Chunks into `cache`'s blocks: a host cache on the direct path, a device cache
    /// through staging, then host-to-device.
    pub fn new(cache: impl Into<KvCacheRef>, chunks: Vec<Vec<u32>>) -> Destination {
        let target = cache.into();
        let path = match target {
            KvCacheRef::Host(_) => TransferPath::Direct,
            KvCacheRef::Device(_) => TransferPath::Staged,
        };
        Destination {
            target,
            chunks,
            path,
            incarnation: None,
            select: None,
            await_published: std::time::Duration::ZERO,
            hold: None,
        }
    }

    /// The block map of the target cache.
    pub fn map(&self) -> &BlockMap {
        self.target.map()
    }

    /// The path actually taken: a device target is always staged.
    pub fn effective_path(&self) -> TransferPath {
        match self.target {
            KvCacheRef::Host(_) => self.path,
            KvCacheRef::Device(_) => TransferPath::Staged,
        }
    }

    /// Chunks into a region laid out by `layout`, through staging (the path that never
    /// leaves a destination dirty).
    pub fn from_layout(
        region: Arc<Region>,
        layout: &KvLayout,
        chunks: Vec<Vec<u32>>,
    ) -> Result<Destination, PeerError> {
        let cache = KvCache::with_layout(region, layout)?;
        Ok(Destination {
            target: KvCacheRef::Host(Arc::new(cache)),
            chunks,
            path: TransferPath::Staged,
            incarnation: None,
            select: None,
            await_published: std::time::Duration::ZERO,
            hold: None,
        })
    }

    /// The same destination on another path.
    pub fn with_path(mut self, path: TransferPath) -> Destination {
        self.path = path;
        self
    }

    /// The same destination, accepting only producer incarnation `incarnation`
    /// (eager gets; a delayed pull checks its handle's incarnation anyway).
    pub fn with_incarnation(mut self, incarnation: Option<u64>) -> Destination {
        self.incarnation = incarnation;
        self
    }

    /// The same destination, whose eager get waits up to `wait` for a first key the
    /// producer has not published yet (see [`Destination::await_published`]).
    pub fn with_await_published(mut self, wait: std::time::Duration) -> Destination {
        self.await_published = wait;
        self
    }

    /// The same destination, holding the registration of its cache (the engine's).
    pub(crate) fn with_hold(mut self, hold: crate::peer::Hold) -> Destination {
        self.hold = Some(Arc::new(hold));
        self
    }

    /// The same destination, moving only `select`ed bytes (see
    /// [`Destination::select`]).
    pub fn with_selection(mut self, select: Option<Selection>) -> Destination {
        self.select = select;
        self
    }

    /// The destination blocks as one list (`chunks` concatenated).
    pub(in crate::peer) fn flat_blocks(&self) -> Vec<u32> {
        self.chunks.iter().flatten().copied().collect()
    }

    /// Checks a selected destination: distinct valid blocks, and the selection
    /// against the destination's pieces. Returns the wire form of the selection, with
    /// what this destination will land.
    pub(in crate::peer) fn check_selected(&self, select: &Selection) -> Result<WireSelection, PeerError> {
        let all = self.flat_blocks();
        self.map()
            .check_blocks(&all)
            .map_err(|e| PeerError::InvalidArgument(format!("destination blocks: {e}")))?;
        Ok(select.check_destination(self.map(), &all)?)
    }

    /// Bytes a selected destination lands (its blocks times its pieces' selected
    /// bytes); 0 when the selection does not fit (checked elsewhere).
    pub(in crate::peer) fn selected_bytes(&self, wire: &WireSelection) -> usize {
        let per_block: u64 = wire.expect_pieces.iter().flatten().sum();
        (per_block as usize).saturating_mul(wire.expect_blocks.unwrap_or(0) as usize)
    }

    pub(in crate::peer) fn capacity(&self, i: usize) -> usize {
        self.map().chunk_bytes(self.chunks[i].len())
    }

    /// Checks the destination against `nkeys` requested chunks: enough chunks, valid
    /// block lists, and no block listed twice across the whole transfer.
    pub(in crate::peer) fn check(&self, nkeys: usize) -> Result<(), PeerError> {
        if self.chunks.len() < nkeys {
            return Err(PeerError::InvalidArgument(format!(
                "{nkeys} keys but destination blocks for only {} chunks",
                self.chunks.len()
            )));
        }
        let all: Vec<u32> = self.chunks.iter().take(nkeys).flatten().copied().collect();
        if self.chunks.iter().take(nkeys).any(|c| c.is_empty()) {
            return Err(PeerError::InvalidArgument("a destination chunk has no blocks".into()));
        }
        self.map()
            .check_blocks(&all)
            .map_err(|e| PeerError::InvalidArgument(format!("destination blocks: {e}")))
    }
}

/// What a successful transfer landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    /// Leading chunks landed (fewer than requested on a partial hit; 0 on a miss).
    pub chunks: usize,
    /// Bytes landed.
    pub bytes: usize,
    /// crc32c of the bytes received, in stream order (the landed chunks one after
    /// another), combined from the checksums the receive path computed and verified as
    /// each piece arrived — on the direct path over the destination blocks themselves,
    /// on the staged path over the staging pages before the landing copy. A caller
    /// can check what landed against its own expectation without reading it again
    /// (0 when nothing landed).
    pub checksum: u32,
}

/// A failed transfer. The destination blocks are quiet only once `fence` fires (the
/// background drain finished); `dirty` says whether they may have been written.
#[derive(Debug)]
pub struct GetFailure {
    /// What went wrong.
    pub error: PeerError,
    /// Fires once the transfer's work has drained and its staging pages are back.
    pub fence: DrainFence,
    /// True when bytes may have been written into the destination blocks (a direct
    /// receive or a landing copy had started): their content is undefined, never a
    /// landed chunk.
    pub dirty: bool,
}

impl GetFailure {
    pub(in crate::peer) fn clean(error: PeerError, fence: DrainFence) -> GetFailure {
        GetFailure {
            error,
            fence,
            dirty: false,
        }
    }
}

impl std::fmt::Display for GetFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for GetFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A transfer in flight from [`Consumer::start_get`](super::Consumer::start_get): a
/// future of its result that also exposes its [`DrainFence`] up front.
///
/// # Cancellation
///
/// Dropping a `Transfer` cancels it; its work drains in the background and the fence
/// (from [`fence`](Self::fence), taken before the drop) fires when the destination
/// blocks are quiet and the staging pages are back.
pub struct Transfer {
    pub(in crate::peer) fence: DrainFence,
    pub(in crate::peer) fut: std::pin::Pin<Box<dyn std::future::Future<Output = Result<Landed, GetFailure>> + Send>>,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer").field("fence", &self.fence).finish()
    }
}

impl Transfer {
    /// A transfer refused before it started: resolves at once to `error`, touching
    /// nothing (its fence has fired).
    pub fn failed(error: PeerError) -> Transfer {
        let fence = DrainFence::ready();
        let f = fence.clone();
        Transfer {
            fence,
            fut: Box::pin(async move { Err(GetFailure::clean(error, f)) }),
        }
    }

    /// The fence that fires when this transfer's work has drained.
    pub fn fence(&self) -> DrainFence {
        self.fence.clone()
    }
}

impl std::future::Future for Transfer {
    type Output = Result<Landed, GetFailure>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        self.fut.as_mut().poll(cx)
    }
}

/// A staged lease on a producer, from [`Consumer::stage`](super::Consumer::stage), to
/// resolve later.
#[derive(Clone, Debug)]
pub struct StagedHandle {
    /// The producer's address.
    pub peer: String,
    /// The lease.
    pub lease_id: crate::wire::LeaseId,
    /// The producer incarnation that granted it.
    pub incarnation: u64,
    /// The staged chunks (a prefix of the keys asked for).
    pub chunks: Vec<ChunkMeta>,
    /// When the lease expires, by this side's clock (conservative: measured from
    /// when the request was sent).
    pub expires: Instant,
    /// For a stage of a selection: what was selected (then `chunks` are the frames of
    /// the selected stream, not one per key).
    pub selection: Option<StagedSelection>,
}

/// What a staged selection holds (see [`StagedHandle::selection`]).
#[derive(Clone, Debug)]
pub struct StagedSelection {
    /// The selection staged (its destination ranges are the default landing of a
    /// resolve that names none).
    pub select: Selection,
    /// The selected stream's shape, as the producer announced it.
    pub shape: SelectedShape,
    /// Keys staged (all of those asked for).
    pub keys: usize,
}

/// Consumer counters.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ConsumerStats {
    /// Transfers that landed.
    pub completed: u64,
    /// Transfers that failed.
    pub failed: u64,
    /// Transfers cancelled by their caller (deadline or drop).
    pub cancelled: u64,
    /// Chunks refused for a checksum mismatch.
    pub checksum_failures: u64,
    /// Bytes landed.
    pub bytes: u64,
    /// Transfers whose background drain is still running.
    pub draining: u64,
    /// Transfers answered with `Timeout` (get, resolve, get_blocking).
    pub timeouts: u64,
    /// Bytes received (into staging pages or straight into destination blocks).
    pub bytes_received: u64,
    /// Chunks received (checksum verified or not).
    pub chunks_received: u64,
    /// Chunks landed.
    pub chunks_landed: u64,
    /// Landing copies into device memory the device never confirmed: their
    /// destination blocks stay reported busy (their fences never fire).
    pub device_unconfirmed: u64,
    /// Transfers whose bytes were read from the producer's memory (CMA mover).
    pub cma_transfers: u64,
    /// Bytes read from producers' memory (CMA mover), verified or not.
    pub cma_bytes: u64,
    /// Producer incarnations for which the socket was chosen although CMA was allowed
    /// (another host, the kernel refused, a wrong probe…: see
    /// [`Consumer::movers`](super::Consumer::movers)).
    pub mover_fallbacks: u64,
    /// Transfers landed by a device-to-device copy from the producer's exported
    /// device memory (device-IPC mover).
    pub device_ipc_transfers: u64,
    /// Bytes copied device to device from producers' exported memory.
    pub device_ipc_bytes: u64,
    /// Times device IPC was given up for a producer incarnation although CMA was
    /// chosen (the producer does not offer it, or its export could not be opened:
    /// see [`Consumer::movers`](super::Consumer::movers)).
    pub device_ipc_fallbacks: u64,
}
