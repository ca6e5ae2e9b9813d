# mypy: disable-error-code="import-untyped"
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
same byte count. Prints one JSON object.

    python -m kvferry.integrations.sglang.bench --mib 256 --reps 5
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="KV bytes per request (MiB)")
    ap.add_argument("--chunks", type=int, default=4, help="send() calls per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--port", type=int, default=18990, help="bootstrap server port")
    ap.add_argument("--kvferry-bin", default=None, help="also run `kvferry bench --bytes` with this binary")
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
    step = -(-pages // o.chunks)
    chunks = [ids[i : i + step] for i in range(0, pages, step)]
    out: dict[str, Any] = {"bytes": total, "pages": pages, "chunks": len(chunks), "reps": o.reps, "cpus": os.cpu_count()}
    backend, engine = [], []
    for rep in range(o.reps):
        room = 1 + rep
        s = KvferryKVSender(pre, f"127.0.0.1:{o.port}", room)
        r = KvferryKVReceiver(dec, f"127.0.0.1:{o.port}", room)
        r.init(0)
        r.send_metadata(ids, 1)
        deadline = time.monotonic() + 60
        while s.poll() != KVPoll.WaitingForInput:
            assert s.poll() != KVPoll.Failed and time.monotonic() < deadline, s.state.reason
            time.sleep(0.001)
        s.init(pages, 2)
        t0 = time.perf_counter()
        for c in chunks:
            s.send(c)
        while r.poll() not in (KVPoll.Success, KVPoll.Failed) or s.poll() not in (KVPoll.Success, KVPoll.Failed):
            assert time.monotonic() < deadline, "backend transfer did not finish in 60 s"
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        assert r.poll() == KVPoll.Success and s.poll() == KVPoll.Success, (r.state.reason, s.state.reason)
        backend.append(dt)
        r.clear()
        s.clear()
        # The same bytes through the two engines directly.
        keys = [f"raw/{rep}/{i}" for i in range(len(chunks))]
        t0 = time.perf_counter()
        for k, c in zip(keys, chunks):
            pre.engine.publish(k, pre.kv_region, c)
        addr = pre.engine.address
        assert addr is not None
        gets = [dec.engine.get(addr, k, dec.kv_region, c, timeout=60) for k, c in zip(keys, chunks)]
        for g in gets:
            g.wait(60)
        engine.append(time.perf_counter() - t0)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(src_kv, dst_kv)), "bytes differ"
    assert torch.equal(dst_aux[1], src_aux[2]), "aux row differs"

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    out["backend_gb_per_s"] = round(total / med(backend) / 1e9, 3)  # GB/s, as `kvferry bench`'s "gbps"
    out["engine_gb_per_s"] = round(total / med(engine) / 1e9, 3)
    out["backend_over_engine"] = round(med(engine) / med(backend), 3)
    out["backend_s"] = [round(x, 4) for x in backend]
    out["engine_s"] = [round(x, 4) for x in engine]
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
