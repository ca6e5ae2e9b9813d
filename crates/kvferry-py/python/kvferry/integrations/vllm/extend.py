"""A KV cache registered again: vLLM 0.34's extensible KV cache.

vLLM 0.34 can commit the KV cache's memory after warm-up (``extend_kv_cache``) and
binds views over the committed bytes: same addresses, more blocks. Its workers
normally create the connector only then, so the first ``register_kv_caches`` already
sees the final cache. When the connector exists before a later commit (another
``extend_kv_cache``), vLLM's model runner makes a new ``ActiveKVConnector``, which
calls ``register_kv_caches`` again on the same connector with the grown views.
:func:`register_again` handles that second call:

- the new views must describe the same cache (attention layout, head slots, dtype,
  per-block bytes of every layer, the same layers): only the number of blocks may
  change, since peers planned their reads from this geometry at the handshake;
  anything else is refused with :class:`~.layout.LayoutError`;
- views over the same memory and the same number of blocks change nothing;
- otherwise every transfer in flight is withdrawn and drained first, as for sleep
  (:func:`.preemption.withdraw`: pulls cancelled and reported failed, publications
  released and reported ``finished_sending``; a decode mid-read gets a refusal, not
  bytes of a region about to go away), then the old region is deregistered (the
  engine refuses while anything still uses it) and the new views registered as one
  region, so every block of the grown cache — the new range included — is
  transferable at once. The engine (address, peer id, incarnation) stays up.
- while the cache is deregistered for sleep or a weight update
  (``unregister_kv_caches``), the new views are only remembered:
  ``restore_kv_caches`` registers them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from . import hetero as vllm_hetero
from .layout import LayoutError
from .preemption import withdraw

if TYPE_CHECKING:
    from .worker import KvferryConnectorWorker

logger = init_logger(__name__)

__all__ = ["register_again"]

# What a handshake told peers about the cache: these may not change.
_FIXED = ("layout", "heads_per_rank", "dtype", "elem_size", "cache_layout")


def register_again(worker: KvferryConnectorWorker, caches: dict[str, torch.Tensor]) -> None:
    """``register_kv_caches`` on a worker whose engine already runs (module docs).
    ``caches``: the layers' views, shared ones already dropped."""
    assert worker.engine is not None
    device = worker._device_for(caches)
    if device != worker.device:
        raise ValueError(f"KvferryConnector: the KV cache moved from {worker.device or 'host'} to {device or 'host'} memory; one engine moves one device's memory")
    if list(caches) != list(worker.phys):
        raise LayoutError(f"KvferryConnector: registered again with layers {sorted(caches)}, not {sorted(worker.phys)}")
    old_nb = worker.num_blocks
    worker.num_blocks = int(next(iter(caches.values())).shape[0])
    try:
        phys, geo = vllm_hetero.geometry(worker, caches)
    except BaseException:
        worker.num_blocks = old_nb
        raise
    pieces = geo.pop("pieces")
    changed = [f"{k} {worker._geo.get(k)!r} -> {geo.get(k)!r}" for k in _FIXED if worker._geo.get(k) != geo.get(k)]
    if pieces and worker._pieces and int(pieces[0].shape[1]) != int(worker._pieces[0].shape[1]):
        changed.append(f"bytes per block and layer {int(worker._pieces[0].shape[1])} -> {int(pieces[0].shape[1])}")
    if changed:
        worker.num_blocks = old_nb
        raise LayoutError(
            "KvferryConnector: the KV cache was registered again with another geometry (" + "; ".join(changed) + "); "
            "only its number of blocks may change (peers planned their reads from the handshake's)"
        )
    same = worker.num_blocks == old_nb and all(phys[n].data_ptr() == worker.phys[n].data_ptr() for n in phys)
    if same and worker.region is not None:
        worker.caches, worker.phys, worker._pieces = caches, phys, pieces
        return
    if worker.region is not None:
        led = worker.ledger
        withdraw(worker, [*led.pulls, *led.pubs], "KV cache registered again")
        for rec in list(led.pulls.values()):
            worker._drop_scratch(rec)  # type: ignore[arg-type]  # a _Pull: drained above
        worker.engine.deregister(worker.region, timeout=worker.config.timeout)
        worker.region = None
    worker.caches, worker.phys, worker._pieces = caches, phys, pieces
    worker._geo = geo
    if worker.asleep:
        logger.info("KvferryConnector worker tp%d: KV cache of %d blocks remembered (registered on wake-up)", worker.tp_rank, worker.num_blocks)
        return
    worker.region = worker._register(phys, worker.num_blocks, "vllm-kv")
    logger.info(
        "KvferryConnector worker tp%d: KV cache registered again: %s -> %d blocks of %d bytes",
        worker.tp_rank,
        old_nb,
        worker.region.num_blocks,
        worker.region.block_bytes,
    )
