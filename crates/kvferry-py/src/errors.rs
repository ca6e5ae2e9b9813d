//! Rust errors as the package's Python exceptions (`kvferry.errors`): one hierarchy
//! under `kvferry.Error`, each exception carrying a stable `code` (the library's
//! [`ErrorCode`] as a string) and structured attributes (`peer`, `key`, `op`,
//! `waited`, `dirty`) beside its message.
//!
//! The classes are created here, at module initialisation, from one list
//! ([`ExcClass::ALL`]); which class an error raises is decided by an exhaustive match on
//! its code ([`ExcClass::of`]), so a new code that no class covers does not compile.
//! `kvferry/errors.py` re-exports them by name (a test checks the two agree) and
//! `_kvferry.pyi` types them (`stubtest` checks it against the module).

use std::time::Duration;

use kvferry::engine::EngineError;
use kvferry::engine::{GetFailure, PeerError};
use kvferry::ErrorCode;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The package's exception classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExcClass {
    /// `Error`: the base of every kvferry error.
    Error,
    /// `InvalidArgumentError` (also a `ValueError`).
    InvalidArgument,
    /// `TimeoutError` (also the builtin `TimeoutError`).
    Timeout,
    /// `CancelledError`.
    Cancelled,
    /// `PeerLostError` (also a `ConnectionError`).
    PeerLost,
    /// `PeerRestartedError`.
    PeerRestarted,
    /// `AuthError` (also a `PermissionError`).
    Auth,
    /// `BusyError`.
    Busy,
    /// `NotFoundError` (also a `LookupError`).
    NotFound,
    /// `LeaseExpiredError`.
    LeaseExpired,
    /// `ChecksumError`.
    Checksum,
    /// `InUseError`.
    InUse,
    /// `ClosedError`.
    Closed,
    /// `DeviceError`.
    Device,
    /// `SelectionError` (an `InvalidArgumentError`).
    Selection,
}

impl ExcClass {
    /// Every class, base first (the order they are created in).
    pub const ALL: [ExcClass; 15] = [
        ExcClass::Error,
        ExcClass::InvalidArgument,
        ExcClass::Timeout,
        ExcClass::Cancelled,
        ExcClass::PeerLost,
        ExcClass::PeerRestarted,
        ExcClass::Auth,
        ExcClass::Busy,
        ExcClass::NotFound,
        ExcClass::LeaseExpired,
        ExcClass::Checksum,
        ExcClass::InUse,
        ExcClass::Closed,
        ExcClass::Device,
        ExcClass::Selection,
    ];

