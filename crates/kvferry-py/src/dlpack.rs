//! DLPack: what a `__dlpack__` object exports, read without copying — the data address
//! (`data + byte_offset`), the device (`kDLCPU`, `kDLCUDA`, ...), the shape and the size
//! in bytes. Only C-contiguous tensors of whole-byte element types are accepted; anything
//! else is an `InvalidArgumentError` naming the problem.
//!
//! The object is asked for a legacy `"dltensor"` capsule (`__dlpack__()` with no
//! arguments: no stream synchronisation is requested, so the caller orders its own
//! writes before kvferry reads the memory). The capsule is kept, not consumed: while it
//! lives, the exporter keeps the memory alive, and when it is collected its destructor
//! runs the tensor's deleter. [`DlTensor::owner`] holds it together with the object.

use std::ffi::{c_void, CStr};

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

use crate::errors::ErrInfo;

/// DLPack's device type of CUDA device memory.
pub const KDL_CUDA: i32 = 2;

/// The most dimensions accepted (DLPack sets no limit; this bounds a malformed one).
const MAX_DIMS: i32 = 64;

const CAPSULE_NAME: &CStr = c"dltensor";

/// `DLDevice` (dlpack.h).
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType` (dlpack.h).
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` (dlpack.h).
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (dlpack.h), the legacy (unversioned) capsule payload. Only
/// `dl_tensor` is read; the rest is there for the layout (the capsule's destructor, not
/// us, calls `deleter`).
#[repr(C)]
#[allow(dead_code)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// A tensor exported through DLPack.
pub struct DlTensor {
    /// Address of the first byte (`data + byte_offset`).
    pub ptr: u64,
    /// Size in bytes.
    pub nbytes: usize,
    /// DLPack device type (1 = CPU, 2 = CUDA, ...).
    pub device_type: i32,
    /// Device ordinal.
    pub device_id: i32,
    /// The shape.
    pub shape: Vec<usize>,
    /// `(object, capsule)`: keeps the memory alive while held.
    pub owner: Py<PyAny>,
}

/// Reads what `obj.__dlpack__()` exports (`what` names it in errors).
pub fn read(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<DlTensor> {
    let invalid = |m: String| PyErr::from(ErrInfo::invalid(format!("{what}: {m}")));
    let capsule = obj
        .call_method0("__dlpack__")
        .map_err(|e| invalid(format!("__dlpack__() failed: {e}")))?;
    let cap = capsule
        .cast::<PyCapsule>()
        .map_err(|_| invalid("__dlpack__() did not return a capsule".into()))?;
    let p = cap
        .pointer_checked(Some(CAPSULE_NAME))
        .map_err(|_| invalid("__dlpack__() did not return an unconsumed 'dltensor' capsule".into()))?;
    // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor` (the DLPack protocol),
    // valid while the capsule is alive and unconsumed; we hold the capsule, run no Python
    // code while reading, and copy out what we need before returning.
    let t = unsafe { &(*p.cast::<DLManagedTensor>().as_ptr()).dl_tensor };
    if !(0..=MAX_DIMS).contains(&t.ndim) {
        return Err(invalid(format!("tensor has {} dimensions", t.ndim)));
    }
    let ndim = t.ndim as usize;
    let dims: &[i64] = if ndim == 0 {
        &[]
    } else if t.shape.is_null() {
        return Err(invalid("tensor has no shape".into()));
    } else {
        // SAFETY: DLPack's `shape` points to `ndim` int64 values (checked non-null).
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let mut shape = Vec::with_capacity(ndim);
    for &d in dims {
        shape.push(usize::try_from(d).map_err(|_| invalid(format!("negative dimension in shape {dims:?}")))?);
    }
    let (bits, lanes) = (t.dtype.bits as usize, t.dtype.lanes as usize);
    if bits == 0 || bits % 8 != 0 || lanes == 0 {
        return Err(invalid(format!(
            "element type (code {}, {bits} bits, {lanes} lanes) is not a whole number of bytes",
            t.dtype.code
        )));
    }
    let elem = bits / 8 * lanes;
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| invalid(format!("shape {shape:?} overflows")))?;
    if numel == 0 {
        return Err(invalid(format!("tensor is empty (shape {shape:?})")));
    }
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: non-null `strides` points to `ndim` int64 values (in elements).
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut want: i64 = 1;
        for (&d, &s) in dims.iter().zip(strides).rev() {
            // A dimension of size 1 may carry any stride.
            if d != 1 && s != want {
                return Err(invalid(format!(
                    "tensor is not C-contiguous (shape {dims:?}, strides {strides:?} in elements); \
                     pass a contiguous tensor (e.g. .contiguous())"
                )));
            }
            want = want.saturating_mul(d);
        }
    }
    let nbytes = numel
        .checked_mul(elem)
        .ok_or_else(|| invalid(format!("shape {shape:?} overflows")))?;
    if t.data.is_null() {
        return Err(invalid("tensor has a null data pointer".into()));
    }
    let ptr = (t.data as u64)
        .checked_add(t.byte_offset)
        .filter(|p| p.checked_add(nbytes as u64).is_some())
        .ok_or_else(|| invalid("data pointer plus byte_offset overflows".into()))?;
    let (device_type, device_id) = (t.device.device_type, t.device.device_id);
    let owner = PyTuple::new(obj.py(), [obj.clone(), capsule.clone()])?
        .into_any()
        .unbind();
    Ok(DlTensor {
        ptr,
        nbytes,
        device_type,
        device_id,
        shape,
        owner,
    })
}

/// Test hook (not API): `(ptr, nbytes, device_type, device_id, shape)` of what `obj`
/// exports through DLPack, or `InvalidArgumentError`.
#[pyfunction]
pub fn dlpack_info(obj: &Bound<'_, PyAny>) -> PyResult<(u64, usize, i32, i32, Vec<usize>)> {
    let t = read(obj, "dlpack_info")?;
    Ok((t.ptr, t.nbytes, t.device_type, t.device_id, t.shape))
}
