//! Values from Python, checked once at the boundary: seconds as durations, chunk keys,
//! C-contiguous byte buffers.

use std::time::Duration;

use kvferry::engine::ChunkKey;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::ErrInfo;

/// Seconds from Python as a duration: positive and finite, or `None`.
pub fn duration(secs: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match secs {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(ErrInfo::invalid(format!("{what} must be a positive number of seconds, got {s}")).into()),
    }
}

pub(crate) fn required(secs: f64, what: &str) -> PyResult<Duration> {
    Ok(duration(Some(secs), what)?.expect("Some in, Some out"))
}

/// A chunk key from Python: a `str` (hashed) or 32 raw `bytes`.
pub fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<ChunkKey> {
    if let Ok(s) = obj.extract::<&str>() {
        if s.is_empty() {
            return Err(ErrInfo::invalid("a key must not be empty").into());
        }
        return Ok(ChunkKey::from_name(s));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        let b = b.as_bytes();
        return <[u8; 32]>::try_from(b)
            .map(ChunkKey)
            .map_err(|_| ErrInfo::invalid(format!("a bytes key must be 32 bytes, got {}", b.len())).into());
    }
    Err(ErrInfo::invalid(format!(
        "a key must be str or 32 bytes, got {}",
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
    ))
    .into())
}

/// A C-contiguous byte view of a buffer-protocol object (the Python layer passes
/// `memoryview(obj).cast("B")`).
pub fn byte_buffer(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<PyBuffer<u8>> {
    let buf = PyBuffer::<u8>::get(obj).map_err(|e| ErrInfo::invalid(format!("{what}: not a byte buffer ({e})")))?;
    if !buf.is_c_contiguous() {
        return Err(ErrInfo::invalid(format!("{what}: buffer is not C-contiguous")).into());
    }
    Ok(buf)
}