    /// The class's Python name.
    pub const fn name(self) -> &'static str {
        match self {
            ExcClass::Error => "Error",
            ExcClass::InvalidArgument => "InvalidArgumentError",
            ExcClass::Timeout => "TimeoutError",
            ExcClass::Cancelled => "CancelledError",
            ExcClass::PeerLost => "PeerLostError",
            ExcClass::PeerRestarted => "PeerRestartedError",
            ExcClass::Auth => "AuthError",
            ExcClass::Busy => "BusyError",
            ExcClass::NotFound => "NotFoundError",
            ExcClass::LeaseExpired => "LeaseExpiredError",
            ExcClass::Checksum => "ChecksumError",
            ExcClass::InUse => "InUseError",
            ExcClass::Closed => "ClosedError",
            ExcClass::Device => "DeviceError",
            ExcClass::Selection => "SelectionError",
        }
    }

    /// The kvferry class it derives from (created before it in [`ExcClass::ALL`]).
    const fn parent(self) -> Option<ExcClass> {
        match self {
            ExcClass::Error => None,
            ExcClass::Selection => Some(ExcClass::InvalidArgument),
            _ => Some(ExcClass::Error),
        }
    }

    /// The builtin exception it also derives from, beside `Error` (`Exception` for the base).
    const fn builtin(self) -> Option<&'static str> {
        match self {
            ExcClass::Error => Some("Exception"),
            ExcClass::InvalidArgument => Some("ValueError"),
            ExcClass::Timeout => Some("TimeoutError"),
            ExcClass::PeerLost => Some("ConnectionError"),
            ExcClass::Auth => Some("PermissionError"),
            ExcClass::NotFound => Some("LookupError"),
            _ => None,
        }
    }

    /// The code an instance created from Python (without one) reports.
    const fn default_code(self) -> ErrorCode {
        match self {
            ExcClass::Error => ErrorCode::Internal,
            ExcClass::InvalidArgument => ErrorCode::InvalidArgument,
            ExcClass::Timeout => ErrorCode::Timeout,
            ExcClass::Cancelled => ErrorCode::Cancelled,
            ExcClass::PeerLost => ErrorCode::PeerLost,
            ExcClass::PeerRestarted => ErrorCode::PeerRestarted,
            ExcClass::Auth => ErrorCode::AuthFailed,
            ExcClass::Busy => ErrorCode::Busy,
            ExcClass::NotFound => ErrorCode::NotFound,
            ExcClass::LeaseExpired => ErrorCode::LeaseExpired,
            ExcClass::Checksum => ErrorCode::ChecksumMismatch,
            ExcClass::InUse => ErrorCode::InUse,
            ExcClass::Closed => ErrorCode::Closed,
            ExcClass::Device => ErrorCode::Device,
            ExcClass::Selection => ErrorCode::Selection,
        }
    }

    /// The class's docstring.
    const fn doc(self) -> &'static str {
        match self {
            ExcClass::Error => "Base class of every kvferry error. ``code`` names what went wrong (a stable string, e.g. ``\"timeout\"``); ``peer``, ``key``, ``op``, ``waited`` and ``dirty`` say where, when known.",
            ExcClass::InvalidArgument => "An argument is unusable: bad block ids, a non-contiguous array, a wrong dtype, a layout that does not fit...",
            ExcClass::Timeout => "The operation did not finish within its timeout; the transfer was cancelled and drains in the background.",
            ExcClass::Cancelled => "The transfer was cancelled (``Transfer.cancel()`` or Ctrl-C).",
            ExcClass::PeerLost => "The peer closed, reset, could not be reached, or is shutting down.",
            ExcClass::PeerRestarted => "The peer restarted (its incarnation changed) since the lease or handle was made.",
            ExcClass::Auth => "Authentication failed: wrong or missing shared secret.",
            ExcClass::Busy => "The peer (or this engine) had no room right now: staging arena, quota or store full, or too many concurrent requests. Retrying later may succeed.",
            ExcClass::NotFound => "The peer holds none of the keys asked for (a miss).",
            ExcClass::LeaseExpired => "A staged lease expired (or was unknown) before it was pulled.",
            ExcClass::Checksum => "Received bytes did not match the checksum computed by the producer; nothing was landed as valid (direct transfers leave the blocks ``dirty``).",
            ExcClass::InUse => "A region is still used by transfers or publications.",
            ExcClass::Closed => "The engine is closed.",
            ExcClass::Selection => "A ``kvferry.Selection`` does not fit the publication or the destination. The message names the mismatch: a block position past the publication's blocks (``block position N of M``), a range outside a piece (``range (o, l) exceeds piece i of P bytes``), per-piece totals that differ (``the source selects S bytes, the destination lands D``), piece counts that differ, block counts that differ, overlapping destination ranges, or keys that cannot be selected from (store chunks, different caches). Raised by the consumer before anything is sent where it can tell, else by the producer's refusal.",
            ExcClass::Device => "A device copy (gathering published device blocks, or landing received ones) failed or did not complete within the engine's ``device_timeout``; staging pages it may still target are quarantined, never reused, until the device confirms.",
        }
    }

    /// The class an error with `code` raises.
    pub const fn of(code: ErrorCode) -> ExcClass {
        use ErrorCode as C;
        match code {
            C::InvalidArgument | C::InvalidConfig | C::LayoutMismatch | C::TooLarge | C::NotRegistered => {
                ExcClass::InvalidArgument
            }
            C::Timeout => ExcClass::Timeout,
            C::Cancelled => ExcClass::Cancelled,
            C::PeerLost | C::ConnectFailed | C::PeerShuttingDown => ExcClass::PeerLost,
            C::PeerRestarted | C::StaleIncarnation => ExcClass::PeerRestarted,
            C::LeaseExpired | C::UnknownLease => ExcClass::LeaseExpired,
            C::AuthFailed | C::AuthRequired => ExcClass::Auth,
            C::Busy | C::StagingExhausted | C::QuotaExceeded | C::StoreFull => ExcClass::Busy,
            C::NotFound => ExcClass::NotFound,
            C::ChecksumMismatch => ExcClass::Checksum,
            C::InUse => ExcClass::InUse,
            C::Closed => ExcClass::Closed,
            C::Device | C::NoDevice | C::DeviceOutOfMemory => ExcClass::Device,
            C::Selection => ExcClass::Selection,
            C::WrongPeer
            | C::Protocol
            | C::Io
            | C::BindFailed
            | C::Directory
            | C::DuplicatePeerId
            | C::Memory
            | C::Internal
            | C::RankFailed
            | C::WorkerDied => ExcClass::Error,
        }
    }
}

