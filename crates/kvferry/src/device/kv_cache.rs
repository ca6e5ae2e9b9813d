//! [`DeviceKvCache`]: a paged KV cache in device memory (one or more device buffers,
//! e.g. one per layer) with its [`BlockMap`], and the two copies that put it on the
//! transfer path: a device-to-host **gather** of chunks into staging pages (producer)
//! and a host-to-device **scatter** of staging pages into blocks (consumer), both on the
//! cache's own copy streams, each completed by a fresh event.
//!
//! # Copy streams
//!
//! A stream runs its copies in order, so one copy that never completes (a stuck DMA, a
//! device fault) would hold every later copy on its stream. The cache therefore keeps a
//! small pool of streams (at most [`MAX_STREAMS`], created as needed): a copy goes to a
//! stream whose last copy has settled, else to a new stream while the pool has room,
//! else to the most recently chosen stream whose last copy is not overdue (the stream of
//! a stuck copy, the oldest unsettled one, is the last a newcomer joins). A stream whose
//! last copy is past the op timeout unsettled is never chosen while another is usable,
//! so a stuck copy costs its own transfer, not the others in flight.
//!
//! Waits are the caller's, through the returned [`PendingCopy`]: bounded, and on
//! timeout or cancel the staging pages are quarantined until the device confirms (see
//! the module docs of [`device`](super)).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use super::{
    D2dSegment, Device, DeviceBuffer, DeviceError, DeviceSlice, Event, GatherSegment, PendingCopy, ScatterSegment,
    Stream,
};
use crate::layout::{BlockMap, LayoutError, Span};
use crate::mem::Lease;

/// A registered KV cache in device memory.
pub struct DeviceKvCache {
    name: String,
    device: Arc<dyn Device>,
    streams: Mutex<Vec<StreamSlot>>,
    buffers: Vec<DeviceBuffer>,
    /// Start of each buffer in the cache's address space, plus the total at the end.
    starts: Vec<usize>,
    map: BlockMap,
    op_timeout: Duration,
    /// This cache's export to other processes (device IPC), made once, on first use.
    export: OnceLock<Result<CacheExport, String>>,
    /// Producers' exports opened on this cache's device, per peer address.
    imports: Mutex<HashMap<String, Vec<Import>>>,
    /// Exported allocations opened so far (each open counted once).
    opens: AtomicU64,
}

/// How another process of this host reaches a cache's device memory (device IPC).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheExport {
    /// Random, names this export (one registration) in grants.
    pub id: u64,
    /// The device-IPC kind (see [`Device::ipc_kind`]).
    pub kind: &'static str,
    /// Each buffer's handle and length, in the cache's buffer order.
    pub buffers: Vec<(Vec<u8>, u64)>,
}

/// A producer's export opened here.
struct Import {
    incarnation: u64,
    export_id: u64,
    buffers: Arc<[DeviceBuffer]>,
}

/// Most exports of one peer kept open per cache (older ones close first).
const MAX_IMPORTS_PER_PEER: usize = 64;

impl std::fmt::Debug for DeviceKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvCache")
            .field("name", &self.name)
            .field("device", &self.device.name())
            .field("rank", &self.device.rank())
            .field("blocks", &self.map.blocks())
            .finish()
    }
}

