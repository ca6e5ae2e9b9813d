//! A [`Lease`]: exclusive ownership of one or more arena pages (not necessarily
//! adjacent), addressed as one logical byte range `0..page_count * page_size`.
//!
//! The pages return to the arena's free list when the lease is dropped — by whoever
//! holds it at that moment (the caller, a copy job, a socket write). A lease that may
//! still be targeted by hardware that could not be drained is turned into a
//! [`Quarantined`] instead, whose pages are never reused until [`Quarantined::release`].

use std::sync::Arc;

use super::arena::ArenaInner;
use super::region::HostMemory;
use super::MemError;

/// Exclusive ownership of some arena pages. `Send + 'static`; not `Clone`.
pub struct Lease {
    arena: Arc<ArenaInner>,
    pages: Vec<u32>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("pages", &self.pages).finish()
    }
}

impl Lease {
    pub(crate) fn new(arena: Arc<ArenaInner>, pages: Vec<u32>) -> Lease {
        Lease { arena, pages }
    }

    #[cfg(test)]
    pub(crate) fn page_ids(&self) -> &[u32] {
        &self.pages
    }

    #[cfg(test)]
    pub(crate) fn arena_inner(&self) -> &Arc<ArenaInner> {
        &self.arena
    }

    /// Number of pages held.
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Bytes per page.
    pub fn page_size(&self) -> usize {
        self.arena.page_size()
    }

    /// Total bytes addressable through this lease.
    pub fn len(&self) -> usize {
        self.pages.len() * self.arena.page_size()
    }

    /// Always false: a lease holds at least one page.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    fn page_ptr(&self, i: usize) -> *mut u8 {
        // SAFETY: page ids are < page_count, so the offset stays inside the backing.
        unsafe { self.arena.base().add(self.pages[i] as usize * self.arena.page_size()) }
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(MemError::OutOfBounds {
                offset,
                len,
                size: self.len(),
            }),
        }
    }

    /// Copies `data` into the lease at `offset`.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.check(offset, data.len())?;
        let mut done = 0;
        self.for_each_run(offset, data.len(), &mut |ptr, n| {
            // SAFETY: `&mut self` proves exclusive access to these pages; the run lies
            // inside one of our pages (checked above) and `data[done..done+n]` is in bounds.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(done), ptr, n) };
            done += n;
        })
    }

    /// Copies bytes at `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), MemError> {
        self.check(offset, out.len())?;
        let mut done = 0;
        let dst = out.as_mut_ptr();
        self.for_each_run(offset, out.len(), &mut |ptr, n| {
            // SAFETY: a `&Lease` exists only while no job owns the lease, so nothing
            // writes these pages concurrently; ranges are in bounds (checked above).
            unsafe { std::ptr::copy_nonoverlapping(ptr, dst.add(done), n) };
            done += n;
        })
    }

    /// The bytes at `offset..offset+len` as a new vector.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, MemError> {
        let mut v = vec![0; len];
        self.read_at(offset, &mut v)?;
        Ok(v)
    }

    /// The contiguous piece of page `i` as a slice (for socket writes).
    pub fn page(&self, i: usize) -> &[u8] {
        // SAFETY: page `i` is ours and in bounds; `&self` means no job is writing it.
        unsafe { std::slice::from_raw_parts(self.page_ptr(i), self.arena.page_size()) }
    }

    /// Page `i` as a mutable slice (for socket reads).
    pub fn page_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: as `page`, with `&mut self` proving exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.page_ptr(i), self.arena.page_size()) }
    }

    /// The bytes at `offset..offset+len` as page-contiguous slices (for vectored
    /// socket writes).
    pub fn io_slices(&self, offset: usize, len: usize) -> Result<Vec<&[u8]>, MemError> {
        let mut out = Vec::new();
        self.for_each_run(offset, len, &mut |p, n| {
            // SAFETY: the run lies in our pages; `&self` means no job writes them, and
            // the slices borrow `self` so the pages cannot be released meanwhile.
            out.push(unsafe { std::slice::from_raw_parts(p as *const u8, n) })
        })?;
        Ok(out)
    }

    /// Mutable page-contiguous slices of `offset..offset+len` (for socket reads).
    pub fn io_slices_mut(&mut self, offset: usize, len: usize) -> Result<Vec<&mut [u8]>, MemError> {
        let mut out = Vec::new();
        self.for_each_run(offset, len, &mut |p, n| {
            // SAFETY: runs are disjoint parts of our pages and `&mut self` proves
            // exclusive access for the slices' lifetime.
            out.push(unsafe { std::slice::from_raw_parts_mut(p, n) })
        })?;
        Ok(out)
    }

    /// Returns all pages beyond the first `keep` to the arena now.
    pub fn truncate(&mut self, keep: usize) {
        let keep = keep.max(1);
        if keep >= self.pages.len() {
            return;
        }
        let extra: Vec<u32> = self.pages.split_off(keep);
        // Account the extra pages as a separate lease being dropped.
        self.arena.split_lease();
        drop(Lease {
            arena: self.arena.clone(),
            pages: extra,
        });
    }

    /// Withholds these pages from reuse: hardware may still target them.
    pub fn quarantine(mut self) -> Quarantined {
        let pages = std::mem::take(&mut self.pages);
        self.arena.quarantine(&pages);
        Quarantined {
            arena: self.arena.clone(),
            pages,
        }
    }
}

