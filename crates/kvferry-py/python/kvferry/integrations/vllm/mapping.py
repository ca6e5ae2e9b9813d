"""Which bytes a decode rank reads from which prefill rank: the pure mapping behind
``KvferryConnector``'s heterogeneous tensor parallelism, block-size and layout
mismatches, MLA and prefix hits. No vLLM, no torch, no I/O: descriptors in, a plan out.

Semantics
---------
A :class:`KvDescriptor` (defined in :mod:`kvferry.integrations._kv_layout`, shared with
the SGLang backend, as are :func:`heads_of` and :func:`piece_ranges`) says how one vLLM
instance lays out its KV cache: model, cache dtype, attention kind (``MHA``, which
covers GQA/MQA, or ``MLA``), the *total* number of KV heads, head size, tokens per
block, tensor-parallel size, per-rank layout — the order of the head vectors inside one
*piece* (the contiguous bytes of one layer of one block), outermost first, over ``H``
(head), ``N`` (token) and ``K`` (K or V), ending in ``D`` (the head vector): ``HNKD`` is
vLLM 0.33's packed ``LBHNC`` cache, ``NHKD`` its ``LBNHC``, ``HKND`` the CPU backend's K
and V planes, ``NHD`` MLA's latent (no ``K``: one vector per cell); an order without
``K`` (``NHD``, ``HND``) means K and V are separate pieces — as ``layout`` derives it
from vLLM's own description —, the number of per-layer pieces per block, and the KV
cache groups (kind and sliding window). A prefill instance advertises its descriptor in
``kv_transfer_params["kvferry_desc"]``; the decode instance calls :func:`check` the
first time it meets that prefill (one verdict per remote engine): an impossible pair
raises :class:`IncompatibleError` listing *every* difference at once; a possible one
yields a :class:`Mapping`.

Heads: with TP size ``t <= H`` KV heads, rank ``r`` holds heads ``[r*H/t, (r+1)*H/t)``
(``H % t == 0``, as vLLM requires); with ``t > H`` the heads are replicated and rank
``r`` holds head ``r*H // t``. A decode rank reads each of its heads from the prefill
rank that holds it; where several prefill ranks hold a replicated head, decode ranks
spread over them. MLA caches are replicated on every rank: decode rank ``r`` reads
prefill rank ``r % P_TP`` whole. Prefill ranks nobody reads are released at once.

Blocks: prefill and decode block sizes must divide one another. With
``D_bs = m * P_bs`` decode block ``j`` takes prefill blocks ``j*m .. j*m+m-1`` (one
read per phase ``k``: prefill block ``j*m+k`` → tokens ``[k*P_bs, (k+1)*P_bs)`` of
decode block ``j``); with ``P_bs = m * D_bs`` prefill block ``i`` feeds decode blocks
``i*m .. i*m+m-1``. Blocks a local prefix hit already holds are not read.

A read is one kvferry get: a publication key (a *reader slot* of the prefill rank, see
below), the positions it takes from the publication's block list, the local blocks
they land in, and byte ranges inside every per-layer piece (``src_ranges`` on the
prefill piece, ``dst_ranges`` on the decode piece; the bytes are the concatenation of
``src_ranges`` in order, filled into ``dst_ranges`` in order). Every range is computed
from the token/head/K-V geometry of both layouts, so HND↔NHD (and packed ↔ planes)
permutes by selection. A pair whose K and V are in one piece on one side and in
separate pieces on the other is refused.

Reader slots: a prefill rank publishes each request's blocks under ``slots`` keys
(``key`` itself and ``key#s1`` … ``key#s{slots-1}``), each released by the first
``Done`` of a get that read it. Every read of a request uses its own slot; the slots no
read uses are released by the decode at once (:attr:`Mapping.releases`), so a prefill
rank's blocks are freed exactly when every read of them has finished — or been given
up. A plan needing more reads of one prefill rank than it has slots is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The descriptor and its byte arithmetic are shared with the SGLang backend; the names
# stay importable from here (the connector's modules and tests use them).
from .._kv_layout import GroupDesc, IncompatibleError, KvDescriptor, head_sources, heads_of, piece_ranges

__all__ = [
    "IncompatibleError",
    "KvDescriptor",
    "GroupDesc",
    "Read",
    "RankPlan",
    "Mapping",
    "check",
    "heads_of",
    "slot_key",
    "plan_request",
]


def slot_key(key: str, slot: int) -> str:
    """The publication key of reader slot ``slot`` of ``key``."""
    return key if slot == 0 else f"{key}#s{slot}"


def _self_check(d: KvDescriptor, who: str) -> list[str]:
    out = []
    if d.attention not in ("MHA", "MLA"):
        out.append(f"{who} attention kind {d.attention!r} is neither MHA nor MLA")
    if not _valid_order(d.layout):
        out.append(f"{who} layout {d.layout!r} is not a cell order over H, N (and K), ending in D")
    for n in ("num_kv_heads", "head_size", "block_size", "tp_size", "elem_size", "slots"):
        if getattr(d, n) <= 0:
            out.append(f"{who} {n} must be > 0, got {getattr(d, n)}")
    if d.attention == "MHA" and d.tp_size <= d.num_kv_heads and d.num_kv_heads % max(1, d.tp_size):
        out.append(f"{who} {d.num_kv_heads} KV heads do not split over TP {d.tp_size}")
    if d.attention == "MHA" and d.tp_size > d.num_kv_heads and d.tp_size % max(1, d.num_kv_heads):
        out.append(f"{who} TP {d.tp_size} is not a multiple of its {d.num_kv_heads} KV heads")
    return out


def _valid_order(order: str) -> bool:
    """A cell order: ``H`` and ``N`` once each, ``K`` at most once, then ``D``."""
    body = order[:-1]
    return order.endswith("D") and sorted(body) in (["H", "N"], ["H", "K", "N"])


@dataclass(frozen=True)
class Mapping:
    """A possible pair's verdict: the two descriptors (see :func:`plan_request`)."""

    prefill: KvDescriptor
    decode: KvDescriptor


