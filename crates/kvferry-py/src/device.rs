//! Device memory for Python: the engine's device (`Engine(device="sim")`, or
//! `"cuda:N"` in a build with the `cuda` feature), the `DeviceMemory` objects it
//! allocates or wraps (CUDA memory of a torch tensor or any `__dlpack__` object, raw
//! device pointers), and the sim backend's fault switches (test hooks). Device memory is
//! not addressable from Python: `write` and `read` copy synchronously, outside stream
//! order, to fill and check it in tests and tools.
//!
//! Wrapped memory belongs to its Python object: the device buffer holds the object (and
//! its DLPack capsule) and drops it only when the buffer and every device operation
//! targeting it are gone, so Python's garbage collector never frees memory that a copy
//! may still read or write. kvferry never frees wrapped memory itself.

use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::Arena;
#[cfg(feature = "cuda")]
use kvferry::engine::CudaDevice;
use kvferry::engine::{Device, DeviceBuffer, DeviceError, Fault, FaultRule, SimConfig, SimDevice, Trigger};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::ErrInfo;

/// The engine's device: a simulated accelerator (latency, fault injection) or a CUDA GPU.
pub struct EngineDevice {
    /// The device, for allocations and caches.
    pub device: Arc<dyn Device>,
    /// The sim backend, for its fault switches (`device="sim"`).
    pub sim: Option<Arc<SimDevice>>,
    /// The CUDA backend (`device="cuda:N"`).
    #[cfg(feature = "cuda")]
    pub cuda: Option<Arc<CudaDevice>>,
    /// Bound on each device copy, measured from its submission.
    pub op_timeout: Duration,
}

/// The GPU ordinal of a `"cuda"` / `"cuda:N"` device name.
pub fn cuda_ordinal(spec: &str) -> Result<usize, ErrInfo> {
    let bad = || {
        ErrInfo::invalid(format!(
            "device {spec:?}: expected 'cuda' or 'cuda:N' with N a GPU ordinal"
        ))
    };
    match spec.strip_prefix("cuda") {
        Some("") => Ok(0),
        Some(rest) => {
            let n = rest.strip_prefix(':').ok_or_else(bad)?;
            if n.is_empty() || n.len() > 4 || !n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            n.parse().map_err(|_| bad())
        }
        None => Err(bad()),
    }
}

impl EngineDevice {
    /// Opens the device named by `spec` on `rt`: `"host"` is none, `"sim"` a fresh sim
    /// device (`latency_us` per copy), `"cuda:N"` GPU N through its primary context
    /// (a build with the `cuda` feature; a `DeviceError` naming what is missing when
    /// there is no driver or GPU).
    pub fn open(
        spec: &str,
        latency_us: u64,
        op_timeout: Duration,
        rt: tokio::runtime::Handle,
    ) -> Result<Option<EngineDevice>, ErrInfo> {
        match spec {
            "host" => Ok(None),
            "sim" => {
                let cfg = SimConfig::new(0).with_latency(Duration::from_micros(latency_us));
                let sim = SimDevice::with_runtime(cfg, rt).map_err(|e| dev_err(&e))?;
                Ok(Some(EngineDevice {
                    device: sim.clone(),
                    sim: Some(sim),
                    #[cfg(feature = "cuda")]
                    cuda: None,
                    op_timeout,
                }))
            }
            other if other.starts_with("cuda") => {
                let ordinal = cuda_ordinal(other)?;
                Self::open_cuda(other, ordinal, op_timeout)
            }
            other => Err(ErrInfo::invalid(format!(
                "unknown device {other:?} (expected 'host', 'sim' or 'cuda:N')"
            ))),
        }
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(spec: &str, ordinal: usize, op_timeout: Duration) -> Result<Option<EngineDevice>, ErrInfo> {
        let cuda = CudaDevice::open(ordinal, 0).map_err(|e| match e {
            DeviceError::InvalidArgument(m) => ErrInfo::invalid(format!("device {spec:?}: {m}")),
            e => ErrInfo::new(e.code(), format!("device {spec:?} (CUDA): {e}")),
        })?;
        Ok(Some(EngineDevice {
            device: cuda.clone(),
            sim: None,
            cuda: Some(cuda),
            op_timeout,
        }))
    }

    #[cfg(not(feature = "cuda"))]
    fn open_cuda(spec: &str, _ordinal: usize, _op_timeout: Duration) -> Result<Option<EngineDevice>, ErrInfo> {
        Err(ErrInfo::invalid(format!(
            "device {spec:?}: this build of the Python package has no CUDA support; build it \
             with `maturin develop --features cuda` (device='sim' simulates a device)"
        )))
    }

    /// The engine's device name: `"sim"` or `"cuda:N"`.
    pub fn spec(&self) -> String {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return format!("cuda:{}", c.ordinal());
        }
        self.device.kind().to_string()
    }

