"""How a KV cache lays out its bytes, and which bytes of one rank's piece hold which
token and head: the descriptor and the byte arithmetic both integrations share (the vLLM
connector's :mod:`~kvferry.integrations.vllm.mapping` plans its reads with them, SGLang's
:mod:`~kvferry.integrations.sglang._plan` its pairings). Pure functions over small
descriptors: no vLLM, no SGLang, no torch, no I/O.

Semantics
---------
A :class:`KvDescriptor` says how one instance lays out its KV cache: model, cache
dtype, attention kind (``MHA``, which covers GQA/MQA, or ``MLA``), the *total* number of
KV heads, head size, tokens per block, tensor-parallel size, per-rank layout — the
order of the head vectors inside one *piece* (the contiguous bytes of one layer of one
block), outermost first, over ``H`` (head), ``N`` (token) and ``K`` (K or V), ending in
``D`` (the head vector): ``HNKD`` is vLLM 0.33's packed ``LBHNC`` cache, ``NHKD`` its
``LBNHC``, ``HKND`` the CPU backend's K and V planes, ``NHD`` MLA's latent (no ``K``:
one vector per cell) and SGLang's per-layer K and V buffers; an order without ``K``
(``NHD``, ``HND``) means K and V are separate pieces —, the number of per-layer pieces
per block, and the KV cache groups (kind and sliding window). A descriptor that does
not parse raises :class:`IncompatibleError`.

Heads (:func:`heads_of`): with TP size ``t <= H`` KV heads, rank ``r`` holds heads
``[r*H/t, (r+1)*H/t)`` (``H % t == 0``); with ``t > H`` the heads are replicated and
rank ``r`` holds head ``r*H // t``. A decode rank reads each of its heads from a prefill
rank that holds it (:func:`head_sources`): the one rank that holds it when the prefill
splits its heads; where ``t/H`` prefill ranks hold a replicated head, decode ranks
spread over those replicas (decode rank ``r`` reads replica ``r % (t/H)``). MLA caches
are whole on every rank: decode rank ``r`` reads prefill rank ``r % t``.

Byte ranges (:func:`piece_ranges`): moving tokens × rank-local heads of a prefill piece
into a decode piece is a list of ``src_ranges`` on the prefill piece and ``dst_ranges``
on the decode piece (the bytes are the concatenation of ``src_ranges`` in order, filled
into ``dst_ranges`` in order), computed from the token/head/K-V geometry of both
layouts, so HND↔NHD (and packed ↔ planes) permutes by selection.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "IncompatibleError",
    "GroupDesc",
    "KvDescriptor",
    "heads_of",
    "head_sources",
    "piece_ranges",
]


class IncompatibleError(ValueError):
    """A prefill/decode pair that cannot exchange KV: ``differences`` lists each
    reason (the message names them all)."""

    def __init__(self, differences: list[str], prefill: str = "prefill", decode: str = "decode") -> None:
        self.differences = list(differences)
        super().__init__(
            f"KvferryConnector: {prefill} and {decode} KV caches are incompatible: " + "; ".join(self.differences)
        )


@dataclass(frozen=True)
class GroupDesc:
    """One KV cache group: ``kind`` ``"full"``, ``"sliding_window"`` or ``"chunked_local"``
    (others are refused at start-up), ``window`` tokens (0 for full attention)."""

    kind: str = "full"
    window: int = 0


@dataclass(frozen=True)
class KvDescriptor:
    """How one instance lays out its KV cache (see the module docs)."""

    model: str
    dtype: str
    attention: str  # "MHA" or "MLA"
    num_kv_heads: int  # total, over all ranks (1 for MLA)
    head_size: int
    block_size: int
    tp_size: int
    layout: str = "NHD"  # a piece's cell order (module docs): "HNKD", "NHKD", "HKND", "NHD", "HND"
    pieces: int = 0  # per-layer pieces per block (2 x layers for MHA, layers for MLA); 0 = unknown
    elem_size: int = 2
    groups: tuple[GroupDesc, ...] = (GroupDesc(),)
    slots: int = 1  # reader slots per request and rank (prefill side)
    cache_layout: str = ""  # backend/KVCacheLayout (order): names the layout in refusals

    def to_params(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [asdict(g) for g in self.groups]
        return d

    @classmethod
    def from_params(cls, d: Any) -> KvDescriptor:
        if not isinstance(d, dict):
            raise IncompatibleError([f"the prefill's kvferry_desc is not a mapping ({type(d).__name__})"])
        try:
            groups = tuple(GroupDesc(str(g["kind"]), int(g.get("window", 0))) for g in d.get("groups") or [{}])
            return cls(
                model=str(d["model"]),
                dtype=str(d["dtype"]),
                attention=str(d["attention"]),
                num_kv_heads=int(d["num_kv_heads"]),
                head_size=int(d["head_size"]),
                block_size=int(d["block_size"]),
                tp_size=int(d["tp_size"]),
                layout=str(d.get("layout", "NHD")),
                pieces=int(d.get("pieces", 0)),
                elem_size=int(d.get("elem_size", 2)),
                groups=groups,
                slots=int(d.get("slots", 1)),
                cache_layout=str(d.get("cache_layout", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise IncompatibleError([f"the prefill's kvferry_desc is malformed ({e!r})"]) from None

    @property
    def heads_per_rank(self) -> int:
        if self.attention == "MLA":
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_in_piece(self) -> bool:
        """K and V share each per-layer piece (``K`` in :attr:`layout`)."""
        return "K" in self.layout

    @property
    def piece_bytes(self) -> int:
        """Bytes of one per-layer piece of one block on one rank."""
        return self.block_size * self.heads_per_rank * self.head_size * self.elem_size * (2 if self.kv_in_piece else 1)

    @property
    def layout_name(self) -> str:
        return self.cache_layout or self.layout


def heads_of(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """The global KV heads ``[a, b)`` rank ``rank`` of ``tp`` holds (replicated when
    ``tp > heads``)."""
    if tp <= heads:
        per = heads // tp
        return rank * per, (rank + 1) * per
    h = rank * heads // tp
    return h, h + 1


def head_sources(prefill: KvDescriptor, decode: KvDescriptor, rank: int) -> list[tuple[int, int, int]]:
    """``[(prefill rank, first global head, last+1)]`` decode rank ``rank`` reads, one
    entry per prefill rank, in head order (module docs: replicated heads spread over
    their replicas; MLA ``[(rank % P, 0, 1)]``)."""
    if decode.attention == "MLA":
        return [(rank % prefill.tp_size, 0, 1)]
    heads = prefill.num_kv_heads
    a, b = heads_of(rank, decode.tp_size, decode.num_kv_heads)
    out: list[tuple[int, int, int]] = []
    for h in range(a, b):
        if prefill.tp_size <= heads:
            q = h // (heads // prefill.tp_size)
        else:
            rep = prefill.tp_size // heads  # prefill ranks holding head h: h*rep .. h*rep+rep-1
            q = h * rep + rank % rep
        if out and out[-1][0] == q and out[-1][2] == h:
            out[-1] = (q, out[-1][1], h + 1)
        else:
            out.append((q, h, h + 1))
    return out


def _offset(desc: KvDescriptor, tok: int, head: int, kv: int = 0) -> int:
    """Byte offset of the head vector of (token, rank-local head, K=0/V=1) inside one
    piece of ``desc``: the piece's cells in the order :attr:`KvDescriptor.layout`
    names, outermost first (``HNKD``: heads, then tokens, then K and V)."""
    size = {"H": desc.heads_per_rank, "N": desc.block_size, "K": 2}
    index = {"H": head, "N": tok, "K": kv}
    off = 0
    for dim in desc.layout[:-1]:
        off = off * size[dim] + index[dim]
    return off * desc.head_size * desc.elem_size


def _coalesce(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, n in runs:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def piece_ranges(
    p: KvDescriptor, d: KvDescriptor, src_tok0: int, dst_tok0: int, ntok: int, src_head0: int, dst_head0: int, nheads: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(src_ranges, dst_ranges)`` moving tokens ``src_tok0..+ntok`` × rank-local heads
    ``src_head0..+nheads`` of a prefill piece to tokens ``dst_tok0..`` × heads
    ``dst_head0..`` of a decode piece, in the decode piece's byte order."""
    hs = p.head_size * p.elem_size
    atoms = []
    kvs = (0, 1) if p.kv_in_piece else (0,)
    for t in range(ntok):
        for h in range(nheads):
            for kv in kvs:
                atoms.append((_offset(d, dst_tok0 + t, dst_head0 + h, kv), _offset(p, src_tok0 + t, src_head0 + h, kv)))
    atoms.sort()
    return _coalesce([(s, hs) for _, s in atoms]), _coalesce([(o, hs) for o, _ in atoms])
