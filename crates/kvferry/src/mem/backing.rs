//! The memory behind an arena: pinned where the machine allows it, reported either way.
//!
//! Preference order:
//!
//! 1. CUDA page-locked host memory (the `cuda` feature with a driver present) — provided
//!    by the device layer through [`Backing::from_external`].
//! 2. Anonymous `mmap` with transparent huge pages requested (`MADV_HUGEPAGE`) and locked
//!    with `mlock` ([`BackingKind::Mlocked`]).
//! 3. The same mapping, unlocked, when `mlock` is refused (e.g. `RLIMIT_MEMLOCK` is
//!    8 MiB) — [`BackingKind::Unlocked`], with the reason kept in
//!    [`Backing::fallback_reason`] and logged once at `warn` level.
//!
//! Falling back never fails and never panics; only a failed `mmap` (the machine is out
//! of address space or memory) is an error.

use std::fmt;
use std::ptr::NonNull;

/// Which kind of memory an arena got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BackingKind {
    /// Page-locked memory from the CUDA driver (DMA-capable without bounce buffers).
    CudaHost,
    /// Anonymous mapping locked with `mlock`: never swapped, stable physical pages.
    Mlocked,
    /// Anonymous mapping, not locked (mlock refused or not requested).
    Unlocked,
}

impl fmt::Display for BackingKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackingKind::CudaHost => "cuda-host (pinned)",
            BackingKind::Mlocked => "mmap+mlock (pinned)",
            BackingKind::Unlocked => "mmap (unpinned)",
        })
    }
}

/// What kind of backing to ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackingRequest {
    /// Pinned if possible, else unlocked (the default).
    #[default]
    PinnedIfPossible,
    /// Do not try to lock (useful for tests creating many arenas).
    Unlocked,
}

/// Why backing memory could not be obtained at all.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// The size was zero.
    #[error("arena backing size must be non-zero")]
    ZeroSize,
    /// `mmap` itself failed.
    #[error("mmap of {bytes} bytes failed: {source}")]
    Mmap {
        /// The requested size.
        bytes: usize,
        /// The OS error.
        source: std::io::Error,
    },
}

impl BackingError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            BackingError::ZeroSize => C::InvalidConfig,
            BackingError::Mmap { .. } => C::Memory,
        }
    }
}

/// Releases externally allocated memory (e.g. `cuMemFreeHost`).
pub type ExternalFree = Box<dyn FnOnce(*mut u8, usize) + Send + Sync>;

/// An owned block of host memory. Unmapped (or freed) exactly once, on drop.
pub struct Backing {
    ptr: NonNull<u8>,
    len: usize,
    kind: BackingKind,
    fallback_reason: Option<String>,
    free: Option<ExternalFree>,
}

// SAFETY: `Backing` owns its memory exclusively; the raw pointer is only an address.
// Access to the bytes is coordinated by the arena (pages) and copy engine (jobs).
unsafe impl Send for Backing {}
// SAFETY: as above; `&Backing` hands out only the address and metadata.
unsafe impl Sync for Backing {}

