//! Partial gets: a consumer's [`Selection`] of part of a publication, turned into the
//! byte ranges a producer sends (`SourcePlan`) and the ranges a consumer lands them
//! into (`LandingPlan`).
//!
//! # Semantics
//!
//! A request's keys name publications; their blocks, concatenated in key order, are
//! the request's *block list*. Each block is made of *pieces*: the spans of its cache's
//! [`BlockMap`] (one per layer and K/V for a vLLM cache; one per block for one buffer
//! of blocks). A [`Selection`] says:
//!
//! - `blocks`: positions into the block list, in the order they land into the
//!   destination's blocks (so the destination lists exactly as many blocks); `None`:
//!   every block, in order;
//! - `src_ranges`: ordered `(offset, length)` ranges inside every source piece; the
//!   producer sends exactly these bytes, in this order (a permutation is fine); `None`:
//!   the whole piece;
//! - `dst_ranges`: ordered ranges inside every destination piece, filled in order by
//!   the bytes the piece receives; they must not overlap; `None`: the whole piece.
//!
//! Source and destination must have as many pieces per block, and each piece's
//! selected source bytes must equal its destination bytes. A mismatch is a
//! [`SelectionError`] naming it: checked on the consumer before sending where it can
//! be (destination ranges, block counts, totals when both sides' ranges are given),
//! by the producer on receipt (positions, source ranges, piece counts and totals
//! against the consumer's announced expectation), and by the consumer again against
//! the shape the producer announces (`StagedSelected`).
//!
//! A selection applies to published blocks of one cache (host or device); the
//! request's keys must all be published, from that cache. The producer sends the
//! selected bytes zero-copy from a host cache (vectored writes over the ranges; each
//! frame's crc32c is made of the crcs of 4 KiB units taken at publication, see
//! `unit_crcs`, and computed over the bytes only where units do not cover a range
//! exactly), or gathers only them
//! into staging pages from a device cache (or, to a same-host device destination on
//! the device-IPC mover, names them in its exported device memory: no gather). The consumer reads them straight into its
//! destination ranges (direct) or into staging pages it then scatters (staged, host or
//! device).
//!
//! Work is bounded: ranges are generated frame by frame (at most
//! [`MAX_BLOCK_SEGMENTS`] per block), and the whole stream at once only for a device
//! copy or a staged landing, at most [`MAX_PLAN_SEGMENTS`] segments.

use std::collections::VecDeque;

use crate::layout::{BlockMap, Span};
use crate::wire::selection::{check_ranges, ranges_in_piece, MAX_SELECTED_BLOCKS};
use crate::wire::{ChunkKey, SelectedShape, SelectionError, WireSelection};

/// Most segments (pieces × ranges) one selected block may make.
pub const MAX_BLOCK_SEGMENTS: usize = 1 << 20;
/// Most segments a whole stream may make where it is planned at once (a device
/// gather or scatter, a staged landing copy).
pub const MAX_PLAN_SEGMENTS: usize = 1 << 24;
/// Bytes a producer aims to put into one bulk frame of a selected stream.
pub const FRAME_TARGET_BYTES: usize = 4 << 20;

/// Which part of a publication a get, pull or stage moves (see the module docs).
/// Immutable once built; [`Selection::all`] is the whole publication.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    blocks: Option<Vec<u32>>,
    src_ranges: Option<Vec<(usize, usize)>>,
    dst_ranges: Option<Vec<(usize, usize)>>,
}

impl Selection {
    /// Every block, whole pieces: the same bytes as a get without a selection, landed
    /// by the selection rules (one flat destination block list).
    pub fn all() -> Selection {
        Selection::default()
    }

    /// A selection; checks what can be checked without a publication: list bounds,
    /// non-empty ranges without overflow, destination ranges that do not overlap, and
    /// equal totals when both range lists are given.
    pub fn new(
        blocks: Option<Vec<u32>>,
        src_ranges: Option<Vec<(usize, usize)>>,
        dst_ranges: Option<Vec<(usize, usize)>>,
    ) -> Result<Selection, SelectionError> {
        let s = Selection {
            blocks,
            src_ranges,
            dst_ranges,
        };
        s.wire(None, None).validate()?;
        if let Some(d) = &s.dst_ranges {
            check_ranges("destination", &to_u64(d))?;
            check_disjoint(d)?;
        }
        if let (Some(a), Some(b)) = (s.src_total(), s.dst_total()) {
            if a != b {
                return Err(SelectionError::TotalsDiffer {
                    piece: 0,
                    src: a as u64,
                    dst: b as u64,
                });
            }
        }
        Ok(s)
    }

