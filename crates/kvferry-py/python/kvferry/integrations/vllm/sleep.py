"""Sleep mode: ``unregister_kv_caches`` before vLLM frees (or remaps) the KV cache's
memory, ``restore_kv_caches`` after it is back.

vLLM's worker calls ``unregister_kv_caches`` in ``sleep`` (and ``discard``) before its
sleep backend releases the KV cache, and ``restore_kv_caches`` in ``wake_up`` after
the memory is resident again (same virtual addresses; the contents are gone); the
engine core then collects every worker's handshake again. vLLM's engine core drains
requests before sleeping (``pause_scheduler``: aborts or waits, then steps while
anything is held), but an in-process engine, or a publication whose decode never
pulls, can still hold transfers, so :func:`unregister` drains them itself, bounded:

- every pull is cancelled and drained, its unread slots released on the prefill, and
  reported as a failed load at the first step after wake-up;
- every publication is withdrawn and its sends stopped (a decode mid-read fails
  instead of landing bytes of freed memory); its blocks are reported
  ``finished_sending`` at the first step after wake-up, as vLLM expects;
- the KV region is deregistered from the engine (which refuses while anything still
  uses it), so nothing of kvferry refers to the memory while it is away.

The engine itself stays up (same address, peer id and incarnation): releases and
the control connection keep working, and peers need no new handshake. A decode asking
for a key withdrawn by the sleep gets a miss, retried until the lease's advertised end
(then a load error), or a refusal at once for a get that was already reading.
:func:`restore` registers the same tensors again. Both are idempotent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from .preemption import withdraw

if TYPE_CHECKING:
    from .worker import KvferryConnectorWorker

logger = init_logger(__name__)

__all__ = ["restore", "unregister"]


def unregister(worker: KvferryConnectorWorker) -> None:
    """Drains every transfer (bounded by ``timeout``), then deregisters the KV cache
    (module docs); raises ``kvferry.errors.TimeoutError`` (drain) or
    ``kvferry.errors.InUseError`` (deregistration) past the bound."""
    if worker.asleep or worker.engine is None or worker.region is None:
        return
    led = worker.ledger
    withdraw(worker, [*led.pulls, *led.pubs], "sleep")
    for rec in list(led.pulls.values()):
        worker._drop_scratch(rec)  # type: ignore[arg-type]  # a _Pull: drained above
    worker.engine.deregister(worker.region, timeout=worker.config.timeout)
    worker.region = None
    worker.asleep = True
    logger.info("KvferryConnector worker tp%d: KV cache deregistered (sleep)", worker.tp_rank)


def restore(worker: KvferryConnectorWorker) -> None:
    """Registers the KV cache again after wake-up (module docs)."""
    if not worker.asleep or worker.engine is None:
        return
    assert worker.num_blocks is not None
    worker.region = worker._register(worker.phys, worker.num_blocks, "vllm-kv")
    worker.asleep = False
    logger.info("KvferryConnector worker tp%d: KV cache registered again (wake-up)", worker.tp_rank)
