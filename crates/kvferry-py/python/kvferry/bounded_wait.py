"""``bounded_wait``: wait for an accelerator event with a deadline, never longer.

``event.synchronize()`` waits without a limit: when a device never completes an event
(a stuck copy, a lost interrupt), the waiting thread blocks for good and nothing above
it learns why. :func:`bounded_wait` is the bounded replacement::

    import kvferry

    kvferry.bounded_wait(copy_event, 30.0, what="output copy")   # seconds waited
    # or kvferry.TimeoutError: "bounded_wait: output copy on cuda:0 did not complete
    # within 30.000 s (waited 30.000 s); ..."  with .op, .waited and .device set

How it learns that the event completed depends on the event (the first query is
immediate, so a completed event costs one query):

- ``kvferry.CompletionEvent`` — an event a thread or a callback completes with
  ``set()`` — is waited for on its notifier: no polling, one wake-up when it is set or
  at the deadline.
- ``torch.cuda.Event`` and ``torch.Event`` of a CUDA device: a private stream waits on
  the event and then runs a host function (``cuLaunchHostFunc``) that wakes the
  waiter, with the GIL released for the whole wait; the event is also queried every
  250 ms and at the deadline (four driver calls per second of a stuck event). Where the
  driver lacks the entry points it polls ``cuEventQuery`` as below.
- Anything else with ``query()`` (``torch.Event`` of other accelerators, your own
  objects) is polled, holding the GIL only for that call, on an adaptive schedule (no
  busy spin): a wait first sleeps until shortly before the completion time of recent
  waits with the same ``what``, polls six times across their spread (at least 40 µs
  apart), then backs off (the next query at four times the time waited, at most
  400 ms later); without history it backs off from 20 µs. A second on an event that
  never completes costs about ten queries.

``python -m kvferry.bench_bounded_wait`` measures CPU and latency per kind; figures in
``docs/benchmarks.md``.

On timeout the event is untouched (the device may still complete it): the caller gets
an error instead of a hang, and decides what to do with the work behind the event.
"""

from __future__ import annotations

from typing import Protocol

from . import _kvferry
from ._kvferry import CompletionEvent


class Queryable(Protocol):
    """An event: ``query()`` is truthy once the work it records has completed."""

    def query(self) -> object: ...


def bounded_wait(event: Queryable, timeout: float, *, what: str | None = None) -> float:
    """Waits until ``event`` has completed, at most ``timeout`` seconds; returns the
    seconds waited.

    ``what`` names the wait in errors (default: the event's type) and keys the history
    that the backoff adapts to, so give each kind of wait its own name.

    Raises :class:`kvferry.TimeoutError` (``op`` = ``what``, ``waited`` in seconds,
    ``device`` = the event's device) when the deadline passes first;
    :class:`kvferry.InvalidArgumentError` for a negative or non-finite ``timeout``
    (``0`` queries once); :class:`kvferry.DeviceError` when the CUDA driver reports an
    error for the event; whatever ``event.query()`` raises, unchanged.
    """
    return _kvferry.bounded_wait(event, timeout, what=what)


__all__ = ["CompletionEvent", "Queryable", "bounded_wait"]
