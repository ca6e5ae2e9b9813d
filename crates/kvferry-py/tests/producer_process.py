"""A producer engine in another process (spawned, so it can be SIGKILLed like a
crashed server) and process memory readings, for the core tests.

A module of its own, not ``conftest.py``: the spawned child finds ``producer_main`` by
this module's name, while ``conftest`` may name another directory's conftest (the vLLM
suite's) when the whole tree is collected at once."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Protocol

import numpy as np

import kvferry

BLOCK = 4096


def producer_main(conn: Connection, listen: str, secret: bytes | None, nblocks: int, send_delay_us: int) -> None:
    """Runs in a spawned process: publishes chunks on request and reports back."""
    # The socket mover: callers delay its sends and kill it mid-send.
    eng = kvferry.Engine(listen=listen, secret=secret, max_ttl=60.0, ttl=60.0, transport="tcp")
    eng._e._inject_faults(send_delay_us=send_delay_us)
    kv = np.arange(nblocks * BLOCK, dtype=np.uint32).astype(np.uint8).reshape(nblocks, BLOCK)
    kv += np.uint8(eng.incarnation % 251)
    region = eng.register_kv_cache(kv, block_bytes=BLOCK)
    conn.send((eng.address, eng.incarnation))
    while True:
        msg = conn.recv()
        if msg[0] == "publish":
            _, key, blocks = msg
            eng.publish(key, region, blocks, ttl=60.0, once=False)
            conn.send(("ok", kv[blocks].tobytes()))
        elif msg[0] == "stop":
            eng.close()
            conn.send(("stopped",))
            return


class RemoteProducer:
    """A producer engine in a child process."""

    def __init__(self, listen: str = "127.0.0.1:0", secret: bytes | None = None, nblocks: int = 64, send_delay_us: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, listen, secret, nblocks, send_delay_us), daemon=True)
        self.proc.start()
        if not self.conn.poll(30):
            raise RuntimeError("producer process did not start")
        address, incarnation = self.conn.recv()
        assert isinstance(address, str) and isinstance(incarnation, int), (address, incarnation)
        self.address = address
        self.incarnation = incarnation

    def publish(self, key: str, blocks: list[int]) -> bytes:
        self.conn.send(("publish", key, blocks))
        _, data = self.conn.recv()
        assert isinstance(data, bytes), data
        return data

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.conn.poll(10)
            self.proc.join(10)


class MakeProducer(Protocol):
    """What the ``remote_producer`` fixture gives: starts a :class:`RemoteProducer`."""

    def __call__(
        self, *, listen: str = ..., secret: bytes | None = ..., nblocks: int = ..., send_delay_us: int = ...
    ) -> RemoteProducer: ...


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
