"""What a decode rank reads from which prefill rank, and the pairing checks: pure
functions over small descriptors (no SGLang, no sockets).

SGLang's MHA pools keep one buffer per layer for K and one for V, each page a
``[page_size, heads_on_this_rank, head_dim]`` block (token-major, kvferry's ``NHD``
piece order); an MLA pool keeps one latent buffer per layer, replicated on every rank.
A kvferry region here is the list of those buffers; one page is one block, one
per-layer buffer's page is one piece. The head arithmetic and the byte ranges inside a
piece come from the descriptor module both integrations share (:func:`heads_of`,
:func:`head_sources`, :func:`piece_ranges`), which this module imports rather than
restates.

Heads: with TP size ``t <= H`` KV heads a rank holds ``H/t`` of them (``H % t == 0``);
with ``t > H`` (``t % H == 0``) they are replicated, rank ``r`` holding head
``r // (t/H)`` as SGLang's attention layers place them. A decode rank reads each of its
heads from one prefill rank that holds it — where several prefill ranks hold a
replicated head, decode ranks spread over the replicas — with a byte selection inside
every piece unless both sides hold the same heads. A prefill rank no decode rank reads
(replicas left over, or an MLA prefill wider than the decode) is told so by one decode
rank and concludes without moving anything. SGLang's mooncake backend pairs the same
TP sizes; where it writes a replicated head from every replica into the same decode
bytes, kvferry reads it once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .._kv_layout import KvDescriptor, head_sources, heads_of, piece_ranges


class PairingError(ValueError):
    """A prefill and a decode rank whose KV caches cannot be paired; the message names
    every difference."""


@dataclass(frozen=True)
class Layout:
    """One rank's KV layout as the wire carries it (both sides send theirs)."""

    page_size: int
    dtype: str
    mla: bool
    tp_size: int
    tp_rank: int
    kv_head_num: int  # heads on this rank (1 for MLA)
    total_kv_head_num: int  # over all ranks (1 for MLA)
    item_lens: tuple[int, ...]  # bytes of one page of each per-layer buffer
    aux_item_lens: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["item_lens"] = list(self.item_lens)
        d["aux_item_lens"] = list(self.aux_item_lens)
        return d

    @classmethod
    def from_wire(cls, d: Any) -> Layout:
        try:
            return cls(
                page_size=int(d["page_size"]),
                dtype=str(d["dtype"]),
                mla=bool(d["mla"]),
                tp_size=int(d["tp_size"]),
                tp_rank=int(d["tp_rank"]),
                kv_head_num=int(d["kv_head_num"]),
                total_kv_head_num=int(d["total_kv_head_num"]),
                item_lens=tuple(int(x) for x in d["item_lens"]),
                aux_item_lens=tuple(int(x) for x in d["aux_item_lens"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PairingError(f"malformed layout from the peer ({e!r})") from None

    @property
    def heads(self) -> int:
        """Total KV heads the plan splits (1 for MLA: the latent is replicated)."""
        return 1 if self.mla else self.total_kv_head_num

    def head_bytes(self) -> int:
        """Bytes of one head vector of one token in a piece (MHA), or of one token's
        latent (MLA)."""
        per_token = self.item_lens[0] // max(1, self.page_size)
        return per_token // max(1, 1 if self.mla else self.kv_head_num)

    def descriptor(self) -> KvDescriptor:
        """This layout as the vLLM mapping's descriptor (one byte per element: the
        head vector is counted in bytes)."""
        return KvDescriptor(
            model="",
            dtype=self.dtype,
            attention="MLA" if self.mla else "MHA",
            num_kv_heads=self.heads,
            head_size=self.head_bytes(),
            block_size=self.page_size,
            tp_size=self.tp_size,
            layout="NHD",
            pieces=len(self.item_lens),
            elem_size=1,
        )


def check_pairing(prefill: Layout, decode: Layout) -> None:
    """Raises :class:`PairingError` naming every difference kvferry's SGLang backend
    does not bridge: page size, KV dtype, MLA against MHA, layer or auxiliary buffer
    count, head size, heads that neither split evenly over a TP size nor replicate over
    it (TP a multiple of the heads)."""
    why: list[str] = []
    if prefill.page_size != decode.page_size:
        why.append(f"page size differs: prefill {prefill.page_size} tokens, decode {decode.page_size}")
    if prefill.dtype != decode.dtype:
        why.append(f"KV cache dtype differs: prefill {prefill.dtype}, decode {decode.dtype}")
    if prefill.mla != decode.mla:
        why.append(f"attention differs: prefill {'MLA' if prefill.mla else 'MHA'}, decode {'MLA' if decode.mla else 'MHA'}")
    if len(prefill.item_lens) != len(decode.item_lens):
        why.append(f"KV buffer count differs: prefill {len(prefill.item_lens)}, decode {len(decode.item_lens)}")
    if len(prefill.aux_item_lens) != len(decode.aux_item_lens) or prefill.aux_item_lens != decode.aux_item_lens:
        why.append(f"auxiliary buffers differ: prefill {list(prefill.aux_item_lens)} bytes, decode {list(decode.aux_item_lens)}")
    if not why and prefill.head_bytes() != decode.head_bytes():
        why.append(f"head size differs: prefill {prefill.head_bytes()} bytes, decode {decode.head_bytes()}")
    if not prefill.mla and not why:
        if prefill.total_kv_head_num != decode.total_kv_head_num:
            why.append(f"total KV heads differ: prefill {prefill.total_kv_head_num}, decode {decode.total_kv_head_num}")
        for side, lay in (("prefill", prefill), ("decode", decode)):
            heads, tp = lay.total_kv_head_num, lay.tp_size
            if tp <= heads and heads % tp:
                why.append(f"{heads} KV heads do not split evenly over the {side}'s TP {tp}")
            elif tp > heads and tp % heads:
                why.append(f"the {side}'s TP {tp} is not a multiple of its {heads} KV heads (replicated heads need one)")
            elif lay.kv_head_num != max(1, heads // tp):
                why.append(f"the {side} rank holds {lay.kv_head_num} KV heads, but {heads} heads over TP {tp} give {max(1, heads // tp)}")
    if why:
        raise PairingError("; ".join(why))


@dataclass(frozen=True)
class Source:
    """One read of a decode rank: prefill rank ``rank``, and the byte ranges inside
    every piece (None: whole pieces)."""

    rank: int
    src_ranges: tuple[tuple[int, int], ...] | None
    dst_ranges: tuple[tuple[int, int], ...] | None


def sources(prefill: Layout, decode: Layout, decode_rank: int) -> list[Source]:
    """The reads of ``decode_rank``, one per prefill rank it reads (:func:`head_sources`:
    each KV head from a prefill rank that holds it, replicas spread over; MLA: prefill
    rank ``decode_rank % P`` whole). A read that covers whole pieces on both sides
    (equal TP sizes, or one replicated head each) selects no bytes."""
    p_tp, d_tp = prefill.tp_size, decode.tp_size
    if prefill.mla:
        return [Source(decode_rank % p_tp, None, None)]
    if p_tp == d_tp:
        return [Source(decode_rank, None, None)]
    heads = decode.total_kv_head_num
    pd, dd = prefill.descriptor(), decode.descriptor()
    d0 = heads_of(decode_rank, d_tp, heads)[0]
    out = []
    for q, a, b in head_sources(pd, dd, decode_rank):
        p0 = heads_of(q, p_tp, heads)[0]
        src, dst = piece_ranges(pd, dd, 0, 0, decode.page_size, a - p0, a - d0, b - a)
        if src == [(0, pd.piece_bytes)] and dst == [(0, dd.piece_bytes)]:
            out.append(Source(q, None, None))
        else:
            out.append(Source(q, tuple(src), tuple(dst)))
    return out


def readers(prefill: Layout, decode: Layout, prefill_rank: int) -> list[int]:
    """The decode ranks that read ``prefill_rank`` (possibly none: an MLA prefill
    wider than the decode)."""
    return [d for d in range(decode.tp_size) if any(s.rank == prefill_rank for s in sources(prefill, decode, d))]


def unread_notified_by(prefill: Layout, decode: Layout, decode_rank: int) -> list[int]:
    """Prefill ranks nobody reads that ``decode_rank`` tells so (rank ``p`` by decode
    rank ``p % D``), so that their senders finish instead of waiting."""
    return [
        p
        for p in range(prefill.tp_size)
        if p % decode.tp_size == decode_rank and not readers(prefill, decode, p)
    ]
