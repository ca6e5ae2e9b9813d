//! Registered host memory: a [`Region`] holds an engine's KV cache (or any buffer the
//! copy engine reads or writes) and is owned by the library through an `Arc` once
//! registered, so a copy job that targets it keeps it alive until the job has drained.
//!
//! A region is shared memory in the sense a device buffer is: the engine and kvferry
//! coordinate *which blocks* each touches (kvferry tells the engine when a destination
//! range is quiet again, e.g. through a drain fence). [`Region::read`] and
//! [`Region::write`] copy bytes; a read of bytes that a live copy is writing returns
//! unspecified bytes, never memory of another allocation.

use std::any::Any;
use std::ptr::NonNull;

use super::backing::{Backing, BackingRequest};
use super::MemError;

/// Memory the copy engine can address as byte ranges made of contiguous runs.
pub trait HostMemory: Send + Sync {
    /// Addressable size in bytes.
    fn size(&self) -> usize;

    /// Calls `f(address, len)` for each contiguous piece of `offset..offset+len`, in
    /// order. Fails with [`MemError::OutOfBounds`] (calling `f` never) if the range does
    /// not fit.
    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError>;
}

enum RegionMem {
    Owned(Backing),
    External {
        ptr: NonNull<u8>,
        _keepalive: Box<dyn Any + Send + Sync>,
    },
}

/// A contiguous block of registered host memory.
pub struct Region {
    mem: RegionMem,
    len: usize,
    name: String,
}

// SAFETY: the region owns (or keeps alive) its memory; access is through raw-pointer
// copies whose coordination is the contract documented on the type.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("name", &self.name)
            .field("len", &self.len)
            .finish()
    }
}

impl Region {
    /// Allocates a zeroed host region of `len` bytes (not pinned: engine memory).
    pub fn host(name: impl Into<String>, len: usize) -> Result<Region, MemError> {
        let backing = Backing::allocate(len.max(1), BackingRequest::Unlocked)?;
        Ok(Region {
            mem: RegionMem::Owned(backing),
            len,
            name: name.into(),
        })
    }

    /// Registers memory owned by the caller.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as
    /// `keepalive` is alive; the region drops `keepalive` only after every copy job that
    /// references the region has drained. The caller must not free or reuse the memory
    /// by other means while the region lives, and must only touch bytes that kvferry has
    /// reported quiet (no copy job in flight targeting them).
    pub unsafe fn from_raw(
        name: impl Into<String>,
        ptr: NonNull<u8>,
        len: usize,
        keepalive: Box<dyn Any + Send + Sync>,
    ) -> Region {
        Region {
            mem: RegionMem::External {
                ptr,
                _keepalive: keepalive,
            },
            len,
            name: name.into(),
        }
    }

    /// The region's name (for errors and stats).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn base(&self) -> *mut u8 {
        match &self.mem {
            RegionMem::Owned(b) => b.as_ptr(),
            RegionMem::External { ptr, .. } => ptr.as_ptr(),
        }
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(MemError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds (checked); see the type's contract for concurrent access.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base().add(offset), data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), MemError> {
        self.check(offset, out.len())?;
        // SAFETY: in bounds (checked); see the type's contract for concurrent access.
        unsafe { std::ptr::copy_nonoverlapping(self.base().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The bytes at `offset..offset+len` as a new vector.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, MemError> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// The crc32c of `offset..offset+len`, computed in place (no copy). Like
    /// [`read`](Self::read), meaningful only for bytes no copy is writing.
    pub fn checksum(&self, offset: usize, len: usize) -> Result<u32, MemError> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked); the slice lives only for this call and is only
        // read; see the type's contract for concurrent access.
        let bytes = unsafe { std::slice::from_raw_parts(self.base().add(offset), len) };
        Ok(crate::checksum::checksum(bytes))
    }

    /// Fills `offset..offset+len` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), MemError> {
        self.check(offset, len)?;
        // SAFETY: in bounds (checked).
        unsafe { std::ptr::write_bytes(self.base().add(offset), byte, len) };
        Ok(())
    }
}

impl HostMemory for Region {
    fn size(&self) -> usize {
        self.len
    }

    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError> {
        self.check(offset, len)?;
        if len > 0 {
            // SAFETY: in bounds (checked).
            f(unsafe { self.base().add(offset) }, len);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_write_and_bounds() {
        let r = Region::host("kv", 1 << 16).unwrap();
        r.write(100, b"hello").unwrap();
        assert_eq!(r.checksum(100, 5).unwrap(), crc32c::crc32c(b"hello"));
        assert!(r.checksum(1 << 16, 1).is_err());
        assert_eq!(r.to_vec(100, 5).unwrap(), b"hello");
        assert!(matches!(
            r.write((1 << 16) - 2, b"abc"),
            Err(MemError::OutOfBounds { .. })
        ));
        assert!(matches!(
            r.read(usize::MAX, &mut [0; 2]),
            Err(MemError::OutOfBounds { .. })
        ));
    }

    #[test]
    fn external_memory_is_kept_alive_by_the_region() {
        let mut v = vec![0u8; 64].into_boxed_slice();
        let ptr = NonNull::new(v.as_mut_ptr()).unwrap();
        // SAFETY: the boxed slice is moved into the region as its keepalive and is not
        // touched by anyone else.
        let r = unsafe { Region::from_raw("ext", ptr, 64, Box::new(v)) };
        r.write(0, &[5; 64]).unwrap();
        assert_eq!(r.to_vec(60, 4).unwrap(), vec![5; 4]);
    }
}
