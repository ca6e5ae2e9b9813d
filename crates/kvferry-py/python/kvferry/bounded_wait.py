"""``bounded_wait``: wait for an accelerator event with a deadline, never longer.

``event.synchronize()`` waits without a limit: when a device never completes an event
(a stuck copy, a lost interrupt), the waiting thread blocks for good and nothing above
it learns why. :func:`bounded_wait` is the bounded replacement::

    import kvferry

    kvferry.bounded_wait(copy_event, 30.0, what="output copy")   # seconds waited
    # or kvferry.TimeoutError: "bounded_wait: output copy on cuda:0 did not complete
    # within 30.000 s (waited 30.000 s); ..."  with .op, .waited and .device set

It accepts any event with ``query()``: ``torch.cuda.Event`` and ``torch.Event`` of a
CUDA device are queried from Rust with the driver's ``cuEventQuery`` on the raw handle,
with the GIL released for the whole wait; anything else (``torch.Event`` of other
accelerators, your own objects) is polled through ``query()``, holding the GIL only for
that call. Between queries the thread sleeps with an adaptive backoff (no busy spin):
a wait first sleeps until shortly before the completion time of recent waits with the
same ``what``, then polls finely (from 10 µs, intervals growing 1.2×) across their
spread, then coarsely (doubling, up to 100 ms); without history it polls coarsely
from the start. Waiting a second on an event that never completes takes 24–36
queries (``python -m kvferry.bench_bounded_wait`` measures CPU and latency; figures
in ``docs/benchmarks.md``).

On timeout the event is untouched (the device may still complete it): the caller gets
an error instead of a hang, and decides what to do with the work behind the event.
"""

from __future__ import annotations

from typing import Protocol

from . import _kvferry


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


__all__ = ["Queryable", "bounded_wait"]
