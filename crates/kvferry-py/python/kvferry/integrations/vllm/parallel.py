"""Where a worker sits in a vLLM deployment — data-parallel rank, pipeline stage,
tensor-parallel rank — and what follows from it: its listen port and peer id, the
``kv_transfer_params`` that name the prefill's DP rank and pipeline stages, and which
prefill workers each decode worker deals with.

Semantics
---------
- **Data parallel.** Each DP rank is an engine core of its own (its own scheduler and
  workers). vLLM 0.33 sets ``ParallelConfig.data_parallel_index`` to the rank in every
  engine core (``run_engine_core``; a dense model's DP ranks are reconfigured as
  independent DP-1 engines — ``data_parallel_size`` 1, ``data_parallel_rank`` 0 — but
  keep the index), and suffixes ``kv_transfer_config.engine_id`` with ``_dp<rank>``.
  The rank is read from ``data_parallel_index``, the size from ``data_parallel_size``
  (the real size for a MoE model's DP group, 1 for a dense model's). A prefill's params
  carry ``remote_dp_rank`` and ``dp_size``; the decode checks them, names the rank in
  its errors and counts what it pulled per prefill DP rank (``stats``). Nothing else
  depends on DP: the params carry every prefill worker's address, so any decode DP rank
  pulls from any prefill DP rank, whatever either side's DP size.
- **Listen ports.** With ``port`` set (a base), worker ``(dp, pp, tp)`` listens on
  ``port + (dp × PP + pp) × TP + tp`` — distinct for every worker of every DP rank and
  stage on one host (NIXL offsets its one side channel per engine core by the DP index;
  kvferry has one engine per worker). ``0`` keeps free ports.
- **Peer ids.** ``<peer_id or kvferry-<engine_id>>[-dp<d>][-pp<p>]-tp<t>``: ``-dp<d>``
  in an engine core of a DP deployment (``data_parallel_index`` > 0,
  ``data_parallel_size`` > 1, or an ``engine_id`` ending ``_dp<d>`` as vLLM marks every
  DP engine core's, rank 0's included — a dense model's rank 0 has nothing else to tell
  it apart), ``-pp<p>`` when ``PP`` > 1; a single-DP, single-stage deployment keeps
  ``…-tp<t>``.
- **Pipeline parallel.** Each stage's workers register only their own layers, so a
  publication of a stage worker holds only that stage's layers. vLLM hands the
  scheduler every worker's handshake keyed by ``(pp_rank, tp_rank)``
  (``set_xfer_handshake_metadata_pp_aware``). The prefill's ``kvferry_peers`` lists
  every worker, stage-major (``pp × TP + tp``); ``pp_size`` is its PP size and
  ``kvferry_stages`` (PP > 1) each stage's layers as ``[count, first, last, digest]``.
  A decode of the same PP size whose stages hold the same layers pulls stage by stage:
  decode worker ``(s, t)`` plans exactly as a single-stage worker ``t`` would, over
  prefill stage ``s``'s slice of ``kvferry_peers`` — only stage ``s``'s layers move
  to it. A PP mismatch (or stages cut differently, e.g. ``VLLM_PP_LAYER_PARTITION``)
  is refused at the compatibility handshake naming both PP sizes (or the stage and
  both layer ranges): a kvferry get moves the same number of per-layer pieces on both
  sides, so a stage cannot be assembled from several prefill stages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Placement",
    "placement",
    "listen_port",
    "peer_id",
    "stage_signature",
    "stage_view",
    "stages_of",
    "pp_differences",
    "dp_problem",
    "remote_dp_rank",
]


@dataclass(frozen=True)
class Placement:
    """One worker's (or scheduler's) place: DP rank and size, PP stage and size, TP
    rank and size."""

    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    in_dp: bool = False  # an engine core of a DP deployment (see placement)

    @property
    def uses_dp(self) -> bool:
        return self.in_dp or self.dp_rank > 0 or self.dp_size > 1

    def describe(self) -> str:
        """``dp1 pp0 tp1`` (only the dimensions in use, ``tp`` always)."""
        parts = []
        if self.uses_dp:
            parts.append(f"dp{self.dp_rank}")
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}")
        parts.append(f"tp{self.tp_rank}")
        return " ".join(parts)


def _dp(pc: Any) -> tuple[int, int]:
    """(rank, size) of data parallelism from vLLM's ``ParallelConfig`` (module docs)."""
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        rank = getattr(pc, "data_parallel_rank", 0)
    return max(0, int(rank or 0)), max(1, int(getattr(pc, "data_parallel_size", 1) or 1))


