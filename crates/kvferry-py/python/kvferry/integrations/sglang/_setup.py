# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""What a :class:`~._manager.KvferryKVManager` checks and builds before it serves:
the deployments it refuses at start-up (naming the flag), this rank's
:class:`~._plan.Layout` (KV head counts included), the device its engine runs on, the
address it binds, and the registration of SGLang's buffers as kvferry regions.

Everything here runs once, in the manager's constructor; a refusal is an exception
SGLang reports at start-up, never a later failure.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.base.conn import KVArgs

from ... import Engine
from ._options import Topology
from ._plan import Layout
from ._rooms import host_buffers


def refuse_unsupported(topo: Topology, args: KVArgs) -> None:
    """Raises ``NotImplementedError`` naming what the backend does not move: pipeline
    or context parallelism (by flag and value), and state buffers (Mamba, SWA, DSA)."""
    refused = [
        f"{what} ({flag} {n})"
        for what, flag, n in (
            ("pipeline parallelism", "--pp-size", topo.pp_size),
            ("attention context parallelism", "--attn-cp-size", topo.cp_size),
            ("decode context parallelism", "--dcp-size", topo.dcp_size),
        )
        if n != 1
    ]
    if refused:
        raise NotImplementedError(
            "kvferry backend: " + ", ".join(refused) + " is not supported: the kvferry transfer backend pairs "
            "prefill and decode ranks by attention TP only; run with --pp-size 1 --attn-cp-size 1 --dcp-size 1 "
            "or use another --disaggregation-transfer-backend"
        )
    if any(len(p) for p in (getattr(args, "state_data_ptrs", None) or [])):
        raise NotImplementedError(
            "kvferry backend: state buffers (mamba, SWA, DSA, ...) are not moved by the kvferry backend; "
            "use it with models whose KV lives in the paged KV pool only"
        )


def kv_heads(args: KVArgs, topo: Topology) -> tuple[int, int]:
    """``(KV heads on this rank, KV heads in all)``. SGLang's prefill sets both in its
    ``KVArgs``; its decode sets them only with staging, so they are otherwise read off
    the model config (rank heads ``max(1, total // attention TP)``, as SGLang sizes its
    pool)."""
    total = getattr(args, "total_kv_head_num", None)
    local = getattr(args, "kv_head_num", None)
    if total is None:
        try:
            from sglang.srt import runtime_context as rc

            total = int(rc.process_model_config().get_total_num_kv_heads())
        except Exception as e:
            if local is None:
                raise ValueError(
                    "kvferry backend: the KV args carry no KV head count (kv_head_num, total_kv_head_num) "
                    f"and the model config is not available ({type(e).__name__}: {e})"
                ) from None
            total = int(local) * topo.tp_size
    if local is None:
        local = max(1, int(total) // topo.tp_size)
    return int(local), int(total)


def layout_of(args: KVArgs, topo: Topology, mla: bool) -> Layout:
    """This rank's layout, as the pairing check and the read plans see it."""
    heads = (1, 1) if mla else kv_heads(args, topo)
    return Layout(
        page_size=int(args.page_size),
        dtype=str(getattr(args, "kv_cache_dtype_str", "auto")),
        mla=mla,
        tp_size=topo.tp_size,
        tp_rank=topo.tp_rank,
        kv_head_num=heads[0],
        total_kv_head_num=heads[1],
        item_lens=tuple(int(x) for x in args.kv_item_lens),
        aux_item_lens=tuple(int(x) for x in args.aux_item_lens),
    )


def engine_device(device: str, args: KVArgs) -> str:
    """``KVFERRY_SGLANG_DEVICE`` resolved: ``auto`` is ``cuda:<gpu_id>`` when torch
    sees a GPU, else ``host``."""
    if device != "auto":
        return device
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{int(getattr(args, 'gpu_id', 0))}"
    except ImportError:
        pass
    return "host"


def local_ip() -> str:
    """SGLang's own choice of this host's address, else loopback."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto

        return str(get_local_ip_auto("127.0.0.1"))
    except Exception:
        return "127.0.0.1"


def register_buffers(engine: Engine, ptrs: list[int], lens: list[int], items: list[int], name: str, device: str) -> Any:
    """Registers SGLang's buffers ``name`` (one per layer, or the auxiliary ones) as one
    kvferry region of pages; buffers holding different page counts are refused."""
    pages = {n // i for n, i in zip(lens, items)}
    if len(pages) != 1:
        raise ValueError(f"kvferry backend: {name} buffers hold different page counts {sorted(pages)}")
    if device == "host":
        return engine.register_kv_caches(host_buffers(ptrs, lens, items, name), name=name)
    raw = {f"{name}{i}": (p, n, device) for i, (p, n) in enumerate(zip(ptrs, lens))}
    return engine.register_kv_caches(raw, pages.pop(), name=name)