impl DeviceKvCache {
    /// A cache over `parts` (each device buffer with the spans of every block inside
    /// it, offsets relative to that buffer) of `blocks` blocks on `device`, copying on
    /// a dedicated stream; every copy's wait is bounded by `op_timeout` from submission
    /// (and by the transfer's deadline).
    pub fn new(
        name: impl Into<String>,
        device: Arc<dyn Device>,
        parts: Vec<(DeviceBuffer, Vec<Span>)>,
        blocks: u32,
        op_timeout: Duration,
    ) -> Result<DeviceKvCache, DeviceError> {
        let name = name.into();
        if op_timeout.is_zero() {
            return Err(DeviceError::InvalidArgument(format!(
                "{name}: op timeout must be greater than zero"
            )));
        }
        let bad = |e: LayoutError| DeviceError::InvalidArgument(format!("{name}: {e}"));
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut spans = Vec::new();
        let mut buffers = Vec::with_capacity(parts.len());
        let mut at = 0usize;
        for (i, (buf, rs)) in parts.into_iter().enumerate() {
            if buf.device_id() != device.id() {
                return Err(DeviceError::InvalidArgument(format!(
                    "{name}: buffer {i} belongs to another device"
                )));
            }
            let local = BlockMap::new(rs.clone(), blocks).map_err(bad)?;
            if local.extent() > buf.len() {
                return Err(DeviceError::InvalidArgument(format!(
                    "{name}: buffer {i}: blocks need {} bytes but it has {}",
                    local.extent(),
                    buf.len()
                )));
            }
            starts.push(at);
            spans.extend(rs.iter().map(|s| Span {
                offset: s.offset + at,
                ..*s
            }));
            at += buf.len();
            buffers.push(buf);
        }
        starts.push(at);
        let map = BlockMap::new(spans, blocks).map_err(bad)?;
        let first = device.create_stream(&format!("{name}-copy0"))?;
        Ok(DeviceKvCache {
            name,
            device,
            streams: Mutex::new(vec![StreamSlot {
                stream: first,
                last: None,
                used: 0,
            }]),
            buffers,
            starts,
            map,
            op_timeout,
            export: OnceLock::new(),
            imports: Mutex::new(HashMap::new()),
            opens: AtomicU64::new(0),
        })
    }

    /// One device buffer of consecutive blocks of `block_bytes` each.
    pub fn contiguous(
        name: impl Into<String>,
        device: Arc<dyn Device>,
        buffer: DeviceBuffer,
        block_bytes: usize,
        op_timeout: Duration,
    ) -> Result<DeviceKvCache, DeviceError> {
        let name = name.into();
        if block_bytes == 0 || buffer.is_empty() || !buffer.len().is_multiple_of(block_bytes) {
            return Err(DeviceError::InvalidArgument(format!(
                "{name}: buffer of {} bytes is not a whole number of {block_bytes}-byte blocks",
                buffer.len()
            )));
        }
        let blocks = u32::try_from(buffer.len() / block_bytes)
            .map_err(|_| DeviceError::InvalidArgument(format!("{name}: more than 2^32 blocks")))?;
        let span = Span {
            offset: 0,
            stride: block_bytes,
            len: block_bytes,
        };
        DeviceKvCache::new(name, device, vec![(buffer, vec![span])], blocks, op_timeout)
    }

    /// The cache's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Where blocks live.
    pub fn map(&self) -> &BlockMap {
        &self.map
    }

    /// Bound on each copy's wait, from its submission.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// The device buffers.
    pub fn buffers(&self) -> &[DeviceBuffer] {
        &self.buffers
    }

    /// Cuts a range of the cache's address space at buffer boundaries.
    fn slices(&self, off: usize, len: usize, out: &mut Vec<DeviceSlice>) -> Result<(), DeviceError> {
        let (mut at, end) = (off, off + len);
        if end > *self.starts.last().expect("total") {
            return Err(DeviceError::InvalidArgument(format!(
                "{}: range {off}+{len} is outside the cache",
                self.name
            )));
        }
        while at < end {
            let i = self.starts.partition_point(|s| *s <= at) - 1;
            let within = at - self.starts[i];
            let n = (self.buffers[i].len() - within).min(end - at);
            if n > 0 {
                out.push(self.buffers[i].slice(within, n));
            }
            at += n;
        }
        Ok(())
    }

    /// Ranges (in the cache's address space) of a chunk of `blocks`, cut to `len`.
    pub fn chunk_ranges(&self, blocks: &[u32], len: usize) -> Result<Vec<(usize, usize)>, LayoutError> {
        self.map.chunk_ranges_cut(blocks, len)
    }

