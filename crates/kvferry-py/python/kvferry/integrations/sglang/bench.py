# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""A small throughput benchmark of the SGLang backend against kvferry's own transfer of
the same bytes, in one process on loopback:

- ``backend``: a prefill and a decode :class:`KvferryKVManager` (TP 1, SGLang's real
  bootstrap server), one request of ``--mib`` MiB of KV pages sent in ``--chunks``
  ``send`` calls, timed from the first ``send`` to the decode's ``Success`` (pages
  landed, verified and drained) and the prefill's ``Success``;
- ``engine``: the same two engines and regions, the same pages, one
  :meth:`Engine.publish` and one :meth:`Engine.get` per chunk, all in flight at once,
  timed to the last landing: what the backend costs above kvferry itself.

``--kvferry-bin`` adds ``kvferry bench --bytes`` (the CLI's end-to-end figure) on the
same byte count. ``--mooncake`` adds Mooncake's transfer engine over TCP (the transport
under SGLang's ``mooncake_tcp`` backend; ``mooncake-transfer-engine-non-cuda``, which
needs ``libibverbs1`` even for TCP): the same pages written with one
``batch_transfer_sync_write`` per chunk, contiguous page runs of each buffer coalesced,
as SGLang's mooncake backend issues them — its transport, not SGLang's mooncake
manager, which needs a full SGLang runtime. Prints one JSON object: GB/s of each
(medians), the process's CPU seconds per GB for the backend and the engines
(``*_cpu_s_per_gb``, every thread), and the ratios measured in this one invocation:
``backend_over_engine``, ``backend_over_mooncake_tcp`` (with ``--mooncake``) and
``backend_over_kvferry_bench`` (with ``--kvferry-bin``; the targets are ≥ 2 and ≥ 0.9).
Both roles share this process (and its GIL): the backend's control threads and the
two engines compete for the same cores, which separate SGLang processes would not.

    python -m kvferry.integrations.sglang.bench --mib 256 --reps 5
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
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