    /// The staging arena this device wants: CUDA pinned host memory (`cuMemHostAlloc`)
    /// on a CUDA device, so device copies run as DMA; `None` (the engine's own arena)
    /// otherwise, or when `arena_bytes` holds no whole page.
    pub fn staging(&self, arena_bytes: usize, page_size: usize) -> Result<Option<Arena>, ErrInfo> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            let pages = arena_bytes.checked_div(page_size).unwrap_or(0);
            if pages == 0 {
                return Ok(None);
            }
            return kvferry::engine::cuda_pinned_arena(c, page_size, pages)
                .map(Some)
                .map_err(|e| dev_err(&e));
        }
        let _ = (arena_bytes, page_size);
        Ok(None)
    }

    /// Wraps `nbytes` of device memory at `ptr`, owned by `owner` (kept alive with the
    /// buffer), after the driver confirmed it is memory of this device.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated while `owner` lives.
    pub unsafe fn wrap(&self, ptr: u64, nbytes: usize, owner: Py<PyAny>) -> Result<DeviceBuffer, ErrInfo> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            // SAFETY: the caller's promise: the memory lives as long as `owner`, which
            // the buffer holds until it and every operation targeting it are gone.
            return unsafe { c.wrap_external(ptr, nbytes, Box::new(owner)) }.map_err(|e| dev_err(&e));
        }
        let _ = (ptr, nbytes, owner);
        Err(ErrInfo::invalid(format!(
            "external device memory needs a CUDA engine (Engine(device='cuda:N')); this engine's device is {:?}",
            self.spec()
        )))
    }

    /// The CUDA ordinal, on a CUDA device.
    pub fn cuda_ordinal(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &self.cuda {
            return Some(c.ordinal());
        }
        None
    }

    /// The sim backend, for test hooks; `InvalidArgumentError` on another device.
    pub fn sim(&self) -> Result<&Arc<SimDevice>, ErrInfo> {
        self.sim
            .as_ref()
            .ok_or_else(|| ErrInfo::invalid(format!("device {:?} is not a sim device", self.spec())))
    }

    /// The device's counters as a JSON object.
    pub fn stats_json(&self) -> String {
        match &self.sim {
            Some(sim) => format!(
                "{{\"kind\": \"{}\", \"operations\": {}, \"stuck\": {}, \"memory_used\": {}}}",
                self.device.kind(),
                sim.operations(),
                sim.stuck(),
                sim.memory_used()
            ),
            None => serde_json::json!({
                "kind": self.device.kind().to_string(),
                "device": self.spec(),
                "name": self.device.name(),
            })
            .to_string(),
        }
    }

    /// Arms a sim fault: `fault` is `never_complete`, `fail_copy`, `stall` or
    /// `slow:N`; `trigger` is `next`, `every` or an operation number.
    pub fn inject(&self, fault: &str, trigger: &str) -> Result<(), ErrInfo> {
        let sim = self.sim()?;
        let fault = match fault {
            "never_complete" => Fault::NeverComplete,
            "fail_copy" => Fault::FailCopy,
            "stall" => Fault::Stall,
            s => match s.strip_prefix("slow:").and_then(|n| n.parse::<u32>().ok()) {
                Some(n) => Fault::Slow(n),
                None => return Err(ErrInfo::invalid(format!("unknown sim fault {s:?}"))),
            },
        };
        let trigger = match trigger {
            "next" => Trigger::Next,
            "every" => Trigger::Every,
            n => Trigger::Nth(
                n.parse()
                    .map_err(|_| ErrInfo::invalid(format!("unknown fault trigger {n:?}")))?,
            ),
        };
        sim.inject(FaultRule { fault, trigger }).map_err(|e| dev_err(&e))
    }
}

/// A device error as the package's `DeviceError` (or `InvalidArgumentError`).
pub fn dev_err(e: &DeviceError) -> ErrInfo {
    match e {
        DeviceError::InvalidArgument(m) => ErrInfo::invalid(m.clone()),
        _ => ErrInfo::new(e.code(), e.to_string()),
    }
}

/// Device memory allocated by `Engine.alloc_device`.
#[pyclass(name = "DeviceMemory", module = "kvferry._kvferry", frozen)]
pub struct PyDeviceMemory {
    pub(crate) buf: DeviceBuffer,
    pub(crate) engine_id: usize,
    pub(crate) kind: String,
    pub(crate) shape: Option<Vec<usize>>,
}

impl PyDeviceMemory {
    fn range(&self, offset: usize, n: usize) -> PyResult<()> {
        if offset.checked_add(n).is_none_or(|end| end > self.buf.len()) {
            return Err(ErrInfo::invalid(format!(
                "range {offset}+{n} is outside device memory of {} bytes",
                self.buf.len()
            ))
            .into());
        }
        Ok(())
    }
}

#[pymethods]
impl PyDeviceMemory {
    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// The device kind (`"sim"` or `"cuda"`).
    #[getter]
    fn device(&self) -> String {
        self.kind.clone()
    }

    /// The shape given at allocation or exported by the wrapped tensor (used by
    /// `register_kv_caches`), or None.
    #[getter]
    fn shape(&self) -> Option<Vec<usize>> {
        self.shape.clone()
    }

    /// Copies `data` (any C-contiguous buffer) to `offset`, synchronously.
    #[pyo3(signature = (data, offset=0))]
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: usize) -> PyResult<()> {
        let buf = crate::engine::byte_buffer(data, "write")?;
        let len = buf.len_bytes();
        self.range(offset, len)?;
        // SAFETY: the buffer is held (and C-contiguous) for this call; it is only read.
        let bytes = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, len) };
        py.detach(|| self.buf.write(offset, bytes))
            .map_err(|e| dev_err(&e).into())
    }

    /// `n` bytes at `offset` (default: to the end), synchronously.
    #[pyo3(signature = (offset=0, n=None))]
    fn read<'py>(&self, py: Python<'py>, offset: usize, n: Option<usize>) -> PyResult<Bound<'py, PyBytes>> {
        let n = n.unwrap_or_else(|| self.buf.len().saturating_sub(offset));
        self.range(offset, n)?;
        let mut out = vec![0u8; n];
        py.detach(|| self.buf.read(offset, &mut out))
            .map_err(|e| PyErr::from(dev_err(&e)))?;
        Ok(PyBytes::new(py, &out))
    }

    fn __repr__(&self) -> String {
        format!("DeviceMemory({} bytes on {})", self.buf.len(), self.kind)
    }
}