    /// Pairs each lease offset with the device range it maps to: `chunks` are
    /// `(offset in the lease, ranges in the cache)`, ranges cut at buffer boundaries.
    fn pairs(&self, chunks: &[(usize, Vec<(usize, usize)>)]) -> Result<Vec<(usize, DeviceSlice)>, DeviceError> {
        let mut out = Vec::new();
        let mut slices = Vec::new();
        for (at, ranges) in chunks {
            let mut at = *at;
            for &(off, len) in ranges {
                slices.clear();
                self.slices(off, len, &mut slices)?;
                for s in slices.drain(..) {
                    let n = s.len;
                    out.push((at, s));
                    at += n;
                }
            }
        }
        Ok(out)
    }

    /// Queues a gather of `chunks` — each `(offset in the lease, ranges)` — from the
    /// device into `dst` on the cache's copy stream.
    pub fn gather(
        &self,
        chunks: &[(usize, Vec<(usize, usize)>)],
        dst: Lease,
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        let segments: Vec<GatherSegment> = self
            .pairs(chunks)?
            .into_iter()
            .map(|(dst_offset, src)| GatherSegment { src, dst_offset })
            .collect();
        self.on_stream(|st| st.copy_d2h_gather(&segments, dst, op))
    }

    /// Queues a scatter of `chunks` — each `(offset in the lease, ranges)` — from `src`
    /// into the device on the cache's copy stream.
    pub fn scatter(
        &self,
        src: Lease,
        chunks: &[(usize, Vec<(usize, usize)>)],
        op: &str,
    ) -> Result<PendingCopy, DeviceError> {
        let segments: Vec<ScatterSegment> = self
            .pairs(chunks)?
            .into_iter()
            .map(|(src_offset, dst)| ScatterSegment { src_offset, dst })
            .collect();
        self.on_stream(|st| st.copy_h2d_scatter(src, &segments, op))
    }

    /// Streams this cache copies on (see "Copy streams" in the module docs).
    pub fn streams(&self) -> usize {
        self.streams.lock().len()
    }