def check(prefill: KvDescriptor, decode: KvDescriptor) -> Mapping:
    """Compares a prefill and a decode descriptor; raises :class:`IncompatibleError`
    naming every difference that makes the pair impossible."""
    diffs = _self_check(prefill, "prefill") + _self_check(decode, "decode")
    p, d = prefill, decode
    for name in ("model", "dtype", "attention", "head_size", "elem_size"):
        if getattr(p, name) != getattr(d, name):
            diffs.append(f"{name} differs (prefill {getattr(p, name)!r}, decode {getattr(d, name)!r})")
    if p.attention == d.attention and p.num_kv_heads != d.num_kv_heads:
        diffs.append(f"num_kv_heads differs (prefill {p.num_kv_heads}, decode {d.num_kv_heads})")
    if p.kv_in_piece != d.kv_in_piece:
        diffs.append(
            f"K and V are {'in one piece' if p.kv_in_piece else 'separate pieces'} per layer on the prefill "
            f"({p.layout_name}) but {'in one piece' if d.kv_in_piece else 'separate pieces'} on the decode ({d.layout_name})"
        )
    elif p.pieces and d.pieces and p.pieces != d.pieces:
        diffs.append(f"per-layer pieces per block differ (prefill {p.pieces}, decode {d.pieces}: another layer count)")
    if p.block_size > 0 and d.block_size > 0 and max(p.block_size, d.block_size) % min(p.block_size, d.block_size):
        diffs.append(f"block sizes {p.block_size} (prefill) and {d.block_size} (decode) do not divide one another")
    if p.groups != d.groups:
        diffs.append(
            "KV cache groups differ (prefill "
            + ", ".join(f"{g.kind}/{g.window}" for g in p.groups)
            + "; decode "
            + ", ".join(f"{g.kind}/{g.window}" for g in d.groups)
            + ")"
        )
    if not diffs:
        need = _reads_per_prefill_rank(p, d)
        if need > p.slots:
            diffs.append(
                f"the decode reads one prefill rank {need} times per request but the prefill publishes "
                f"{p.slots} reader slot(s) (raise reader_slots on the prefill)"
            )
    if diffs:
        raise IncompatibleError(diffs)
    return Mapping(prefill, decode)


def _phases(p: KvDescriptor, d: KvDescriptor) -> int:
    return max(p.block_size, d.block_size) // min(p.block_size, d.block_size)


def _reads_per_prefill_rank(p: KvDescriptor, d: KvDescriptor) -> int:
    count: dict[int, int] = {}
    for r in range(d.tp_size):
        for q, _, _ in head_sources(p, d, r):
            count[q] = count.get(q, 0) + _phases(p, d)
    return max(count.values(), default=1)


