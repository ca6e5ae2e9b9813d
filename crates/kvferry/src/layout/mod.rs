//! KV cache layouts: how an engine lays out its KV cache in a region, and how a chunk
//! (the KV of a run of blocks across all layers, K and V) maps to byte ranges.
//!
//! A chunk travels in a **canonical order** — for each of its blocks in order, for each
//! layer, K then V — so producer and consumer may use different arrangements and
//! different block ids, as long as their pieces have the same shape
//! ([`KvLayout::compatible_with`]).

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

mod blocks;
mod kv_cache;

pub use blocks::{cut_ranges, BlockMap, Span};
pub use kv_cache::KvCache;

/// Errors from layouts.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A dimension is zero or the total size overflows.
    #[error("invalid KV layout: {0}")]
    Invalid(String),
    /// The named preset does not exist.
    #[error("unknown model preset {0:?} (known: llama3-8b, llama3-70b-tp8, tiny)")]
    UnknownPreset(String),
    /// A block id is outside the region's block count.
    #[error("block {block} out of range (layout has {blocks} blocks)")]
    BlockOutOfRange {
        /// The offending block.
        block: u32,
        /// Blocks in the layout.
        blocks: u32,
    },
    /// Producer and consumer pieces have different shapes.
    #[error("incompatible KV layouts: {0}")]
    Incompatible(String),
}

impl LayoutError {
    /// The stable code of this error.
    pub fn code(&self) -> crate::ErrorCode {
        use crate::ErrorCode as C;
        match self {
            LayoutError::Invalid(_) | LayoutError::UnknownPreset(_) => C::InvalidArgument,
            LayoutError::BlockOutOfRange { .. } | LayoutError::Incompatible(_) => C::LayoutMismatch,
        }
    }
}

/// Whether K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Kv {
    /// Keys.
    K = 0,
    /// Values.
    V = 1,
}

/// How blocks are arranged in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arrangement {
    /// One tensor per layer and K/V: `[layer][kv][block]` (vLLM-style per-layer caches).
    LayerSeparate,
    /// One tensor for everything, block-major: `[block][layer][kv]`.
    FullyContiguous,
}

/// The shape of one engine's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: u32,
    /// Blocks in the cache.
    pub blocks: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// KV heads (per rank).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16/fp16).
    pub elem_size: u32,
    /// Arrangement in memory.
    pub arrangement: Arrangement,
}

/// Model presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Llama 3 8B: 32 layers, 8 KV heads, head dim 128, bf16, 16 tokens per block
    /// (32 KiB per block, layer and K/V; 2 MiB per block across layers).
    Llama3_8b,
    /// Llama 3 70B at tensor parallelism 8: 80 layers, 1 KV head per rank, head dim 128,
    /// bf16, 16 tokens per block (4 KiB pieces; 640 KiB per block).
    Llama3_70bTp8,
    /// A tiny layout for tests: 2 layers, 1 head, head dim 64, 2-byte elements,
    /// 4 tokens per block (512-byte pieces).
    Tiny,
}

impl FromStr for Preset {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "llama3-8b" => Ok(Preset::Llama3_8b),
            "llama3-70b-tp8" => Ok(Preset::Llama3_70bTp8),
            "tiny" => Ok(Preset::Tiny),
            _ => Err(LayoutError::UnknownPreset(s.to_string())),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Preset::Llama3_8b => "llama3-8b",
            Preset::Llama3_70bTp8 => "llama3-70b-tp8",
            Preset::Tiny => "tiny",
        })
    }
}

impl KvLayout {
    /// A preset's layout with `blocks` blocks.
    pub fn preset(p: Preset, blocks: u32, arrangement: Arrangement) -> Result<KvLayout, LayoutError> {
        let (layers, kv_heads, head_dim, elem, tpb) = match p {
            Preset::Llama3_8b => (32, 8, 128, 2, 16),
            Preset::Llama3_70bTp8 => (80, 1, 128, 2, 16),
            Preset::Tiny => (2, 1, 64, 2, 4),
        };
        KvLayout {
            layers,
            blocks,
            tokens_per_block: tpb,
            kv_heads,
            head_dim,
            elem_size: elem,
            arrangement,
        }
        .validated()
    }

    /// Checks dimensions and that the region size fits in memory.
    pub fn validated(self) -> Result<KvLayout, LayoutError> {
        let dims = [
            self.layers,
            self.blocks,
            self.tokens_per_block,
            self.kv_heads,
            self.head_dim,
            self.elem_size,
        ];
        if dims.contains(&0) {
            return Err(LayoutError::Invalid(format!(
                "every dimension must be non-zero: {self:?}"
            )));
        }
        let piece =
            (self.tokens_per_block as u64) * (self.kv_heads as u64) * (self.head_dim as u64) * (self.elem_size as u64);
        piece
            .checked_mul(2 * self.layers as u64)
            .and_then(|b| b.checked_mul(self.blocks as u64))
            .filter(|t| *t <= isize::MAX as u64)
            .ok_or_else(|| LayoutError::Invalid("region size overflows".into()))?;
        Ok(self)
    }

    /// Bytes of one `(block, layer, K|V)` piece.
    pub fn piece_bytes(&self) -> usize {
        self.tokens_per_block as usize * self.kv_heads as usize * self.head_dim as usize * self.elem_size as usize
    }

