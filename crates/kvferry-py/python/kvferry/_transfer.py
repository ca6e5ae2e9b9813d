"""The :class:`Transfer`: a get in flight, waited on (the GIL released), polled,
cancelled (returning after its drain) or awaited from asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from . import _kvferry


class Transfer:
    """A get in flight, from :meth:`Engine.get`.

    ``wait(timeout)`` returns the number of chunks landed or raises the transfer's
    error; ``done()`` tells whether it finished; ``cancel()`` cancels it and returns
    after its drain (the destination blocks are quiet, staging pages are back);
    ``error`` is its exception (or None). ``await transfer`` works in asyncio without a
    thread per await.
    """

    __slots__ = ("_t",)

    def __init__(self, t: _kvferry.Transfer) -> None:
        self._t = t

    def wait(self, timeout: float | None = None) -> int:
        """Chunks landed; raises the transfer's error, or ``TimeoutError`` if
        ``timeout`` seconds passed first (the transfer goes on). Ctrl-C cancels the
        transfer, waits for its drain, then raises ``KeyboardInterrupt``."""
        return self._t.wait(timeout)

    def done(self) -> bool:
        """True once the transfer finished: its outcome (landed or the error) is known."""
        return self._t.done()

    def drained(self) -> bool:
        """True once nothing writes the destination blocks any more (never blocks). A
        failed transfer can be ``done()`` and not yet drained (a device copy that
        outlived it); hand the blocks back only once this is True."""
        return self._t.drained()

    def cancel(self, timeout: float | None = None) -> bool:
        """Cancels and returns after the drain: True, or False if the drain outlived
        ``timeout`` seconds (default 10; ``0``: return at once and poll
        :meth:`drained`)."""
        return self._t.cancel(timeout)

    @property
    def error(self) -> BaseException | None:
        """The exception of a failed transfer, else None."""
        return self._t.error

    @property
    def result(self) -> int | None:
        """Chunks landed, once finished successfully; else None."""
        return self._t.result

    def __await__(self) -> Generator[Any, None, int]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not fut.done():
                fut.set_result(None)

        def on_done() -> None:  # runs on an engine thread
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop closed meanwhile
                pass

        self._t.add_done_callback(on_done)
        yield from fut.__await__()
        return self._t.wait(None)

    def __repr__(self) -> str:
        return repr(self._t)
