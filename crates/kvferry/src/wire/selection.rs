//! Partial gets on the wire: the part of a publication a `GetSelected` or
//! `StageSelected` asks for ([`WireSelection`]), the shape of what the producer will
//! send back ([`SelectedShape`]), and [`SelectionError`], the typed error naming a
//! selection that does not fit.
//!
//! # Semantics
//!
//! A publication (or the concatenation, in key order, of the publications of one
//! request's keys) is a list of blocks; each block is a list of *pieces* (the spans of
//! its cache's block map: typically one per layer and K/V). A selection names:
//!
//! - `blocks`: positions (0-based) into that block list, in the order they are to be
//!   sent (repeats allowed); `None` = every block, in order;
//! - `ranges`: ordered `(offset, length)` byte ranges inside **every** piece of each
//!   selected block; the producer sends exactly these bytes, concatenated in this
//!   order (any order, overlaps allowed: it only reads them); `None` = the whole piece.
//!
//! The bytes sent are therefore, for each selected block, for each piece, for each
//! range, that range's bytes: a stream of `blocks × Σ pieces` bytes, where `pieces`
//! ([`SelectedShape::pieces`]) are the per-piece selected byte counts. The producer
//! cuts the stream into bulk frames at block boundaries; the consumer lands it by its
//! own destination ranges (see `peer::selection`).
//!
//! A consumer that knows its destination also sends what it will land
//! (`expect_blocks`, `expect_pieces`): the producer then refuses a mismatch before it
//! stages anything. The reply, `StagedSelected`, always carries the shape, so the
//! consumer checks it again (a delayed pull learns it only there).
//!
//! # Bounds
//!
//! Every list is bounded ([`MAX_SELECTED_BLOCKS`], [`MAX_SELECTED_RANGES`],
//! [`MAX_PIECES`]); ranges must be non-empty and `offset + length` must not overflow.
//! [`WireSelection::validate`] checks this on receipt, before anything is planned; a
//! malicious peer's selection is a typed error, never a panic or a large allocation
//! beyond what the control frame itself holds.

use serde::{Deserialize, Serialize};

/// Most block positions one selection may name.
pub const MAX_SELECTED_BLOCKS: usize = 1 << 16;
/// Most byte ranges per piece one selection may name.
pub const MAX_SELECTED_RANGES: usize = 1 << 14;
/// Most pieces per block a selection may describe.
pub const MAX_PIECES: usize = 4096;

/// What part of a request's published blocks to send (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSelection {
    /// Positions into the request's block list (`None`: every block).
    pub blocks: Option<Vec<u32>>,
    /// `(offset, length)` ranges inside every piece (`None`: the whole piece).
    pub ranges: Option<Vec<(u64, u64)>>,
    /// Destination blocks the consumer will land (`None`: not known yet, a stage).
    pub expect_blocks: Option<u32>,
    /// Bytes the consumer will land per destination piece (`None`: not known yet).
    pub expect_pieces: Option<Vec<u64>>,
}

/// The shape of a selected stream, announced by `StagedSelected`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectedShape {
    /// Selected blocks sent.
    pub blocks: u32,
    /// Selected bytes of each piece of a block, in piece order.
    pub pieces: Vec<u64>,
}

impl SelectedShape {
    /// Bytes one selected block contributes.
    pub fn block_bytes(&self) -> u64 {
        self.pieces.iter().fold(0u64, |a, p| a.saturating_add(*p))
    }

    /// Bytes of the whole stream (saturating: a hostile shape never overflows).
    pub fn total(&self) -> u64 {
        self.block_bytes().saturating_mul(self.blocks as u64)
    }

    /// Checks the bounds: at most [`MAX_PIECES`] pieces, at most
    /// [`MAX_SELECTED_BLOCKS`] blocks.
    pub fn validate(&self) -> Result<(), SelectionError> {
        too_many("pieces", self.pieces.len(), MAX_PIECES)?;
        too_many("selected blocks", self.blocks as usize, MAX_SELECTED_BLOCKS)
    }
}

