# mypy: disable-error-code="import-untyped"
# (lmcache ships no type information: its classes are Any here.)
"""Awaiting work that touches LMCache's buffers to its end, whatever the caller does:
:func:`settle`, and :func:`as_future` (a kvferry transfer's outcome as an asyncio
future). Both the remote tier and the transfer channel wait through these.

Cancellation
------------
LMCache cancels a coroutine that outlived its own timeout (``future.cancel()``), and
may do so more than once. :func:`settle` absorbs every cancel until the awaited work
has ended — ``asyncio.shield`` alone would keep the work alive but resume the caller at
once, while a socket may still write the caller's buffer — then re-raises one
``CancelledError``. Its ``on_cancel`` hook (run once, at the first cancel) is how a
caller asks the work to end sooner, e.g. ``Transfer.cancel``, which returns only after
the transfer drained. The work's own failure after a cancel is logged at debug level
and superseded by the cancellation. The wait itself is as bounded as the work: callers
bound the work (kvferry deadlines plus a drain grace), never the wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Optional, TypeVar

from lmcache.logging import init_logger

import kvferry

logger = init_logger(__name__)

T = TypeVar("T")


async def settle(fut: Awaitable[T], on_cancel: Optional[Callable[[], object]] = None) -> T:
    """Awaits ``fut`` to its end even if the caller is cancelled (any number of times),
    then re-raises the cancellation. ``on_cancel`` runs once, at the first cancel (e.g.
    ``Transfer.cancel`` on a thread), so that the end comes sooner. A single shielded
    await would not do: ``shield`` keeps the work alive but resumes the caller at once."""
    task = asyncio.ensure_future(fut)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            if not cancelled and on_cancel is not None:
                on_cancel()
            cancelled = True
        except BaseException:  # the work failed: task.result() below raises it
            break
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            logger.debug("kvferry: work ended with %r after a cancel", task.exception())
        raise asyncio.CancelledError()
    return task.result()


def as_future(t: kvferry.Transfer) -> "asyncio.Future[int]":
    """An asyncio future of a transfer's outcome (``await transfer``, as a future)."""

    async def run() -> int:
        return await t

    return asyncio.ensure_future(run())
