//! Starting an engine from its options: the library checks every value once
//! (`EngineOptions::to_config`); the binding opens what it owns — the runtime, the
//! device, the directory's connection — from the same options.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::Engine;
use kvferry::ErrorCode;
use parking_lot::Mutex;
use pyo3::prelude::*;

use super::{PyEngine, NEXT_ENGINE};
use crate::device::EngineDevice;
use crate::errors::{py_err, ErrInfo};
use crate::options::PyEngineOptions;
use crate::runtime::RuntimeRef;
use crate::transfer::Waiting;

impl PyEngine {
    pub(super) fn start(py: Python<'_>, options: PyRef<'_, PyEngineOptions>) -> PyResult<PyEngine> {
        let o = options.inner.clone();
        drop(options);
        // Every value is checked once, by the library's options (named as the caller
        // wrote them); what the binding owns — runtime, device, directory connection —
        // it reads from the same options.
        let mut cfg = o
            .to_config()
            .map_err(|e| PyErr::from(ErrInfo::new(e.code, e.to_string())))?;
        let runtime = RuntimeRef::get(o.runtime_threads, o.shared_runtime)
            .map_err(|e| ErrInfo::new(ErrorCode::Io, format!("starting the engine's runtime: {e}")))?;
        let handle = runtime.handle().clone();
        let device = EngineDevice::open(&o.device, o.device_latency_us, o.device_timeout, handle.clone())?;
        if let (Some(d), true) = (&device, o.pinned) {
            cfg.staging = d.staging(o.arena_bytes, o.page_size)?;
        }
        if let Some(url) = &o.etcd {
            let wait = cfg.net.connect_timeout;
            let (namespace, ttl) = (o.namespace.as_str(), o.directory_ttl);
            cfg.directory =
                Some(py.detach(|| handle.block_on(crate::directory::connect_etcd(url, namespace, ttl, wait)))?);
        }
        let wait_spin_us = o.wait_spin_us;
        let engine = py.detach(|| handle.block_on(Engine::start(cfg))).map_err(py_err)?;
        let waiting = Waiting {
            runtime: handle.clone(),
            spin: Arc::new(crate::spin::AdaptiveSpin::new(Duration::from_micros(wait_spin_us))),
            linger: runtime.linger().clone(),
        };
        Ok(PyEngine {
            runtime: Mutex::new(Some(runtime)),
            waiting,
            engine,
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            published: Mutex::new(HashMap::new()),
            device,
        })
    }
}
