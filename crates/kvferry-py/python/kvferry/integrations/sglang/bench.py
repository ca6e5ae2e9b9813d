# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""A small throughput benchmark of the SGLang backend against kvferry's own transfer of
the same bytes, on loopback, the prefill and the decode in two processes (as SGLang
runs them, and as ``kvferry bench`` runs its producer):

- ``backend``: a prefill :class:`KvferryKVManager` with SGLang's real bootstrap server
  in a child process, a decode manager in this one (TP 1), one request of ``--mib`` MiB
  of KV pages sent in ``--chunks`` ``send`` calls, timed from the first ``send`` to the
  later of the decode's ``Success`` (pages landed, verified and drained) and the
  prefill's ``Success`` (every chunk acknowledged); both processes poll their request
  every ``--poll-ms`` (0.2 ms), as a scheduler loop would;
- ``engine``: the same two engines and regions, the same pages, one
  :meth:`Engine.publish` (in the child) and one :meth:`Engine.get` per chunk, all in
  flight at once, timed from the first publish to the last landing: what the backend
  costs above kvferry itself. Its publish calls (a crc32c pass over every page) are
  also timed alone (``engine_publish_s``), and its gets alone, from the last publish to
  the last landing (``engine_gets_gb_per_s``), as ``kvferry bench`` times its gets.

