//! `Engine`: the Python face of [`kvferry::engine::Engine`]. Its server and transfers
//! run on a tokio runtime: the process's shared one by default, or one of its own
//! (see [`crate::runtime`]); every call that waits or copies releases the GIL.
//!
//! Regions are host memory (registered with the engine) or, on a `device="sim"` or
//! `"cuda:N"` engine, device memory ([`DeviceKvCache`]; on CUDA also memory wrapped
//! from a torch tensor, a `__dlpack__` object or a raw pointer, kept alive by its
//! Python object): published device blocks go out through
//! a device-to-host gather, received ones land through a host-to-device scatter, both
//! bounded by the engine's device timeout. Gets may name the producer incarnation
//! they expect (a restarted peer is refused before anything is staged), and
//! `release_remote` lets a consumer give up keys it will not fetch (stage, then
//! `Done` at once) so the producer frees them before their TTL.
//!
//! # Cancellation
//!
//! Transfers and releases run as tasks on the engine's runtime; Python waits on them
//! through [`PyTransfer`] (see its module for cancel and Ctrl-C). Dropping a
//! `Transfer` object does not cancel its task: it finishes or fails on its own
//! deadline, and the memory it touches stays alive until then.

use kvferry::ErrorCode;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::ChunkKey;
use kvferry::engine::Engine;
use kvferry::engine::{Destination, TransferPath};
use kvferry::engine::{KvCache, Region, Span};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

mod convert;
mod device_memory;
mod fetching;
mod host_memory;
mod staged;
mod start;

pub(crate) use convert::required;
pub use convert::{byte_buffer, duration, key_of};
pub(crate) use host_memory::HeldBuffer;
pub use staged::PyStaged;

use crate::block_ids::{self, BlockIdsArg};
use crate::device::{dev_err, EngineDevice, PyDeviceMemory};
use crate::errors::{py_err, ErrInfo};
use crate::options::PyEngineOptions;
use crate::region::PyRegion;
use crate::runtime::RuntimeRef;
use crate::selection::{selection, PySelection};
use crate::transfer::{PyTransfer, Waiting};

static NEXT_ENGINE: AtomicUsize = AtomicUsize::new(1);

/// The kind of memory an engine's `DeviceMemory` holds (`"sim"`, `"cuda"`).
fn buf_kind(device: Option<&EngineDevice>) -> String {
    device.map_or_else(|| "host".to_string(), |d| d.device.kind().to_string())
}

