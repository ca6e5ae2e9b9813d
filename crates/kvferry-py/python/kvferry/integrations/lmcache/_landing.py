# mypy: disable-error-code="import-untyped"
# (lmcache ships no type information: its classes are Any here.)
"""Landing a get in place: LMCache's CPU buffer registered with the kvferry engine
once, so a chunk's bytes are written by the socket straight into the ``MemoryObj``
LMCache allocated (zero copy). :class:`Landing`.

Semantics: a buffer (a CPU tensor's storage) is registered the first time an object in
it is landed, as a region of the allocator's aligned blocks (``align`` bytes each, aligned in memory;
the buffer's head and tail short of a whole block are left out), and stays registered for the
engine's life — the region holds a view of the storage, so the memory outlives every
transfer into it. A buffer seen again with another size is registered anew. An object
lands in place only when it starts on a block boundary and the whole blocks its length
needs lie inside it, and only in a CPU tensor; otherwise :meth:`Landing.place` says
``None`` and the chunk is not fetched (a miss).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from lmcache.logging import init_logger
from lmcache.v1.memory_management import MemoryObj

import kvferry

logger = init_logger(__name__)


class Landing:
    """LMCache's CPU buffer(s) registered with the engine once, cut into the
    allocator's aligned blocks, so a get lands straight into an allocated object."""

    def __init__(self, engine: kvferry.Engine, align: int) -> None:
        self._engine = engine
        self._align = align
        self._regions: dict[int, tuple[int, int, Any, Any]] = {}  # base ptr -> (nbytes, block, region, view)
        self._lock = threading.Lock()

    def place(self, obj: MemoryObj, length: int) -> tuple[Any, list[int]] | None:
        """``(region, block_ids)`` receiving ``length`` bytes at ``obj``, or None when
        ``obj`` cannot be landed in place (the remote tier then gets no further chunks:
        they are misses)."""
        raw = getattr(obj, "raw_data", None)
        if not isinstance(raw, torch.Tensor) or raw.device.type != "cpu":
            return None
        storage = raw.untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            entry = self._regions.get(base)
            if entry is None or entry[0] != nbytes:
                block = self._align
                pad = (-base) % block  # blocks are aligned in memory, whatever the storage's start
                usable = max(0, nbytes - pad) // block * block
                if usable == 0:
                    return None
                # The buffer's whole aligned blocks, shared (no copy); the region holds
                # the view, so the memory outlives every transfer into it.
                view = torch.empty(0, dtype=torch.uint8).set_(storage)[pad : pad + usable]
                region = self._engine.register_kv_cache(view, block_bytes=block, name="lmcache-cpu")
                entry = (nbytes, block, region, view)
                self._regions[base] = entry
        _, block, region, view = entry
        off = raw.data_ptr() - view.data_ptr()
        phys = raw.numel() * raw.element_size()
        nblocks = -(-length // block)
        # land only inside this object: aligned start, whole blocks within its physical size
        if off < 0 or off % block or nblocks * block > phys or length > phys or off + nblocks * block > view.numel():
            return None
        first = off // block
        return region, list(range(first, first + nblocks))

    def close(self, timeout: float) -> None:
        """Deregisters every buffer (call once no transfer lands any more: each waits at
        most ``timeout`` seconds for its users). Landing in place ends here."""
        with self._lock:
            entries, self._regions = list(self._regions.values()), {}
        for _, _, region, _ in entries:
            try:
                self._engine.deregister(region, timeout=timeout)
            except kvferry.Error as e:  # still held: the engine's close drains and reports it
                logger.warning("kvferry: an LMCache buffer is still in use at close (%s)", e)
