"""``KvferryConnector``'s side of the compatibility handshake and of heterogeneous
transfers: descriptors from vLLM's configs, per-request plans on the decode scheduler,
reader slots on the prefill worker, :class:`~.reads.RankReads` on the decode worker.

Semantics
---------
- Start-up: :func:`groups_of` reads the KV cache groups and refuses (``ValueError``,
  naming the group) a kind kvferry cannot move: anything but full attention, MLA,
  sliding window and chunked local attention (Mamba state, cross attention, ...).
- Prefill scheduler: :func:`advertise` adds ``kvferry_desc`` (the instance's
  :class:`~.mapping.KvDescriptor`) to the ``kv_transfer_params`` it returns, and
  ``remote_block_ids`` become one list per KV cache group (absolute block positions;
  ``0``, vLLM's null block, where the group holds none, as a sliding window does).
- Decode scheduler: :func:`plan` compares the prefill's descriptor with its own the
  first time it meets that prefill engine (one verdict per ``remote_engine_id``, kept;
  an impossible pair is logged once with every difference) and returns a
  :class:`RecvSpec` carrying every decode rank's reads and releases — or, refused,
  the reason: the workers then report the request as a load error (vLLM recomputes or
  fails it per ``kv_load_failure_policy``) and release every slot of the prefill's
  publication so its blocks are freed at once. Nothing waits on an incompatible peer.
- Prefill worker: :func:`publish_slots` publishes each finished request under
  ``reader_slots`` keys (zero copy, the same blocks); :func:`slot_released` counts the
  releases; the request's blocks are free once every slot is released (every reader's
  ``Done``, the decode's releases of unused slots, lease expiry or shutdown).
- Decode worker: :func:`start_reads` starts the rank's releases and reads;
  :func:`give_up` releases the slots whose reads did not land.

Cancellation
------------
Aborting a decode request cancels its :class:`~.reads.RankReads` (each get drains
before its memory is reused) and releases the unread slots; see ``reads``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ... import errors
from .mapping import GroupDesc, IncompatibleError, KvDescriptor, RankPlan, check, plan_request
from .parallel import pp_differences, remote_dp_rank, stages_of
from .prompt import WrongPromptError
from .reads import RankReads, _Geometry, launch_batched

if TYPE_CHECKING:
    import torch

__all__ = [
    "groups_of",
    "auto_reader_slots",
    "reader_slots_for",
    "advertise",
    "plan",
    "publish_slots",
    "slot_released",
    "start_reads",
    "give_up",
    "geometry",
    "batched_releases",
]


# -- start-up ------------------------------------------------------------------------


def groups_of(kv_cache_config: Any) -> tuple[GroupDesc, ...]:
    """The KV cache groups kvferry moves, or ``ValueError`` naming what it cannot."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    if kv_cache_config is None:
        return (GroupDesc(),)
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            out.append(GroupDesc("sliding_window", int(spec.sliding_window)))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(GroupDesc("chunked_local", int(getattr(spec, "attention_chunk_size", 0))))
        elif isinstance(spec, FullAttentionSpec) and type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec"):
            out.append(GroupDesc("full"))
        else:
            raise ValueError(
                f"KvferryConnector: KV cache group {i} ({type(spec).__name__}, layers {list(g.layer_names)[:3]}...) "
                "cannot be transferred: kvferry moves full attention, MLA, sliding-window and chunked-local "
                "attention KV caches, not Mamba/SSM state, cross-attention or other kinds"
            )
    return tuple(out)