    /// Bytes of one block across all layers, K and V.
    pub fn block_bytes(&self) -> usize {
        self.piece_bytes() * 2 * self.layers as usize
    }

    /// Bytes of the whole region.
    pub fn region_bytes(&self) -> usize {
        self.block_bytes() * self.blocks as usize
    }

    /// Byte range of one piece in the region.
    pub fn piece(&self, block: u32, layer: u32, kv: Kv) -> Result<Range<usize>, LayoutError> {
        if block >= self.blocks {
            return Err(LayoutError::BlockOutOfRange {
                block,
                blocks: self.blocks,
            });
        }
        debug_assert!(layer < self.layers);
        let p = self.piece_bytes();
        let (b, l, k) = (block as usize, layer as usize, kv as usize);
        let index = match self.arrangement {
            Arrangement::LayerSeparate => (l * 2 + k) * self.blocks as usize + b,
            Arrangement::FullyContiguous => (b * self.layers as usize + l) * 2 + k,
        };
        Ok(index * p..(index + 1) * p)
    }

    /// Region ranges of `blocks` in canonical order (per block, per layer, K then V),
    /// merged where adjacent.
    pub fn chunk_ranges(&self, blocks: &[u32]) -> Result<Vec<(usize, usize)>, LayoutError> {
        let mut out: Vec<(usize, usize)> = Vec::with_capacity(blocks.len() * self.layers as usize * 2);
        for &b in blocks {
            for l in 0..self.layers {
                for kv in [Kv::K, Kv::V] {
                    let r = self.piece(b, l, kv)?;
                    match out.last_mut() {
                        Some((off, len)) if *off + *len == r.start => *len += r.len(),
                        _ => out.push((r.start, r.len())),
                    }
                }
            }
        }
        Ok(out)
    }

    /// Bytes of a chunk of `blocks` blocks.
    pub fn chunk_bytes(&self, blocks: usize) -> usize {
        self.block_bytes() * blocks
    }

    /// Whether chunks staged with `self` can be landed with `other`: same piece shape
    /// and layer count (arrangement and block count may differ).
    pub fn compatible_with(&self, other: &KvLayout) -> Result<(), LayoutError> {
        if self.layers != other.layers || self.piece_bytes() != other.piece_bytes() {
            return Err(LayoutError::Incompatible(format!(
                "{} layers × {} B pieces vs {} layers × {} B pieces",
                self.layers,
                self.piece_bytes(),
                other.layers,
                other.piece_bytes()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_documented_sizes() {
        let l = KvLayout::preset(Preset::Llama3_8b, 4, Arrangement::LayerSeparate).unwrap();
        assert_eq!(l.piece_bytes(), 32 << 10);
        assert_eq!(l.block_bytes(), 2 << 20);
        let l = KvLayout::preset(Preset::Llama3_70bTp8, 4, Arrangement::FullyContiguous).unwrap();
        assert_eq!(l.piece_bytes(), 4 << 10);
        assert_eq!(l.block_bytes(), 640 << 10);
        assert!("nope".parse::<Preset>().is_err());
    }

    #[test]
    fn pieces_tile_the_region_exactly_once() {
        for arr in [Arrangement::LayerSeparate, Arrangement::FullyContiguous] {
            let l = KvLayout::preset(Preset::Tiny, 5, arr).unwrap();
            let mut seen = vec![false; l.region_bytes() / l.piece_bytes()];
            for b in 0..5 {
                for layer in 0..l.layers {
                    for kv in [Kv::K, Kv::V] {
                        let r = l.piece(b, layer, kv).unwrap();
                        assert_eq!(r.len(), l.piece_bytes());
                        let i = r.start / l.piece_bytes();
                        assert!(!seen[i], "piece used twice");
                        seen[i] = true;
                    }
                }
            }
            assert!(seen.iter().all(|s| *s));
        }
    }

    #[test]
    fn contiguous_chunk_ranges_merge() {
        let l = KvLayout::preset(Preset::Tiny, 8, Arrangement::FullyContiguous).unwrap();
        assert_eq!(
            l.chunk_ranges(&[2, 3]).unwrap(),
            vec![(2 * l.block_bytes(), 2 * l.block_bytes())]
        );
        let l = KvLayout::preset(Preset::Tiny, 8, Arrangement::LayerSeparate).unwrap();
        assert_eq!(l.chunk_ranges(&[2]).unwrap().len(), 4);
        assert!(matches!(l.chunk_ranges(&[8]), Err(LayoutError::BlockOutOfRange { .. })));
    }

    #[test]
    fn invalid_and_incompatible_layouts_are_rejected() {
        let mut l = KvLayout::preset(Preset::Tiny, 8, Arrangement::FullyContiguous).unwrap();
        l.layers = 0;
        assert!(l.validated().is_err());
        let a = KvLayout::preset(Preset::Tiny, 8, Arrangement::FullyContiguous).unwrap();
        let b = KvLayout::preset(Preset::Llama3_8b, 8, Arrangement::FullyContiguous).unwrap();
        assert!(a.compatible_with(&b).is_err());
        let c = KvLayout::preset(Preset::Tiny, 3, Arrangement::LayerSeparate).unwrap();
        assert!(a.compatible_with(&c).is_ok());
    }
}
