"""The connector's prefill→decode mapping (``kvferry.integrations.vllm.mapping``),
pure Python: every plan is executed byte by byte on numpy "caches" and each decode
rank's blocks compared with a reference assembled from global (token, head) contents,
so a read from the wrong rank, head, token or layout cannot pass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from numpy.typing import NDArray

from kvferry.integrations.vllm.mapping import (
    GroupDesc,
    IncompatibleError,
    KvDescriptor,
    RankPlan,
    check,
    heads_of,
    plan_request,
    slot_key,
)

HS, ES, PIECES = 4, 2, 4  # head size, element size, per-layer pieces per block (2 layers x K/V)


def desc(
    tp: int,
    heads: int = 4,
    bs: int = 16,
    layout: str = "NHD",
    attention: str = "MHA",
    slots: int = 8,
    groups: tuple[GroupDesc, ...] = (GroupDesc(),),
) -> KvDescriptor:
    return KvDescriptor(
        model="m", dtype="float16", attention=attention, num_kv_heads=1 if attention == "MLA" else heads, head_size=HS,
        block_size=bs, tp_size=tp, layout=layout, pieces=PIECES, elem_size=ES, slots=slots, groups=groups,
    )


def content(piece: int, tok: int, head: int) -> bytes:
    """The bytes of one (piece, absolute token, global head): what any rank holding
    that head must hold."""
    return bytes((piece * 31 + tok * 7 + head * 13 + i) % 251 for i in range(HS * ES))


def build(dsc: KvDescriptor, rank: int, blocks: list[int], ntok: int, nblocks: int) -> NDArray[np.uint8]:
    """One rank's cache: [nblocks, pieces, piece_bytes], block blocks[j] holds tokens j*bs.."""
    a, b = heads_of(rank, dsc.tp_size, dsc.num_kv_heads)
    buf = np.zeros((nblocks, PIECES, dsc.piece_bytes), np.uint8)
    for j, blk in enumerate(blocks):
        for t in range(dsc.block_size):
            tok = j * dsc.block_size + t
            if tok >= ntok:
                break
            for pc in range(PIECES):
                for h in range(a, b):
                    off = (
                        ((h - a) * dsc.block_size + t) * HS * ES if dsc.layout == "HND" else (t * (b - a) + (h - a)) * HS * ES
                    )
                    buf[blk, pc, off : off + HS * ES] = np.frombuffer(content(pc, tok, h), np.uint8)
    return buf


def execute(
    plans: list[RankPlan], p: KvDescriptor, d: KvDescriptor, remote: list[int], src: list[NDArray[np.uint8]], nloc: int
) -> tuple[list[NDArray[np.uint8]], dict[int, list[str]]]:
    out = [np.zeros((nloc, PIECES, d.piece_bytes), np.uint8) for _ in range(d.tp_size)]
    keys_read: dict[int, list[str]] = {}
    for r, plan in enumerate(plans):
        for rd in plan.reads:
            keys_read.setdefault(rd.rank, []).append(rd.key)
            for pos, dst in zip(rd.blocks, rd.dst_blocks):
                for pc in range(PIECES):
                    s = src[rd.rank][remote[pos], pc]
                    sr = rd.src_ranges or [(0, p.piece_bytes)]
                    dr = rd.dst_ranges or [(0, d.piece_bytes)]
                    data = b"".join(bytes(s[o : o + n]) for o, n in sr)
                    assert len(data) == sum(n for _, n in dr)
                    at = 0
                    for o, n in dr:
                        out[r][dst, pc, o : o + n] = np.frombuffer(data[at : at + n], np.uint8)
                        at += n
    return out, keys_read


CASES = [
    # (P_TP, D_TP, KV heads, P bs, D bs, P layout, D layout)
    (1, 1, 4, 16, 16, "NHD", "NHD"),
    (1, 2, 4, 16, 16, "NHD", "NHD"),
    (2, 1, 4, 16, 16, "NHD", "NHD"),
    (2, 4, 4, 16, 16, "HND", "HND"),
    (4, 2, 4, 16, 16, "HND", "HND"),
    (2, 4, 2, 16, 16, "NHD", "NHD"),  # decode TP exceeds KV heads: replicated
    (4, 1, 2, 16, 16, "NHD", "NHD"),  # prefill TP exceeds KV heads
    (4, 8, 2, 16, 16, "HND", "NHD"),
    (2, 4, 4, 16, 32, "HND", "HND"),
    (2, 4, 4, 32, 16, "NHD", "NHD"),
    (2, 4, 4, 16, 16, "HND", "NHD"),
    (2, 4, 4, 32, 16, "NHD", "HND"),
    (4, 2, 4, 16, 64, "NHD", "HND"),
]


