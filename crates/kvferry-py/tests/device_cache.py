"""A KV cache in (sim) device memory for the core tests: the engine's device
allocation, filled from host bytes when given, registered in blocks of ``BLOCK``."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

import kvferry

BLOCK = 4096


def device_cache(
    eng: kvferry.Engine, nblocks: int, data: NDArray[np.uint8] | None = None
) -> tuple[kvferry.DeviceMemory, kvferry.Region]:
    """``nblocks`` blocks of device memory of ``eng`` (holding ``data`` when given),
    registered as a KV cache: the memory and its region."""
    mem = eng.alloc_device(nblocks * BLOCK)
    if data is not None:
        mem.write(data.data)  # its buffer: numpy types an array as a Buffer only on Python >= 3.12
    return mem, eng.register_kv_cache(mem, block_bytes=BLOCK)