impl Backing {
    /// Maps `len` bytes of anonymous memory, pinned if requested and allowed.
    pub fn allocate(len: usize, request: BackingRequest) -> Result<Backing, BackingError> {
        if len == 0 {
            return Err(BackingError::ZeroSize);
        }
        // SAFETY: an anonymous private mapping with no address hint has no
        // preconditions; the result is checked against MAP_FAILED below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(BackingError::Mmap {
                bytes: len,
                source: std::io::Error::last_os_error(),
            });
        }
        // Transparent huge pages are a hint; failure is harmless and not reported.
        // SAFETY: `raw..raw+len` is the mapping we just created.
        unsafe {
            libc::madvise(raw, len, libc::MADV_HUGEPAGE);
        }
        let (kind, fallback_reason) = match request {
            BackingRequest::Unlocked => (BackingKind::Unlocked, Some("pinning not requested".to_string())),
            BackingRequest::PinnedIfPossible => {
                // SAFETY: `raw..raw+len` is our own mapping.
                let rc = unsafe { libc::mlock(raw, len) };
                if rc == 0 {
                    (BackingKind::Mlocked, None)
                } else {
                    let err = std::io::Error::last_os_error();
                    let reason = format!(
                        "mlock of {len} bytes refused ({err}); RLIMIT_MEMLOCK is {}; using unpinned memory",
                        memlock_limit_text()
                    );
                    tracing::warn!(target: "kvferry::mem", "{reason}");
                    (BackingKind::Unlocked, Some(reason))
                }
            }
        };
        if kind == BackingKind::Unlocked {
            // Fault the pages in now so the first transfer does not pay for it.
            // SAFETY: we own the mapping and nobody else can see it yet.
            unsafe { prefault(raw as *mut u8, len) };
        }
        Ok(Backing {
            // SAFETY: mmap succeeded, so `raw` is non-null.
            ptr: unsafe { NonNull::new_unchecked(raw as *mut u8) },
            len,
            kind,
            fallback_reason,
            free: None,
        })
    }

    /// Wraps memory allocated elsewhere (e.g. CUDA pinned host memory).
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes, not aliased by anyone
    /// else for the lifetime of the returned value, and `free(ptr, len)` must release it
    /// correctly exactly once.
    pub unsafe fn from_external(ptr: NonNull<u8>, len: usize, kind: BackingKind, free: ExternalFree) -> Backing {
        Backing {
            ptr,
            len,
            kind,
            fallback_reason: None,
            free: Some(free),
        }
    }

    /// The base address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a backing is never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Which kind of memory this is.
    pub fn kind(&self) -> BackingKind {
        self.kind
    }

    /// Why pinning was not obtained, when it was not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Some(free) = self.free.take() {
            free(self.ptr.as_ptr(), self.len);
            return;
        }
        // SAFETY: we created this mapping in `allocate` and drop runs once. Every page
        // holder (lease, copy job) keeps the arena — and so this backing — alive, so
        // nothing can still point into it here.
        unsafe {
            if self.kind == BackingKind::Mlocked {
                libc::munlock(self.ptr.as_ptr() as *mut libc::c_void, self.len);
            }
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

impl fmt::Debug for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backing")
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("fallback_reason", &self.fallback_reason)
            .finish()
    }
}

/// Touches one byte per 4 KiB so the kernel allocates the pages now.
///
/// # Safety
///
/// `ptr..ptr+len` must be writable memory owned by the caller with no other users.
unsafe fn prefault(ptr: *mut u8, len: usize) {
    let mut off = 0;
    while off < len {
        // SAFETY: `off < len`, inside the caller's exclusive mapping.
        unsafe { std::ptr::write_volatile(ptr.add(off), 0) };
        off += 4096;
    }
}

fn memlock_limit_text() -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass; no other preconditions.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        return "unknown".into();
    }
    if lim.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        super::ByteSize(lim.rlim_cur).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_request_falls_back_and_says_why_or_is_pinned() {
        // 64 MiB is above the 8 MiB memlock limit of CI machines; on machines with a
        // higher limit the mapping is locked. Either way it must work and be reported.
        let b = Backing::allocate(64 << 20, BackingRequest::PinnedIfPossible).unwrap();
        match b.kind() {
            BackingKind::Mlocked => assert!(b.fallback_reason().is_none()),
            BackingKind::Unlocked => assert!(b.fallback_reason().unwrap().contains("mlock")),
            BackingKind::CudaHost => unreachable!(),
        }
        // The memory is usable.
        // SAFETY: we own the mapping exclusively.
        unsafe {
            b.as_ptr().write(7);
            b.as_ptr().add(b.len() - 1).write(9);
            assert_eq!(b.as_ptr().read() + b.as_ptr().add(b.len() - 1).read(), 16);
        }
    }

    #[test]
    fn small_request_is_pinned_under_default_limit() {
        let b = Backing::allocate(1 << 20, BackingRequest::PinnedIfPossible).unwrap();
        // 1 MiB fits under any sane memlock limit (8 MiB here) unless the process has
        // already locked a lot; accept either but require a reason for unlocked.
        if b.kind() == BackingKind::Unlocked {
            assert!(b.fallback_reason().is_some());
        }
    }

    #[test]
    fn zero_size_is_an_error() {
        assert!(matches!(
            Backing::allocate(0, BackingRequest::Unlocked),
            Err(BackingError::ZeroSize)
        ));
    }
}
