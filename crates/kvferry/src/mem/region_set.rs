//! [`RegionSet`]: several registered regions addressed as one memory, region after
//! region (region `i` starts where region `i - 1` ends), so that a KV cache made of
//! one tensor per layer is one copy source or destination.
//!
//! The set holds every region through an `Arc`: a copy or socket operation that holds
//! the set keeps all of them (and whatever they keep alive) until it has drained.

use std::sync::Arc;

use super::{HostMemory, MemError, Region};

/// Regions laid end to end.
#[derive(Debug)]
pub struct RegionSet {
    regions: Vec<Arc<Region>>,
    /// Start of each region in the set's address space, plus the total at the end.
    starts: Vec<usize>,
}

impl RegionSet {
    /// The set of `regions`, in order.
    pub fn new(regions: Vec<Arc<Region>>) -> RegionSet {
        let mut starts = Vec::with_capacity(regions.len() + 1);
        let mut at = 0usize;
        for r in &regions {
            starts.push(at);
            at += r.len();
        }
        starts.push(at);
        RegionSet { regions, starts }
    }

    /// The regions.
    pub fn regions(&self) -> &[Arc<Region>] {
        &self.regions
    }

    /// Where region `i` starts in the set's address space.
    pub fn start_of(&self, i: usize) -> usize {
        self.starts[i]
    }
}

impl HostMemory for RegionSet {
    fn size(&self) -> usize {
        *self.starts.last().expect("starts has a total")
    }

    fn for_each_run(&self, offset: usize, len: usize, f: &mut dyn FnMut(*mut u8, usize)) -> Result<(), MemError> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => {}
            _ => return Err(MemError::OutOfBounds { offset, len, size }),
        }
        let (mut at, end) = (offset, offset + len);
        while at < end {
            // The last region whose start is <= at (regions may be empty).
            let i = self.starts.partition_point(|s| *s <= at) - 1;
            let r = &self.regions[i];
            let within = at - self.starts[i];
            let n = (r.len() - within).min(end - at);
            if n > 0 {
                r.for_each_run(within, n, f)?;
            }
            at += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_region_boundaries() {
        let a = Arc::new(Region::host("a", 100).unwrap());
        let b = Arc::new(Region::host("b", 50).unwrap());
        let set = RegionSet::new(vec![a.clone(), b.clone()]);
        assert_eq!(set.size(), 150);
        assert_eq!(set.start_of(1), 100);
        let mut runs = Vec::new();
        set.for_each_run(90, 30, &mut |_, n| runs.push(n)).unwrap();
        assert_eq!(runs, vec![10, 20]);
        assert!(set.for_each_run(140, 11, &mut |_, _| {}).is_err());
    }
}