    /// Positions into the request's block list (`None`: every block).
    pub fn blocks(&self) -> Option<&[u32]> {
        self.blocks.as_deref()
    }

    /// Ranges inside every source piece (`None`: whole pieces).
    pub fn src_ranges(&self) -> Option<&[(usize, usize)]> {
        self.src_ranges.as_deref()
    }

    /// Ranges inside every destination piece (`None`: whole pieces).
    pub fn dst_ranges(&self) -> Option<&[(usize, usize)]> {
        self.dst_ranges.as_deref()
    }

    /// The same blocks and source ranges (what a producer stages), other destination
    /// ranges: how a staged handle's selection lands into another layout.
    pub fn with_dst_ranges(&self, dst_ranges: Option<Vec<(usize, usize)>>) -> Result<Selection, SelectionError> {
        Selection::new(self.blocks.clone(), self.src_ranges.clone(), dst_ranges)
    }

    fn src_total(&self) -> Option<usize> {
        self.src_ranges.as_ref().map(|r| r.iter().map(|x| x.1).sum())
    }

    fn dst_total(&self) -> Option<usize> {
        self.dst_ranges.as_ref().map(|r| r.iter().map(|x| x.1).sum())
    }

    /// The wire form, with what the destination will land when known.
    pub(crate) fn wire(&self, expect_blocks: Option<u32>, expect_pieces: Option<Vec<u64>>) -> WireSelection {
        WireSelection {
            blocks: self.blocks.clone(),
            ranges: self.src_ranges.as_ref().map(|r| to_u64(r)),
            expect_blocks,
            expect_pieces,
        }
    }

    /// Checks the selection against a destination (its map and flat block list)
    /// before anything is sent; returns the wire form carrying the expectation.
    pub(crate) fn check_destination(
        &self,
        map: &BlockMap,
        dst_blocks: &[u32],
    ) -> Result<WireSelection, SelectionError> {
        if let Some(b) = &self.blocks {
            if b.len() != dst_blocks.len() {
                return Err(SelectionError::BlockCountsDiffer {
                    selected: b.len(),
                    dst: dst_blocks.len(),
                });
            }
        }
        if dst_blocks.len() > MAX_SELECTED_BLOCKS {
            return Err(SelectionError::TooMany {
                what: "destination blocks",
                len: dst_blocks.len(),
                limit: MAX_SELECTED_BLOCKS,
            });
        }
        let pieces = self.dst_pieces(map)?;
        if let Some(src) = self.src_total() {
            if let Some((i, &d)) = pieces.iter().enumerate().find(|(_, d)| **d != src as u64) {
                return Err(SelectionError::TotalsDiffer {
                    piece: i,
                    src: src as u64,
                    dst: d,
                });
            }
        }
        let segments = (map.spans().len()).saturating_mul(self.dst_ranges.as_ref().map_or(1, Vec::len));
        if segments > MAX_BLOCK_SEGMENTS {
            return Err(SelectionError::TooMany {
                what: "segments per destination block (pieces x ranges)",
                len: segments,
                limit: MAX_BLOCK_SEGMENTS,
            });
        }
        Ok(self.wire(Some(dst_blocks.len() as u32), Some(pieces)))
    }

    /// Destination bytes of each piece of `map`'s blocks.
    fn dst_pieces(&self, map: &BlockMap) -> Result<Vec<u64>, SelectionError> {
        map.spans()
            .iter()
            .enumerate()
            .map(|(i, s)| match &self.dst_ranges {
                None => Ok(s.len as u64),
                Some(r) => ranges_in_piece("destination", &to_u64(r), i, s.len as u64),
            })
            .collect()
    }
}

fn to_u64(r: &[(usize, usize)]) -> Vec<(u64, u64)> {
    r.iter().map(|&(o, l)| (o as u64, l as u64)).collect()
}