/// Raw memory handed out by another engine: kept alive by `owner` (any object).
struct HeldObject(#[allow(dead_code)] Py<PyAny>);

/// The kvferry engine.
#[pyclass(name = "Engine", module = "kvferry._kvferry", frozen)]
pub struct PyEngine {
    /// The runtime this engine runs on, until closed.
    runtime: Mutex<Option<RuntimeRef>>,
    /// The runtime's handle, spin budget and linger window transfers run and are
    /// waited on with.
    waiting: Waiting,
    engine: Engine,
    id: usize,
    /// The Python key objects of publications, to report releases by them.
    published: Mutex<HashMap<ChunkKey, Py<PyAny>>>,
    /// The device (`device="sim"`), if any.
    device: Option<EngineDevice>,
}

impl PyEngine {
    /// The handle of the engine's runtime (it stays valid after close).
    fn handle(&self) -> &tokio::runtime::Handle {
        &self.waiting.runtime
    }

    fn check_region(&self, region: &PyRegion) -> PyResult<()> {
        if region.engine_id != self.id {
            return Err(ErrInfo::invalid("region was registered with another engine").into());
        }
        if region.is_deregistered() {
            return Err(ErrInfo::invalid(format!("{} was deregistered", region.cache_name())).into());
        }
        Ok(())
    }

    fn destination(
        &self,
        region: &PyRegion,
        block_ids: Vec<BlockIdsArg>,
        path: &str,
        incarnation: Option<u64>,
        select: Option<PySelection>,
    ) -> PyResult<Destination> {
        let select = selection(select)?;
        self.check_region(region)?;
        if region.readonly {
            return Err(ErrInfo::invalid(format!("{} is read-only: it cannot receive", region.cache_name())).into());
        }
        let path: TransferPath = path.parse().map_err(ErrInfo::invalid)?;
        // Device memory is always received through staging pages, whatever `path` says.
        let dst = Destination::new(&region.reg.cache, block_ids::rows(block_ids)).with_path(path);
        Ok(dst.with_incarnation(incarnation).with_selection(select))
    }

    fn dev(&self) -> PyResult<&EngineDevice> {
        self.device.as_ref().ok_or_else(|| {
            ErrInfo::invalid("this engine has no device (create it with Engine(device='sim') or device='cuda:N')")
                .into()
        })
    }

    fn device_memory(&self, buf: kvferry::engine::DeviceBuffer, shape: Option<Vec<usize>>) -> PyDeviceMemory {
        PyDeviceMemory {
            kind: buf_kind(self.device.as_ref()),
            buf,
            engine_id: self.id,
            shape,
        }
    }

    fn keys(keys: &Bound<'_, PyList>) -> PyResult<Vec<ChunkKey>> {
        keys.iter().map(|k| key_of(&k)).collect()
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    fn new(py: Python<'_>, options: PyRef<'_, PyEngineOptions>) -> PyResult<PyEngine> {
        PyEngine::start(py, options)
    }

    /// `"host:port"` peers reach this engine on (None for a client-only engine).
    #[getter]
    fn address(&self) -> Option<String> {
        self.engine.address().map(|a| a.to_string())
    }

    /// This engine's peer id.
    #[getter]
    fn peer_id(&self) -> String {
        self.engine.peer_id().to_string()
    }

    /// This engine's incarnation (a new one at every start).
    #[getter]
    fn incarnation(&self) -> u64 {
        self.engine.incarnation()
    }

    /// The runtime this engine runs on: `(shared, threads, engines holding it, polls
    /// made lingering)`; None once closed.
    fn runtime_info(&self) -> Option<(bool, usize, usize, u64)> {
        self.runtime
            .lock()
            .as_ref()
            .map(|r| (r.is_shared(), r.threads(), r.holders(), r.linger().polls()))
    }

    /// Every counter, as JSON (the Python layer parses it into a dict).
    fn stats_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.engine.stats()).map_err(|e| ErrInfo::new(ErrorCode::Internal, e.to_string()).into())
    }

    /// Registers `parts` — `[(buffer, [(offset, stride, length), ...]), ...]` — as one
    /// KV cache of `blocks` blocks; block *i* is every part's spans at `i`, in order.
    fn register_spans(
        &self,
        py: Python<'_>,
        name: String,
        parts: Vec<(Bound<'_, PyAny>, Vec<(usize, usize, usize)>)>,
        blocks: u32,
    ) -> PyResult<PyRegion> {
        self.register_buffers(py, name, parts, blocks)
    }

    /// Registers raw memory another engine handed out: `ptr`, `nbytes` on the host,
    /// laid out by `spans`; `owner` (any object) is kept alive as long as the region.
    /// The caller guarantees the memory stays valid while `owner` lives.
    #[pyo3(signature = (name, ptr, nbytes, spans, blocks, owner=None))]
    fn register_raw(
        &self,
        py: Python<'_>,
        name: String,
        ptr: usize,
        nbytes: usize,
        spans: Vec<(usize, usize, usize)>,
        blocks: u32,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<PyRegion> {
        let ptr = NonNull::new(ptr as *mut u8).ok_or_else(|| ErrInfo::invalid("ptr must not be null"))?;
        let owner = owner.unwrap_or_else(|| py.None());
        // SAFETY: the caller of this documented-unsafe entry point promises `ptr` is
        // valid for `nbytes` while `owner` lives; the region keeps `owner` until every
        // transfer touching it has drained.
        let region = unsafe { Region::from_raw(name.clone(), ptr, nbytes, Box::new(HeldObject(owner))) };
        let spans = spans
            .iter()
            .map(|&(offset, stride, len)| Span { offset, stride, len })
            .collect();
        let cache =
            KvCache::new(name, vec![(Arc::new(region), spans)], blocks).map_err(|e| ErrInfo::invalid(e.to_string()))?;
        self.register_cache(cache, false)
    }

    /// Deregisters `region`, waiting up to `timeout` seconds for the transfers and
    /// publications using it; raises `InUseError` if they did not finish.
    fn deregister(&self, py: Python<'_>, region: &PyRegion, timeout: f64) -> PyResult<()> {
        self.check_region(region)?;
        let t = required(timeout, "timeout")?;
        let e = &self.engine;
        // The engine's ledger wakes the wait when the last holder lets go.
        py.detach(|| self.handle().block_on(e.deregister(&region.reg, t)))
            .map_err(py_err)?;
        if region.reg.cache.is_device() {
            // A host region's later use is refused by the engine (`NotRegisteredError`).
            region.deregistered.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Publishes blocks of `region` under `key`, zero copy. The blocks must not be
    /// written until `take_released()` reports the key.
    #[pyo3(signature = (key, region, block_ids, ttl, once))]
    fn publish(
        &self,
        py: Python<'_>,
        key: Bound<'_, PyAny>,
        region: &PyRegion,
        block_ids: BlockIdsArg,
        ttl: Option<f64>,
        once: bool,
    ) -> PyResult<()> {
        self.check_region(region)?;
        let k = key_of(&key)?;
        let ttl = duration(ttl, "ttl")?.unwrap_or(Duration::ZERO);
        let e = &self.engine;
        py.detach(|| e.publish(k, &region.reg, &block_ids.0, ttl, once))
            .map_err(py_err)?;
        self.published.lock().insert(k, key.unbind());
        Ok(())
    }

    /// Releases a publication. False if the key is not published.
    fn unpublish(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.engine.unpublish(&key_of(key)?))
    }

    /// `[(key, reason), ...]` of publications released since the last call.
    fn take_released(&self, py: Python<'_>) -> Vec<(Py<PyAny>, String)> {
        let released = self.engine.take_released();
        let mut names = self.published.lock();
        released
            .into_iter()
            .map(|r| {
                let reason = serde_json::to_value(r.reason)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                let key = names
                    .remove(&r.key)
                    .unwrap_or_else(|| PyBytes::new(py, &r.key.0).into_any().unbind());
                (key, reason)
            })
            .collect()
    }

    /// Copies `data` (any buffer) into the engine's store under `key`.
    fn put(&self, py: Python<'_>, key: &Bound<'_, PyAny>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = key_of(key)?;
        let buf = byte_buffer(data, "put")?;
        let len = buf.len_bytes();
        // SAFETY: the buffer is held (and C-contiguous) for this call; it is only read.
        let bytes = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) };
        let e = &self.engine;
        py.detach(|| e.put(k, bytes)).map_err(py_err)
    }

    /// Starts an eager get of `keys` from `peer` into `block_ids` of `region`. With
    /// `incarnation`, a peer that is any other incarnation (it restarted) fails the
    /// transfer with `PeerRestartedError` before anything is staged. With
    /// `await_published` (seconds), a first key the peer has not published yet is
    /// waited for that long (the peer answers when it is published) before the get
    /// misses.
    #[pyo3(signature = (keys, peer, region, block_ids, timeout, path, incarnation=None, select=None, await_published=0.0))]
    fn get(
        &self,
        keys: &Bound<'_, PyList>,
        peer: String,
        region: &PyRegion,
        block_ids: Vec<BlockIdsArg>,
        timeout: f64,
        path: &str,
        incarnation: Option<u64>,
        select: Option<PySelection>,
        await_published: f64,
    ) -> PyResult<PyTransfer> {
        let keys = Self::keys(keys)?;
        if !(await_published.is_finite() && await_published >= 0.0) {
            return Err(
                ErrInfo::invalid(format!("await_published must be >= 0 seconds, got {await_published}")).into(),
            );
        }
        let dst = self
            .destination(region, block_ids, path, incarnation, select)?
            .with_await_published(Duration::from_secs_f64(await_published.min(timeout.max(0.0))));
        let t = required(timeout, "timeout")?;
        let _guard = self.handle().enter();
        let deadline = tokio::time::Instant::now() + t;
        let transfer = self.engine.start_get(&peer, &keys, dst, deadline);
        let fence = transfer.fence();
        Ok(PyTransfer::spawn(&self.waiting, peer, fence, transfer))
    }

    /// Delayed pull: asks `peer` to stage `keys`, then moves them into `block_ids` of
    /// `region`; returns the chunks landed.
    #[pyo3(signature = (keys, peer, region, block_ids, timeout, path, select=None))]
    fn pull(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        peer: String,
        region: &PyRegion,
        block_ids: Vec<BlockIdsArg>,
        timeout: f64,
        path: &str,
        select: Option<PySelection>,
    ) -> PyResult<usize> {
        self.pull_blocking(py, keys, peer, region, block_ids, timeout, path, select)
    }

    /// Delayed pull, step one: asks `peer` to stage `keys` under a lease (copied or
    /// pinned on its side) and returns a handle to resolve before the lease expires.
    #[pyo3(signature = (peer, keys, timeout, select=None))]
    fn stage(
        &self,
        py: Python<'_>,
        peer: String,
        keys: &Bound<'_, PyList>,
        timeout: f64,
        select: Option<PySelection>,
    ) -> PyResult<PyStaged> {
        self.stage_blocking(py, peer, keys, timeout, select)
    }

    /// Delayed pull, step two: moves a staged handle's chunks into `block_ids` of
    /// `region`; returns the chunks landed. Raises `PeerRestartedError` if the peer
    /// restarted since staging, `LeaseExpiredError` if the lease is (nearly) over.
    #[pyo3(signature = (staged, region, block_ids, timeout, path, select=None))]
    fn resolve(
        &self,
        py: Python<'_>,
        staged: &PyStaged,
        region: &PyRegion,
        block_ids: Vec<BlockIdsArg>,
        timeout: f64,
        path: &str,
        select: Option<PySelection>,
    ) -> PyResult<usize> {
        self.resolve_blocking(py, staged, region, block_ids, timeout, path, select)
    }

    /// Test hook (not API): arms the producer's fault switches. `send_delay_us` delays
    /// every chunk sent; `corrupt_next_sends` corrupts the next N chunks on the wire.
    #[pyo3(signature = (send_delay_us=None, corrupt_next_sends=None))]
    fn _inject_faults(&self, send_delay_us: Option<u64>, corrupt_next_sends: Option<u64>) {
        let f = self.engine.producer().faults();
        if let Some(d) = send_delay_us {
            f.send_delay_us.store(d, Ordering::Relaxed);
        }
        if let Some(n) = corrupt_next_sends {
            f.corrupt_next_sends.store(n, Ordering::Relaxed);
        }
    }

    /// Pushes `data` to `peer`'s store under `key`.
    fn push(
        &self,
        py: Python<'_>,
        peer: String,
        key: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<()> {
        let k = key_of(key)?;
        let buf = byte_buffer(data, "push")?;
        let t = required(timeout, "timeout")?;
        let len = buf.len_bytes();
        // SAFETY: the buffer is held (and C-contiguous) for this call; it is only read.
        let bytes = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) };
        let e = &self.engine;
        py.detach(|| {
            self.handle()
                .block_on(async { e.push(&peer, k, bytes, tokio::time::Instant::now() + t).await })
                .map_err(|err| ErrInfo::from(&err).peer(&peer).op("push"))
        })
        .map_err(PyErr::from)
    }

    /// The live peers of this engine's directory (`None` without one) as a JSON text:
    /// `{"stale": bool, "peers": [{peer_id, address, incarnation, role, known_for}]}`.
    fn peers_json(&self) -> Option<String> {
        let d = self.engine.config().directory.as_ref()?;
        Some(crate::directory::live_peers_json(&d.live_peers()))
    }

    /// Which live peers hold `keys`, best first: `[(peer_id, address, hits)]`.
    fn locate(&self, py: Python<'_>, keys: &Bound<'_, PyList>, timeout: f64) -> PyResult<Vec<(String, String, usize)>> {
        let keys = Self::keys(keys)?;
        let t = required(timeout, "timeout")?;
        let e = &self.engine;
        py.detach(|| {
            self.handle()
                .block_on(async { e.locate(&keys, tokio::time::Instant::now() + t).await })
                .map(|found| found.into_iter().map(|l| (l.peer_id, l.address, l.hits)).collect())
                .map_err(|err| ErrInfo::from(&err).op("locate"))
        })
        .map_err(PyErr::from)
    }

    /// How many leading `keys` `peer` holds.
    fn lookup(&self, py: Python<'_>, peer: String, keys: &Bound<'_, PyList>, timeout: f64) -> PyResult<usize> {
        let keys = Self::keys(keys)?;
        let t = required(timeout, "timeout")?;
        let e = &self.engine;
        py.detach(|| {
            self.handle()
                .block_on(async { e.lookup(&peer, &keys, tokio::time::Instant::now() + t).await })
                .map_err(|err| ErrInfo::from(&err).peer(&peer).op("lookup"))
        })
        .map_err(PyErr::from)
    }

    /// Closes the engine (drains everything, at most `timeout` seconds) and returns
    /// what was still out. Idempotent.
    fn close<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let t = required(timeout, "timeout")?;
        let e = &self.engine;
        let report = py.detach(|| self.handle().block_on(e.close(tokio::time::Instant::now() + t)));
        // The last engine on its runtime shuts it down (bounded); a shared runtime
        // other engines still hold goes on.
        let rt = self.runtime.lock().take();
        if let Some(rt) = rt {
            py.detach(|| drop(rt));
        }
        self.published.lock().clear();
        let d = PyDict::new(py);
        d.set_item("outstanding_pages", report.outstanding_pages)?;
        d.set_item("quarantined_pages", report.quarantined_pages)?;
        d.set_item("draining_transfers", report.draining_transfers)?;
        d.set_item("clean", report.is_clean())?;
        Ok(d)
    }

    /// True once `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.runtime.lock().is_none()
    }

    /// The engine's device kind: `"host"` (none), `"sim"` or `"cuda"`.
    #[getter]
    fn device(&self) -> String {
        self.device
            .as_ref()
            .map_or_else(|| "host".to_string(), |d| d.device.kind().to_string())
    }

    /// Allocates `nbytes` of device memory (zeroed) on the engine's device.
    #[pyo3(signature = (nbytes, shape=None))]
    fn alloc_device(&self, nbytes: usize, shape: Option<Vec<usize>>) -> PyResult<PyDeviceMemory> {
        let dev = self.dev()?;
        if nbytes == 0 {
            return Err(ErrInfo::invalid("nbytes must be positive").into());
        }
        let buf = dev.device.alloc(nbytes).map_err(|e| PyErr::from(dev_err(&e)))?;
        Ok(self.device_memory(buf, shape))
    }

    /// Wraps the device memory of a `__dlpack__` object (a torch CUDA tensor) on a
    /// CUDA engine as `DeviceMemory`, without copying: the tensor must be C-contiguous
    /// and on this engine's GPU. The memory holds `obj` (and its DLPack capsule) until
    /// it and every transfer touching it are gone.
    fn wrap_dlpack(&self, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<PyDeviceMemory> {
        self.wrap_dlpack_memory(name, obj)
    }

    /// Wraps raw device memory (`ptr`, `nbytes` on `device`, `"cuda:N"`) on a CUDA
    /// engine as `DeviceMemory`; `owner` (any object) is kept alive with it. The caller
    /// guarantees the memory stays allocated while `owner` lives; the driver confirms it
    /// is device memory of this engine's GPU.
    #[pyo3(signature = (name, ptr, nbytes, device, owner=None))]
    fn wrap_device_ptr(
        &self,
        py: Python<'_>,
        name: &str,
        ptr: u64,
        nbytes: usize,
        device: &str,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<PyDeviceMemory> {
        self.wrap_device_memory(py, name, ptr, nbytes, device, owner)
    }

    /// On a sim engine: host memory (any writable buffer, such as a torch CPU tensor)
    /// adopted as the sim device's memory without copying, so the device data path
    /// (staging, device copies, events, faults) runs over it. `obj` is kept alive while
    /// the memory is in use. `InvalidArgumentError` on other engines.
    #[pyo3(signature = (name, obj, shape=None))]
    fn adopt_host_memory(
        &self,
        name: &str,
        obj: &Bound<'_, PyAny>,
        shape: Option<Vec<usize>>,
    ) -> PyResult<PyDeviceMemory> {
        self.adopt_host(name, obj, shape)
    }

    /// Registers device memory `parts` — `[(DeviceMemory, [(offset, stride, length),
    /// ...]), ...]` — as one KV cache of `blocks` blocks, block *i* being every part's
    /// spans at `i`, in order. Published blocks are gathered into staging pages
    /// (device-to-host) when a peer asks; received ones are scattered from staging
    /// pages (host-to-device); every device copy is bounded by `device_timeout`.
    fn register_device(
        &self,
        name: String,
        parts: Vec<(Bound<'_, PyDeviceMemory>, Vec<(usize, usize, usize)>)>,
        blocks: u32,
    ) -> PyResult<PyRegion> {
        self.register_device_parts(name, parts, blocks)
    }

    /// Tells `peer` this engine will not fetch `keys` (a request was aborted): the peer
    /// frees the publications made `once` among them now rather than at their TTL
    /// (a `Release` request: nothing is staged, so it works when the peer's staging is
    /// full). A miss (the peer has not published yet) is retried with backoff (2 ms
    /// doubling to 50 ms) for up to `retry_miss` seconds; everything within `timeout`.
    /// With `incarnation`, a peer that restarted since is refused
    /// (`PeerRestartedError`). Runs in the background; the returned transfer's result
    /// is the number of keys released (`NotFoundError` when none was).
    #[pyo3(signature = (keys, peer, timeout, retry_miss=0.0, incarnation=None))]
    fn release_remote(
        &self,
        keys: &Bound<'_, PyList>,
        peer: String,
        timeout: f64,
        retry_miss: f64,
        incarnation: Option<u64>,
    ) -> PyResult<PyTransfer> {
        self.spawn_release_remote(keys, peer, timeout, retry_miss, incarnation)
    }

    /// Test hook (not API): arms a sim device fault (`never_complete`, `fail_copy`,
    /// `stall`, `slow:N`) for the `next`, `every` or N-th device operation.
    #[pyo3(signature = (fault, trigger="next"))]
    fn _inject_device_fault(&self, fault: &str, trigger: &str) -> PyResult<()> {
        Ok(self.dev()?.inject(fault, trigger)?)
    }

    /// Test hook (not API): disarms sim faults and lets stuck operations complete.
    fn _release_device(&self) -> PyResult<()> {
        let sim = self.dev()?.sim()?;
        sim.clear_faults();
        sim.release_stuck();
        Ok(())
    }

    /// The device's counters as JSON (`{}` without a device): kind, operations,
    /// stuck and memory_used on a sim engine; kind, device and name on a CUDA one.
    fn device_stats_json(&self) -> String {
        self.device
            .as_ref()
            .map_or_else(|| "{}".to_string(), EngineDevice::stats_json)
    }
}
