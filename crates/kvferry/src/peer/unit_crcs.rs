//! A host publication's crc32c per 4 KiB unit, taken once when it is published.
//!
//! # Semantics
//!
//! [`UnitCrcs::compute`] reads a publication's ranges once: it cuts every range into
//! [`UNIT`]-byte units from the range's start (the last unit of a range may be
//! shorter), keeps each unit's crc32c, and returns the whole chunk's crc32c as well
//! (the units folded together, no second pass). Publications of the same blocks
//! published while an earlier one is live (a request's reader slots) share them, so a
//! request is read once however many keys it is published under.
//!
//! A selected get (a subset of blocks, a byte slice of every piece: one decode rank's
//! KV heads) sends part of a publication. [`selected_checksum`] gives the crc32c of
//! the selected ranges from these units wherever a range starts on a unit boundary and
//! ends on one (or at its range's end) — every head slice of a KV block whose heads
//! are 4 KiB or a multiple, and every whole block. Two things follow:
//!
//! - the selected bytes are not read again to checksum them (one pass fewer per byte
//!   on the producer);
//! - the consumer checks them against the bytes **as they were published**: an engine
//!   that wrote a published block before its release is caught, as it is for a whole
//!   publication.
//!
//! A range the units do not cover exactly is read and checksummed as it is sent (the
//! behaviour before units existed).

use crate::checksum::{self, FixedCombine};
use crate::layout::KvCache;
use crate::mem::MemError;

/// Bytes per unit: one KV head of a 16-token block of 128 fp16 values, and the page
/// size, so that head slices and blocks usually start and end on unit boundaries.
pub(crate) const UNIT: usize = 4096;

/// Folds the crc of one full unit onto a running crc.
static UNIT_COMBINE: FixedCombine = FixedCombine::new(UNIT);

/// The units of one publication (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct UnitCrcs {
    /// The publication's ranges sorted by offset: `(offset, len, index of the range's
    /// first unit in crcs)`.
    by_offset: Vec<(usize, usize, usize)>,
    /// Every unit's crc32c, range by range in the publication's order.
    crcs: Vec<u32>,
}

impl UnitCrcs {
    /// Reads `ranges` of `cache` once: their units' crcs and the crc32c of all of them
    /// in order.
    pub(crate) fn compute(cache: &KvCache, ranges: &[(usize, usize)]) -> Result<(UnitCrcs, u32), MemError> {
        let units: usize = ranges.iter().map(|&(_, len)| len.div_ceil(UNIT)).sum();
        let mut crcs = Vec::with_capacity(units);
        let mut by_offset = Vec::with_capacity(ranges.len());
        let mut whole = 0u32;
        for &(off, len) in ranges {
            by_offset.push((off, len, crcs.len()));
            // The range's slices (a range may cross regions), cut into units counted
            // from the range's start.
            let (mut unit, mut filled) = (0u32, 0usize);
            for slice in cache.io_slices(&[(off, len)])? {
                let mut rest = slice;
                while !rest.is_empty() {
                    let take = rest.len().min(UNIT - filled);
                    unit = checksum::append(unit, &rest[..take]);
                    filled += take;
                    rest = &rest[take..];
                    if filled == UNIT {
                        crcs.push(unit);
                        whole = UNIT_COMBINE.combine(whole, unit);
                        (unit, filled) = (0, 0);
                    }
                }
            }
            if filled > 0 {
                crcs.push(unit);
                whole = checksum::combine(whole, unit, filled);
            }
        }
        by_offset.sort_unstable_by_key(|r| r.0);
        Ok((UnitCrcs { by_offset, crcs }, whole))
    }

    /// `crc` extended by the bytes `[off, off + len)` from the units, if they lie in
    /// one range, start on a unit boundary of it and end on one or at its end; `None`
    /// otherwise.
    fn append(&self, crc: u32, off: usize, len: usize) -> Option<u32> {
        // The last range starting at or before `off`.
        let at = self.by_offset.partition_point(|r| r.0 <= off).checked_sub(1)?;
        let (r_off, r_len, first) = self.by_offset[at];
        let rel = off - r_off;
        let end = rel.checked_add(len)?;
        if end > r_len || !rel.is_multiple_of(UNIT) || (!end.is_multiple_of(UNIT) && end != r_len) {
            return None;
        }
        let mut crc = crc;
        let mut at_byte = rel;
        for &unit in &self.crcs[first + rel / UNIT..first + end.div_ceil(UNIT)] {
            let n = UNIT.min(end - at_byte);
            crc = match n {
                UNIT => UNIT_COMBINE.combine(crc, unit),
                _ => checksum::combine(crc, unit, n),
            };
            at_byte += n;
        }
        Some(crc)
    }
}