def placement(vllm_config: Any, worker: bool = True) -> Placement:
    """Where this process sits. A worker's TP rank and PP stage come from vLLM's TP and
    PP groups when they are initialized, else from ``parallel_config.rank`` (vLLM's
    rank inside one engine core: ``pp × TP + tp``); the scheduler (``worker=False``)
    is stage 0, rank 0."""
    pc = vllm_config.parallel_config
    tp = max(1, int(pc.tensor_parallel_size))
    pp = max(1, int(getattr(pc, "pipeline_parallel_size", 1) or 1))
    dp_rank, dp_size = _dp(pc)
    # A dense model's DP rank 0 looks like no DP at all in its ParallelConfig (size 1,
    # index 0); vLLM marks every DP engine core's engine id ``_dp<rank>``, rank 0's too.
    kvc = getattr(vllm_config, "kv_transfer_config", None)
    in_dp = dp_size > 1 or dp_rank > 0 or str(getattr(kvc, "engine_id", "") or "").endswith(f"_dp{dp_rank}")
    tp_rank = pp_rank = 0
    if worker:
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp_rank = int(get_tp_group().rank_in_group)
            pp_rank = int(get_pp_group().rank_in_group)
        except Exception:  # not initialized: one process per rank, set up by the caller
            rank = int(getattr(pc, "rank", 0) or 0)
            tp_rank, pp_rank = rank % tp, (rank // tp) % pp
    return Placement(dp_rank=dp_rank, dp_size=dp_size, pp_rank=pp_rank, pp_size=pp, tp_rank=tp_rank, tp_size=tp, in_dp=in_dp)


def listen_port(base: int, p: Placement) -> int:
    """The worker's listen port: ``0`` (free) without a base, else
    ``base + (dp × PP + pp) × TP + tp``; ``ValueError`` past 65535, with the formula."""
    if not base:
        return 0
    port = base + (p.dp_rank * p.pp_size + p.pp_rank) * p.tp_size + p.tp_rank
    if port > 65535:
        raise ValueError(
            f"KvferryConnector: listen port {port} = port {base} + (data_parallel_index {p.dp_rank} × "
            f"pipeline_parallel_size {p.pp_size} + pp_rank {p.pp_rank}) × tensor_parallel_size {p.tp_size} "
            f"+ tp_rank {p.tp_rank} is past 65535: lower port"
        )
    return port


def peer_id(prefix: str, p: Placement) -> str:
    """The worker engine's peer id (module docs)."""
    parts = [prefix]
    if p.uses_dp:
        parts.append(f"dp{p.dp_rank}")
    if p.pp_size > 1:
        parts.append(f"pp{p.pp_rank}")
    parts.append(f"tp{p.tp_rank}")
    return "-".join(parts)


def stage_signature(layers: Sequence[str]) -> list[Any]:
    """A stage's layers as they travel in the params: ``[count, first, last, digest]``
    (a digest of every name, in region order)."""
    names = [str(n) for n in layers]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    return [len(names), names[0] if names else "", names[-1] if names else "", digest]


def stages_of(params: dict[str, Any], own_pp: int) -> int:
    """How many stages a decode of PP size ``own_pp`` cuts the params'
    ``kvferry_peers`` into: the prefill's PP size when the two match, else 1."""
    pp = _int(params.get("pp_size"), 1)
    return pp if pp == own_pp and pp > 1 else 1


def pp_differences(params: dict[str, Any], own_pp: int, own_stages: dict[int, list[Any]]) -> list[str]:
    """Why a prefill's pipeline stages cannot feed this decode's (empty: they can):
    PP sizes differ, or a stage holds other layers."""
    pp = _int(params.get("pp_size"), 1)
    if pp != own_pp:
        return [
            f"pipeline parallel sizes differ (prefill pp_size {pp}, decode pipeline_parallel_size {own_pp}): "
            "each decode stage pulls its own layers from the prefill stage holding them, so both need the same PP size"
        ]
    if pp <= 1:
        return []
    theirs = params.get("kvferry_stages")
    if not isinstance(theirs, list) or len(theirs) != pp:
        return [f"the prefill (pp_size {pp}) did not say which layers each stage holds (kvferry_stages)"]
    out = []
    for s in range(pp):
        mine = own_stages.get(s)
        if mine is None:
            out.append(f"the decode's stage {s} has not reported its layers")
        elif list(theirs[s]) != list(mine):
            out.append(
                f"pipeline stage {s} holds other layers (prefill {theirs[s][0]} layers {theirs[s][1]}..{theirs[s][2]}, "
                f"decode {mine[0]} layers {mine[1]}..{mine[2]})"
            )
    return out


def dp_problem(params: dict[str, Any]) -> str | None:
    """What is wrong with the params' DP fields (None: nothing, or none given)."""
    if "remote_dp_rank" not in params:
        return None
    rank, size = params.get("remote_dp_rank"), params.get("dp_size", 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        return f"remote_dp_rank {rank!r} is not a data-parallel rank"
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"dp_size {size!r} is not a data-parallel size"
    if size > 1 and rank >= size:
        return f"remote_dp_rank {rank} is not a rank of dp_size {size}"
    return None


def remote_dp_rank(params: dict[str, Any]) -> int | None:
    """The prefill's DP rank the params name (None: none, or not a rank)."""
    v = params.get("remote_dp_rank")
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def stage_view(peers: list[Any], stages: int, p: Placement) -> list[Any] | None:
    """The prefill workers decode worker ``p`` deals with: its own stage's slice of
    ``peers`` when they are cut into its PP size's stages; else (one stage) the whole
    list on stage 0 and nothing (None) on the others."""
    if stages > 1:
        if stages != p.pp_size or len(peers) % stages:
            raise ValueError(f"kvferry_peers ({len(peers)} workers) do not split into this decode's {p.pp_size} stages")
        n = len(peers) // stages
        return peers[p.pp_rank * n : (p.pp_rank + 1) * n]
    return peers if p.pp_rank == 0 else None


def _int(v: Any, default: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        return default
    return v
