"""Blocks vLLM takes back while kvferry may still touch them: ``handle_preemptions``.

vLLM calls ``handle_preemptions`` in every worker before the step's forward, with the
step's connector metadata; the scheduler half puts the step's
``SchedulerOutput.preempted_req_ids`` in it (``KvferryConnectorMetadata.preempted``).
Those requests' blocks are vLLM's again, and this step's forward may write them, so
before :func:`handle_preemptions` returns:

- a pull into them is cancelled and **drained** — a socket or device copy still
  writing them would corrupt whatever vLLM puts there (a batched get carrying other
  requests too is waited for: it writes one destination list). Its unread reader
  slots are released on the prefill (which frees its blocks within a round trip), and
  it is reported as a failed load once drained (``RequestLedger.preempt``);
- a publication of them is withdrawn and its **sends have stopped** (the engine
  reports each slot released), so no peer reads them after vLLM reuses them; the
  decode's pull fails (a load error there, recomputed per its
  ``kv_load_failure_policy``) instead of landing bytes of another request.

Both waits are bounded by ``timeout``; one that outlives it raises
:class:`kvferry.errors.TimeoutError` naming the requests: vLLM fails the step instead
of letting the forward write under a live writer (never corrupt, never hang).

vLLM 0.33 itself preempts only running requests, and kvferry touches only requests
waiting for remote KV (decode) or finished (prefill), so its scheduler never names one
with a transfer — what this module guards is the contract of ``handle_preemptions``
(blocks given back *before* they are overwritten), for any vLLM that does, and the
same withdrawal serves sleep mode (:mod:`.sleep`), where every request's blocks go.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from . import hetero as vllm_hetero
from ... import errors

if TYPE_CHECKING:
    from .worker import KvferryConnectorWorker

logger = init_logger(__name__)

__all__ = ["handle_preemptions", "withdraw"]


def handle_preemptions(worker: KvferryConnectorWorker, meta: Any) -> None:
    """The worker half of ``KVConnectorBase_V1.handle_preemptions`` (module docs)."""
    preempted = set(getattr(meta, "preempted", ()) or ())
    if preempted and worker.engine is not None:
        withdraw(worker, preempted, "preempted")


def withdraw(worker: KvferryConnectorWorker, req_ids: Iterable[str], why: str) -> None:
    """Stops every transfer touching ``req_ids``' blocks and returns once none can
    (module docs); raises ``kvferry.errors.TimeoutError`` past ``timeout``."""
    led = worker.ledger
    ids = list(req_ids)
    deadline = time.monotonic() + worker.config.timeout
    pulls: list[Any] = []
    with vllm_hetero.batched_releases(worker):  # unread slots: one Release per prefill rank
        for r in ids:
            rec = led.pulls.get(r)
            if rec is None:
                continue
            got, cancel = led.preempt(r, worker._seen(rec, unread=True))
            t = getattr(got, "transfer", None)
            if got is None or t is None:
                continue
            pulls.append(got)
            if cancel:
                t.cancel(timeout=0)  # every one asked first, then each drain awaited
    keys: set[str] = set()
    for r in ids:
        keys.update(led.preempt_publication(r))
    assert worker.engine is not None
    for k in keys:
        worker.engine.release(k)  # False: already released, reported below all the same
    # A cancelled transfer is done() at once but drained() only once its socket and
    # device copies stopped (a batched get: once it ended for every request riding it).
    pending = set(keys)
    live = list(pulls)
    while True:
        pending -= worker.take_released()
        live = [p for p in live if not p.transfer.drained()]
        if (not pending and not live) or time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    stuck = sorted(p.req_id for p in live)
    if stuck or pending:
        raise errors.TimeoutError(
            f"KvferryConnector ({why}): within {worker.config.timeout}s, pulls of {stuck} did not drain and "
            f"{len(pending)} publication slot(s) still sending; their blocks cannot be given back to vLLM"
        )
    if pulls or keys:
        logger.info(
            "KvferryConnector (%s): %d pull(s) drained, %d publication slot(s) withdrawn", why, len(pulls), len(keys)
        )