/// A selection that does not fit its publication or destination. Every variant names
/// the mismatch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    /// A list is longer than its bound.
    #[error("selection names {len} {what}; at most {limit}")]
    TooMany {
        /// What list ("selected blocks", "ranges", "pieces").
        what: &'static str,
        /// Its length.
        len: usize,
        /// The bound.
        limit: usize,
    },
    /// A selected block position is past the end of the publication's block list.
    #[error("block position {position} of {blocks}: the publication has only {blocks} blocks")]
    BlockOutOfRange {
        /// The position asked for.
        position: u32,
        /// Blocks the request's keys hold.
        blocks: usize,
    },
    /// The selection selects no block at all.
    #[error("the selection selects no block")]
    NoBlocks,
    /// A range is empty, or `offset + length` overflows.
    #[error("{side} range ({offset}, {len}) is empty or overflows")]
    BadRange {
        /// "source" or "destination".
        side: &'static str,
        /// The range's offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// A range does not lie inside a piece.
    #[error("{side} range ({offset}, {len}) exceeds piece {piece} of {piece_bytes} bytes")]
    RangeOutsidePiece {
        /// "source" or "destination".
        side: &'static str,
        /// The range's offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The piece's index within its block.
        piece: usize,
        /// The piece's size.
        piece_bytes: u64,
    },
    /// Two destination ranges overlap (the same bytes would be written twice).
    #[error("destination ranges ({a_offset}, {a_len}) and ({b_offset}, {b_len}) overlap")]
    Overlap {
        /// One range's offset.
        a_offset: u64,
        /// Its length.
        a_len: u64,
        /// The other's offset.
        b_offset: u64,
        /// Its length.
        b_len: u64,
    },
    /// Source and destination blocks have different numbers of pieces.
    #[error("piece counts differ: the source has {src} pieces per block, the destination {dst}")]
    PieceCountsDiffer {
        /// Pieces per source block.
        src: usize,
        /// Pieces per destination block.
        dst: usize,
    },
    /// A piece's selected source bytes and its destination bytes differ.
    #[error("totals differ in piece {piece}: the source selects {src} bytes, the destination lands {dst}")]
    TotalsDiffer {
        /// The piece's index.
        piece: usize,
        /// Selected source bytes of the piece.
        src: u64,
        /// Destination bytes of the piece.
        dst: u64,
    },
    /// The number of selected blocks and destination blocks differ.
    #[error("{selected} blocks selected but {dst} destination blocks given")]
    BlockCountsDiffer {
        /// Selected blocks.
        selected: usize,
        /// Destination blocks.
        dst: usize,
    },
    /// The request's keys cannot be selected from together (not published, store
    /// chunks, or publications whose blocks are shaped differently).
    #[error("cannot select: {0}")]
    Unsupported(String),
    /// The selected stream disagrees with what was announced (a peer's bug or lie).
    #[error("selected stream: {0}")]
    Stream(String),
}

impl WireSelection {
    /// Checks the list lengths only (what [`Message::validate`](super::Message::validate)
    /// enforces on receipt).
    pub fn check_bounds(&self) -> Result<(), SelectionError> {
        too_many(
            "selected blocks",
            self.blocks.as_ref().map_or(0, Vec::len),
            MAX_SELECTED_BLOCKS,
        )?;
        too_many("ranges", self.ranges.as_ref().map_or(0, Vec::len), MAX_SELECTED_RANGES)?;
        too_many("pieces", self.expect_pieces.as_ref().map_or(0, Vec::len), MAX_PIECES)?;
        too_many(
            "selected blocks",
            self.expect_blocks.unwrap_or(0) as usize,
            MAX_SELECTED_BLOCKS,
        )
    }

