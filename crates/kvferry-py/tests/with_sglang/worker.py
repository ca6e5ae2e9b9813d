# mypy: disable-error-code="import-untyped,import-not-found"
"""One SGLang role (prefill or decode) in its own process, driven by JSON lines on
stdin, answering JSON lines on stdout: the test's real processes.

A *group* is one PD pairing configuration: its ranks (one :class:`KvferryKVManager`
each, as SGLang builds one per scheduler rank), CPU tensors as their KV and auxiliary
buffers, and on the prefill SGLang's real bootstrap server. Buffer contents derive from
a seed: every prefill page holds ``ref(layer, kv, token, global head)`` values, so the
decode can compute, for any page mapping and TP split, exactly which bytes must land.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import traceback
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.utils import DisaggregationMode, poll_and_all_reduce

from kvferry.integrations.sglang import KvferryKVBootstrapServer, KvferryKVManager, KvferryKVReceiver, KvferryKVSender

GROUPS: dict[str, dict[str, Any]] = {}


def reference(g: dict[str, Any]) -> list[torch.Tensor]:
    """The full (all heads) cache every prefill rank slices: one tensor per buffer
    ``[pages * page_size, heads_total, head_dim]``."""
    gen = torch.Generator().manual_seed(int(g["seed"]))
    n = g["pages"] * g["page_size"]
    heads = 1 if g["mla"] else g["heads"]
    count = g["layers"] * (1 if g["mla"] else 2)
    return [torch.randint(-30000, 30000, (n, heads, g["head_dim"]), generator=gen, dtype=torch.int16) for _ in range(count)]


def rank_heads(g: dict[str, Any], rank: int) -> tuple[int, int]:
    """``(first global head, heads)`` of ``rank``, as SGLang's attention layers place
    them: ``heads / tp`` each, or with ``tp > heads`` one replicated head, rank ``r``
    holding head ``r // (tp / heads)``. MLA: the one latent."""
    tp, heads = g["tp"], g["heads"]
    if g["mla"]:
        return 0, 1
    if tp <= heads:
        return rank * (heads // tp), heads // tp
    return rank // (tp // heads), 1


def setup(c: dict[str, Any]) -> dict[str, Any]:
    g = dict(c)
    tp, mla = g["tp"], g["mla"]
    ref = reference(g) if g["mode"] == "prefill" else None
    if g["mode"] == "prefill" and not g.get("no_server"):
        g["server"] = KvferryKVBootstrapServer("127.0.0.1", g["port"])
    g["ranks"] = {}
    for rank in g["ranks_here"]:
        h0, heads_local = rank_heads(g, rank)
        if ref is not None:
            kv = [t[:, h0 : h0 + heads_local, :].contiguous() for t in ref]
            aux = [torch.full((g["aux_rows"], 48), rank + 7, dtype=torch.uint8), torch.arange(g["aux_rows"] * 4, dtype=torch.int32).reshape(-1, 4) * (rank + 3)]
        else:
            kv = [torch.zeros((g["pages"] * g["page_size"], heads_local, g["head_dim"]), dtype=torch.int16) for _ in range(g["layers"] * (1 if mla else 2))]
            aux = [torch.zeros((g["aux_rows"], 48), dtype=torch.uint8), torch.zeros((g["aux_rows"], 4), dtype=torch.int32)]
        args = KVArgs()
        args.engine_rank = rank
        args.kv_data_ptrs = [t.data_ptr() for t in kv]
        args.kv_data_lens = [t.numel() * t.element_size() for t in kv]
        args.kv_item_lens = [g["page_size"] * heads_local * g["head_dim"] * 2 for _ in kv]
        args.aux_data_ptrs = [t.data_ptr() for t in aux]
        args.aux_data_lens = [t.numel() * t.element_size() for t in aux]
        args.aux_item_lens = [t[0].numel() * t.element_size() for t in aux]
        args.state_data_ptrs = []
        args.page_size = g["page_size"]
        if not g.get("no_heads"):  # SGLang's decode sets them only with staging
            args.kv_head_num = heads_local
            args.total_kv_head_num = g["heads"]
        args.kv_cache_dtype_str = g.get("dtype", "int16")
        args.gpu_id = 0
        args.pp_rank = 0
        sa = SimpleNamespace(
            tp_size=tp, dp_size=1, pp_size=g.get("pp_size", 1), attn_cp_size=g.get("attn_cp_size", 1),
            dcp_size=g.get("dcp_size", 1), host="127.0.0.1", disaggregation_bootstrap_port=g["port"],
        )
        mode = DisaggregationMode.PREFILL if g["mode"] == "prefill" else DisaggregationMode.DECODE
        mgr = KvferryKVManager(args, mode, sa, is_mla_backend=mla)
        g["ranks"][rank] = {"mgr": mgr, "kv": kv, "aux": aux, "reqs": {}}
    g["pgs"] = gloo_groups(g["name"], list(g["ranks"]))
    GROUPS[g["name"]] = g
    return {"ok": True}


def each_rank(g: dict[str, Any], fn: Any) -> dict[int, Any]:
    """``fn(rank, state)`` on every rank at once, one thread each (as SGLang's ranks
    run in parallel: a collective needs every rank inside it)."""
    out: dict[int, Any] = {}

    def run(rank: int, st: dict[str, Any]) -> None:
        out[rank] = fn(rank, st)

    threads = [threading.Thread(target=run, args=(r, st)) for r, st in g["ranks"].items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def gloo_groups(name: str, ranks: list[int]) -> dict[int, Any]:
    """One gloo process group over this role's ranks (SGLang's ``attn_tp_cpu_group``,
    here between threads of one process), so polls go through SGLang's own
    ``poll_and_all_reduce`` MIN reduction."""
    store = getattr(dist, "PrefixStore")(f"kvpoll-{name}", getattr(dist, "HashStore")())  # not re-exported in the stubs
    pgs: dict[int, Any] = {}

    def make(i: int, rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, i, len(ranks), datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return pgs


def start(c: dict[str, Any]) -> dict[str, Any]:
    g = GROUPS[c["group"]]
    for rank, st in g["ranks"].items():
        mgr = st["mgr"]
        if g["mode"] == "prefill":
            s = KvferryKVSender(mgr, f"127.0.0.1:{g['port']}", c["room"])
            s.init(len(c["pages"]), c["aux_index"])
            st["reqs"][c["room"]] = s
        else:
            r = KvferryKVReceiver(mgr, f"127.0.0.1:{c.get('bootstrap_port', g['port'])}", c["room"])
            r.init(0)
            r.send_metadata(torch.tensor(c["pages"], dtype=torch.int32).numpy(), c["aux_index"])
            st["reqs"][c["room"]] = r
    return {"ok": True}


def send(c: dict[str, Any]) -> dict[str, Any]:
    g = GROUPS[c["group"]]
    for st in g["ranks"].values():
        st["reqs"][c["room"]].send(torch.tensor(c["pages"], dtype=torch.int32).numpy())
    return {"ok": True}


def poll(c: dict[str, Any]) -> dict[str, Any]:
    """Every rank's own poll, and what SGLang's ``poll_and_all_reduce`` makes of them
    (every rank must get the same reduced state)."""
    g = GROUPS[c["group"]]
    own = {str(rank): int(st["reqs"][c["room"]].poll()) for rank, st in g["ranks"].items()}
    red = each_rank(g, lambda rank, st: poll_and_all_reduce([st["reqs"][c["room"]]], g["pgs"][rank])[0])
    return {"polls": own, "reduced": {str(r): int(v) for r, v in red.items()}}


def failure(c: dict[str, Any]) -> dict[str, Any]:
    g = GROUPS[c["group"]]
    out = {}
    for rank, st in g["ranks"].items():
        try:
            st["reqs"][c["room"]].failure_exception()
        except Exception as e:  # the point: the exception's type and message
            out[str(rank)] = f"{type(e).__name__}: {e}"
    return {"errors": out}


def abort(c: dict[str, Any]) -> dict[str, Any]:
    g = GROUPS[c["group"]]
    for st in g["ranks"].values():
        st["reqs"][c["room"]].abort()
    return {"ok": True}


def metric(c: dict[str, Any]) -> dict[str, Any]:
    g = GROUPS[c["group"]]
    out = {}
    for rank, st in g["ranks"].items():
        m = st["reqs"][c["room"]].get_transfer_metric()
        out[str(rank)] = [m.transfer_latency_s, m.transfer_total_bytes]
    return {"metric": out}


def polls(c: dict[str, Any]) -> dict[str, Any]:
    """Each rank's own poll of one request, ``n`` times in a row (as a scheduler polls a
    waiting request once per loop): the states each rank saw."""
    g = GROUPS[c["group"]]
    seen = {}
    for rank, st in g["ranks"].items():
        req = st["reqs"][c["room"]]
        seen[str(rank)] = sorted({int(req.poll()) for _ in range(int(c["n"]))})
    return {"seen": seen}


def clear(c: dict[str, Any]) -> dict[str, Any]:
    """``clear()`` on every rank's request; whether each rank's manager still tracks the
    room afterwards."""
    g = GROUPS[c["group"]]
    tracked = {}
    for rank, st in g["ranks"].items():
        st["reqs"][c["room"]].clear()
        mgr = st["mgr"]
        with mgr.lock:
            tracked[str(rank)] = c["room"] in (mgr.senders if g["mode"] == "prefill" else mgr.receivers)
    return {"tracked": tracked}


def untouched(c: dict[str, Any]) -> dict[str, Any]:
    """Decode: the destination pages and auxiliary row that still hold only zeros (the
    state :func:`setup` left them in), per rank."""
    g = GROUPS[c["group"]]
    ps = g["page_size"]
    out = {}
    for rank, st in g["ranks"].items():
        pages = [dp for dp in c["dst_pages"] if not any(bool(t[dp * ps : (dp + 1) * ps].any()) for t in st["kv"])]
        aux = not any(bool(a[c["dst_aux"]].any()) for a in st["aux"])
        out[str(rank)] = {"pages": pages, "aux": aux}
    return {"untouched": out}


def check(c: dict[str, Any]) -> dict[str, Any]:
    """Decode: every byte of every destination page and of the auxiliary rows equals
    what the prefill pages hold, for this rank's heads."""
    g = GROUPS[c["group"]]
    ref = reference(g)
    ps = g["page_size"]
    bad = []
    for rank, st in g["ranks"].items():
        h0, heads_local = rank_heads(g, rank)
        for b, (dst_t, ref_t) in enumerate(zip(st["kv"], ref)):
            for sp, dp in zip(c["src_pages"], c["dst_pages"]):
                want = ref_t[sp * ps : (sp + 1) * ps, h0 : h0 + heads_local, :]
                got = dst_t[dp * ps : (dp + 1) * ps]
                if not torch.equal(want, got):
                    bad.append(f"rank {rank} buffer {b} page {sp}->{dp}")
        src_rank = c["aux_src"][str(rank)]
        a0 = torch.full((48,), src_rank + 7, dtype=torch.uint8)
        a1 = torch.arange(g["aux_rows"] * 4, dtype=torch.int32).reshape(-1, 4)[c["src_aux"]] * (src_rank + 3)
        if not torch.equal(st["aux"][0][c["dst_aux"]], a0) or not torch.equal(st["aux"][1][c["dst_aux"]], a1):
            bad.append(f"rank {rank} aux row")
    return {"bad": bad[:10], "nbad": len(bad)}


def main() -> None:
    ops = {
        "setup": setup, "start": start, "send": send, "poll": poll, "polls": polls, "failure": failure, "abort": abort,
        "clear": clear, "metric": metric, "check": check, "untouched": untouched,
    }
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        try:
            out = ops[c["op"]](c)
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