@dataclass
class Read:
    """One get: ``key`` from prefill rank ``rank``; publication positions ``blocks``
    land in local ``dst_blocks`` (same length), each per-layer piece's ``src_ranges``
    into its ``dst_ranges`` (``None``: the whole piece)."""

    rank: int
    key: str
    blocks: list[int]
    dst_blocks: list[int]
    src_ranges: list[tuple[int, int]] | None
    dst_ranges: list[tuple[int, int]] | None

    @property
    def nbytes_per_piece(self) -> int:
        return sum(n for _, n in self.src_ranges) if self.src_ranges is not None else -1


@dataclass
class RankPlan:
    """What one decode rank does for one request: its reads, and the ``(prefill rank,
    key)`` publications it releases at once (slots nobody reads)."""

    reads: list[Read] = field(default_factory=list)
    releases: list[tuple[int, str]] = field(default_factory=list)


def plan_request(
    m: Mapping,
    key: str,
    num_tokens: int,
    remote_blocks: list[list[int | None]],
    local_blocks: list[list[int | None]],
) -> list[RankPlan]:
    """Every decode rank's plan for one request of ``num_tokens`` prompt tokens.

    ``remote_blocks[g][i]``: the prefill's block holding block *i* (from the prompt's
    start) of KV cache group *g*, or ``None``/``0`` where it holds none (vLLM's null
    block: a sliding window's skipped blocks). The publication's block list is every
    held block, group by group, in order. ``local_blocks[g][j]``: the decode's block
    for block *j* of group *g*, or ``None`` where nothing is to be read (a local prefix
    hit, or outside a sliding window)."""
    p, d = m.prefill, m.decode
    plans = [RankPlan() for _ in range(d.tp_size)]
    used: dict[int, int] = {}  # prefill rank -> slots taken
    ph = _phases(p, d)
    pairs_by_phase: list[list[tuple[int, int]]] = [[] for _ in range(ph)]
    base = 0  # publication position of this group's first held block
    for g, rb in enumerate(remote_blocks):
        pos: dict[int, int] = {}
        for i, blk in enumerate(rb):
            if blk:
                pos[i] = base + len(pos)
        base += len(pos)
        lb = local_blocks[g] if g < len(local_blocks) else []
        for jj, lblock in enumerate(lb):
            if lblock is None:
                continue
            for k in range(ph):
                if d.block_size >= p.block_size:
                    ii = jj * ph + k  # the prefill block feeding phase k
                    tok0 = ii * p.block_size
                else:
                    ii = jj // ph
                    if jj % ph != k:
                        continue
                    tok0 = jj * d.block_size
                if tok0 >= num_tokens or ii not in pos:
                    continue
                pairs_by_phase[k].append((pos[ii], int(lblock)))
    for r in range(d.tp_size):
        dst_a, _ = heads_of(r, d.tp_size, d.num_kv_heads) if d.attention == "MHA" else (0, 1)
        for q, ha, hb in head_sources(p, d, r):
            src_a, _ = heads_of(q, p.tp_size, p.num_kv_heads) if p.attention == "MHA" else (0, 1)
            for k in range(ph):
                pairs = pairs_by_phase[k]
                if not pairs:
                    continue
                if d.block_size >= p.block_size:
                    ntok, s0, d0 = p.block_size, 0, k * p.block_size
                else:
                    ntok, s0, d0 = d.block_size, k * d.block_size, 0
                src, dst = piece_ranges(p, d, s0, d0, ntok, ha - src_a, ha - dst_a, hb - ha)
                whole = len(src) == 1 and src[0] == (0, p.piece_bytes) and len(dst) == 1 and dst[0] == (0, d.piece_bytes)
                slot = used.get(q, 0)
                used[q] = slot + 1
                plans[r].reads.append(
                    Read(
                        rank=q,
                        key=slot_key(key, slot),
                        blocks=[i for i, _ in pairs],
                        dst_blocks=[b for _, b in pairs],
                        src_ranges=None if whole else src,
                        dst_ranges=None if whole else dst,
                    )
                )
    # Slots no read takes (and prefill ranks nobody reads): released at once, each
    # prefill rank's by decode rank q % D_TP.
    for q in range(p.tp_size):
        for s in range(used.get(q, 0), p.slots):
            plans[q % d.tp_size].releases.append((q, slot_key(key, s)))
    return plans