    /// Checks the bounds: list lengths within their limits, ranges non-empty and
    /// without overflow. Does not look at any publication.
    pub fn validate(&self) -> Result<(), SelectionError> {
        if let Some(b) = &self.blocks {
            too_many("selected blocks", b.len(), MAX_SELECTED_BLOCKS)?;
            if b.is_empty() {
                return Err(SelectionError::NoBlocks);
            }
        }
        if let Some(r) = &self.ranges {
            check_ranges("source", r)?;
        }
        if let Some(p) = &self.expect_pieces {
            too_many("pieces", p.len(), MAX_PIECES)?;
        }
        if let Some(n) = self.expect_blocks {
            too_many("selected blocks", n as usize, MAX_SELECTED_BLOCKS)?;
        }
        Ok(())
    }

    /// Bytes the ranges select from one piece of `piece_bytes` (the whole piece when
    /// there are no ranges); checks that every range lies inside the piece.
    pub fn selected_of_piece(&self, piece: usize, piece_bytes: u64) -> Result<u64, SelectionError> {
        match &self.ranges {
            None => Ok(piece_bytes),
            Some(r) => ranges_in_piece("source", r, piece, piece_bytes),
        }
    }
}

/// Checks a range list: at most [`MAX_SELECTED_RANGES`], at least one, each non-empty
/// and without overflow.
pub fn check_ranges(side: &'static str, ranges: &[(u64, u64)]) -> Result<(), SelectionError> {
    too_many("ranges", ranges.len(), MAX_SELECTED_RANGES)?;
    if ranges.is_empty() {
        return Err(SelectionError::TooMany {
            what: "ranges (an empty list selects nothing; give None for the whole piece)",
            len: 0,
            limit: MAX_SELECTED_RANGES,
        });
    }
    for &(offset, len) in ranges {
        if len == 0 || offset.checked_add(len).is_none() {
            return Err(SelectionError::BadRange { side, offset, len });
        }
    }
    Ok(())
}

/// Total bytes of `ranges`, each checked to lie inside a piece of `piece_bytes`.
pub fn ranges_in_piece(
    side: &'static str,
    ranges: &[(u64, u64)],
    piece: usize,
    piece_bytes: u64,
) -> Result<u64, SelectionError> {
    let mut total = 0u64;
    for &(offset, len) in ranges {
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= piece_bytes => total += len,
            Some(_) if len > 0 => {
                return Err(SelectionError::RangeOutsidePiece {
                    side,
                    offset,
                    len,
                    piece,
                    piece_bytes,
                })
            }
            _ => return Err(SelectionError::BadRange { side, offset, len }),
        }
    }
    Ok(total)
}

fn too_many(what: &'static str, len: usize, limit: usize) -> Result<(), SelectionError> {
    if len > limit {
        return Err(SelectionError::TooMany { what, len, limit });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked() {
        let ok = WireSelection {
            blocks: Some(vec![0, 2]),
            ranges: Some(vec![(0, 8), (16, 8)]),
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
        assert_eq!(ok.selected_of_piece(0, 32).unwrap(), 16);
        assert!(matches!(
            ok.selected_of_piece(3, 20),
            Err(SelectionError::RangeOutsidePiece {
                piece: 3,
                piece_bytes: 20,
                ..
            })
        ));
        let bad = WireSelection {
            ranges: Some(vec![(u64::MAX, 2)]),
            ..Default::default()
        };
        assert!(matches!(bad.validate(), Err(SelectionError::BadRange { .. })));
        let empty = WireSelection {
            ranges: Some(vec![(4, 0)]),
            ..Default::default()
        };
        assert!(empty.validate().is_err());
        let many = WireSelection {
            blocks: Some(vec![0; MAX_SELECTED_BLOCKS + 1]),
            ..Default::default()
        };
        assert!(matches!(many.validate(), Err(SelectionError::TooMany { .. })));
        let none = WireSelection {
            blocks: Some(vec![]),
            ..Default::default()
        };
        assert_eq!(none.validate(), Err(SelectionError::NoBlocks));
        let shape = SelectedShape {
            blocks: 3,
            pieces: vec![u64::MAX, 5],
        };
        assert_eq!(shape.total(), u64::MAX);
    }
}
