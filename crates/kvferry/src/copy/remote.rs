//! A copy source in another process on this host, read with cross-memory attach
//! (`process_vm_readv`, "CMA"): the one-copy same-host mover's source.
//!
//! A [`RemoteSource`] is the concatenation of `(remote address, length)` runs of one
//! process, addressed by offset in that concatenation, exactly as a local source is
//! addressed by offset in its memory. A [`CopyPlan`](super::CopyPlan) whose source is
//! one ([`Endpoint::Remote`](super::Endpoint::Remote)) is cut into slices like any
//! other; a copy thread then reads each slice with as few `process_vm_readv` calls as
//! its pieces allow (at most `IOV_MAX` pieces a call) instead of `memcpy`. Everything
//! else is the copy engine's: slices, the drain on cancel, checksums per group.
//!
//! # What the kernel guarantees, and what it does not
//!
//! - The call reads only the named remote ranges, into only the named local ranges:
//!   a consumer cannot read what it was not granted, because the grant's ranges are
//!   the only remote addresses a plan holds.
//! - The call needs ptrace rights over the target (same uid and the target dumpable, or
//!   `CAP_SYS_PTRACE`; Yama may restrict further): `EPERM` otherwise.
//! - A target that exited is `ESRCH`; a range that is no longer mapped is `EFAULT`, or
//!   a short read. Either fails the slice ([`RemoteReadError`]); it never blocks.
//! - Nothing stops the target from writing the bytes while they are read: callers
//!   verify what landed against checksums taken when the bytes were granted.
//!
//! # Cancellation
//!
//! A `process_vm_readv` call cannot be interrupted, but a slice is short (about 1 MiB,
//! a few hundred microseconds); cancelling a copy skips unstarted slices and waits
//! for the started ones, as for any copy (see [`CopyJob`](super::CopyJob)).

use super::job::Piece;
use super::CopyError;

/// Most iovecs one `process_vm_readv` call takes (Linux's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;

/// Memory of another process on this host: the concatenation of `runs`.
#[derive(Clone, Debug)]
pub struct RemoteSource {
    pid: i32,
    /// `(remote address, length)`, in stream order, lengths non-zero.
    runs: Vec<(usize, usize)>,
    /// Offset in the stream at which each run starts.
    starts: Vec<usize>,
    total: usize,
}

impl RemoteSource {
    /// The runs of process `pid`, in stream order. Empty runs are dropped.
    ///
    /// Refused ([`CopyError::InvalidPlan`]) for pid 0, a run whose end overflows the
    /// address space, or a total that overflows. Nothing is read here; whether the
    /// process exists and may be read is found out by the first read.
    pub fn new(pid: u32, runs: impl IntoIterator<Item = (u64, u64)>) -> Result<RemoteSource, CopyError> {
        let pid = i32::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| CopyError::InvalidPlan(format!("remote pid {pid} is not a process id")))?;
        let mut out = Vec::new();
        let mut starts = Vec::new();
        let mut total = 0usize;
        for (addr, len) in runs {
            if len == 0 {
                continue;
            }
            let (addr, len) = match (usize::try_from(addr), usize::try_from(len)) {
                (Ok(a), Ok(l)) if a.checked_add(l).is_some() && a != 0 => (a, l),
                _ => {
                    return Err(CopyError::InvalidPlan(format!(
                        "remote run {addr:#x}+{len} is not an address range of this machine"
                    )))
                }
            };
            starts.push(total);
            out.push((addr, len));
            total = total
                .checked_add(len)
                .ok_or_else(|| CopyError::InvalidPlan("remote runs overflow".into()))?;
        }
        Ok(RemoteSource {
            pid,
            runs: out,
            starts,
            total,
        })
    }

    /// The process read.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Total bytes of the runs.
    pub fn size(&self) -> usize {
        self.total
    }

    /// Calls `f` with each `(remote address, length)` covering stream bytes
    /// `offset..offset + len`, in order. The addresses are the other process's: they
    /// are handed to the kernel, never dereferenced here.
    pub(crate) fn for_each_run(
        &self,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(usize, usize),
    ) -> Result<(), CopyError> {
        let end = offset.checked_add(len).filter(|e| *e <= self.total).ok_or_else(|| {
            CopyError::InvalidPlan(format!(
                "remote range {offset}+{len} exceeds the source's {} bytes",
                self.total
            ))
        })?;
        if len == 0 {
            return Ok(());
        }
        let mut i = self.starts.partition_point(|s| *s <= offset) - 1;
        let mut at = offset;
        while at < end {
            let (addr, run_len) = self.runs[i];
            let within = at - self.starts[i];
            let n = (run_len - within).min(end - at);
            f(addr + within, n);
            at += n;
            i += 1;
        }
        Ok(())
    }
}

/// Why a remote read failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("reading {wanted} bytes from process {pid}: {what}")]
pub struct RemoteReadError {
    /// The process read.
    pub pid: u32,
    /// Bytes the call asked for.
    pub wanted: usize,
    /// Bytes it read before it stopped.
    pub got: usize,
    /// The `errno`, or `None` for a short read without one.
    pub errno: Option<i32>,
    what: String,
}