    /// This cache's export for other processes of this host (made once: one handle
    /// per buffer), or why it has none (a device without IPC, a buffer not shared).
    pub fn export(&self) -> Result<&CacheExport, String> {
        self.export
            .get_or_init(|| {
                let kind = self
                    .device
                    .ipc_kind()
                    .ok_or_else(|| format!("{} exports no memory", self.device.name()))?;
                let mut buffers = Vec::with_capacity(self.buffers.len());
                for (i, b) in self.buffers.iter().enumerate() {
                    let h = b.export_handle().map_err(|e| format!("buffer {i}: {e}"))?;
                    buffers.push((h, b.len() as u64));
                }
                Ok(CacheExport {
                    id: rand::random(),
                    kind,
                    buffers,
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// `ranges` of the cache's address space as `(buffer, offset in it, length)` runs
    /// (cut at buffer boundaries), as a device-IPC grant names them.
    pub fn export_runs(&self, ranges: &[(usize, usize)]) -> Result<Vec<(u32, u64, u64)>, DeviceError> {
        let mut out: Vec<(u32, u64, u64)> = Vec::new();
        let mut slices = Vec::new();
        for &(off, len) in ranges {
            slices.clear();
            self.slices(off, len, &mut slices)?;
            for s in &slices {
                let i = self
                    .buffers
                    .iter()
                    .position(|b| b.same_buffer(&s.buffer))
                    .expect("a slice of one of the buffers") as u32;
                match out.last_mut() {
                    Some((b, o, l)) if *b == i && *o + *l == s.offset as u64 => *l += s.len as u64,
                    _ => out.push((i, s.offset as u64, s.len as u64)),
                }
            }
        }
        Ok(out)
    }

    /// The buffers of `peer`'s export `export_id` (incarnation `incarnation`) opened on
    /// this cache's device: opened on first use and kept, so each producer
    /// registration is opened once per incarnation here. Imports of `peer`'s other
    /// incarnations are closed now (their copies keep what they read alive until
    /// they settle). `buffers`: each handle and length, as exported.
    pub fn import(
        &self,
        peer: &str,
        incarnation: u64,
        export_id: u64,
        kind: &str,
        buffers: &[(Vec<u8>, u64)],
    ) -> Result<Arc<[DeviceBuffer]>, DeviceError> {
        if self.device.ipc_kind() != Some(kind) {
            return Err(DeviceError::InvalidArgument(format!(
                "the producer's memory is {kind:?} device IPC; {} speaks {:?}",
                self.device.name(),
                self.device.ipc_kind()
            )));
        }
        let mut imports = self.imports.lock();
        let list = imports.entry(peer.to_string()).or_default();
        list.retain(|i| i.incarnation == incarnation);
        if let Some(i) = list.iter().find(|i| i.export_id == export_id) {
            return Ok(i.buffers.clone());
        }
        let mut opened = Vec::with_capacity(buffers.len());
        for (handle, len) in buffers {
            let b = self.device.open_ipc(handle)?;
            if (b.len() as u64) < *len {
                return Err(DeviceError::InvalidArgument(format!(
                    "an imported buffer holds {} bytes, its export names {len}",
                    b.len()
                )));
            }
            self.opens.fetch_add(1, Ordering::Relaxed);
            opened.push(b);
        }
        let buffers: Arc<[DeviceBuffer]> = opened.into();
        if list.len() >= MAX_IMPORTS_PER_PEER {
            list.remove(0);
        }
        list.push(Import {
            incarnation,
            export_id,
            buffers: buffers.clone(),
        });
        Ok(buffers)
    }

    /// The crc32c of `ranges` of the cache's address space, in order, read from the
    /// device memory now, outside stream order (the caller knows no copy writes them:
    /// published blocks, or a landing whose copy settled). Host-visible memory (sim) is
    /// read in place; other memory through a bounce buffer of at most 1 MiB.
    pub fn checksum_ranges(&self, ranges: &[(usize, usize)]) -> Result<u32, DeviceError> {
        let mut crc = 0u32;
        let mut slices = Vec::new();
        for &(off, len) in ranges {
            self.slices(off, len, &mut slices)?;
        }
        let mut bounce = Vec::new();
        for s in &slices {
            match s.buffer.backend().host_memory() {
                Some(mem) => {
                    mem.for_each_run(s.offset, s.len, &mut |p, n| {
                        // SAFETY: the run lies inside memory the buffer keeps alive; the
                        // caller guarantees no copy writes it meanwhile.
                        let bytes = unsafe { std::slice::from_raw_parts(p.cast_const(), n) };
                        crc = crate::checksum::append(crc, bytes);
                    })?;
                }
                None => {
                    let mut at = 0;
                    while at < s.len {
                        let n = (s.len - at).min(1 << 20);
                        bounce.resize(n, 0);
                        s.buffer.read(s.offset + at, &mut bounce)?;
                        crc = crate::checksum::append(crc, &bounce);
                        at += n;
                    }
                }
            }
        }
        Ok(crc)
    }

    /// Closes every import of `peer` (say, when it is known gone).
    pub fn close_imports(&self, peer: &str) {
        self.imports.lock().remove(peer);
    }

    /// Exports of other processes currently open here, and how many allocations were
    /// opened in all (for tests and stats).
    pub fn imports_open(&self) -> (usize, u64) {
        let n = self.imports.lock().values().map(Vec::len).sum();
        (n, self.opens.load(Ordering::Relaxed))
    }

    /// Queues a device-to-device copy into this cache on its copy stream: the stream
    /// made of `runs` of `sources` (`(buffer, offset, length)`, imported with
    /// [`import`](Self::import)) lands in `dst` (ranges of this cache's address space,
    /// the same total length), in order. Returns the copy's fresh event; until it
    /// settles the destination ranges must be treated as busy.
    pub fn copy_in(
        &self,
        sources: &[DeviceBuffer],
        runs: &[(u32, u64, u64)],
        dst: &[(usize, usize)],
        op: &str,
    ) -> Result<Event, DeviceError> {
        let bad = |m: String| DeviceError::InvalidArgument(format!("{}: {m}", self.name));
        let mut dst_slices = Vec::new();
        for &(off, len) in dst {
            self.slices(off, len, &mut dst_slices)?;
        }
        let mut src_slices = Vec::with_capacity(runs.len());
        for &(b, off, len) in runs {
            let buf = sources
                .get(b as usize)
                .ok_or_else(|| bad(format!("a run names buffer {b} of {}", sources.len())))?;
            let (off, len) = (
                usize::try_from(off).map_err(|_| bad("run offset".into()))?,
                usize::try_from(len).map_err(|_| bad("run length".into()))?,
            );
            src_slices.push(buf.slice(off, len));
        }
        let total = |v: &[DeviceSlice]| v.iter().map(|s| s.len).sum::<usize>();
        if total(&src_slices) != total(&dst_slices) {
            return Err(bad(format!(
                "the source holds {} bytes, the destination {}",
                total(&src_slices),
                total(&dst_slices)
            )));
        }
        // Pair the two lists, cutting at both sides' boundaries.
        let mut segments = Vec::new();
        let (mut si, mut di, mut s_at, mut d_at) = (0, 0, 0, 0);
        while si < src_slices.len() && di < dst_slices.len() {
            let (s, d) = (&src_slices[si], &dst_slices[di]);
            let n = (s.len - s_at).min(d.len - d_at);
            if n > 0 {
                segments.push(D2dSegment {
                    src: s.buffer.slice(s.offset + s_at, n),
                    dst: d.buffer.slice(d.offset + d_at, n),
                });
            }
            s_at += n;
            d_at += n;
            if s_at == s.len {
                si += 1;
                s_at = 0;
            }
            if d_at == d.len {
                di += 1;
                d_at = 0;
            }
        }
        self.on_stream_with(|st| st.copy_d2d(&segments, op), |e| e)
    }

    /// Submits one copy on the stream the pool picks, and remembers its event.
    fn on_stream(
        &self,
        submit: impl FnOnce(&Stream) -> Result<PendingCopy, DeviceError>,
    ) -> Result<PendingCopy, DeviceError> {
        self.on_stream_with(submit, PendingCopy::event)
    }

    /// [`on_stream`](Self::on_stream) for any submission with an event.
    fn on_stream_with<T>(
        &self,
        submit: impl FnOnce(&Stream) -> Result<T, DeviceError>,
        event_of: impl Fn(&T) -> &Event,
    ) -> Result<T, DeviceError> {
        let mut slots = self.streams.lock();
        let now = tokio::time::Instant::now();
        let settled = |s: &StreamSlot| s.last.as_ref().is_none_or(|e| e.query().is_settled());
        let overdue = |s: &StreamSlot| {
            s.last
                .as_ref()
                .is_some_and(|e| !e.query().is_settled() && now.duration_since(e.meta().submitted()) > self.op_timeout)
        };
        let pick = match slots.iter().position(settled) {
            Some(i) => i,
            None if slots.len() < MAX_STREAMS => {
                let stream = self
                    .device
                    .create_stream(&format!("{}-copy{}", self.name, slots.len()))?;
                slots.push(StreamSlot {
                    stream,
                    last: None,
                    used: 0,
                });
                slots.len() - 1
            }
            None => {
                // Every stream is busy: the most recently chosen one that is not overdue.
                // A stuck copy is the oldest unsettled one, so its stream is the last a
                // newcomer would join, even before it is known to be stuck; streams that
                // settle are preferred again above, which spreads the work back out.
                let by_use = |i: &usize| slots[*i].used;
                let healthy = (0..slots.len()).filter(|&i| !overdue(&slots[i])).max_by_key(by_use);
                healthy.or_else(|| (0..slots.len()).max_by_key(by_use)).unwrap_or(0)
            }
        };
        let pending = submit(&slots[pick].stream)?;
        let seq = slots.iter().map(|s| s.used).max().unwrap_or(0) + 1;
        let slot = &mut slots[pick];
        slot.last = Some(event_of(&pending).clone());
        slot.used = seq;
        Ok(pending)
    }
}

/// Most copy streams one cache opens (see "Copy streams" in the module docs).
pub const MAX_STREAMS: usize = 4;

/// One of a cache's copy streams and the last copy submitted on it.
struct StreamSlot {
    stream: Stream,
    last: Option<super::Event>,
    /// When it was last chosen (a sequence number: higher is more recent).
    used: u64,
}