/// Destination ranges must not overlap: the same bytes would be written twice.
fn check_disjoint(ranges: &[(usize, usize)]) -> Result<(), SelectionError> {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    for w in sorted.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(SelectionError::Overlap {
                a_offset: w[0].0 as u64,
                a_len: w[0].1 as u64,
                b_offset: w[1].0 as u64,
                b_len: w[1].1 as u64,
            });
        }
    }
    Ok(())
}

/// Pushes one block's segments (for each span, for each range) onto `out`, merging
/// adjacent ones.
fn block_segments(spans: &[Span], ranges: Option<&[(usize, usize)]>, block: u32, out: &mut Vec<(usize, usize)>) {
    for s in spans {
        let base = s.offset + block as usize * s.stride;
        let mut push = |off: usize, len: usize| match out.last_mut() {
            Some((o, l)) if *o + *l == off => *l += len,
            _ => out.push((off, len)),
        };
        match ranges {
            None => push(base, s.len),
            Some(r) => r.iter().for_each(|&(o, l)| push(base + o, l)),
        }
    }
}

/// What a producer sends for a selection: the selected blocks of one cache, cut into
/// frames at block boundaries.
#[derive(Debug)]
pub(crate) struct SourcePlan {
    /// What the stream holds (announced to the consumer).
    pub shape: SelectedShape,
    blocks: Vec<u32>,
    spans: Vec<Span>,
    ranges: Option<Vec<(usize, usize)>>,
    /// Per frame: `[start, end)` into `blocks`, and the key of its first block.
    frames: Vec<(usize, usize, ChunkKey)>,
}

impl SourcePlan {
    /// Frames of the stream.
    pub fn frame_count(&self) -> usize {
        self.frames.len()
    }

    /// Frame `i`'s key (that of its first block) and length in bytes.
    pub fn frame(&self, i: usize) -> (ChunkKey, usize) {
        let (a, b, key) = self.frames[i];
        (key, (b - a) * self.shape.block_bytes() as usize)
    }

    /// Frame `i`'s ranges in the cache's address space, in stream order.
    pub fn frame_ranges(&self, i: usize) -> Vec<(usize, usize)> {
        let (a, b, _) = self.frames[i];
        let mut out = Vec::new();
        for &block in &self.blocks[a..b] {
            block_segments(&self.spans, self.ranges.as_deref(), block, &mut out);
        }
        out
    }

    /// Every frame's ranges at once (a device gather), bounded by
    /// [`MAX_PLAN_SEGMENTS`].
    pub fn all_ranges(&self) -> Result<Vec<Vec<(usize, usize)>>, SelectionError> {
        let per_block = self.spans.len() * self.ranges.as_ref().map_or(1, Vec::len);
        let segments = per_block.saturating_mul(self.blocks.len());
        if segments > MAX_PLAN_SEGMENTS {
            return Err(SelectionError::TooMany {
                what: "segments in one device copy",
                len: segments,
                limit: MAX_PLAN_SEGMENTS,
            });
        }
        Ok((0..self.frames.len()).map(|i| self.frame_ranges(i)).collect())
    }
}

