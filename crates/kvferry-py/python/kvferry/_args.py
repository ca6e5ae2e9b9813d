"""Arguments of the engine's methods, checked and converted once: keys, block-id
lists (one per key, or one flat list), a peer's incarnation, a transfer path."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

from . import _kvferry
from .errors import InvalidArgumentError

Key = Union[str, bytes]

_PATHS = ("direct", "staged")


def _ids(block_ids: Any, what: str = "block_ids") -> _kvferry.BlockIds:
    """``block_ids`` (a list, any sequence or iterable of ints, or a NumPy array)
    checked and converted by the binding at native speed, in one walk: non-empty,
    every element an integer in ``0..2**32``; ``InvalidArgumentError`` otherwise. The
    engine's methods take the result without walking the ids again."""
    tolist = getattr(block_ids, "tolist", None)
    ids = tolist() if callable(tolist) else block_ids
    if type(ids) is not list:
        try:
            ids = list(ids)
        except TypeError:
            raise InvalidArgumentError(f"{what} must be a sequence of ints, got {block_ids!r}") from None
    return _kvferry.check_block_ids(ids, what)


def _batch(key: Key | Iterable[Key], block_ids: Any) -> tuple[list[Key], list[_kvferry.BlockIds]]:
    """One key with its block ids, or a batch: keys with one block-id list per key."""
    if isinstance(key, (str, bytes)):
        return [key], [_ids(block_ids)]
    tolist = getattr(key, "tolist", None)
    keys = list(tolist() if callable(tolist) else key)
    if not keys:
        raise InvalidArgumentError("empty key list")
    rows = block_ids.tolist() if callable(getattr(block_ids, "tolist", None)) else list(block_ids)
    if len(rows) != len(keys):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(rows)} block-id lists")
    return keys, [_ids(r, f"block_ids[{i}]") for i, r in enumerate(rows)]


def _incarnation(incarnation: int | None) -> int | None:
    if incarnation is None:
        return None
    if not isinstance(incarnation, int) or incarnation < 0 or incarnation >= 1 << 64:
        raise InvalidArgumentError(f"incarnation must be an int in 0..2**64, got {incarnation!r}")
    return incarnation


def _path(path: str) -> str:
    if path not in _PATHS:
        raise InvalidArgumentError(f"path must be one of {_PATHS}, got {path!r}")
    return path
