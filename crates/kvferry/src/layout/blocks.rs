//! [`BlockMap`]: where each block of a paged KV cache lives, as a list of strided
//! spans over one addressable memory.
//!
//! A block's bytes, in canonical order, are the concatenation over the map's spans of
//! `offset + block * stride .. + len`. One contiguous buffer of `N` blocks is one span
//! (`stride == len == block_bytes`); a vLLM-style cache with one tensor per layer (and
//! K/V halves) is one span per layer and half, each in its own tensor; a
//! [`KvLayout`] maps onto spans exactly as its `chunk_ranges` orders pieces. Producer
//! and consumer maps may differ: only the block's byte count must agree, since the wire
//! carries the canonical bytes.

use super::{Arrangement, Kv, KvLayout, LayoutError};

/// One strided piece of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Offset of block 0's piece.
    pub offset: usize,
    /// Distance between consecutive blocks' pieces.
    pub stride: usize,
    /// Bytes of the piece.
    pub len: usize,
}

/// Where every block of a cache lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMap {
    spans: Vec<Span>,
    blocks: u32,
    block_bytes: usize,
    extent: usize,
}

impl BlockMap {
    /// A map of `blocks` blocks made of `spans`; checks that every span is non-empty,
    /// that sizes do not overflow, and that no two blocks' pieces overlap within a span
    /// (`stride >= len`).
    pub fn new(spans: Vec<Span>, blocks: u32) -> Result<BlockMap, LayoutError> {
        if spans.is_empty() || blocks == 0 {
            return Err(LayoutError::Invalid(
                "a block map needs at least one span and one block".into(),
            ));
        }
        let mut block_bytes = 0usize;
        let mut extent = 0usize;
        for s in &spans {
            if s.len == 0 || (blocks > 1 && s.stride < s.len) {
                return Err(LayoutError::Invalid(format!(
                    "span {s:?}: pieces must be non-empty and not overlap (stride >= len)"
                )));
            }
            let end = s
                .stride
                .checked_mul(blocks as usize - 1)
                .and_then(|x| x.checked_add(s.offset))
                .and_then(|x| x.checked_add(s.len))
                .filter(|e| *e <= isize::MAX as usize)
                .ok_or_else(|| LayoutError::Invalid(format!("span {s:?} overflows")))?;
            extent = extent.max(end);
            block_bytes = block_bytes
                .checked_add(s.len)
                .ok_or_else(|| LayoutError::Invalid("block size overflows".into()))?;
        }
        Ok(BlockMap {
            spans,
            blocks,
            block_bytes,
            extent,
        })
    }

    /// `blocks` consecutive blocks of `block_bytes` each, from offset 0.
    pub fn contiguous(block_bytes: usize, blocks: u32) -> Result<BlockMap, LayoutError> {
        BlockMap::new(
            vec![Span {
                offset: 0,
                stride: block_bytes,
                len: block_bytes,
            }],
            blocks,
        )
    }

    /// The map of a [`KvLayout`] (same canonical order as [`KvLayout::chunk_ranges`]).
    pub fn from_layout(layout: &KvLayout) -> BlockMap {
        let p = layout.piece_bytes();
        let spans = match layout.arrangement {
            Arrangement::FullyContiguous => vec![Span {
                offset: 0,
                stride: layout.block_bytes(),
                len: layout.block_bytes(),
            }],
            Arrangement::LayerSeparate => (0..layout.layers)
                .flat_map(|l| [Kv::K, Kv::V].map(|kv| (l, kv)))
                .map(|(l, kv)| Span {
                    offset: layout.piece(0, l, kv).expect("block 0 exists").start,
                    stride: p,
                    len: p,
                })
                .collect(),
        };
        BlockMap::new(spans, layout.blocks).expect("a validated layout maps onto valid spans")
    }

    /// Blocks in the cache.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Bytes of one block (all spans).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Bytes of a chunk of `n` blocks.
    pub fn chunk_bytes(&self, n: usize) -> usize {
        self.block_bytes * n
    }

