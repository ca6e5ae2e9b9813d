//! `Region`: a registered KV cache as Python sees it — one engine registration of a
//! [`KvCacheRef`](kvferry::engine::KvCacheRef): host memory or device memory (a
//! `DeviceKvCache` on the engine's device). It holds
//! the registration (and through it the Python objects or device buffers whose memory
//! it uses): Python's garbage collector cannot free that memory while any transfer or
//! publication still touches it. Both kinds are registered with the engine, whose
//! ledger counts their holders (publications, transfers) explicitly: `users` reads
//! that count, and `deregister` waits on it (woken by the last holder, not polled).

use std::sync::atomic::{AtomicBool, Ordering};

use kvferry::engine::BlockMap;
use kvferry::engine::Engine;
use kvferry::engine::Registered;
use pyo3::prelude::*;

/// A registered KV cache (from `Engine.register_kv_cache` and friends).
#[pyclass(name = "Region", module = "kvferry._kvferry", frozen)]
pub struct PyRegion {
    /// The registration: its id and the cache, in host or device memory (device
    /// memory is gathered into staging pages when published, scattered from them when
    /// received: always the staged path).
    pub(crate) reg: Registered,
    pub(crate) readonly: bool,
    /// The engine it was registered with (its registration id space).
    pub(crate) engine_id: usize,
    /// That engine (its ledger counts the region's holders).
    engine: Engine,
    /// Set by a successful `deregister` of a device region (a host region's later
    /// use is refused by the engine itself).
    pub(crate) deregistered: AtomicBool,
}

impl PyRegion {
    pub(crate) fn new(reg: Registered, readonly: bool, engine_id: usize, engine: Engine) -> PyRegion {
        PyRegion {
            reg,
            readonly,
            engine_id,
            engine,
            deregistered: AtomicBool::new(false),
        }
    }

    /// The registration id.
    pub(crate) fn id(&self) -> u64 {
        self.reg.id
    }

    pub(crate) fn is_deregistered(&self) -> bool {
        self.deregistered.load(Ordering::Acquire)
    }

    fn map(&self) -> &BlockMap {
        self.reg.cache.map()
    }

    pub(crate) fn cache_name(&self) -> &str {
        self.reg.cache.name()
    }

    /// Transfers and publications holding it, as the engine's ledger counts them
    /// (zero once deregistered).
    pub(crate) fn holders(&self) -> usize {
        self.engine.holders(self.id()).unwrap_or(0)
    }
}

#[pymethods]
impl PyRegion {
    /// The region's name.
    #[getter]
    fn name(&self) -> String {
        self.cache_name().to_string()
    }

    /// Blocks in the region.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.map().blocks()
    }

    /// Bytes of one block (across every buffer of the region).
    #[getter]
    fn block_bytes(&self) -> usize {
        self.map().block_bytes()
    }

    /// True when the memory is read-only (it can be published, not written into).
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// Where the memory lives: `"host"`, or the device kind (`"sim"`).
    #[getter]
    fn device(&self) -> String {
        self.reg.cache.memory_kind()
    }

    /// Transfers and publications holding the region right now.
    #[getter]
    fn users(&self) -> usize {
        self.holders()
    }

    fn __repr__(&self) -> String {
        format!(
            "Region({:?}, {} blocks of {} bytes{}{})",
            self.cache_name(),
            self.map().blocks(),
            self.map().block_bytes(),
            match self.reg.cache.is_device() {
                false => String::new(),
                true => format!(", on {}", self.reg.cache.memory_kind()),
            },
            if self.readonly { ", read-only" } else { "" }
        )
    }
}