@pytest.mark.parametrize("ptp,dtp,heads,pbs,dbs,play,dlay", CASES)
@pytest.mark.parametrize("ntok", [1, 37, 64])
@pytest.mark.parametrize("skip", [0, 1])
def test_every_decode_block_matches_the_reference(
    ptp: int, dtp: int, heads: int, pbs: int, dbs: int, play: str, dlay: str, ntok: int, skip: int
) -> None:
    p = desc(ptp, heads, pbs, play)
    d = desc(dtp, heads, dbs, dlay)
    m = check(p, d)
    nrem, nloc = -(-ntok // pbs), -(-ntok // dbs)
    skip = min(skip, nloc - 1)
    remote = [5 + 2 * i for i in range(nrem)]  # scattered prefill blocks
    local = [3 + 3 * j for j in range(nloc)]
    src = [build(p, q, remote, ntok, max(remote) + 1) for q in range(ptp)]
    held: list[int | None] = list(remote)  # plan_request's blocks may be None (none held)
    plans = plan_request(m, "req", ntok, [held], [[None if j < skip else b for j, b in enumerate(local)]])
    got, keys = execute(plans, p, d, remote, src, max(local) + 1)
    for r in range(dtp):
        want = build(d, r, local, ntok, max(local) + 1)
        for j, blk in enumerate(local):
            if j < skip:
                assert not got[r][blk].any(), "a prefix-hit block was read"
                continue
            # Tokens past the prompt are not compared (the prefill's padding).
            valid = min(dbs, ntok - j * dbs)
            for pc in range(PIECES):
                for t in range(valid):
                    for hh in range(d.heads_per_rank):
                        off = (hh * dbs + t) * HS * ES if dlay == "HND" else (t * d.heads_per_rank + hh) * HS * ES
                        assert bytes(got[r][blk, pc, off : off + HS * ES]) == bytes(want[blk, pc, off : off + HS * ES]), (
                            r, j, pc, t, hh,
                        )
    # Slots: every read its own key; every unread slot released by exactly one rank.
    released = [(q, k) for plan in plans for q, k in plan.releases]
    for q in range(ptp):
        mine = keys.get(q, []) + [k for qq, k in released if qq == q]
        assert sorted(mine) == sorted(slot_key("req", s) for s in range(p.slots)), (q, mine)


@pytest.mark.parametrize("ptp,dtp", [(2, 1), (2, 4), (1, 2), (4, 4)])
def test_mla_one_reader_per_decode_rank_unread_released(ptp: int, dtp: int) -> None:
    p, d = desc(ptp, attention="MLA"), desc(dtp, attention="MLA")
    plans = plan_request(check(p, d), "k", 40, [[1, 2, 3]], [[7, 8, 9]])
    for r, plan in enumerate(plans):
        assert [rd.rank for rd in plan.reads] == [r % ptp]
        assert plan.reads[0].src_ranges is None and plan.reads[0].blocks == [0, 1, 2]
    read = {rd.rank for plan in plans for rd in plan.reads}
    for q in set(range(ptp)) - read:  # nobody reads it: every slot released at once
        assert sorted(k for plan in plans for qq, k in plan.releases if qq == q) == sorted(slot_key("k", s) for s in range(p.slots))


def test_head_slices_move_only_the_heads_read() -> None:
    p, d = desc(2, 4, layout="HND"), desc(4, 4, layout="HND")
    plans = plan_request(check(p, d), "k", 16, [[1]], [[2]])
    for r, plan in enumerate(plans):
        (rd,) = plan.reads
        assert rd.rank == r // 2
        per_head = 16 * HS * ES
        assert rd.src_ranges == [((r % 2) * per_head, per_head)] and rd.dst_ranges == [(0, per_head)]


def test_same_shape_reads_whole_pieces() -> None:
    plans = plan_request(check(desc(2), desc(2)), "k", 20, [[4, 5]], [[1, 2]])
    assert [(rd.rank, rd.src_ranges, rd.dst_ranges, rd.blocks) for pl in plans for rd in pl.reads] == [
        (0, None, None, [0, 1]),
        (1, None, None, [0, 1]),
    ]


def test_prefix_hit_reads_only_the_missing_blocks() -> None:
    plans = plan_request(check(desc(1), desc(1)), "k", 64, [[10, 11, 12, 13]], [[None, None, None, 4]])
    (rd,) = plans[0].reads
    assert rd.blocks == [3] and rd.dst_blocks == [4]
    all_hit = plan_request(check(desc(1), desc(1)), "k", 64, [[10, 11, 12, 13]], [[None] * 4])
    assert not all_hit[0].reads and ("k" in {k for _, k in all_hit[0].releases})


def test_sliding_window_group_moves_only_the_window() -> None:
    g = (GroupDesc("full"), GroupDesc("sliding_window", 32))
    p, d = desc(1, groups=g), desc(1, groups=g)
    # 100 tokens: the full group has 7 blocks, the window group only its last 3.
    plans = plan_request(
        check(p, d), "k", 100, [[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 20, 21, 22]],
        [[31, 32, 33, 34, 35, 36, 37], [None, None, None, None, 40, 41, 42]],
    )
    (rd,) = plans[0].reads
    assert rd.blocks == list(range(10)) and rd.dst_blocks == [31, 32, 33, 34, 35, 36, 37, 40, 41, 42]


def test_incompatible_pair_names_every_difference() -> None:
    p = desc(2, 4)
    d = KvDescriptor(**{**p.__dict__, "head_size": 8, "dtype": "bfloat16", "tp_size": 4})
    with pytest.raises(IncompatibleError) as e:
        check(p, d)
    msg = str(e.value)
    assert "head_size differs (prefill 4, decode 8)" in msg and "dtype differs" in msg
    assert len(e.value.differences) == 2
    with pytest.raises(IncompatibleError, match="do not divide"):
        check(desc(1, bs=16), desc(1, bs=24))
    with pytest.raises(IncompatibleError, match="reader slot"):
        check(desc(1, slots=2), desc(4))
    with pytest.raises(IncompatibleError, match="groups differ"):
        check(desc(1), desc(1, groups=(GroupDesc(), GroupDesc("sliding_window", 64))))
    with pytest.raises(IncompatibleError, match="malformed"):
        KvDescriptor.from_params({"model": "m"})


def test_descriptor_round_trips_through_params() -> None:
    p = desc(2, groups=(GroupDesc(), GroupDesc("sliding_window", 128)))
    assert KvDescriptor.from_params(p.to_params()) == p


def test_heads_of() -> None:
    assert [heads_of(r, 4, 8) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [heads_of(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert list(itertools.chain(*(range(*heads_of(r, 2, 2)) for r in range(2)))) == [0, 1]
