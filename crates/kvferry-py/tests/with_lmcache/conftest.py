"""Shared pieces of the LMCache tests: the pin check, a real ``kvferry serve`` process,
and a real ``LMCacheEngine`` on CPU.

LMCache ships no connector that moves KV between CPU tensors and its engine (its
``GPUConnectorInterface`` implementations need CUDA kernels), so these tests use a
small one, :class:`CpuKVConnector`: KV tensors ``[layers, 2, tokens, heads, head_dim]``
on CPU copied to and from LMCache's ``KV_2LTD`` memory objects with ``torch`` copies.
Everything else — ``LMCacheEngine``, its storage manager, ``LocalCPUBackend``, the
``RemoteBackend`` that loads the kvferry plugin — is LMCache 0.5.6's own code.

Needs lmcache 0.5.6 beside torch (``scripts/install-lmcache.sh``). Without it every
test here is skipped with the reason, unless ``KVFERRY_REQUIRE_LMCACHE=1`` (then they
fail). The ``kvferry`` binary is ``$KVFERRY_BIN`` or ``target/release/kvferry``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The integration suites' shared pin check lives one folder up; the child processes of
# the P2P and PD tests import this file by its own folder, so put that one on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pinned import skip_or_fail, why_not_pinned  # noqa: E402 - after the path above

PINNED = "0.5.6"
_HOW = "install it with scripts/install-lmcache.sh (lmcache==0.5.6 without its dependencies, beside torch) and run pytest from that venv"
ROOT = Path(__file__).resolve().parents[4]


def _find_lmcache() -> str | None:
    why = why_not_pinned("lmcache", PINNED, ("torch",), _HOW)
    if why is not None:
        return why
    try:
        import torch  # noqa: F401

        import kvferry.integrations.lmcache  # noqa: F401
    except ImportError as e:
        return f"lmcache {PINNED} does not import here ({e}); {_HOW}"
    return None


WHY_NOT = _find_lmcache()


def kvferry_bin() -> str | None:
    env = os.environ.get("KVFERRY_BIN")
    if env:
        return env
    built = ROOT / "target" / "release" / "kvferry"
    if built.exists():
        return str(built)
    return shutil.which("kvferry")


@pytest.fixture(scope="module")
def need_lmcache() -> None:
    """Skips (or, with KVFERRY_REQUIRE_LMCACHE=1, fails) without lmcache 0.5.6 or the binary."""
    why = WHY_NOT
    if why is None and kvferry_bin() is None:
        why = "the kvferry binary is missing: cargo build --release -p kvferry-cli, or set KVFERRY_BIN"
    skip_or_fail(why, "KVFERRY_REQUIRE_LMCACHE")


SECRET = "kvferry-lmcache-test-secret-0123456789"


class Serve:
    """A real ``kvferry serve`` process (SIGKILL-able, restartable on its port)."""

    def __init__(self, *, secret: str | None = SECRET, blocks: int = 16384, arena: str = "64MiB", model: str = "tiny", listen: str = "127.0.0.1:0", extra: list[str] | None = None) -> None:
        self.model = model
        self.secret = secret
        self.blocks = blocks
        self.arena = arena
        self.extra = extra or []
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.start(listen)

    def start(self, listen: str | None = None) -> None:
        listen = listen or self.address
        cmd = [kvferry_bin() or "kvferry", "serve", "--listen", listen, "--model", self.model, "--blocks", str(self.blocks), "--arena", self.arena, "--page-size", "1MiB", *self.extra]
        env = dict(os.environ)
        env.pop("KVFERRY_SECRET", None)
        if self.secret:
            env["KVFERRY_SECRET"] = self.secret
        deadline = time.monotonic() + 20
        while True:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            assert self.proc.stdout is not None
            lines = []
            for line in self.proc.stdout:
                lines.append(line)
                if "listening on" in line:
                    self.address = line.split("listening on ")[1].split()[0]
                    return
            self.proc.wait()
            if time.monotonic() > deadline:  # e.g. the old port still held: retried until then
                raise RuntimeError("kvferry serve did not start: " + "".join(lines))
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start(self.address)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def serve(need_lmcache: None) -> Iterator[Any]:
    made: list[Serve] = []

    def make(**kw: Any) -> Serve:
        s = Serve(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.kill()


# -- a real LMCacheEngine on CPU -----------------------------------------------


def cpu_connector_class() -> Any:
    import torch
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class CpuKVConnector(GPUConnectorInterface):
        """KV ``[L, 2, T, H, D]`` CPU tensors <-> LMCache ``KV_2LTD`` memory objects
        (``[2, L, T, H*D]``) with plain torch copies (a test connector; see the module docs)."""

        def __init__(self, layers: int, heads: int, head_dim: int) -> None:
            self.L, self.H, self.D = layers, heads, head_dim

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.L, num_tokens, self.H * self.D])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            kv = kw["kvcaches"]
            n = end - start
            memory_obj.tensor.copy_(kv[:, :, start:end].permute(1, 0, 2, 3, 4).reshape(2, self.L, n, self.H * self.D))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            kv = kw["kvcaches"]
            n = end - start
            kv[:, :, start:end] = memory_obj.tensor.reshape(2, self.L, n, self.H, self.D).permute(1, 0, 2, 3, 4)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e, **kw)

    return CpuKVConnector


class Lmc:
    """An ``LMCacheEngine`` (LMCache's own) with the kvferry remote tier as a plugin."""

    def __init__(self, server: str, *, secret: str | None = SECRET, chunk: int = 16, layers: int = 2, heads: int = 2, head_dim: int = 16, cpu_gb: float = 0.2, timeout: float = 3.0, extra: dict[str, Any] | None = None, adapter: bool = False) -> None:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        self.id = f"kvferry-test-{uuid.uuid4().hex[:8]}"
        self.chunk, self.L, self.H, self.D = chunk, layers, heads, head_dim
        ec: dict[str, Any] = {
            "remote_storage_plugin.kvferry.module_path": "kvferry.integrations.lmcache",
            "remote_storage_plugin.kvferry.class_name": "KvferryConnectorAdapter" if adapter else "KvferryRemoteConnector",
            "kvferry.server": server,
            "kvferry.timeout": timeout,
        }
        if secret is not None:
            ec["kvferry.secret"] = secret
        ec.update(extra or {})
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk,
            local_cpu=True,
            max_local_cpu_size=cpu_gb,
            remote_serde="naive",
            remote_storage_plugins=["kvferry"],
            extra_config=ec,
            blocking_timeout_secs=int(timeout) + 2,
        )
        md = LMCacheMetadata(
            model_name="kvferry-test",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float16,
            kv_shape=(layers, 2, chunk, heads, head_dim),
        )
        self.engine = LMCacheEngineBuilder.get_or_create(self.id, cfg, md, cpu_connector_class()(layers, heads, head_dim), lambda t, r: None, lambda o, r: o)
        self.engine.post_init()

    @property
    def backends(self) -> dict[str, Any]:
        return dict(self.engine.storage_manager.storage_backends)

    @property
    def remote(self) -> Any:
        return self.backends["RemoteBackend-kvferry"]

    @property
    def connector(self) -> Any:
        conn = self.remote.connection
        return getattr(conn, "connector", getattr(conn, "_connector", conn))

    def kv(self, tokens: int, seed: int = 0) -> Any:
        import torch

        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.L, 2, tokens, self.H, self.D, generator=g).to(torch.float16)

    def store(self, tokens: Any, kv: Any, wait: float = 30.0) -> None:
        """Stores, then waits until the server holds every chunk (LMCache's puts are
        asynchronous; batched puts are not tracked in its ``put_tasks``)."""
        self.engine.store(tokens, kvcaches=kv)
        keys = self.keys(tokens)
        deadline = time.monotonic() + wait
        while self.connector.batched_contains(keys) < len(keys):
            assert time.monotonic() < deadline, "remote puts did not finish"
            time.sleep(0.01)

    def keys(self, tokens: Any) -> list[Any]:
        return [k for _, _, k in self.engine.token_database.process_tokens(tokens=tokens)]

    def drop_local(self) -> None:
        self.engine.clear(locations=["LocalCPUBackend"])

    def retrieve(self, tokens: Any) -> tuple[int, Any]:
        import torch

        out = torch.zeros(self.L, 2, len(tokens), self.H, self.D, dtype=torch.float16)
        mask = self.engine.retrieve(tokens, kvcaches=out)
        return int(mask.sum().item()), out

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(self.id)


@pytest.fixture
def lmc(need_lmcache: None) -> Iterator[Any]:
    made: list[Lmc] = []

    def make(server: str, **kw: Any) -> Lmc:
        e = Lmc(server, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        try:
            e.close()
        except Exception:  # noqa: BLE001 - teardown of a test that already failed
            pass


@pytest.fixture
def cpu_connector(need_lmcache: None) -> Any:
    """The CPU test connector class (see the module docs)."""
    return cpu_connector_class()