/// Plans what a producer sends for `sel` over publications `pubs` (each a key and its
/// blocks, in request order) of one cache with block map `map`. `max_frames` and
/// `max_frame_bytes` are the consumer's bounds on a reply's chunk list and a bulk
/// frame.
pub(crate) fn plan_source(
    pubs: &[(ChunkKey, &[u32])],
    map: &BlockMap,
    sel: &WireSelection,
    max_frames: usize,
    max_frame_bytes: u64,
) -> Result<SourcePlan, SelectionError> {
    sel.validate()?;
    let spans = map.spans().to_vec();
    let total_blocks: usize = pubs.iter().map(|(_, b)| b.len()).sum();
    // Every position resolved to (cache block, key).
    let mut owner = Vec::with_capacity(total_blocks);
    for (key, blocks) in pubs {
        owner.extend(blocks.iter().map(|b| (*b, *key)));
    }
    let positions: Vec<u32> = match &sel.blocks {
        Some(p) => p.clone(),
        None => {
            if total_blocks > MAX_SELECTED_BLOCKS {
                return Err(SelectionError::TooMany {
                    what: "selected blocks",
                    len: total_blocks,
                    limit: MAX_SELECTED_BLOCKS,
                });
            }
            (0..total_blocks as u32).collect()
        }
    };
    if positions.is_empty() {
        return Err(SelectionError::NoBlocks);
    }
    if let Some(&p) = positions.iter().find(|p| **p as usize >= total_blocks) {
        return Err(SelectionError::BlockOutOfRange {
            position: p,
            blocks: total_blocks,
        });
    }
    let mut pieces = Vec::with_capacity(spans.len());
    for (i, s) in spans.iter().enumerate() {
        pieces.push(sel.selected_of_piece(i, s.len as u64)?);
    }
    if let Some(expect) = &sel.expect_pieces {
        if expect.len() != pieces.len() {
            return Err(SelectionError::PieceCountsDiffer {
                src: pieces.len(),
                dst: expect.len(),
            });
        }
        if let Some((i, (s, d))) = pieces.iter().zip(expect).enumerate().find(|(_, (s, d))| s != d) {
            return Err(SelectionError::TotalsDiffer {
                piece: i,
                src: *s,
                dst: *d,
            });
        }
    }
    if let Some(n) = sel.expect_blocks {
        if n as usize != positions.len() {
            return Err(SelectionError::BlockCountsDiffer {
                selected: positions.len(),
                dst: n as usize,
            });
        }
    }
    let per_block_segments = spans.len().saturating_mul(sel.ranges.as_ref().map_or(1, Vec::len));
    if per_block_segments > MAX_BLOCK_SEGMENTS {
        return Err(SelectionError::TooMany {
            what: "segments per block (pieces x ranges)",
            len: per_block_segments,
            limit: MAX_BLOCK_SEGMENTS,
        });
    }
    let shape = SelectedShape {
        blocks: positions.len() as u32,
        pieces,
    };
    let unit = shape.block_bytes().max(1);
    if unit > max_frame_bytes {
        return Err(SelectionError::TooMany {
            what: "bytes in one selected block (over the bulk frame limit)",
            len: unit as usize,
            limit: max_frame_bytes as usize,
        });
    }
    // Blocks per frame: about the target size, fewer segments than a block's bound,
    // and few enough frames for the reply's chunk list.
    let by_bytes = (FRAME_TARGET_BYTES as u64 / unit).max(1) as usize;
    let by_segments = (MAX_BLOCK_SEGMENTS / per_block_segments.max(1)).max(1);
    let mut per_frame = by_bytes.min(by_segments);
    let need = positions.len().div_ceil(per_frame);
    if need > max_frames {
        per_frame = positions.len().div_ceil(max_frames.max(1));
        if per_frame as u64 * unit > max_frame_bytes {
            return Err(SelectionError::TooMany {
                what: "frames for the selected stream",
                len: need,
                limit: max_frames,
            });
        }
    }
    let blocks: Vec<u32> = positions.iter().map(|&p| owner[p as usize].0).collect();
    let frames = (0..positions.len())
        .step_by(per_frame)
        .map(|a| {
            let b = (a + per_frame).min(positions.len());
            (a, b, owner[positions[a] as usize].1)
        })
        .collect();
    let ranges = sel
        .ranges
        .as_ref()
        .map(|r| r.iter().map(|&(o, l)| (o as usize, l as usize)).collect());
    Ok(SourcePlan {
        shape,
        blocks,
        spans,
        ranges,
        frames,
    })
}

/// Where a consumer lands a selected stream: its destination blocks, pieces and
/// ranges, checked against the shape the producer announced.
#[derive(Clone, Debug)]
pub(crate) struct LandingPlan {
    blocks: Vec<u32>,
    spans: Vec<Span>,
    ranges: Option<Vec<(usize, usize)>>,
    total: usize,
}

