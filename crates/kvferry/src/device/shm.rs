//! Shared device memory of the sim backend: the same-host device-IPC analogue of CUDA
//! IPC handles.
//!
//! A sim device's allocation is an anonymous shared-memory file (`memfd_create`)
//! mapped read-write into the producer. It is **exported** as a [`ShmHandle`]: the
//! producer's pid, the file descriptor's number in the producer, and the file's
//! device and inode numbers. Another process **imports** it by opening
//! `/proc/<pid>/fd/<fd>` — which the kernel allows only to a process with ptrace read
//! rights over the producer (`PTRACE_MODE_READ_FSCREDS`), the same rule as a
//! cross-memory-attach read — checking that the file opened is the one exported (same
//! device, same inode, at least the exported length), and mapping it **read-only**.
//! The importer's mapping keeps the memory valid after the producer exits or frees
//! its allocation (the file lives while any mapping does), so a dead producer can
//! never turn a read into a fault; what it wrote last is what is read, which the
//! grant's checksums judge.
//!
//! # Errors
//!
//! One enum, [`ShmError`]: a failed system call (named, with `errno`), or an import
//! whose file is not the exported one (a closed and reused fd number, another host's
//! handle, a shorter file).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::mem::Region;

/// Errors of shared device memory.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call failed.
    #[error("{call} failed: {error}")]
    Sys {
        /// The call.
        call: &'static str,
        /// What the kernel said.
        error: std::io::Error,
    },
    /// The file opened from a handle is not the exported allocation.
    #[error("shared device memory handle does not match: {0}")]
    Mismatch(String),
    /// The handle bytes are malformed.
    #[error("malformed shared device memory handle ({0} bytes)")]
    Malformed(usize),
}

fn sys(call: &'static str) -> ShmError {
    ShmError::Sys {
        call,
        error: std::io::Error::last_os_error(),
    }
}

/// Where an exported sim allocation can be opened from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmHandle {
    /// The exporting process.
    pub pid: u32,
    /// The memfd's number in that process.
    pub fd: i32,
    /// `st_dev` of the file.
    pub dev: u64,
    /// `st_ino` of the file.
    pub ino: u64,
    /// Bytes exported.
    pub len: u64,
}

/// Encoded size of a [`ShmHandle`].
pub const SHM_HANDLE_BYTES: usize = 4 + 4 + 8 + 8 + 8;

impl ShmHandle {
    /// The handle as bytes (little endian), as the wire carries it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(SHM_HANDLE_BYTES);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.fd.to_le_bytes());
        v.extend_from_slice(&self.dev.to_le_bytes());
        v.extend_from_slice(&self.ino.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v
    }

    /// Parses [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(b: &[u8]) -> Result<ShmHandle, ShmError> {
        if b.len() != SHM_HANDLE_BYTES {
            return Err(ShmError::Malformed(b.len()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(ShmHandle {
            pid: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            fd: i32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            dev: u64_at(8),
            ino: u64_at(16),
            len: u64_at(24),
        })
    }
}

/// A mapping of shared memory; unmapped when dropped (after the region that uses it).
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// The exporter keeps its fd open (its number is the handle); an importer closes
    /// it once mapped.
    _fd: Option<OwnedFd>,
}

// SAFETY: the mapping is plain memory owned by this value until drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; only the address is shared.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `create`/`open`, unmapped
        // once (this value owns it), after every region over it is gone.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn fstat(fd: i32) -> Result<libc::stat, ShmError> {
    // SAFETY: `st` is plain data the kernel fills; `fd` is an open descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(sys("fstat"));
    }
    Ok(st)
}

