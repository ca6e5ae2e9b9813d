//! Rust errors as the package's Python exceptions (`kvferry.errors`): one hierarchy
//! under `kvferry.Error`, each exception carrying structured attributes (`peer`, `key`,
//! `op`, `waited`, `dirty`) beside its message.

use std::time::Duration;

use kvferry::engine::EngineError;
use kvferry::net::NetError;
use kvferry::peer::{GetFailure, PeerError};
use kvferry::wire::ErrorKind;
use pyo3::prelude::*;

/// A failure ready to become a Python exception (cloneable, GIL-free).
#[derive(Clone, Debug)]
pub struct ErrInfo {
    /// The exception class's name in `kvferry.errors`.
    pub class: &'static str,
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
    /// An error of `class` with `message` and no attributes.
    pub fn new(class: &'static str, message: impl Into<String>) -> ErrInfo {
        ErrInfo {
            class,
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
        ErrInfo::new("InvalidArgumentError", message)
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
            let cls = py.import("kvferry.errors")?.getattr(self.class)?;
            let inst = cls.call1((self.message.clone(),))?;
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

fn remote_class(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Busy => "BusyError",
        ErrorKind::BadRequest | ErrorKind::TooLarge => "InvalidArgumentError",
        ErrorKind::StaleIncarnation => "PeerRestartedError",
        ErrorKind::LeaseExpired | ErrorKind::UnknownLease => "LeaseExpiredError",
        ErrorKind::AuthFailed | ErrorKind::AuthRequired => "AuthError",
        ErrorKind::NotFound => "NotFoundError",
        ErrorKind::ShuttingDown => "PeerLostError",
        ErrorKind::BadSelection => "SelectionError",
        _ => "Error",
    }
}

impl From<&PeerError> for ErrInfo {
    fn from(e: &PeerError) -> ErrInfo {
        let msg = e.to_string();
        match e {
            PeerError::InvalidArgument(_) | PeerError::Layout(_) => ErrInfo::invalid(msg),
            PeerError::Timeout { op, waited } => {
                let mut i = ErrInfo::new("TimeoutError", msg).op(op);
                i.waited = Some(*waited);
                i
            }
            PeerError::Cancelled => ErrInfo::new("CancelledError", msg),
            PeerError::PeerLost { peer, .. } => ErrInfo::new("PeerLostError", msg).peer(peer),
            PeerError::StaleIncarnation { .. } | PeerError::PeerRestarted { .. } => {
                ErrInfo::new("PeerRestartedError", msg)
            }
            PeerError::LeaseExpired { .. } => ErrInfo::new("LeaseExpiredError", msg),
            PeerError::Remote { kind, .. } => ErrInfo::new(remote_class(*kind), msg),
            PeerError::StagingExhausted { .. } | PeerError::QuotaExceeded { .. } | PeerError::StoreFull { .. } => {
                ErrInfo::new("BusyError", msg)
            }
            PeerError::ChecksumMismatch { key, .. } => {
                let mut i = ErrInfo::new("ChecksumError", msg);
                i.key = Some(key.to_string());
                i
            }
            PeerError::Net(NetError::Auth(_)) => ErrInfo::new("AuthError", msg),
            PeerError::Net(NetError::Remote { kind, .. }) => ErrInfo::new(remote_class(*kind), msg),
            PeerError::ShuttingDown => ErrInfo::new("ClosedError", msg),
            PeerError::Device { .. } => ErrInfo::new("DeviceError", msg),
            PeerError::Selection(_) => ErrInfo::new("SelectionError", msg),
            _ => ErrInfo::new("Error", msg),
        }
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
            EngineError::InvalidConfig(_) | EngineError::Layout(_) | EngineError::NotRegistered(_) => {
                ErrInfo::invalid(e.to_string())
            }
            EngineError::InUse { waited, .. } => {
                let mut i = ErrInfo::new("InUseError", e.to_string());
                i.waited = Some(*waited);
                i
            }
            EngineError::Closed => ErrInfo::new("ClosedError", e.to_string()),
            EngineError::Bind { .. } => ErrInfo::new("Error", e.to_string()),
            EngineError::Mem(_) | EngineError::Directory(_) => ErrInfo::new("Error", e.to_string()),
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