impl LandingPlan {
    /// Checks `shape` (what the producer will send) against the destination `map`,
    /// its flat `dst_blocks` and the selection's destination ranges.
    pub fn new(
        map: &BlockMap,
        dst_blocks: &[u32],
        sel: &Selection,
        shape: &SelectedShape,
    ) -> Result<LandingPlan, SelectionError> {
        shape.validate()?;
        let dst = sel.dst_pieces(map)?;
        if dst.len() != shape.pieces.len() {
            return Err(SelectionError::PieceCountsDiffer {
                src: shape.pieces.len(),
                dst: dst.len(),
            });
        }
        if let Some((i, (s, d))) = shape.pieces.iter().zip(&dst).enumerate().find(|(_, (s, d))| s != d) {
            return Err(SelectionError::TotalsDiffer {
                piece: i,
                src: *s,
                dst: *d,
            });
        }
        if shape.blocks as usize != dst_blocks.len() {
            return Err(SelectionError::BlockCountsDiffer {
                selected: shape.blocks as usize,
                dst: dst_blocks.len(),
            });
        }
        let total = usize::try_from(shape.total()).map_err(|_| SelectionError::Stream("stream too large".into()))?;
        Ok(LandingPlan {
            blocks: dst_blocks.to_vec(),
            spans: map.spans().to_vec(),
            ranges: sel.dst_ranges.clone(),
            total,
        })
    }

    /// Bytes the stream lands.
    pub fn total(&self) -> usize {
        self.total
    }

    /// A cursor over the destination segments, in stream order.
    pub fn cursor(&self) -> LandingCursor<'_> {
        LandingCursor {
            plan: self,
            next_block: 0,
            pending: VecDeque::new(),
        }
    }

    /// Every destination segment at once (a staged or device landing), bounded by
    /// [`MAX_PLAN_SEGMENTS`].
    pub fn all_ranges(&self) -> Result<Vec<(usize, usize)>, SelectionError> {
        let per_block = self.spans.len() * self.ranges.as_ref().map_or(1, Vec::len);
        let segments = per_block.saturating_mul(self.blocks.len());
        if segments > MAX_PLAN_SEGMENTS {
            return Err(SelectionError::TooMany {
                what: "segments in one landing copy",
                len: segments,
                limit: MAX_PLAN_SEGMENTS,
            });
        }
        let mut out = Vec::with_capacity(segments);
        for &b in &self.blocks {
            block_segments(&self.spans, self.ranges.as_deref(), b, &mut out);
        }
        Ok(out)
    }
}

/// Walks a landing plan's segments, handing out the next `n` bytes' worth at a time
/// (a frame's), splitting a segment at a frame boundary.
pub(crate) struct LandingCursor<'a> {
    plan: &'a LandingPlan,
    next_block: usize,
    pending: VecDeque<(usize, usize)>,
}