/// A fresh zeroed shared allocation of `len` bytes (at least one page is mapped),
/// exportable as the returned handle. The region keeps the file and its mapping.
pub(crate) fn create(name: &str, len: usize) -> Result<(Arc<Region>, ShmHandle), ShmError> {
    let cname = std::ffi::CString::new(format!("kvferry-{name}")).expect("no NUL in the name");
    // SAFETY: a valid C string; flags are constants.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(sys("memfd_create"));
    }
    // SAFETY: `raw` is a descriptor we just opened and own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let map_len = len.max(1);
    // SAFETY: `fd` is open; the length is a plain value.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
        return Err(sys("ftruncate"));
    }
    let st = fstat(fd.as_raw_fd())?;
    let ptr = map(fd.as_raw_fd(), map_len, libc::PROT_READ | libc::PROT_WRITE)?;
    let handle = ShmHandle {
        pid: std::process::id(),
        fd: fd.as_raw_fd(),
        dev: st.st_dev,
        ino: st.st_ino,
        len: len as u64,
    };
    let mapping = Mapping {
        ptr,
        len: map_len,
        _fd: Some(fd),
    };
    // SAFETY: the mapping is valid for `len` bytes read-write while `mapping` (the
    // keepalive) lives, and nothing else in this process frees it.
    let region = unsafe { Region::from_raw(format!("sim-shm-{name}"), ptr, len, Box::new(mapping)) };
    Ok((Arc::new(region), handle))
}

/// Opens an exported allocation read-only (see the module docs for who may).
pub(crate) fn open(handle: &ShmHandle) -> Result<Arc<Region>, ShmError> {
    let path = std::ffi::CString::new(format!("/proc/{}/fd/{}", handle.pid, handle.fd)).expect("no NUL");
    // SAFETY: a valid C string; flags are constants.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(sys("open of the producer's shared device memory"));
    }
    // SAFETY: `raw` is a descriptor we just opened and own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let st = fstat(fd.as_raw_fd())?;
    if st.st_dev != handle.dev || st.st_ino != handle.ino {
        return Err(ShmError::Mismatch(format!(
            "fd {} of pid {} is another file (the allocation was freed, or another pid namespace)",
            handle.fd, handle.pid
        )));
    }
    let len = usize::try_from(handle.len).map_err(|_| ShmError::Malformed(SHM_HANDLE_BYTES))?;
    if (st.st_size as u64) < handle.len {
        return Err(ShmError::Mismatch(format!(
            "the file holds {} bytes, the handle names {}",
            st.st_size, handle.len
        )));
    }
    let map_len = len.max(1);
    let ptr = map(fd.as_raw_fd(), map_len, libc::PROT_READ)?;
    drop(fd); // the mapping keeps the file
    let mapping = Mapping {
        ptr,
        len: map_len,
        _fd: None,
    };
    // SAFETY: the mapping is valid for reads of `len` bytes while `mapping` lives. It
    // is read-only: the buffer wrapping this region refuses every write (see
    // `HostBuffer::read_only`), so no copy ever targets it.
    let region = unsafe { Region::from_raw(format!("sim-shm-import-{}", handle.ino), ptr, len, Box::new(mapping)) };
    Ok(Arc::new(region))
}

fn map(fd: i32, len: usize, prot: i32) -> Result<NonNull<u8>, ShmError> {
    // SAFETY: a fresh shared mapping of an open file of at least `len` bytes; the
    // kernel picks the address.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(sys("mmap"));
    }
    NonNull::new(p.cast()).ok_or_else(|| sys("mmap"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_and_import_share_bytes_and_check_identity() {
        let (region, handle) = create("t", 8192).unwrap();
        region.write(100, b"shared").unwrap();
        assert_eq!(ShmHandle::from_bytes(&handle.to_bytes()).unwrap(), handle);
        let imported = open(&handle).unwrap();
        let mut out = [0u8; 6];
        imported.read(100, &mut out).unwrap();
        assert_eq!(&out, b"shared");
        region.write(100, b"SHARED").unwrap();
        imported.read(100, &mut out).unwrap();
        assert_eq!(&out, b"SHARED", "one memory, not a copy");
        // A handle naming another file (wrong inode) is refused.
        let wrong = ShmHandle {
            ino: handle.ino + 1,
            ..handle
        };
        assert!(matches!(open(&wrong), Err(ShmError::Mismatch(_))));
        let longer = ShmHandle { len: 1 << 20, ..handle };
        assert!(matches!(open(&longer), Err(ShmError::Mismatch(_))));
        // The import outlives the exporter's region.
        drop(region);
        imported.read(100, &mut out).unwrap();
        assert_eq!(&out, b"SHARED");
        assert!(matches!(ShmHandle::from_bytes(&[1, 2]), Err(ShmError::Malformed(2))));
    }
}
