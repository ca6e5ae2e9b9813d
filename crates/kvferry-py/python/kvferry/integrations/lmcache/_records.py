# mypy: disable-error-code="import-untyped"
# (lmcache ships no type information: its classes are Any here.)
"""How the remote tier names and describes a chunk in the kvferry store.

A chunk (one LMCache ``MemoryObj``) is stored under two keys derived from its
``CacheEngineKey``: :func:`data_key` holds its bytes, :func:`meta_key` a metadata
record (:func:`encode_meta`): a magic, the chunk's length, then JSON of its shapes,
dtypes and memory format, at most :data:`META_SLOT` bytes, so a get can fetch the
records of many chunks into fixed slots of one buffer (a chunk whose record would be
longer is a ``ValueError`` from :func:`encode_meta`). A record that does not start
with the magic, or names a dtype outside the known set, is a ``ValueError`` /
``KeyError`` from :func:`decode_meta` (the tier treats it as a miss).
"""

from __future__ import annotations

import json
import struct

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

META_SLOT = 512
"""Bytes reserved for one chunk's metadata record on a get."""

_META_MAGIC = b"KVFLMC1\0"


def data_key(key: CacheEngineKey) -> str:
    return "lmc/" + str(key.to_string())


def meta_key(key: CacheEngineKey) -> str:
    return "lmc-meta/" + str(key.to_string())


_DTYPES = {
    str(d): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        getattr(torch, "float8_e4m3fn", torch.uint8),
        getattr(torch, "float8_e5m2", torch.uint8),
    )
}


def encode_meta(obj: MemoryObj) -> bytes:
    """The metadata record of ``obj``: magic, length, then JSON of shapes/dtypes/format."""
    body = json.dumps(
        {
            "shapes": [list(s) for s in obj.get_shapes()],
            "dtypes": [str(d) for d in obj.get_dtypes()],
            "fmt": int(obj.get_memory_format().value),
        },
        separators=(",", ":"),
    ).encode()
    rec = _META_MAGIC + struct.pack("<QI", obj.get_size(), len(body)) + body
    if len(rec) > META_SLOT:
        raise ValueError(f"chunk metadata of {len(rec)} bytes exceeds {META_SLOT}")
    return rec


def decode_meta(rec: memoryview | bytes) -> tuple[int, list[torch.Size], list[torch.dtype], MemoryFormat]:
    """``(length, shapes, dtypes, fmt)`` of a record; ``ValueError`` if it is not one."""
    rec = bytes(rec)
    if rec[: len(_META_MAGIC)] != _META_MAGIC:
        raise ValueError("not a kvferry LMCache metadata record")
    length, n = struct.unpack_from("<QI", rec, len(_META_MAGIC))
    start = len(_META_MAGIC) + 12
    d = json.loads(rec[start : start + n])
    return (
        int(length),
        [torch.Size(s) for s in d["shapes"]],
        [_DTYPES[x] for x in d["dtypes"]],
        MemoryFormat(int(d["fmt"])),
    )