The stamps of the two processes are ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock
for the host). ``--transport`` is kvferry's (``KVFERRY_SGLANG_TRANSPORT``): ``auto``
reads the prefill's memory with ``process_vm_readv`` on one host, ``tcp`` keeps every
byte on the socket, as between hosts (and as Mooncake's TCP transport does here).
``--kvferry-bin`` adds ``kvferry bench --bytes --transport <transport> --producer-process
true`` (the CLI's end-to-end figure, its producer in a child process too) on the same
byte count, with the raw TCP limit that run measures. ``--mooncake`` adds Mooncake's
transfer engine over TCP (the transport under SGLang's ``mooncake_tcp`` backend;
``mooncake-transfer-engine-non-cuda``, which needs ``libibverbs1`` even for TCP), both
its engines in this process: the same pages written with one
``batch_transfer_sync_write`` per chunk, contiguous page runs of each buffer coalesced,
as SGLang's mooncake backend issues them — its transport, not SGLang's mooncake
manager, which needs a full SGLang runtime. Every case runs once per rep, interleaved
(backend, engine, Mooncake, ``kvferry bench``), so that every ratio compares medians of
the same minutes; the destination is zeroed before each case and every landed byte
compared after it.
Prints one JSON object: GB/s of each (medians), the CPU seconds per GB of both
processes for the backend and the engines (``*_cpu_s_per_gb``, every thread; the
backend's includes both polling loops), and the ratios measured in this one
invocation: ``backend_over_engine``, ``backend_over_mooncake_tcp`` (with ``--mooncake``),
``backend_over_kvferry_bench`` and ``backend_over_tcp_limit`` (with ``--kvferry-bin``;
the targets are ≥ 2 and ≥ 0.9).

    python -m kvferry.integrations.sglang.bench --mib 256 --reps 5 --mooncake \
        --kvferry-bin target/release/kvferry
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode

from . import KvferryKVBootstrapServer, KvferryKVManager, KvferryKVReceiver, KvferryKVSender

LAYERS = 16
PAGE = 16
HEADS = 8
HEAD_DIM = 128


def _args(kv: list[torch.Tensor], aux: torch.Tensor) -> Any:
    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs = [t.data_ptr() for t in kv]
    a.kv_data_lens = [t.numel() * t.element_size() for t in kv]
    a.kv_item_lens = [PAGE * HEADS * HEAD_DIM * kv[0].element_size()] * len(kv)
    a.aux_data_ptrs = [aux.data_ptr()]
    a.aux_data_lens = [aux.numel()]
    a.aux_item_lens = [aux.shape[1]]
    a.state_data_ptrs = []
    a.page_size, a.kv_head_num, a.total_kv_head_num = PAGE, HEADS, HEADS
    a.kv_cache_dtype_str, a.gpu_id, a.pp_rank = "bfloat16", 0, 0
    return a


def _same(src: torch.Tensor, dst: torch.Tensor, ids: list[int], dst_ids: list[int]) -> bool:
    """Every source page ``ids[i]`` landed in destination page ``dst_ids[i]``."""
    s = src.view(torch.int16).view(-1, PAGE * HEADS * HEAD_DIM)
    d = dst.view(torch.int16).view(-1, PAGE * HEADS * HEAD_DIM)
    return torch.equal(s[torch.tensor(ids)], d[torch.tensor(dst_ids)])


class _MooncakeTcp:
    """Two Mooncake transfer engines over TCP in this process, ``src`` registered on
    one and ``dst`` on the other; each :meth:`rep` writes one request's pages."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        os.environ.setdefault("MC_FORCE_TCP", "1")
        engine_mod = importlib.import_module("mooncake.engine")
        self.a, self.b = engine_mod.TransferEngine(), engine_mod.TransferEngine()
        for e in (self.a, self.b):
            if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("Mooncake's transfer engine did not initialize")
        for e, bufs in ((self.a, src), (self.b, dst)):
            for t in bufs:
                e.register_memory(t.data_ptr(), t.numel() * t.element_size())
        self.src, self.dst = src, dst
        self.session = f"127.0.0.1:{self.b.get_rpc_port()}"

    def rep(self, chunks: list[list[int]], dst_chunks: list[list[int]]) -> float:
        """Seconds for one request: one ``batch_transfer_sync_write`` per chunk,
        contiguous page runs of each buffer coalesced (as SGLang's mooncake backend
        issues them); every page compared afterwards."""
        src, dst = self.src, self.dst
        item = PAGE * HEADS * HEAD_DIM * src[0].element_size()
        for t in dst:
            t.zero_()
        t0 = time.perf_counter()
        for c, dc in zip(chunks, dst_chunks):
            runs: list[tuple[int, int, int]] = []  # (src page, dst page, pages)
            for p, q in zip(c, dc):
                if runs and runs[-1][0] + runs[-1][2] == p and runs[-1][1] + runs[-1][2] == q:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((p, q, 1))
            s_addr, d_addr, lens = [], [], []
            for sb, db in zip(src, dst):
                for p0, q0, n in runs:
                    s_addr.append(sb.data_ptr() + p0 * item)
                    d_addr.append(db.data_ptr() + q0 * item)
                    lens.append(n * item)
            if self.a.batch_transfer_sync_write(self.session, s_addr, d_addr, lens) != 0:
                raise RuntimeError("Mooncake's batch write failed")
        took = time.perf_counter() - t0
        ids = [p for c in chunks for p in c]
        dst_ids = [p for c in dst_chunks for p in c]
        assert all(_same(x, y, ids, dst_ids) for x, y in zip(src, dst)), "Mooncake: bytes differ"
        return took


def _kvferry_bench(binary: str, mib: int, transport: str) -> dict[str, Any]:
    """One ``kvferry bench`` run on the same byte count, its producer in a process of
    its own; its JSON, or ``{"error": ...}``."""
    cli = subprocess.run(
        [binary, "bench", "--bytes", f"{mib}MiB", "--transport", transport, "--producer-process", "true", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    try:
        b: dict[str, Any] = json.loads(cli.stdout)
        float(b["gbps"])
        return b
    except (ValueError, KeyError, TypeError):
        return {"error": (cli.stderr or cli.stdout)[-500:]}


def _source(pages: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The prefill's KV and auxiliary buffers, the same bytes in every process (seeded)."""
    kv = [torch.empty((pages * PAGE, HEADS, HEAD_DIM), dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    for i, buf in enumerate(kv):
        buf.view(torch.int16).copy_(torch.randint(-30000, 30000, buf.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(i)))
    return kv, torch.arange(4 * 64, dtype=torch.uint8).reshape(4, 64)


def _prefill_child(pages: int, port: int, poll_s: float) -> None:
    """The prefill process: SGLang's bootstrap server and a prefill manager over
    :func:`_source`'s buffers, driven by JSON lines on stdin, answering on stdout with
    ``time.perf_counter()`` stamps (CLOCK_MONOTONIC: comparable across processes)."""
    src_kv, src_aux = _source(pages)
    server = KvferryKVBootstrapServer("127.0.0.1", port)
    sa = SimpleNamespace(tp_size=1, dp_size=1, pp_size=1, host="127.0.0.1", disaggregation_bootstrap_port=port)
    pre = KvferryKVManager(_args(src_kv, src_aux), DisaggregationMode.PREFILL, sa)
    print(json.dumps({"ready": pre.engine.address}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        if c["op"] == "backend":
            s = KvferryKVSender(pre, f"127.0.0.1:{port}", c["room"])
            deadline = time.monotonic() + 60
            while s.poll() != KVPoll.WaitingForInput:
                assert s.poll() != KVPoll.Failed and time.monotonic() < deadline, s.state.reason
                time.sleep(0.0005)
            s.init(pages, 2)
            c0, t0 = time.process_time(), time.perf_counter()
            for chunk in c["chunks"]:
                s.send(chunk)
            while s.poll() not in (KVPoll.Success, KVPoll.Failed):
                assert time.monotonic() < deadline, "the prefill did not finish in 60 s"
                time.sleep(poll_s)
            t1 = time.perf_counter()
            print(json.dumps({"t0": t0, "t1": t1, "cpu": time.process_time() - c0, "ok": s.poll() == KVPoll.Success, "why": s.state.reason}), flush=True)
            s.clear()
        elif c["op"] == "publish":
            c0, t0 = time.process_time(), time.perf_counter()
            for k, chunk in zip(c["keys"], c["chunks"]):
                pre.engine.publish(k, pre.kv_region, chunk)
            print(json.dumps({"t0": t0, "t1": time.perf_counter()}), flush=True)
        elif c["op"] == "release":  # after the gets landed: the CPU since the publish
            cpu = time.process_time() - c0
            for k in c["keys"]:
                pre.engine.release(k)
            print(json.dumps({"cpu": cpu}), flush=True)
        else:
            break
    pre.close()
    server.close()
    os._exit(0)  # the bootstrap server's loop thread has no clean stop in 0.5.23


class _Child:
    def __init__(self, pages: int, port: int, poll_ms: float) -> None:
        self.p = subprocess.Popen(
            [
                sys.executable, "-m", "kvferry.integrations.sglang.bench",
                "--prefill-child", str(pages), "--port", str(port), "--poll-ms", str(poll_ms),
                "--transport", os.environ.get("KVFERRY_SGLANG_TRANSPORT", "auto"),
            ],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"the prefill process exited ({self.p.wait()})")
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out

    def send(self, **c: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(c) + "\n")
        self.p.stdin.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="KV bytes per request (MiB)")
    ap.add_argument("--chunks", type=int, default=4, help="send() calls per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--port", type=int, default=18990, help="bootstrap server port")
    ap.add_argument("--kvferry-bin", default=None, help="also run `kvferry bench --bytes` with this binary")
    ap.add_argument("--mooncake", action="store_true", help="also time Mooncake's transfer engine over TCP")
    ap.add_argument("--scatter", action="store_true", help="decode pages in a shuffled order (as a busy pool hands them out)")
    ap.add_argument("--transport", choices=("auto", "tcp"), default="auto",
                    help="kvferry's transport (KVFERRY_SGLANG_TRANSPORT): auto reads a same-host prefill's memory, tcp always the socket")
    ap.add_argument("--poll-ms", type=float, default=0.2, help="how often each process polls its request (ms)")
    ap.add_argument("--prefill-child", type=int, default=None, help=argparse.SUPPRESS)
    o = ap.parse_args(argv)
    os.environ["KVFERRY_SGLANG_TRANSPORT"] = o.transport  # both processes, before any manager
    if o.prefill_child is not None:
        _prefill_child(o.prefill_child, o.port, o.poll_ms / 1e3)
        return
    page_bytes = PAGE * HEADS * HEAD_DIM * 2 * 2 * LAYERS
    pages = max(o.chunks, (o.mib << 20) // page_bytes)
    total = pages * page_bytes
    child = _Child(pages, o.port, o.poll_ms)
    poll_s = o.poll_ms / 1e3
    dst_kv = [torch.zeros((pages * PAGE, HEADS, HEAD_DIM), dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    dst_aux = torch.zeros((4, 64), dtype=torch.uint8)
    prefill_addr = str(child.read()["ready"])
    sa = SimpleNamespace(tp_size=1, dp_size=1, pp_size=1, host="127.0.0.1", disaggregation_bootstrap_port=o.port)
    dec = KvferryKVManager(_args(dst_kv, dst_aux), DisaggregationMode.DECODE, sa)
    ids = list(range(pages))
    dst_ids = torch.randperm(pages, generator=torch.Generator().manual_seed(7)).tolist() if o.scatter else ids
    step = -(-pages // o.chunks)
    chunks = [ids[i : i + step] for i in range(0, pages, step)]
    dst_chunks = [dst_ids[i : i + step] for i in range(0, pages, step)]
    out: dict[str, Any] = {
        "bytes": total, "pages": pages, "chunks": len(chunks), "scatter": o.scatter, "reps": o.reps, "cpus": os.cpu_count(),
        "processes": "prefill and decode in two processes", "transport": o.transport,
    }
    src_kv, src_aux = _source(pages)  # what every case must land
    mooncake = _MooncakeTcp(src_kv, dst_kv) if o.mooncake else None
    backend: list[float] = []
    engine: list[float] = []
    publish: list[float] = []  # the engine case's publish calls (every page's crc32c)
    gets_only: list[float] = []  # its gets, from the last publish to the last landing
    backend_cpu: list[float] = []  # both processes' CPU seconds (every thread) per request
    engine_cpu: list[float] = []
    mc: list[float] = []
    cli_runs: list[dict[str, Any]] = []

    def landed(case: str) -> None:
        assert all(_same(a, b, ids, dst_ids) for a, b in zip(src_kv, dst_kv)), f"{case}: bytes differ"

    def zero() -> None:
        for t in dst_kv:
            t.zero_()

    # Every case once per rep, interleaved, so that each ratio compares the same minutes.
    for rep in range(o.reps):
        room = 1 + rep
        zero()
        dst_aux.zero_()
        r = KvferryKVReceiver(dec, f"127.0.0.1:{o.port}", room)
        r.init(0)
        r.send_metadata(dst_ids, 1)
        c0 = time.process_time()
        child.send(op="backend", room=room, chunks=chunks)
        deadline = time.monotonic() + 60
        while r.poll() not in (KVPoll.Success, KVPoll.Failed):
            assert time.monotonic() < deadline, "backend transfer did not finish in 60 s"
            time.sleep(poll_s)
        t_dec = time.perf_counter()
        assert r.poll() == KVPoll.Success, r.state.reason
        c = child.read()
        assert c["ok"], c["why"]
        backend.append(max(t_dec, float(c["t1"])) - float(c["t0"]))
        backend_cpu.append(time.process_time() - c0 + float(c["cpu"]))
        r.clear()
        landed("backend")
        assert torch.equal(dst_aux[1], src_aux[2]), "backend: aux row differs"
        # The same bytes through the two engines directly: one publish and one get per
        # chunk, all in flight, timed from the first publish to the last landing (and
        # the gets alone, from the last publish, as `kvferry bench` times its gets).
        zero()
        keys = [f"raw/{rep}/{i}" for i in range(len(chunks))]
        c0 = time.process_time()
        child.send(op="publish", keys=keys, chunks=chunks)
        c = child.read()
        gets = [dec.engine.get(prefill_addr, k, dec.kv_region, dc, timeout=60) for k, dc in zip(keys, dst_chunks)]
        for g in gets:
            g.wait(60)
        t_end = time.perf_counter()
        engine.append(t_end - float(c["t0"]))
        publish.append(float(c["t1"]) - float(c["t0"]))
        gets_only.append(t_end - float(c["t1"]))
        cpu = time.process_time() - c0
        child.send(op="release", keys=keys)
        engine_cpu.append(cpu + float(child.read()["cpu"]))
        landed("engine")
        if mooncake is not None:
            mc.append(mooncake.rep(chunks, dst_chunks))
        if o.kvferry_bin:
            cli_runs.append(_kvferry_bench(o.kvferry_bin, o.mib, o.transport))
    out["mover"] = [m.get("mover") for m in dec.engine.stats().get("movers") or []] or ["tcp"]
    child.send(op="quit")
    child.p.wait(30)
    dec.close()

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    out["backend_gb_per_s"] = round(total / med(backend) / 1e9, 3)  # GB/s, as `kvferry bench`'s "gbps"
    out["engine_gb_per_s"] = round(total / med(engine) / 1e9, 3)
    out["engine_publish_s"] = round(med(publish), 4)
    out["engine_gets_gb_per_s"] = round(total / med(gets_only) / 1e9, 3)
    out["backend_over_engine"] = round(med(engine) / med(backend), 3)
    out["backend_cpu_s_per_gb"] = round(med(backend_cpu) / total * 1e9, 3)
    out["engine_cpu_s_per_gb"] = round(med(engine_cpu) / total * 1e9, 3)
    out["backend_s"] = [round(x, 4) for x in backend]
    out["engine_s"] = [round(x, 4) for x in engine]
    if mc:
        out["mooncake_tcp_s"] = [round(x, 4) for x in mc]
        out["mooncake_tcp_gb_per_s"] = round(total / med(mc) / 1e9, 3)
        out["backend_over_mooncake_tcp"] = round(med(mc) / med(backend), 3)
    if cli_runs:
        good = [b for b in cli_runs if "error" not in b]
        keep = ("bytes", "gbps", "best_round_gbps", "tcp_limit_gbps", "mover", "corrupted_bytes")
        out["kvferry_bench"] = [{k: b.get(k) for k in keep} if "error" not in b else b for b in cli_runs]
        if good:
            gbps = [float(b["gbps"]) for b in good]
            tcp = [float(b["tcp_limit_gbps"]) for b in good]
            out["kvferry_bench_gb_per_s"] = round(med(gbps), 3)
            out["tcp_limit_gb_per_s"] = round(med(tcp), 3)
            out["backend_over_kvferry_bench"] = round(out["backend_gb_per_s"] / med(gbps), 3)
            out["backend_over_tcp_limit"] = round(out["backend_gb_per_s"] / med(tcp), 3)
            if mc:
                out["mooncake_tcp_over_tcp_limit"] = round(out["mooncake_tcp_gb_per_s"] / med(tcp), 3)
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
