"""Fixtures of the core tests: ``remote_producer`` starts producer engines in processes
of their own (:mod:`producer_process`) and kills what is left at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from producer_process import MakeProducer, RemoteProducer


@pytest.fixture
def remote_producer() -> Iterator[MakeProducer]:
    made: list[RemoteProducer] = []

    def make(
        *, listen: str = "127.0.0.1:0", secret: bytes | None = None, nblocks: int = 64, send_delay_us: int = 0
    ) -> RemoteProducer:
        p = RemoteProducer(listen=listen, secret=secret, nblocks=nblocks, send_delay_us=send_delay_us)
        made.append(p)
        return p

    yield make
    for p in made:
        if p.proc.is_alive():
            p.kill()