def auto_reader_slots(attention: str, num_kv_heads: int, tp_size: int) -> int:
    """``reader_slots`` ``"auto"``: the reads of one prefill rank per request by any
    decode whose TP splits the KV heads (``D_TP <= KV heads``: at most ``KV heads /
    P_TP`` decode ranks read one prefill rank; MLA: up to 8 decode ranks, ``8 / P_TP``),
    times 2 for block sizes up to 2x apart (a decode block takes two prefill blocks, or
    the reverse: one get per phase). At least 2, at most 64."""
    tp = max(1, tp_size)
    if attention == "MLA":
        readers = max(1, 8 // tp)
    elif tp <= num_kv_heads:
        readers = max(1, num_kv_heads // tp)
    else:  # replicated on the prefill: decode ranks spread over the replicas
        readers = 1
    return min(64, 2 * readers)


def reader_slots_for(config: Any, vllm_config: Any) -> int:
    """The reader slots this instance publishes: ``reader_slots`` when set, else
    :func:`auto_reader_slots` of its model and TP size."""
    if config.reader_slots is not None:
        return int(config.reader_slots)
    mc = vllm_config.model_config
    mla = bool(getattr(mc, "use_mla", False))
    heads = 1 if mla else int(mc.get_total_num_kv_heads())
    return auto_reader_slots("MLA" if mla else "MHA", heads, int(vllm_config.parallel_config.tensor_parallel_size))


def descriptor(sched: Any) -> KvDescriptor | None:
    """The scheduler's own descriptor, once rank 0's handshake metadata is in."""
    meta = sched.peers.get(0)
    if meta is None or not getattr(meta, "pieces", 0):
        return None
    mc = sched.vllm_config.model_config
    mla = bool(getattr(mc, "use_mla", False))
    return KvDescriptor(
        model=str(mc.model),
        dtype=str(meta.dtype),
        attention="MLA" if mla else "MHA",
        num_kv_heads=1 if mla else int(mc.get_total_num_kv_heads()),
        head_size=int(mc.get_head_size()),
        block_size=int(sched.block_size),
        tp_size=int(sched.tp_size),
        layout=str(meta.layout),
        pieces=int(meta.pieces),
        elem_size=int(meta.elem_size),
        groups=sched.groups,
        slots=int(sched.reader_slots),
        cache_layout=str(getattr(meta, "cache_layout", "")),
    )


# -- prefill scheduler ---------------------------------------------------------------


def group_block_ids(
    block_ids: Any, num_tokens: int, block_size: int, kinds: tuple[GroupDesc, ...] = ()
) -> list[list[int]]:
    """``block_ids`` (one list, or one per group) → per group, the prompt's blocks by
    position; a sliding-window group's blocks wholly before the window that the next
    token attends to become ``0`` (not published, not moved)."""
    ids = list(block_ids or [])
    groups = [list(g) for g in ids] if ids and isinstance(ids[0], (list, tuple)) else [ids]
    n = math.ceil(num_tokens / block_size)
    out = []
    for gi, g in enumerate(groups):
        row = [int(b) for b in g[:n]]
        kind = kinds[gi] if gi < len(kinds) else GroupDesc()
        if kind.kind == "sliding_window" and kind.window > 0:
            first = max(0, num_tokens - kind.window) // block_size  # first block the window touches
            row = [0 if i < first else b for i, b in enumerate(row)]
        out.append(row)
    return out


def advertise(sched: Any, params: dict[str, Any], groups: list[list[int]]) -> None:
    d = descriptor(sched)
    if d is not None:
        params["kvferry_desc"] = d.to_params()
        if len(groups) > 1 or any(b == 0 for g in groups for b in g):
            params["remote_block_ids"] = groups


# -- decode scheduler ----------------------------------------------------------------


def _verdict(sched: Any, params: dict[str, Any]) -> Any:
    """The cached mapping, or the :class:`IncompatibleError`, for this prefill."""
    engine = str(params.get("remote_engine_id"))
    v = sched.verdicts.get(engine)
    if v is not None:
        return v
    mine = descriptor(sched)
    # Pipeline stages first (parallel.py): each decode stage reads one prefill stage.
    pp = pp_differences(params, int(getattr(sched, "pp_size", 1)), getattr(sched, "stages", {}))
    try:
        if mine is None:
            raise IncompatibleError(pp + ["the decode's own KV geometry is unknown (no handshake from rank 0)"])
        try:
            v = check(KvDescriptor.from_params(params["kvferry_desc"]), mine)
        except IncompatibleError as e:
            raise IncompatibleError(pp + e.differences) from None
        if pp:
            raise IncompatibleError(pp)
    except IncompatibleError as e:
        v = e
        sched.log_error("KvferryConnector: refusing prefill engine %s: %s", engine, e)
    sched.verdicts[engine] = v
    return v


def plan(sched: Any, request: Any, blocks: Any, params: dict[str, Any], spec_cls: Any) -> Any:
    """The decode's :class:`RecvSpec` for a prefill that advertised a descriptor."""
    v = _verdict(sched, params)
    key = str(params["remote_request_id"])
    peers = list(params["kvferry_peers"])
    # kvferry_peers cut into the prefill's pipeline stages when they match the
    # decode's: plans then index one stage's workers (parallel.stage_view).
    stages = stages_of(params, int(getattr(sched, "pp_size", 1)))
    where = {
        "stages": stages,
        "remote_engine_id": None if params.get("remote_engine_id") is None else str(params["remote_engine_id"]),
        "remote_dp_rank": remote_dp_rank(params),
    }
    ntok = min(len(request.prompt_token_ids or ()), int(params.get("remote_num_tokens") or 1 << 60))
    raw = params["remote_block_ids"]
    remote = [list(g) for g in raw] if raw and isinstance(raw[0], (list, tuple)) else [list(raw)]
    local: list[list[int | None]] = []
    for g in blocks.blocks:
        local.append([None if (getattr(b, "is_null", False) or b.block_hash is not None) else b.block_id for b in g])
    flat_local = [b for g in local for b in g if b is not None]
    npub = sum(1 for g in remote for b in g if b)
    if isinstance(v, IncompatibleError):
        pd = KvDescriptor.from_params(params["kvferry_desc"]) if isinstance(params.get("kvferry_desc"), dict) else None
        slots = pd.slots if pd is not None else 1
        d_tp = int(sched.tp_size)
        plans = [RankPlan() for _ in range(d_tp)]
        from .mapping import slot_key

        for q in range(len(peers) // stages):
            for s in range(slots):
                plans[q % d_tp].releases.append((q, slot_key(key, s)))
        return spec_cls(
            key=key, peers=peers, remote_block_ids=[], local_block_ids=flat_local, plans=plans, refused=str(v), **where
        )
    plans = plan_request(v, key, ntok, remote, local)
    first = list(blocks.blocks[0]) if blocks.blocks else []
    return spec_cls(
        key=key,
        peers=peers,
        remote_block_ids=[b for g in remote for b in g if b],
        local_block_ids=[b.block_id for b in first if not getattr(b, "is_null", False)],
        skip_blocks=sum(1 for b in first if b.block_hash is not None and not getattr(b, "is_null", False)),
        plans=plans,
        npub=npub,
        src_piece_bytes=v.prefill.piece_bytes,
        **where,
    )


# -- prefill worker ------------------------------------------------------------------


def publish_slots(worker: Any, req_id: str, block_ids: list[int], key: str | None = None) -> None:
    """Publishes ``block_ids`` under every reader slot of ``key`` (default: the
    request id; the connector passes the key bound to the prompt, :mod:`.prompt`) and
    records the slots as ``req_id``'s in the worker's ledger (raises what the first
    publish raises; a later slot that fails to publish is simply not one of the
    request's slots)."""
    from .mapping import slot_key

    key = req_id if key is None else key
    worker.engine.publish(key, worker.region, block_ids, ttl=worker.config.lease_ttl, once=True)
    keys = [key]
    for s in range(1, worker.reader_slots):
        k = slot_key(key, s)
        try:
            worker.engine.publish(k, worker.region, block_ids, ttl=worker.config.lease_ttl, once=True)
            keys.append(k)
        except errors.Error:
            pass
    worker.ledger.published(req_id, keys)


def slot_released(worker: Any, key: str, reason: str = "done") -> tuple[str, str] | None:
    """A slot's publication was released: ``(request id, reason)`` once it was the
    last (see :meth:`.ledger.RequestLedger.slot_released`); None while other slots are
    still out."""
    out: tuple[str, str] | None = worker.ledger.slot_released(key, reason)
    return out


# -- decode worker -------------------------------------------------------------------


def geometry(worker: Any, caches: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Raw per-layer views of vLLM's KV tensors for registration (``[num_blocks,
    piece_bytes]`` uint8 views of the same memory, never copies) and this rank's
    geometry, taken from what vLLM says about the cache
    (:func:`.layout.describe`: the layers' attention backends, the resolved
    ``KVCacheLayout``, the KV cache spec); :class:`~.layout.LayoutError` naming
    shape, strides, layout and backend where it cannot be mapped exactly."""
    import torch

    from .layout import LayoutError, describe

    cfg = worker.vllm_config
    mc = cfg.model_config
    mla = bool(getattr(mc, "use_mla", False))
    spec = _first_spec(worker.kv_cache_config)
    if spec is not None:
        heads = 1 if mla else int(spec.num_kv_heads)
        head_size = int(spec.head_size)
        head_size_v = getattr(spec, "head_size_v", None)
        block_size = int(spec.block_size)
    else:
        tp = max(1, int(cfg.parallel_config.tensor_parallel_size))
        total = int(mc.get_total_num_kv_heads())
        heads = 1 if mla else (total // tp if tp <= total else 1)
        head_size, head_size_v, block_size = int(mc.get_head_size()), None, int(cfg.cache_config.block_size)
    layout = getattr(worker.kv_cache_config, "kv_cache_layout", None) or cfg.cache_config.kv_cache_layout
    if layout is None:
        raise LayoutError("KvferryConnector: vLLM has not resolved the KV cache layout (cache_config.kv_cache_layout is unset)")
    backends: list[str] = []
    if not mla:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        try:
            backends = [b.get_name() for b in get_current_attn_backends(cfg, list(caches))]
        except Exception as e:  # noqa: BLE001 - vLLM could not say: refuse, never guess
            raise LayoutError(f"KvferryConnector: vLLM cannot name the attention backend of layers {list(caches)[:3]}...: {e}") from e
    lay = describe(
        caches,
        num_blocks=int(worker.num_blocks),
        block_size=block_size,
        heads=heads,
        head_size=head_size,
        kv_layout=str(getattr(layout, "name", layout)),
        backends=backends,
        mla=mla,
        head_size_v=None if head_size_v in (None, 0) else int(head_size_v),
        head_major_slots=bool(getattr(spec, "kv_head_major_slots", False)),  # vLLM 0.34's field
    )
    phys: dict[str, torch.Tensor] = {}
    pieces: list[torch.Tensor] = []
    nb = int(worker.num_blocks)
    for name, t in caches.items():
        perm = sorted(range(t.dim()), key=lambda i: (-int(t.stride()[i]), i))
        p = t.permute(perm)
        if not p.is_contiguous():  # describe() checked the strides: cannot happen
            raise LayoutError(f"KvferryConnector: KV cache {name} is not dense (strides {tuple(t.stride())})")
        raw = p.view(torch.uint8).reshape(nb, -1)
        assert raw.data_ptr() == t.data_ptr() and int(raw.shape[1]) == lay.piece_bytes, (name, raw.shape, lay)
        phys[name] = raw
        pieces.append(raw)
    # Layers sharing a cache were dropped (same address); any other overlap would move
    # the same bytes under two layers' names: refused.
    spans = sorted((int(r.data_ptr()), int(r.data_ptr()) + r.numel(), n) for n, r in phys.items())
    for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise LayoutError(
                f"KvferryConnector: KV caches {an} and {bn} overlap without being the same cache "
                f"({a1 - b0} bytes shared); kvferry moves each byte under one layer"
            )
    info = {
        "layout": lay.order,
        "heads_per_rank": lay.heads,
        "pieces": pieces,
        "dtype": lay.dtype,
        "elem_size": lay.elem_size,
        "cache_layout": lay.name,
    }
    return phys, info


def _first_spec(kv_cache_config: Any) -> Any:
    """The attention spec of the first KV cache group (every group of one worker has
    the same cell shape: vLLM's hybrid allocator aliases their pages)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    for g in groups:
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if isinstance(inner, dict) and inner:
            spec = next(iter(inner.values()))
        if hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"):
            return spec
    return None


def start_reads(worker: Any, pull: Any) -> None:
    """Starts this rank's releases and reads of ``pull.spec`` (a planned RecvSpec)."""
    spec = pull.spec
    r = worker.tp_rank
    mine: RankPlan = spec.plans[r] if r < len(spec.plans) else RankPlan()
    by_rank: dict[int, list[str]] = {}
    for q, k in mine.releases:
        by_rank.setdefault(q, []).append(k)
    for q, keys in by_rank.items():
        _release(worker, pull.req_id, spec.peers, pull.expires_at, q, keys)
    if spec.refused is not None:
        raise WrongPromptError(spec.refused) if spec.wrong_prompt else IncompatibleError([spec.refused])
    geo = _Geometry(pieces=worker._pieces, src_piece_bytes=spec.src_piece_bytes, npub=spec.npub)
    pull.transfer = RankReads(
        worker.engine,
        worker.region,
        geo,
        mine.reads,
        spec.peers,
        deadline=pull.deadline,
        retry_until=pull.retry_until,
        path=worker.config.path,
        timeout=worker.config.timeout,
        register=worker._register,
        defer=worker._read_defer,
    )


def _release(worker: Any, req_id: str, peers: list[dict[str, Any]], expires_at: float | None, q: int, keys: list[str]) -> None:
    """Tells prefill rank ``q`` that ``keys`` will not be read: queued in the worker's
    ledger, sent with the step's other releases (one message per prefill rank and at
    most ``max_keys`` keys) when the worker flushes them."""
    address = peers[q].get("address") if q < len(peers) else None
    if worker.engine is None or not address or not keys:
        return
    worker.ledger.release(str(address), keys, expires_at)


release_slots = _release  # for the worker's pulls without a plan (worker.py)


class batched_gets:  # noqa: N801 - used as a statement: ``with batched_gets(worker):``
    """Collects the reads of one engine step's new pulls and starts them on exit, the
    reads of one prefill rank that share their ranges as batched gets of up to
    ``read_batch`` keys (:func:`.reads.launch_batched`) instead of one get per
    request. Only for host caches on the direct path (a device cache stages, and a
    batch would take that many times one request's staging at once)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def __enter__(self) -> None:
        w = self.worker
        host = w.device is None
        w._read_defer = [] if w.config.read_batch > 1 and host and w.config.path == "direct" else None

    def __exit__(self, *exc: object) -> None:
        reads, self.worker._read_defer = self.worker._read_defer, None
        if reads:
            launch_batched(reads, self.worker.config.read_batch)


class batched_releases:  # noqa: N801 - used as a statement: ``with batched_releases(worker):``
    """Sends the releases queued in the worker's ledger during the block (one
    ``Release`` per prefill rank, cut at ``max_keys``) when it ends."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.worker.flush_releases()


def give_up(worker: Any, pull: Any) -> None:
    """The pull will not complete (failed, aborted): release the slots not read."""
    t = pull.transfer
    if not isinstance(t, RankReads):
        return
    for addr, key in t.unread():
        worker.ledger.release(addr, [key], pull.expires_at)


# -- releases without a pull -----------------------------------------------------------


def release_all(sched: Any, params: dict[str, Any], stages: int = 1) -> list[list[tuple[int, str]]] | None:
    """Every slot of every prefill rank, spread over the decode ranks (``q % D_TP``);
    None when there is one key per rank (no descriptor, and this instance publishes
    one slot). ``stages`` > 1: the ranks of one pipeline stage (each decode stage
    releases its own stage's, :func:`.parallel.stage_view`)."""
    from .mapping import slot_key

    raw = params.get("kvferry_desc")
    if not isinstance(raw, dict):
        # No descriptor (a proxy written for NIXL): the prefill published as many
        # slots as this instance would; one key per rank when that is one.
        slots = int(sched.reader_slots)
        if slots <= 1:
            return None
    else:
        try:
            slots = max(1, int(raw.get("slots", 1)))
        except (TypeError, ValueError):
            slots = 1
    key = str(params["remote_request_id"])
    d_tp = max(1, int(sched.tp_size))
    out: list[list[tuple[int, str]]] = [[] for _ in range(d_tp)]
    for q in range(len(params.get("kvferry_peers") or ()) // max(1, stages)):
        for s in range(slots):
            out[q % d_tp].append((q, slot_key(key, s)))
    return out


def release_planned(spec: Any) -> list[list[tuple[int, str]]] | None:
    """A planned pull that will not start: each decode rank releases its reads' slots
    and the slots it was to release anyway."""
    if spec.plans is None:
        return None
    return [list(p.releases) + [(rd.rank, rd.key) for rd in p.reads] for p in spec.plans]


def release_keys(worker: Any, req_id: str, rel: Any) -> None:
    """The worker's share of a :class:`ReleaseSpec` with ``per_rank``."""
    r = worker.tp_rank
    mine = rel.per_rank[r] if r < len(rel.per_rank) else []
    by_rank: dict[int, list[str]] = {}
    for q, k in mine:
        by_rank.setdefault(q, []).append(k)
    for q, keys in by_rank.items():
        _release(worker, req_id, rel.peers, rel.expires_at, q, keys)