impl RemoteReadError {
    fn new(pid: i32, wanted: usize, got: usize, errno: Option<i32>) -> RemoteReadError {
        let what = match errno {
            Some(libc::ESRCH) => "the process is gone (ESRCH)".to_string(),
            Some(libc::EPERM) => "not permitted (EPERM: ptrace rules, another uid, or a container)".to_string(),
            Some(libc::EFAULT) => "a remote range is no longer mapped (EFAULT)".to_string(),
            Some(e) => std::io::Error::from_raw_os_error(e).to_string(),
            None => format!("short read: {got} bytes (a remote range is no longer mapped)"),
        };
        RemoteReadError {
            pid: pid as u32,
            wanted,
            got,
            errno,
            what,
        }
    }

    /// The process cannot be read any more (it exited, or unmapped what was granted):
    /// for a peer, lost.
    pub fn is_gone(&self) -> bool {
        matches!(self.errno, Some(libc::ESRCH) | Some(libc::EFAULT) | None)
    }

    /// The kernel refused the read (`EPERM`): reading that process is not allowed here.
    pub fn is_refused(&self) -> bool {
        self.errno == Some(libc::EPERM)
    }
}

/// Reads `pieces` (remote source address, local destination, length) from `pid`.
///
/// # Safety
///
/// Every piece's `dst` must be valid for writes of `len` bytes, and nothing else may
/// read or write those bytes during the call. `src` is the other process's address and
/// is not dereferenced here.
pub(crate) unsafe fn read_pieces(pid: i32, pieces: &[Piece]) -> Result<(), RemoteReadError> {
    for batch in pieces.chunks(MAX_IOVECS) {
        let local: Vec<libc::iovec> = batch
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.dst.cast(),
                iov_len: p.len,
            })
            .collect();
        let remote: Vec<libc::iovec> = batch
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.src as *mut libc::c_void,
                iov_len: p.len,
            })
            .collect();
        let wanted: usize = batch.iter().map(|p| p.len).sum();
        // SAFETY: `local` names destination bytes the caller guarantees writable and
        // unshared for the call (this function's contract); `remote` names the other
        // process's memory, which the kernel checks and reads on our behalf; both
        // arrays hold `batch.len()` (≤ IOV_MAX) iovecs and outlive the call.
        let n = unsafe {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error();
            return Err(RemoteReadError::new(pid, wanted, 0, errno));
        }
        if n as usize != wanted {
            return Err(RemoteReadError::new(pid, wanted, n as usize, None));
        }
    }
    Ok(())
}

/// Reads `out.len()` bytes at `addr` of process `pid` (a probe: small, one call).
pub fn read_remote(pid: u32, addr: u64, out: &mut [u8]) -> Result<(), RemoteReadError> {
    let pid_i = i32::try_from(pid).map_err(|_| RemoteReadError::new(0, out.len(), 0, Some(libc::ESRCH)))?;
    let piece = Piece {
        src: addr as usize as *const u8,
        dst: out.as_mut_ptr(),
        len: out.len(),
        group: 0,
    };
    // SAFETY: `out` is borrowed mutably for the call: writable and unshared.
    unsafe { read_pieces(pid_i, &[piece]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_map_stream_offsets_to_remote_addresses() {
        let src = RemoteSource::new(1, [(0x1000, 10), (0x5000, 0), (0x9000, 20)]).unwrap();
        assert_eq!(src.size(), 30);
        let mut seen = Vec::new();
        src.for_each_run(5, 10, &mut |a, n| seen.push((a, n))).unwrap();
        assert_eq!(seen, vec![(0x1005, 5), (0x9000, 5)]);
        assert!(src.for_each_run(25, 6, &mut |_, _| {}).is_err());
        assert!(RemoteSource::new(0, [(0x1000, 1)]).is_err(), "pid 0");
        assert!(RemoteSource::new(1, [(u64::MAX - 1, 4)]).is_err(), "wraps");
        assert!(RemoteSource::new(1, [(0, 4)]).is_err(), "null address");
    }

    #[test]
    fn reads_own_memory_and_reports_a_missing_process() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut out = vec![0u8; data.len()];
        let pieces = [
            Piece {
                src: data.as_ptr(),
                dst: out.as_mut_ptr(),
                len: 60_000,
                group: 0,
            },
            Piece {
                src: data[60_000..].as_ptr(),
                dst: out[60_000..].as_mut_ptr(),
                len: 40_000,
                group: 0,
            },
        ];
        let me = std::process::id() as i32;
        // SAFETY: `out` is ours, writable, and untouched during the call.
        unsafe { read_pieces(me, &pieces) }.unwrap();
        assert_eq!(out, data);
        // A pid beyond pid_max never exists.
        // SAFETY: as above.
        let err = unsafe { read_pieces(i32::MAX, &pieces) }.unwrap_err();
        assert_eq!(err.errno, Some(libc::ESRCH), "{err}");
        assert!(err.is_gone());
        // An unmapped remote address: EFAULT, never a crash.
        let bad = [Piece {
            src: 8 as *const u8,
            dst: out.as_mut_ptr(),
            len: 16,
            group: 0,
        }];
        // SAFETY: as above.
        let err = unsafe { read_pieces(me, &bad) }.unwrap_err();
        assert!(err.is_gone(), "{err}");
    }
}
