//! A [`CopyPlan`]: a source, a destination, and `(src offset, dst offset, len)`
//! segments between them. The plan owns both endpoints while a copy runs.

use std::sync::Arc;

use crate::mem::{HostMemory, Lease, MemError, Region};

use super::remote::RemoteSource;
use super::CopyError;

/// One contiguous copy: `len` bytes from `src` offset to `dst` offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Offset in the source.
    pub src: usize,
    /// Offset in the destination.
    pub dst: usize,
    /// Bytes to copy.
    pub len: usize,
}

/// Caller-owned memory accepted as a copy endpoint.
pub struct RawBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the constructor's contract makes the caller responsible for the memory being
// valid and unaliased for the copy's lifetime; the engine only copies bytes.
unsafe impl Send for RawBuffer {}
// SAFETY: as above.
unsafe impl Sync for RawBuffer {}

impl RawBuffer {
    /// Wraps caller memory.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes until the plan holding
    /// this buffer is handed back by the engine (the job resolved, or its
    /// [`DrainFence`](super::DrainFence) fired) — *not* merely until the caller stops
    /// awaiting: a dropped job keeps copying its started slices. No one else may write
    /// the bytes the plan writes during that time.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuffer {
        RawBuffer { ptr, len }
    }
}

impl HostMemory for RawBuffer {
    fn size(&self) -> usize {
        self.len
    }

    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                if len > 0 {
                    // SAFETY: in bounds of the caller-guaranteed buffer.
                    f(unsafe { self.ptr.add(offset) }, len);
                }
                Ok(())
            }
            _ => Err(MemError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }
}

/// Where a copy reads or writes.
pub enum Endpoint {
    /// Arena pages, owned by the plan.
    Lease(Lease),
    /// A registered region, kept alive by the plan.
    Region(Arc<Region>),
    /// Any other registered memory, kept alive by the plan (e.g. a device backend's
    /// host-visible buffer).
    Memory(Arc<dyn HostMemory>),
    /// Caller memory under [`RawBuffer::new`]'s contract.
    Raw(RawBuffer),
    /// Another process's memory, read with `process_vm_readv` (a source only; see
    /// [`RemoteSource`]).
    Remote(RemoteSource),
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Lease(l) => write!(f, "Lease({} pages)", l.page_count()),
            Endpoint::Region(r) => write!(f, "Region({})", r.name()),
            Endpoint::Memory(m) => write!(f, "Memory({} bytes)", m.size()),
            Endpoint::Raw(r) => write!(f, "Raw({} bytes)", r.len),
            Endpoint::Remote(r) => write!(f, "Remote(pid {}, {} bytes)", r.pid(), r.size()),
        }
    }
}

impl Endpoint {
    /// Local memory, or `None` for a remote source.
    fn local(&self) -> Option<&dyn HostMemory> {
        match self {
            Endpoint::Lease(l) => Some(l),
            Endpoint::Region(r) => Some(&**r),
            Endpoint::Memory(m) => Some(&**m),
            Endpoint::Raw(r) => Some(r),
            Endpoint::Remote(_) => None,
        }
    }

    /// Bytes addressable through this endpoint.
    pub(crate) fn size(&self) -> usize {
        match (self.local(), self) {
            (Some(m), _) => m.size(),
            (None, Endpoint::Remote(r)) => r.size(),
            (None, _) => 0,
        }
    }

    /// Calls `f` with each contiguous run covering `offset..offset + len`. For a
    /// remote source the pointers are the other process's addresses: they go to the
    /// kernel and are never dereferenced here.
    pub(crate) fn for_each_run(
        &self,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(*mut u8, usize),
    ) -> Result<(), CopyError> {
        match self {
            Endpoint::Remote(r) => r.for_each_run(offset, len, &mut |addr, n| f(addr as *mut u8, n)),
            _ => match self.local() {
                Some(m) => m
                    .for_each_run(offset, len, f)
                    .map_err(|e| CopyError::InvalidPlan(e.to_string())),
                None => Ok(()),
            },
        }
    }

    /// The process a remote source reads, if this endpoint is one.
    pub(crate) fn remote_pid(&self) -> Option<i32> {
        match self {
            Endpoint::Remote(r) => Some(r.pid() as i32),
            _ => None,
        }
    }

    /// The lease, if this endpoint is one.
    pub fn into_lease(self) -> Option<Lease> {
        match self {
            Endpoint::Lease(l) => Some(l),
            _ => None,
        }
    }

    /// Address range identity, to detect a plan copying within one memory.
    fn identity(&self) -> Option<*const ()> {
        match self {
            Endpoint::Region(r) => Some(Arc::as_ptr(r) as *const ()),
            Endpoint::Memory(m) => Some(Arc::as_ptr(m) as *const ()),
            Endpoint::Raw(r) => Some(r.ptr as *const ()),
            Endpoint::Lease(_) | Endpoint::Remote(_) => None,
        }
    }
}

impl From<Lease> for Endpoint {
    fn from(l: Lease) -> Self {
        Endpoint::Lease(l)
    }
}

impl From<Arc<Region>> for Endpoint {
    fn from(r: Arc<Region>) -> Self {
        Endpoint::Region(r)
    }
}

/// A list of segments from one source to one destination.
#[derive(Debug)]
pub struct CopyPlan {
    /// Where bytes are read.
    pub src: Endpoint,
    /// Where bytes are written.
    pub dst: Endpoint,
    segments: Vec<Segment>,
    checksum_groups: Option<Vec<usize>>,
    group_checksums: Option<Vec<u32>>,
}

