//! Device memory for Python: the engine's device (`Engine(device="sim")`), the
//! `DeviceMemory` objects it allocates, and the sim backend's fault switches (test
//! hooks). Device memory is not addressable from Python: `write` and `read` copy
//! synchronously, outside stream order, to fill and check it in tests and tools.

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{Device, DeviceBuffer, DeviceError, Fault, FaultRule, SimConfig, SimDevice, Trigger};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::ErrInfo;

/// The engine's device: a simulated accelerator (latency, fault injection).
pub struct EngineDevice {
    /// The device, for allocations and caches.
    pub device: Arc<dyn Device>,
    /// The sim backend, for its fault switches.
    pub sim: Arc<SimDevice>,
    /// Bound on each device copy, measured from its submission.
    pub op_timeout: Duration,
}

impl EngineDevice {
    /// Opens the device named by `spec` on `rt`: `"host"` is none, `"sim"` a fresh sim
    /// device (`latency_us` per copy).
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
                    sim,
                    op_timeout,
                }))
            }
            other if other.starts_with("cuda") => Err(ErrInfo::invalid(format!(
                "device {other:?}: this build of the Python package has no CUDA device support \
                 (device='sim' simulates one)"
            ))),
            other => Err(ErrInfo::invalid(format!(
                "unknown device {other:?} (expected 'host' or 'sim')"
            ))),
        }
    }

    /// Arms a sim fault: `fault` is `never_complete`, `fail_copy`, `stall` or
    /// `slow:N`; `trigger` is `next`, `every` or an operation number.
    pub fn inject(&self, fault: &str, trigger: &str) -> Result<(), ErrInfo> {
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
        self.sim.inject(FaultRule { fault, trigger }).map_err(|e| dev_err(&e))
    }
}

/// A device error as the package's `DeviceError` (or `InvalidArgumentError`).
pub fn dev_err(e: &DeviceError) -> ErrInfo {
    match e {
        DeviceError::InvalidArgument(m) => ErrInfo::invalid(m.clone()),
        _ => ErrInfo::new("DeviceError", e.to_string()),
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

    /// The device kind (`"sim"`).
    #[getter]
    fn device(&self) -> String {
        self.kind.clone()
    }

    /// The shape given at allocation (used by `register_kv_caches`), or None.
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