impl LandingCursor<'_> {
    /// The destination segments of the next `n` bytes of the stream.
    pub fn take(&mut self, n: usize) -> Result<Vec<(usize, usize)>, SelectionError> {
        let mut out = Vec::new();
        let mut need = n;
        while need > 0 {
            if self.pending.is_empty() {
                let Some(&b) = self.plan.blocks.get(self.next_block) else {
                    return Err(SelectionError::Stream(format!(
                        "the producer sends more than the {} bytes the destination lands",
                        self.plan.total
                    )));
                };
                self.next_block += 1;
                let mut segs = Vec::new();
                block_segments(&self.plan.spans, self.plan.ranges.as_deref(), b, &mut segs);
                self.pending.extend(segs);
            }
            let (off, len) = self.pending.pop_front().expect("filled above");
            if len <= need {
                out.push((off, len));
                need -= len;
            } else {
                out.push((off, need));
                self.pending.push_front((off + need, len - need));
                need = 0;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> ChunkKey {
        ChunkKey([n; 32])
    }

    /// Two pieces (K, V) of 32 bytes per block, layer-separate: piece s of block b at
    /// s*256 + b*32.
    fn map() -> BlockMap {
        let spans = (0..2)
            .map(|s| Span {
                offset: s * 256,
                stride: 32,
                len: 32,
            })
            .collect();
        BlockMap::new(spans, 8).unwrap()
    }

    #[test]
    fn source_plan_selects_blocks_and_ranges() {
        let m = map();
        let blocks_a = [1u32, 2];
        let blocks_b = [5u32];
        let pubs = [(key(1), &blocks_a[..]), (key(2), &blocks_b[..])];
        let sel = WireSelection {
            blocks: Some(vec![2, 0]),
            ranges: Some(vec![(8, 8), (0, 4)]),
            expect_blocks: Some(2),
            expect_pieces: Some(vec![12, 12]),
        };
        let p = plan_source(&pubs, &m, &sel, 4096, 1 << 28).unwrap();
        assert_eq!(p.shape.pieces, vec![12, 12]);
        assert_eq!(p.frame_count(), 1);
        assert_eq!(p.frame(0), (key(2), 48));
        // block 5 then block 1, each: K (8..16, 0..4) then V.
        assert_eq!(
            p.frame_ranges(0),
            vec![
                (5 * 32 + 8, 8),
                (5 * 32, 4),
                (256 + 5 * 32 + 8, 8),
                (256 + 5 * 32, 4),
                (32 + 8, 8),
                (32, 4),
                (256 + 32 + 8, 8),
                (256 + 32, 4)
            ]
        );
        let out = plan_source(
            &pubs,
            &m,
            &WireSelection {
                blocks: Some(vec![3]),
                ..Default::default()
            },
            4096,
            1 << 28,
        );
        assert_eq!(
            out.unwrap_err(),
            SelectionError::BlockOutOfRange { position: 3, blocks: 3 }
        );
        let wide = WireSelection {
            ranges: Some(vec![(30, 4)]),
            ..Default::default()
        };
        assert!(matches!(
            plan_source(&pubs, &m, &wide, 4096, 1 << 28),
            Err(SelectionError::RangeOutsidePiece { piece_bytes: 32, .. })
        ));
        let pieces = WireSelection {
            expect_pieces: Some(vec![32]),
            ..Default::default()
        };
        assert_eq!(
            plan_source(&pubs, &m, &pieces, 4096, 1 << 28).unwrap_err(),
            SelectionError::PieceCountsDiffer { src: 2, dst: 1 }
        );
        // Frames are cut when the reply's chunk list would be too long.
        let p = plan_source(&pubs, &m, &WireSelection::default(), 2, 1 << 28).unwrap();
        assert!(p.frame_count() <= 2);
    }

    #[test]
    fn landing_cursor_splits_at_frame_boundaries() {
        let m = map();
        let sel = Selection::new(None, Some(vec![(0, 16)]), Some(vec![(16, 16)])).unwrap();
        let wire = sel.check_destination(&m, &[3, 4]).unwrap();
        assert_eq!(wire.expect_pieces, Some(vec![16, 16]));
        let shape = SelectedShape {
            blocks: 2,
            pieces: vec![16, 16],
        };
        let plan = LandingPlan::new(&m, &[3, 4], &sel, &shape).unwrap();
        assert_eq!(plan.total(), 64);
        let mut c = plan.cursor();
        assert_eq!(c.take(20).unwrap(), vec![(3 * 32 + 16, 16), (256 + 3 * 32 + 16, 4)]);
        assert_eq!(
            c.take(44).unwrap(),
            vec![(256 + 3 * 32 + 20, 12), (4 * 32 + 16, 16), (256 + 4 * 32 + 16, 16)]
        );
        assert!(c.take(1).is_err());
        let bad = SelectedShape {
            blocks: 2,
            pieces: vec![16, 8],
        };
        assert_eq!(
            LandingPlan::new(&m, &[3, 4], &sel, &bad).unwrap_err(),
            SelectionError::TotalsDiffer {
                piece: 1,
                src: 8,
                dst: 16
            }
        );
    }

    #[test]
    fn consumer_side_checks() {
        let m = map();
        assert!(matches!(
            Selection::new(None, None, Some(vec![(0, 8), (4, 8)])),
            Err(SelectionError::Overlap { .. })
        ));
        assert!(matches!(
            Selection::new(None, Some(vec![(0, 8)]), Some(vec![(0, 4)])),
            Err(SelectionError::TotalsDiffer { .. })
        ));
        let sel = Selection::new(Some(vec![0, 1]), None, None).unwrap();
        assert_eq!(
            sel.check_destination(&m, &[1]).unwrap_err(),
            SelectionError::BlockCountsDiffer { selected: 2, dst: 1 }
        );
        let sel = Selection::new(None, None, Some(vec![(24, 16)])).unwrap();
        assert!(matches!(
            sel.check_destination(&m, &[1]),
            Err(SelectionError::RangeOutsidePiece { piece_bytes: 32, .. })
        ));
        let sel = Selection::new(None, Some(vec![(0, 8)]), None).unwrap();
        assert!(matches!(
            sel.check_destination(&m, &[1]),
            Err(SelectionError::TotalsDiffer { src: 8, dst: 32, .. })
        ));
    }
}