impl HostMemory for Lease {
    fn size(&self) -> usize {
        self.len()
    }

    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError> {
        self.check(offset, len)?;
        let ps = self.arena.page_size();
        let mut off = offset;
        let end = offset + len;
        while off < end {
            let page = off / ps;
            let in_page = off % ps;
            // Merge physically adjacent pages into one run.
            let mut run = (ps - in_page).min(end - off);
            let mut next = page + 1;
            while off + run < end && next < self.pages.len() && self.pages[next] == self.pages[next - 1] + 1 {
                run += ps.min(end - off - run);
                next += 1;
            }
            // SAFETY: `in_page < ps`, inside page `page` which we own.
            f(unsafe { self.page_ptr(page).add(in_page) }, run);
            off += run;
        }
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            self.arena.release(&self.pages);
        }
    }
}

/// Pages withheld from reuse because hardware may still target them. Dropping this
/// without [`release`](Quarantined::release) keeps them quarantined forever (counted in
/// [`super::ArenaStats::quarantined_pages`]); the memory stays mapped.
#[must_use = "dropping a Quarantined keeps its pages out of use forever"]
pub struct Quarantined {
    arena: Arc<ArenaInner>,
    pages: Vec<u32>,
}

impl Quarantined {
    /// Number of pages withheld.
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// The hardware confirmed it no longer targets these pages: reuse them.
    pub fn release(self) {
        self.arena.unquarantine(&self.pages);
    }
}

impl std::fmt::Debug for Quarantined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quarantined").field("pages", &self.pages).finish()
    }
}

#[cfg(test)]
mod tests {
    use crate::mem::{Arena, ArenaConfig, HostMemory};

    #[test]
    fn scattered_pages_read_back_what_was_written() {
        let a = Arena::new(ArenaConfig::new(4096, 8).unpinned()).unwrap();
        let hold = [
            a.try_alloc(1).unwrap(),
            a.try_alloc(1).unwrap(),
            a.try_alloc(1).unwrap(),
        ];
        drop(hold.into_iter().nth(1)); // leave a hole so the next lease is scattered
        let mut l = a.try_alloc(6).unwrap(); // pages 3..8 then 1: not adjacent
        let data: Vec<u8> = (0..6 * 4096).map(|i| (i * 7 % 251) as u8).collect();
        l.write_at(0, &data).unwrap();
        assert_eq!(l.to_vec(0, data.len()).unwrap(), data);
        assert_eq!(l.to_vec(4000, 300).unwrap(), data[4000..4300]);
        let mut runs = 0;
        l.for_each_run(0, l.len(), &mut |_, _| runs += 1).unwrap();
        assert!(runs >= 2, "scattered lease must yield several runs");
        assert!(l.write_at(6 * 4096 - 1, b"xx").is_err());
        assert_eq!(l.to_vec(5 * 4096 - 10, 20).unwrap(), data[5 * 4096 - 10..5 * 4096 + 10]);
    }

    #[test]
    fn truncate_returns_extra_pages() {
        let a = Arena::new(ArenaConfig::new(4096, 4).unpinned()).unwrap();
        let mut l = a.try_alloc(4).unwrap();
        l.truncate(1);
        let s = a.stats();
        assert_eq!((s.free_pages, s.leased_pages, s.outstanding_leases), (3, 1, 1));
        drop(l);
        assert_eq!(a.stats().free_pages, 4);
        assert_eq!(a.stats().outstanding_leases, 0);
    }

    #[test]
    fn lease_is_send_and_static() {
        fn assert_send_static<T: Send + 'static>() {}
        assert_send_static::<super::Lease>();
    }
}
