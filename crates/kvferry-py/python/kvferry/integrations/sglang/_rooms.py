# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""The state of one request on one rank (:class:`SendRoom` on a prefill,
:class:`RecvRoom` on a decode), owned by the manager and guarded by its lock, and the
numpy views the manager registers SGLang's host buffers through."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll

from ... import Transfer
from ._plan import Source


@dataclass
class SendRoom:
    """A prefill rank's state of one request."""

    room: int
    status: int = KVPoll.Bootstrapping
    reason: str = ""
    owned: bool = False  # a KvferryKVSender holds it (else only decode messages made it)
    born: float = field(default_factory=time.monotonic)
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)
    expected: int | None = None
    num_pages: int = 0
    inited: bool = False
    aux_index: int | None = None
    sent_pages: int = 0
    chunks: int = 0
    last_sent: bool = False
    pending: dict[str, set[int]] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    progress: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_done: float | None = None
    bytes: int = 0


@dataclass
class RecvRoom:
    """A decode rank's state of one request."""

    room: int
    bootstrap_addr: str
    status: int = KVPoll.Bootstrapping
    reason: str = ""
    failing: str = ""
    kv_indices: list[int] | None = None
    aux_index: int | None = None
    sources: dict[int, Source] = field(default_factory=dict)
    notify: list[int] = field(default_factory=list)
    endpoints: dict[int, str] = field(default_factory=dict)
    meta_sent: bool = False
    last_seen: set[int] = field(default_factory=set)
    addrs: dict[int, str] = field(default_factory=dict)
    inflight: list[tuple[Transfer, int, str]] = field(default_factory=list)
    aux_needed: bool = True
    aux_done: bool = False
    progress: float = field(default_factory=time.monotonic)


def host_buffers(ptrs: list[int], lens: list[int], items: list[int], what: str) -> dict[str, Any]:
    """Numpy views ``[pages, item_len]`` over host buffers given as pointers."""
    import numpy as np

    out = {}
    for i, (p, n, item) in enumerate(zip(ptrs, lens, items)):
        if n % item:
            raise ValueError(f"{what}[{i}]: {n} bytes is not a whole number of {item}-byte items")
        arr = np.frombuffer(memoryview((ctypes.c_uint8 * n).from_address(p)).cast("B"), dtype=np.uint8)
        out[f"{what}{i}"] = arr.reshape(n // item, item)
    return out