    /// One past the last byte any block touches: the memory must be at least this big.
    pub fn extent(&self) -> usize {
        self.extent
    }

    /// The spans.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Memory ranges of `blocks` in canonical order, merged where adjacent.
    pub fn chunk_ranges(&self, blocks: &[u32]) -> Result<Vec<(usize, usize)>, LayoutError> {
        let mut out: Vec<(usize, usize)> = Vec::with_capacity(blocks.len() * self.spans.len());
        for &b in blocks {
            if b >= self.blocks {
                return Err(LayoutError::BlockOutOfRange {
                    block: b,
                    blocks: self.blocks,
                });
            }
            for s in &self.spans {
                let start = s.offset + b as usize * s.stride;
                match out.last_mut() {
                    Some((off, len)) if *off + *len == start => *len += s.len,
                    _ => out.push((start, s.len)),
                }
            }
        }
        Ok(out)
    }

    /// Memory ranges of a chunk made of `blocks`, cut to its first `len` bytes.
    pub fn chunk_ranges_cut(&self, blocks: &[u32], len: usize) -> Result<Vec<(usize, usize)>, LayoutError> {
        let mut r = self.chunk_ranges(blocks)?;
        cut_ranges(&mut r, len);
        Ok(r)
    }

    /// Checks a list of block ids for one transfer: non-empty, in range, no repeats
    /// (a repeated block would be written twice at once).
    pub fn check_blocks(&self, blocks: &[u32]) -> Result<(), LayoutError> {
        if blocks.is_empty() {
            return Err(LayoutError::Invalid("empty block list".into()));
        }
        if let Some(&b) = blocks.iter().find(|b| **b >= self.blocks) {
            return Err(LayoutError::BlockOutOfRange {
                block: b,
                blocks: self.blocks,
            });
        }
        let mut seen = blocks.to_vec();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(LayoutError::Invalid(format!("block {} listed twice", w[0])));
        }
        Ok(())
    }
}

/// Cuts a range list down to its first `len` bytes.
pub fn cut_ranges(ranges: &mut Vec<(usize, usize)>, len: usize) {
    let mut left = len;
    let mut keep = 0;
    for r in ranges.iter_mut() {
        if left == 0 {
            break;
        }
        r.1 = r.1.min(left);
        left -= r.1;
        keep += 1;
    }
    ranges.truncate(keep);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Preset;

    #[test]
    fn layout_maps_agree_with_chunk_ranges() {
        for arr in [Arrangement::LayerSeparate, Arrangement::FullyContiguous] {
            let l = KvLayout::preset(Preset::Tiny, 8, arr).unwrap();
            let m = BlockMap::from_layout(&l);
            assert_eq!(m.block_bytes(), l.block_bytes());
            assert_eq!(m.extent(), l.region_bytes());
            for blocks in [vec![0], vec![3, 4, 5], vec![7, 1, 2]] {
                assert_eq!(m.chunk_ranges(&blocks).unwrap(), l.chunk_ranges(&blocks).unwrap());
            }
        }
    }

    #[test]
    fn contiguous_and_checks() {
        let m = BlockMap::contiguous(4096, 64).unwrap();
        assert_eq!(m.chunk_ranges(&[3, 4, 5]).unwrap(), vec![(3 * 4096, 3 * 4096)]);
        assert_eq!(
            m.chunk_ranges(&[5, 3]).unwrap(),
            vec![(5 * 4096, 4096), (3 * 4096, 4096)]
        );
        assert!(m.chunk_ranges(&[64]).is_err());
        assert!(m.check_blocks(&[1, 2, 1]).is_err());
        assert!(m.check_blocks(&[]).is_err());
        assert!(m.check_blocks(&[0, 63]).is_ok());
        assert!(BlockMap::new(
            vec![Span {
                offset: 0,
                stride: 8,
                len: 16
            }],
            2
        )
        .is_err());
        assert!(BlockMap::new(
            vec![Span {
                offset: usize::MAX - 4,
                stride: 8,
                len: 8
            }],
            2
        )
        .is_err());
    }
}