/// The classes, created once per interpreter by [`add_classes`].
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// Creates every exception class and adds it to `m` (and `ERROR_CODES`, every code's
/// string, and `ERROR_CLASSES`, every class's name).
pub fn add_classes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let classes = CLASSES.get_or_try_init(py, || -> PyResult<Vec<Py<PyType>>> {
        let builtins = py.import("builtins")?;
        let ty = builtins.getattr("type")?;
        let mut made: Vec<Py<PyType>> = Vec::with_capacity(ExcClass::ALL.len());
        for c in ExcClass::ALL {
            let mut bases: Vec<Bound<'_, PyAny>> = Vec::new();
            if let Some(parent) = c.parent() {
                let i = ExcClass::ALL.iter().position(|x| *x == parent).unwrap_or(0);
                bases.push(made[i].bind(py).clone().into_any());
            }
            if let Some(b) = c.builtin() {
                bases.push(builtins.getattr(b)?);
            }
            let ns = PyDict::new(py);
            ns.set_item("__doc__", c.doc())?;
            ns.set_item("__module__", "kvferry.errors")?;
            ns.set_item("code", c.default_code().as_str())?;
            if c == ExcClass::Error {
                for attr in ["peer", "key", "op", "waited"] {
                    ns.set_item(attr, py.None())?;
                }
                ns.set_item("dirty", false)?;
            }
            let cls = ty.call1((c.name(), PyTuple::new(py, bases)?, ns))?;
            made.push(cls.cast_into::<PyType>()?.unbind());
        }
        Ok(made)
    })?;
    for (c, cls) in ExcClass::ALL.iter().zip(classes) {
        m.add(c.name(), cls.bind(py))?;
    }
    m.add("ERROR_CODES", ErrorCode::ALL.map(|c| c.as_str()).to_vec())?;
    m.add("ERROR_CLASSES", ExcClass::ALL.map(|c| c.name()).to_vec())?;
    Ok(())
}

fn class_object(py: Python<'_>, c: ExcClass) -> PyResult<Bound<'_, PyType>> {
    let classes = CLASSES
        .get(py)
        .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("kvferry exception classes not created"))?;
    let i = ExcClass::ALL.iter().position(|x| *x == c).unwrap_or(0);
    Ok(classes[i].bind(py).clone())
}

/// A failure ready to become a Python exception (cloneable, GIL-free).
#[derive(Clone, Debug)]
pub struct ErrInfo {
    /// What went wrong; decides the class.
    pub code: ErrorCode,
    /// Its message.
    pub message: String,
    /// The peer involved, if any.
    pub peer: Option<String>,
    /// The key involved, if any.
    pub key: Option<String>,
    /// The operation that failed, if known.
    pub op: Option<String>,
    /// How long the caller waited, if it timed out.
    pub waited: Option<Duration>,
    /// Whether destination blocks may have been written.
    pub dirty: bool,
}

impl ErrInfo {
    /// An error with `code` and `message` and no attributes.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ErrInfo {
        ErrInfo {
            code,
            message: message.into(),
            peer: None,
            key: None,
            op: None,
            waited: None,
            dirty: false,
        }
    }

    /// An invalid argument.
    pub fn invalid(message: impl Into<String>) -> ErrInfo {
        ErrInfo::new(ErrorCode::InvalidArgument, message)
    }

    /// The class it raises.
    pub fn class(&self) -> ExcClass {
        ExcClass::of(self.code)
    }

    /// Sets the peer.
    pub fn peer(mut self, peer: &str) -> ErrInfo {
        if self.peer.is_none() {
            self.peer = Some(peer.to_string());
        }
        self
    }

    /// Sets the operation.
    pub fn op(mut self, op: &str) -> ErrInfo {
        if self.op.is_none() {
            self.op = Some(op.to_string());
        }
        self
    }

    /// The Python exception.
    pub fn to_py(&self, py: Python<'_>) -> PyErr {
        let made = (|| -> PyResult<PyErr> {
            let inst = class_object(py, self.class())?.call1((self.message.clone(),))?;
            inst.setattr("code", self.code.as_str())?;
            inst.setattr("peer", self.peer.clone())?;
            inst.setattr("key", self.key.clone())?;
            inst.setattr("op", self.op.clone())?;
            inst.setattr("waited", self.waited.map(|d| d.as_secs_f64()))?;
            inst.setattr("dirty", self.dirty)?;
            Ok(PyErr::from_value(inst))
        })();
        made.unwrap_or_else(|e| e)
    }
}

impl From<ErrInfo> for PyErr {
    fn from(e: ErrInfo) -> PyErr {
        Python::attach(|py| e.to_py(py))
    }
}

impl From<&PeerError> for ErrInfo {
    fn from(e: &PeerError) -> ErrInfo {
        let mut i = ErrInfo::new(e.code(), e.to_string());
        match e {
            PeerError::Timeout { op, waited } => {
                i = i.op(op);
                i.waited = Some(*waited);
            }
            PeerError::PeerLost { peer, .. } => i = i.peer(peer),
            PeerError::ChecksumMismatch { key, .. } => i.key = Some(key.to_string()),
            _ => {}
        }
        i
    }
}

impl From<&GetFailure> for ErrInfo {
    fn from(f: &GetFailure) -> ErrInfo {
        let mut i = ErrInfo::from(&f.error);
        i.dirty = f.dirty;
        i
    }
}

impl From<&EngineError> for ErrInfo {
    fn from(e: &EngineError) -> ErrInfo {
        match e {
            EngineError::Peer(p) => ErrInfo::from(p),
            EngineError::InUse { waited, .. } => {
                let mut i = ErrInfo::new(e.code(), e.to_string());
                i.waited = Some(*waited);
                i
            }
            _ => ErrInfo::new(e.code(), e.to_string()),
        }
    }
}

/// Converts any of the crate's errors into a Python exception.
pub fn py_err<E>(e: E) -> PyErr
where
    for<'a> ErrInfo: From<&'a E>,
{
    ErrInfo::from(&e).into()
}