def _mooncake_tcp(
    src: list[torch.Tensor], dst: list[torch.Tensor], chunks: list[list[int]], dst_chunks: list[list[int]], reps: int
) -> list[float]:
    """Seconds per request through two Mooncake transfer engines over TCP."""
    os.environ.setdefault("MC_FORCE_TCP", "1")
    engine_mod = importlib.import_module("mooncake.engine")
    a, b = engine_mod.TransferEngine(), engine_mod.TransferEngine()
    for e in (a, b):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake's transfer engine did not initialize")
    for e, bufs in ((a, src), (b, dst)):
        for t in bufs:
            e.register_memory(t.data_ptr(), t.numel() * t.element_size())
    session = f"127.0.0.1:{b.get_rpc_port()}"
    item = PAGE * HEADS * HEAD_DIM * src[0].element_size()
    times = []
    for _ in range(reps):
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
            if a.batch_transfer_sync_write(session, s_addr, d_addr, lens) != 0:
                raise RuntimeError("Mooncake's batch write failed")
        times.append(time.perf_counter() - t0)
        ids = [p for c in chunks for p in c]
        dst_ids = [p for c in dst_chunks for p in c]
        assert all(_same(x, y, ids, dst_ids) for x, y in zip(src, dst)), "Mooncake: bytes differ"
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="KV bytes per request (MiB)")
    ap.add_argument("--chunks", type=int, default=4, help="send() calls per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--port", type=int, default=18990, help="bootstrap server port")
    ap.add_argument("--kvferry-bin", default=None, help="also run `kvferry bench --bytes` with this binary")
    ap.add_argument("--mooncake", action="store_true", help="also time Mooncake's transfer engine over TCP")
    ap.add_argument("--scatter", action="store_true", help="decode pages in a shuffled order (as a busy pool hands them out)")
    o = ap.parse_args(argv)
    page_bytes = PAGE * HEADS * HEAD_DIM * 2 * 2 * LAYERS
    pages = max(o.chunks, (o.mib << 20) // page_bytes)
    total = pages * page_bytes

    def mk() -> list[torch.Tensor]:
        return [torch.empty((pages * PAGE, HEADS, HEAD_DIM), dtype=torch.bfloat16) for _ in range(2 * LAYERS)]

    src_kv, dst_kv = mk(), mk()
    for i, buf in enumerate(src_kv):
        buf.view(torch.int16).copy_(torch.randint(-30000, 30000, buf.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(i)))
    src_aux, dst_aux = torch.arange(4 * 64, dtype=torch.uint8).reshape(4, 64), torch.zeros((4, 64), dtype=torch.uint8)
    server = KvferryKVBootstrapServer("127.0.0.1", o.port)
    sa = SimpleNamespace(tp_size=1, dp_size=1, pp_size=1, host="127.0.0.1", disaggregation_bootstrap_port=o.port)
    pre = KvferryKVManager(_args(src_kv, src_aux), DisaggregationMode.PREFILL, sa)
    dec = KvferryKVManager(_args(dst_kv, dst_aux), DisaggregationMode.DECODE, sa)
    ids = list(range(pages))
    dst_ids = torch.randperm(pages, generator=torch.Generator().manual_seed(7)).tolist() if o.scatter else ids
    step = -(-pages // o.chunks)
    chunks = [ids[i : i + step] for i in range(0, pages, step)]
    dst_chunks = [dst_ids[i : i + step] for i in range(0, pages, step)]
    out: dict[str, Any] = {"bytes": total, "pages": pages, "chunks": len(chunks), "scatter": o.scatter, "reps": o.reps, "cpus": os.cpu_count()}
    backend: list[float] = []
    engine: list[float] = []
    backend_cpu: list[float] = []  # the process's CPU seconds (every thread) per request
    engine_cpu: list[float] = []
    for rep in range(o.reps):
        room = 1 + rep
        s = KvferryKVSender(pre, f"127.0.0.1:{o.port}", room)
        r = KvferryKVReceiver(dec, f"127.0.0.1:{o.port}", room)
        r.init(0)
        r.send_metadata(dst_ids, 1)
        deadline = time.monotonic() + 60
        while s.poll() != KVPoll.WaitingForInput:
            assert s.poll() != KVPoll.Failed and time.monotonic() < deadline, s.state.reason
            time.sleep(0.001)
        s.init(pages, 2)
        c0 = time.process_time()
        t0 = time.perf_counter()
        for c in chunks:
            s.send(c)
        while r.poll() not in (KVPoll.Success, KVPoll.Failed) or s.poll() not in (KVPoll.Success, KVPoll.Failed):
            assert time.monotonic() < deadline, "backend transfer did not finish in 60 s"
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        backend_cpu.append(time.process_time() - c0)
        assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, (r.state.reason, s.state.reason)
        backend.append(dt)
        r.clear()
        s.clear()
        # The same bytes through the two engines directly.
        keys = [f"raw/{rep}/{i}" for i in range(len(chunks))]
        c0 = time.process_time()
        t0 = time.perf_counter()
        for k, c in zip(keys, chunks):
            pre.engine.publish(k, pre.kv_region, c)
        addr = pre.engine.address
        assert addr is not None
        gets = [dec.engine.get(addr, k, dec.kv_region, c, timeout=60) for k, c in zip(keys, dst_chunks)]
        for g in gets:
            g.wait(60)
        engine.append(time.perf_counter() - t0)
        engine_cpu.append(time.process_time() - c0)
        for k in keys:
            pre.engine.release(k)
    assert all(_same(a, b, ids, dst_ids) for a, b in zip(src_kv, dst_kv)), "bytes differ"
    assert torch.equal(dst_aux[1], src_aux[2]), "aux row differs"

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    out["backend_gb_per_s"] = round(total / med(backend) / 1e9, 3)  # GB/s, as `kvferry bench`'s "gbps"
    out["engine_gb_per_s"] = round(total / med(engine) / 1e9, 3)
    out["backend_over_engine"] = round(med(engine) / med(backend), 3)
    out["backend_cpu_s_per_gb"] = round(med(backend_cpu) / total * 1e9, 3)
    out["engine_cpu_s_per_gb"] = round(med(engine_cpu) / total * 1e9, 3)
    out["backend_s"] = [round(x, 4) for x in backend]
    out["engine_s"] = [round(x, 4) for x in engine]
    if o.mooncake:
        mc = _mooncake_tcp(src_kv, dst_kv, chunks, dst_chunks, o.reps)
        out["mooncake_tcp_s"] = [round(x, 4) for x in mc]
        out["mooncake_tcp_gb_per_s"] = round(total / med(mc) / 1e9, 3)
        out["backend_over_mooncake_tcp"] = round(med(mc) / med(backend), 3)
    if o.kvferry_bin:
        cli = subprocess.run([o.kvferry_bin, "bench", "--bytes", f"{o.mib}MiB", "--json"], capture_output=True, text=True, timeout=300)
        try:
            b = json.loads(cli.stdout)
            out["kvferry_bench"] = {k: b.get(k) for k in ("bytes", "gbps", "best_round_gbps", "tcp_limit_gbps", "corrupted_bytes")}
            out["backend_over_kvferry_bench"] = round(out["backend_gb_per_s"] / float(b["gbps"]), 3)
        except (ValueError, KeyError, TypeError):
            out["kvferry_bench"] = {"error": (cli.stderr or cli.stdout)[-500:]}
    pre.close()
    dec.close()
    server.close()
    print(json.dumps(out), flush=True)
    os._exit(0)  # the bootstrap server's loop thread has no clean stop in 0.5.23


if __name__ == "__main__":
    main()
