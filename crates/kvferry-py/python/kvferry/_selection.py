"""The :class:`Selection`: part of a publication to move (a subset of its blocks, byte
ranges of every per-layer piece, and where they land), and the block-id lists a
selected get takes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from . import _kvferry
from ._args import Key, _ids
from .errors import InvalidArgumentError, SelectionError


def _selection_ints(values: Any, what: str) -> tuple[int, ...]:
    tolist = getattr(values, "tolist", None)
    vals = tolist() if callable(tolist) else values
    try:
        out = tuple(int(v) for v in vals)
    except (TypeError, ValueError):
        raise SelectionError(f"{what} must be a sequence of ints, got {values!r}") from None
    if any(v < 0 or v >= 1 << 32 for v in out):
        raise SelectionError(f"{what}: positions must be in 0..2**32, got {list(out)}")
    return out


def _selection_ranges(values: Any, what: str) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((int(o), int(n)) for o, n in values)
    except (TypeError, ValueError):
        raise SelectionError(f"{what} must be a sequence of (offset, length) pairs, got {values!r}") from None
    if any(o < 0 or n < 0 or o >= 1 << 63 or n >= 1 << 63 for o, n in out):
        raise SelectionError(f"{what}: offsets and lengths must be in 0..2**63, got {list(out)}")
    return out


class Selection:
    """Which part of a publication a get, pull or stage moves (a partial get).
    Immutable.

    Args:
        blocks: positions (0-based) into the publication's block list (the
            ``block_ids`` given to :meth:`Engine.publish`; with several keys, their
            lists concatenated in key order). The selected blocks land, in this order,
            into the get's destination ``block_ids`` (so ``len(block_ids) ==
            len(blocks)``; several keys' destination lists are concatenated). None:
            every block.
        src_ranges: ordered ``(offset, length)`` byte ranges inside every per-layer
            piece of each selected source block (a piece is one span of the source
            region: one layer's K or V of one block for a vLLM cache). The producer
            sends exactly these bytes, concatenated in this order (any order, e.g. a
            permutation; each must lie inside the piece). None: the whole piece.
        dst_ranges: ordered ``(offset, length)`` byte ranges inside every per-layer
            piece of the destination block, filled in order by the bytes of that piece
            (they must not overlap, and their total must equal the source's). None:
            the whole destination piece (then the selected source bytes of a piece
            must equal the destination piece's size).

    Source and destination must have the same number of pieces per block. A selection
    that does not fit raises :class:`kvferry.SelectionError` naming the mismatch: here
    for what can be told without a publication, at the get for what the destination
    tells, and by the producer for the rest.

    Every selected byte is counted on the wire: ``stats()["consumer"]["bytes_received"]``
    on the consumer and ``stats()["producer"]["bytes_sent"]`` on the producer grow by
    exactly the selected bytes of a selected get (payload bytes, frame headers not
    counted).
    """

    __slots__ = ("_blocks", "_src", "_dst", "_w")

    _blocks: tuple[int, ...] | None
    _src: tuple[tuple[int, int], ...] | None
    _dst: tuple[tuple[int, int], ...] | None
    _w: tuple[list[int] | None, list[tuple[int, int]] | None, list[tuple[int, int]] | None]

    def __init__(
        self,
        blocks: Sequence[int] | None = None,
        src_ranges: Sequence[tuple[int, int]] | None = None,
        dst_ranges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        b = None if blocks is None else _selection_ints(blocks, "blocks")
        s = None if src_ranges is None else _selection_ranges(src_ranges, "src_ranges")
        d = None if dst_ranges is None else _selection_ranges(dst_ranges, "dst_ranges")
        wire = (
            None if b is None else list(b),
            None if s is None else list(s),
            None if d is None else list(d),
        )
        _kvferry.check_selection(*wire)
        object.__setattr__(self, "_blocks", b)
        object.__setattr__(self, "_src", s)
        object.__setattr__(self, "_dst", d)
        # The form the engine takes, built once: a Selection is reused for every get of
        # the same shape (the binding only reads these lists).
        object.__setattr__(self, "_w", wire)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Selection is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Selection is immutable")

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """Positions into the publication's block list, or None (every block)."""
        return self._blocks

    @property
    def src_ranges(self) -> tuple[tuple[int, int], ...] | None:
        """``(offset, length)`` ranges inside every source piece, or None (whole)."""
        return self._src

    @property
    def dst_ranges(self) -> tuple[tuple[int, int], ...] | None:
        """``(offset, length)`` ranges inside every destination piece, or None (whole)."""
        return self._dst

    def _wire(self) -> tuple[list[int] | None, list[tuple[int, int]] | None, list[tuple[int, int]] | None]:
        return self._w

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Selection):
            return NotImplemented
        return (self._blocks, self._src, self._dst) == (other._blocks, other._src, other._dst)

    def __hash__(self) -> int:
        return hash((self._blocks, self._src, self._dst))

    def __repr__(self) -> str:
        return f"Selection(blocks={self._blocks!r}, src_ranges={self._src!r}, dst_ranges={self._dst!r})"


def _select(select: Selection | None) -> Any:
    if select is None:
        return None
    if not isinstance(select, Selection):
        raise SelectionError(f"select must be a kvferry.Selection or None, got {select!r}")
    return select._wire()


def _selected_batch(key: Key | Iterable[Key], block_ids: Any) -> tuple[list[Key], list[_kvferry.BlockIds]]:
    """A selected get's keys and its destination blocks as one flat list (one list, or
    one list per key, concatenated)."""
    if isinstance(key, (str, bytes)):
        keys: list[Key] = [key]
    else:
        tolist = getattr(key, "tolist", None)
        keys = list(tolist() if callable(tolist) else key)
        if not keys:
            raise InvalidArgumentError("empty key list")
    rows = block_ids.tolist() if callable(getattr(block_ids, "tolist", None)) else list(block_ids)
    if rows and all(isinstance(r, (list, tuple)) or hasattr(r, "tolist") for r in rows):
        flat: list[Any] = [b for r in rows for b in (r.tolist() if hasattr(r, "tolist") else r)]
    else:
        flat = rows
    return keys, [_ids(flat)]
