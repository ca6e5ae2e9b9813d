# mypy: disable-error-code="import-untyped"
# mypy: allow-subclassing-any
# (lmcache ships no type information: its classes are Any here.)
"""Benchmark: LMCache retrieve through its remote tiers, in one run, on the same workload.

    python -m kvferry.integrations.lmcache.bench [--chunks 8] [--rounds 3]

Tiers: kvferry (``KvferryRemoteConnector`` against a ``kvferry serve``), LMCache's own
remote server (``python -m lmcache.v1.server``, the ``lm://`` tier) and its Redis tier
(``redis-server``, ``redis://``). Workload: ``--chunks`` chunks of 256 tokens of a
llama-3-8B-shaped KV (32 layers, 8 KV heads, head dim 128, fp16: 32 MiB a chunk),
stored by a real ``LMCacheEngine`` into the tier, the local copy dropped, then
retrieved. Two figures per tier: ``tier`` (the remote backend's batched get of every
chunk into LMCache memory objects: what the tier itself costs) and ``retrieve``
(``LMCacheEngine.retrieve`` into a KV tensor, which adds LMCache's own copy into the
KV cache through the CPU test connector). Every retrieve is checked byte for byte.
Prints one JSON object per tier and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

LAYERS, HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


class _CpuConnector:
    """Built lazily (needs lmcache): KV [L, 2, T, H, D] CPU tensors <-> KV_2LTD objects."""

    @staticmethod
    def make() -> Any:
        import torch
        from lmcache.v1.gpu_connector import GPUConnectorInterface

        class C(GPUConnectorInterface):
            def get_shape(self, n: int) -> Any:
                return torch.Size([2, LAYERS, n, HEADS * HEAD_DIM])

            def from_gpu(self, m: Any, s: int, e: int, **kw: Any) -> None:
                m.tensor.copy_(kw["kvcaches"][:, :, s:e].permute(1, 0, 2, 3, 4).reshape(2, LAYERS, e - s, HEADS * HEAD_DIM))

            def to_gpu(self, m: Any, s: int, e: int, **kw: Any) -> None:
                kw["kvcaches"][:, :, s:e] = m.tensor.reshape(2, LAYERS, e - s, HEADS, HEAD_DIM).permute(1, 0, 2, 3, 4)

            def batched_from_gpu(self, ms: Any, ss: Any, es: Any, **kw: Any) -> None:
                for m, s, e in zip(ms, ss, es):
                    self.from_gpu(m, s, e, **kw)

            def batched_to_gpu(self, ms: Any = None, ss: Any = None, es: Any = None, **kw: Any) -> None:
                for m, s, e in zip(ms, ss, es):
                    self.to_gpu(m, s, e, **kw)

        return C()


def _engine(remote: dict[str, Any], chunks: int) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=(chunks + 4) * CHUNK_BYTES / 1024**3,
        remote_serde="naive",
        blocking_timeout_secs=60,
        **remote,
    )
    md = LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.float16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
    )
    iid = f"bench-{uuid.uuid4().hex[:8]}"
    eng = LMCacheEngineBuilder.get_or_create(iid, cfg, md, _CpuConnector.make(), lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return iid, eng


def _remote_backend(eng: Any) -> Any:
    for name, b in eng.storage_manager.storage_backends.items():
        if name.startswith("RemoteBackend"):
            if b.connection is None:
                raise RuntimeError(f"{name} has no connection (see LMCache's log: a missing client module?)")
            return b
    raise RuntimeError("no remote backend was created (see LMCache's log)")


class Tier:
    """One tier's LMCache engine, with the workload stored and verified."""

    def __init__(self, name: str, remote: dict[str, Any], chunks: int) -> None:
        import torch

        self.name, self.chunks = name, chunks
        self.iid, self.eng = _engine(remote, chunks)
        self.rb = _remote_backend(self.eng)
        self.tokens = torch.arange(chunks * CHUNK)
        g = torch.Generator().manual_seed(7)
        self.kv = torch.randn(LAYERS, 2, len(self.tokens), HEADS, HEAD_DIM, generator=g).to(torch.float16)
        t0 = time.perf_counter()
        self.eng.store(self.tokens, kvcaches=self.kv)
        self.keys = [k for _, _, k in self.eng.token_database.process_tokens(tokens=self.tokens)]
        deadline = time.monotonic() + 300
        while sum(1 for k in self.keys if self.rb.contains(k)) < len(self.keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: puts did not finish")
            time.sleep(0.02)
        self.store_s = time.perf_counter() - t0
        self.tier_s: list[float] = []
        self.retr_s: list[float] = []

    def round(self) -> None:
        import torch

        self.eng.clear(locations=["LocalCPUBackend"])
        t0 = time.perf_counter()
        objs = self.rb.batched_get_blocking(self.keys)
        self.tier_s.append(time.perf_counter() - t0)
        ok = all(o is not None for o in objs)
        for i, o in enumerate(objs):
            if o is None:
                continue
            want = self.kv[:, :, i * CHUNK : (i + 1) * CHUNK].permute(1, 0, 2, 3, 4).reshape(2, LAYERS, CHUNK, HEADS * HEAD_DIM)
            ok = ok and torch.equal(o.tensor, want)
            o.ref_count_down()
        if not ok:
            raise RuntimeError(f"{self.name}: the tier returned wrong or missing chunks")
        self.eng.clear(locations=["LocalCPUBackend"])
        out = torch.zeros_like(self.kv)
        t0 = time.perf_counter()
        n = int(self.eng.retrieve(self.tokens, kvcaches=out).sum().item())
        self.retr_s.append(time.perf_counter() - t0)
        if n != len(self.tokens) or not torch.equal(out, self.kv):
            raise RuntimeError(f"{self.name}: retrieve returned {n}/{len(self.tokens)} tokens or wrong bytes")

    def result(self) -> dict[str, Any]:
        total = self.chunks * CHUNK_BYTES
        tier, retr = statistics.median(self.tier_s), statistics.median(self.retr_s)
        return {
            "tier": self.name,
            "chunks": self.chunks,
            "chunk_bytes": CHUNK_BYTES,
            "store_s": round(self.store_s, 3),
            "tier_get_GBps": round(total / tier / 1e9, 3),
            "tier_get_chunks_per_s": round(self.chunks / tier, 1),
            "retrieve_GBps": round(total / retr / 1e9, 3),
            "retrieve_chunks_per_s": round(self.chunks / retr, 1),
            "tier_get_s": [round(x, 4) for x in self.tier_s],
            "retrieve_s": [round(x, 4) for x in self.retr_s],
        }

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(self.iid)


def _kvferry_bin() -> str:
    env = os.environ.get("KVFERRY_BIN")
    if env:
        return env
    built = Path(__file__).resolve().parents[6] / "target" / "release" / "kvferry"
    if built.exists():
        return str(built)
    found = shutil.which("kvferry")
    if not found:
        raise SystemExit("the kvferry binary is missing: set KVFERRY_BIN")
    return found


def _summary(results: list[dict[str, Any]]) -> None:
    by = {r["tier"]: r for r in results}
    if "kvferry" in by:
        k = by["kvferry"]
        parts = [f"kvferry tier get {k['tier_get_GBps']} GB/s ({k['tier_get_chunks_per_s']} chunks/s), retrieve {k['retrieve_GBps']} GB/s"]
        for other in ("lm", "redis"):
            if other in by:
                o = by[other]
                parts.append(f"vs {other}: tier x{k['tier_get_GBps'] / o['tier_get_GBps']:.2f}, retrieve x{k['retrieve_GBps'] / o['retrieve_GBps']:.2f}")
        print("summary: " + "; ".join(parts), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiers", default="kvferry,lm,redis")
    ap.add_argument("--parallel", type=int, default=4, help="the kvferry tier's kvferry.parallel (concurrent transfers per batched get)")
    args = ap.parse_args(argv)
    procs: list[subprocess.Popen[Any]] = []
    tiers: list[Tier] = []
    secret = "bench-secret-0123456789abcdef0123456789"
    try:
        for tier in args.tiers.split(","):
            port = _free_port()
            if tier == "kvferry":
                blocks = args.chunks * (CHUNK_BYTES // (2 << 20) + 1) + 8
                arena = max(256, 2 * args.chunks * CHUNK_BYTES >> 20)
                env = dict(os.environ, KVFERRY_SECRET=secret)
                cmd = [_kvferry_bin(), "serve", "--listen", f"127.0.0.1:{port}", "--model", "llama3-8b", "--blocks", str(blocks), "--arena", f"{arena}MiB"]
                remote = {
                    "remote_storage_plugins": ["kvferry"],
                    "extra_config": {
                        "remote_storage_plugin.kvferry.module_path": "kvferry.integrations.lmcache",
                        "remote_storage_plugin.kvferry.class_name": "KvferryRemoteConnector",
                        "kvferry.server": f"127.0.0.1:{port}",
                        "kvferry.secret": secret,
                        "kvferry.timeout": 30.0,
                        "kvferry.parallel": args.parallel,
                    },
                }
            elif tier == "lm":
                env = dict(os.environ)
                cmd = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port)]
                remote = {"remote_url": f"lm://127.0.0.1:{port}"}
            elif tier == "redis":
                env = dict(os.environ)
                cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                remote = {"remote_url": f"redis://127.0.0.1:{port}"}
            else:
                raise SystemExit(f"unknown tier {tier!r}")
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait_port(port)
            tiers.append(Tier(tier, remote, args.chunks))
        # rounds interleaved across tiers, so that a busy moment of a shared machine
        # does not land on one tier only
        for _ in range(args.rounds):
            for t in tiers:
                t.round()
        results = [t.result() for t in tiers]
        for r in results:
            print(json.dumps(r), flush=True)
        _summary(results)
    finally:
        # LMCache's own tiers can take minutes to close (its Redis connector was
        # seen to hang in close): each close gets a bounded wait on a daemon thread.
        for t in tiers:
            closer = threading.Thread(target=t.close, daemon=True)
            closer.start()
            closer.join(30)
            if closer.is_alive():
                print(f"warning: the {t.name} tier did not close within 30 s", file=sys.stderr, flush=True)
        for p in procs:
            if p.poll() is None:
                p.kill()
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:  # --help, a usage error, a missing binary
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 2
    except BaseException:  # a failed round, Ctrl-C: reported, then the same hard exit
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Threads LMCache left running (its Redis connector's close was seen to hang) must
    # not hold the exit, after a failure either.
    os._exit(rc)