/// The crc32c of `ranges` of `cache`, in order: from the units of `publications`
/// where one covers a range exactly (see the module docs), else read from the cache.
pub(crate) fn selected_checksum(
    publications: &[&UnitCrcs],
    cache: &KvCache,
    ranges: &[(usize, usize)],
) -> Result<u32, MemError> {
    let mut crc = 0u32;
    for &(off, len) in ranges {
        crc = match publications.iter().find_map(|u| u.append(crc, off, len)) {
            Some(c) => c,
            None => cache.append_checksum(crc, &[(off, len)])?,
        };
    }
    Ok(crc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Region;
    use std::sync::Arc;

    /// A host cache of one region of `bytes` (one block), filled with a pattern, and
    /// the region (to write to it afterwards).
    fn cache(bytes: usize) -> (Arc<Region>, KvCache) {
        let region = Arc::new(Region::host("units", bytes).expect("region"));
        let data: Vec<u8> = (0..bytes as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        region.write(0, &data).expect("write");
        let c = KvCache::contiguous(region.clone(), bytes).expect("cache");
        (region, c)
    }

    fn read(c: &KvCache, ranges: &[(usize, usize)]) -> u32 {
        c.checksum(ranges).expect("in range")
    }

    #[test]
    fn whole_crc_and_every_covered_or_uncovered_range_match_the_bytes() {
        let (_, c) = cache(64 * UNIT + 300);
        // Ranges of the publication, not sorted by offset, some not unit multiples.
        let ranges = [
            (10 * UNIT, 4 * UNIT),
            (0, 3 * UNIT + 17),
            (20 * UNIT + 5, 2 * UNIT),
            (40 * UNIT, 24 * UNIT + 300),
        ];
        let (units, whole) = UnitCrcs::compute(&c, &ranges).expect("compute");
        assert_eq!(whole, read(&c, &ranges), "the whole crc");
        let p = [&units];
        let cases: &[&[(usize, usize)]] = &[
            &[(10 * UNIT, UNIT), (11 * UNIT, 2 * UNIT)],     // unit-aligned slices
            &[(0, 3 * UNIT + 17)],                           // a whole range with a short last unit
            &[(UNIT, 2 * UNIT + 17), (10 * UNIT, 4 * UNIT)], // to a range's end
            &[(20 * UNIT + 5, 2 * UNIT)],                    // a range not starting on a page
            &[(20 * UNIT + 5 + UNIT, UNIT)],                 // its second unit
            &[(10 * UNIT + 1, UNIT)],                        // not on a unit boundary: read
            &[(10 * UNIT, UNIT + 3)],                        // ends mid-unit: read
            &[(30 * UNIT, UNIT)],                            // not published: read
            &[(13 * UNIT, 2 * UNIT)],                        // runs past its range: read
            &[(40 * UNIT, 24 * UNIT + 300), (0, UNIT)],      // last range, short tail
        ];
        for ranges in cases {
            assert_eq!(
                selected_checksum(&p, &c, ranges).unwrap(),
                read(&c, ranges),
                "{ranges:?}"
            );
        }
        assert_eq!(
            selected_checksum(&[], &c, cases[0]).unwrap(),
            read(&c, cases[0]),
            "no units: read"
        );
    }

    #[test]
    fn a_block_written_after_publication_no_longer_matches() {
        let (region, c) = cache(8 * UNIT);
        let (units, _) = UnitCrcs::compute(&c, &[(0, 8 * UNIT)]).expect("compute");
        let slice = [(2 * UNIT, 2 * UNIT)];
        let published = selected_checksum(&[&units], &c, &slice).unwrap();
        region.write(3 * UNIT + 9, &[0xAB]).expect("write");
        assert_eq!(
            selected_checksum(&[&units], &c, &slice).unwrap(),
            published,
            "from the units"
        );
        assert_ne!(
            read(&c, &slice),
            published,
            "the bytes sent now differ: the consumer's check fails"
        );
    }

    proptest::proptest! {
        #[test]
        fn any_unit_aligned_selection_matches_the_bytes(
            lens in proptest::collection::vec(1usize..6 * UNIT, 1..6),
            picks in proptest::collection::vec((0usize..6, 0usize..6, 1usize..6), 1..8),
        ) {
            let total: usize = lens.iter().sum::<usize>() + lens.len() * 100;
            let (_, c) = cache(total);
            let mut ranges = Vec::new();
            let mut at = 0;
            for len in &lens {
                ranges.push((at, *len));
                at += len + 100;
            }
            let (units, whole) = UnitCrcs::compute(&c, &ranges).unwrap();
            proptest::prop_assert_eq!(whole, read(&c, &ranges));
            let sel: Vec<(usize, usize)> = picks
                .iter()
                .map(|&(r, u, n)| {
                    let (off, len) = ranges[r % ranges.len()];
                    let start = (u * UNIT).min(len - 1);
                    (off + start, (n * UNIT).min(len - start))
                })
                .collect();
            proptest::prop_assert_eq!(selected_checksum(&[&units], &c, &sel).unwrap(), read(&c, &sel));
        }
    }
}