impl CopyPlan {
    /// An empty plan between two endpoints.
    pub fn new(src: impl Into<Endpoint>, dst: impl Into<Endpoint>) -> CopyPlan {
        CopyPlan {
            src: src.into(),
            dst: dst.into(),
            segments: Vec::new(),
            checksum_groups: None,
            group_checksums: None,
        }
    }

    /// Adds a segment.
    pub fn push(&mut self, src: usize, dst: usize, len: usize) -> &mut Self {
        if len > 0 {
            self.segments.push(Segment { src, dst, len });
        }
        self
    }

    /// Builder form of [`push`](Self::push).
    pub fn with(mut self, src: usize, dst: usize, len: usize) -> Self {
        self.push(src, dst, len);
        self
    }

    /// The segments.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Total bytes the plan copies.
    pub fn bytes(&self) -> usize {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Also computes a crc32c per *group* of consecutive segments (e.g. one group per
    /// chunk): group `i` covers segments `ends[i-1]..ends[i]` (`ends` strictly
    /// increasing, the last equal to the number of segments). The copy threads
    /// checksum each piece right after copying it, while it is still in cache (no
    /// second pass over memory). Available from
    /// [`group_checksums`](Self::group_checksums) once the copy completed.
    pub fn with_checksum_groups(mut self, ends: Vec<usize>) -> Self {
        self.checksum_groups = Some(ends);
        self
    }

    pub(crate) fn checksum_groups(&self) -> Option<&[usize]> {
        self.checksum_groups.as_deref()
    }

    pub(crate) fn set_group_checksums(&mut self, crcs: Vec<u32>) {
        self.group_checksums = Some(crcs);
    }

    /// The crc32c of each checksum group's bytes (in group order), if the plan asked
    /// for them and the copy completed.
    pub fn group_checksums(&self) -> Option<&[u32]> {
        self.group_checksums.as_deref()
    }

    /// Gives back both endpoints.
    pub fn into_parts(self) -> (Endpoint, Endpoint) {
        (self.src, self.dst)
    }

    /// Checks bounds and that destination ranges overlap neither each other nor (when
    /// source and destination are the same memory) the source ranges: concurrent
    /// slices writing the same bytes would make the result depend on timing.
    pub(crate) fn validate(&self) -> Result<(), CopyError> {
        if matches!(self.dst, Endpoint::Remote(_)) {
            return Err(CopyError::InvalidPlan(
                "another process's memory is only ever a copy's source".into(),
            ));
        }
        let (ss, ds) = (self.src.size(), self.dst.size());
        for (i, s) in self.segments.iter().enumerate() {
            let ok = |off: usize, size: usize| off.checked_add(s.len).is_some_and(|e| e <= size);
            if !ok(s.src, ss) {
                return Err(CopyError::InvalidPlan(format!(
                    "segment {i}: source range {}+{} exceeds source size {ss}",
                    s.src, s.len
                )));
            }
            if !ok(s.dst, ds) {
                return Err(CopyError::InvalidPlan(format!(
                    "segment {i}: destination range {}+{} exceeds destination size {ds}",
                    s.dst, s.len
                )));
            }
        }
        if let Some(ends) = &self.checksum_groups {
            let increasing = ends.windows(2).all(|w| w[0] < w[1]) && ends.first().is_some_and(|e| *e > 0);
            if !increasing || ends.last() != Some(&self.segments.len()) {
                return Err(CopyError::InvalidPlan(format!(
                    "checksum groups {ends:?} must be strictly increasing and end at {} segments",
                    self.segments.len()
                )));
            }
        }
        let same = matches!((self.src.identity(), self.dst.identity()), (Some(a), Some(b)) if a == b);
        let mut ranges: Vec<(usize, usize, bool)> =
            self.segments.iter().map(|s| (s.dst, s.dst + s.len, true)).collect();
        if same {
            ranges.extend(self.segments.iter().map(|s| (s.src, s.src + s.len, false)));
        }
        ranges.sort_unstable();
        // Any overlap involving at least one destination range is a conflict.
        let mut reach_dst = 0usize; // furthest end among destination ranges seen
        let mut reach_any = 0usize; // furthest end among all ranges seen
        for (start, end, is_dst) in ranges {
            if start < reach_dst || (is_dst && start < reach_any) {
                return Err(CopyError::InvalidPlan(format!(
                    "destination range starting at {start} overlaps another range of the plan"
                )));
            }
            reach_any = reach_any.max(end);
            if is_dst {
                reach_dst = reach_dst.max(end);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(n: usize) -> Arc<Region> {
        Arc::new(Region::host("r", n).unwrap())
    }

    #[test]
    fn out_of_bounds_and_overlap_are_rejected() {
        let p = CopyPlan::new(region(100), region(100)).with(90, 0, 20);
        assert!(matches!(p.validate(), Err(CopyError::InvalidPlan(m)) if m.contains("source")));
        let p = CopyPlan::new(region(100), region(100)).with(0, 90, 20);
        assert!(matches!(p.validate(), Err(CopyError::InvalidPlan(m)) if m.contains("destination")));
        let p = CopyPlan::new(region(100), region(100)).with(0, 0, 10).with(20, 5, 10);
        assert!(p.validate().is_err(), "overlapping destinations");
        let p = CopyPlan::new(region(100), region(100)).with(0, 0, 10).with(0, 10, 10);
        assert!(p.validate().is_ok(), "reading a source twice is fine");
        let r = region(100);
        let p = CopyPlan::new(r.clone(), r.clone()).with(0, 5, 10);
        assert!(p.validate().is_err(), "in-place overlap");
        let p = CopyPlan::new(r.clone(), r).with(0, 50, 10);
        assert!(p.validate().is_ok());
        let p = CopyPlan::new(region(10), region(10)).with(usize::MAX, 0, 2);
        assert!(p.validate().is_err());
    }
}
