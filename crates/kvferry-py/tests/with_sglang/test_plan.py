# mypy: disable-error-code="import-untyped,import-not-found"
"""The pairing plan's head arithmetic (pure, no processes): which prefill rank each
decode rank reads which KV heads from, for split and replicated heads on either side.

Checked against what SGLang places on each rank (``heads / tp`` heads, or with
``tp > heads`` one head, rank ``r`` holding head ``r // (tp / heads)``) rather than
against the plan's own helpers. The replica rule is ``_kv_layout.head_sources``, the one
the vLLM mapping uses too (its byte-level checks: ``tests/test_vllm_mapping.py``)."""

from __future__ import annotations

import pytest


def _placed(tp: int, heads: int, rank: int) -> list[int]:
    """The global heads SGLang puts on ``rank`` of ``tp``."""
    if tp <= heads:
        per = heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // heads)]


CASES = [(p, d, h) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)]


@pytest.mark.parametrize("p_tp,d_tp,heads", CASES)
def test_every_decode_head_read_once_from_a_rank_that_holds_it(need_sglang: None, p_tp: int, d_tp: int, heads: int) -> None:
    from kvferry.integrations.sglang._plan import Layout, check_pairing, readers, sources, unread_notified_by

    head_dim, page = 16, 4

    def lay(tp: int) -> Layout:
        local = max(1, heads // tp)
        return Layout(page, "bf16", False, tp, 0, local, heads, (page * local * head_dim,) * 4, (8,))

    pre, dec = lay(p_tp), lay(d_tp)
    check_pairing(pre, dec)
    notified: list[int] = []
    for d in range(d_tp):
        got: dict[int, int] = {}  # decode-local head slot -> prefill rank
        for s in sources(pre, dec, d):
            if s.src_ranges is None:  # whole pieces: the same heads on both sides
                assert _placed(p_tp, heads, s.rank) == _placed(d_tp, heads, d)
                for i in range(len(_placed(d_tp, heads, d))):
                    got[i] = s.rank
                continue
            # Each range moves one head vector of one token (NHD pieces): decode the
            # (token, head) cells from the byte offsets on both sides.
            assert s.dst_ranges is not None
            p_local, d_local = len(_placed(p_tp, heads, s.rank)), len(_placed(d_tp, heads, d))
            src = [(o + k) // head_dim for o, n in s.src_ranges for k in range(0, n, head_dim)]
            dst = [(o + k) // head_dim for o, n in s.dst_ranges for k in range(0, n, head_dim)]
            assert len(src) == len(dst)
            for a, b in zip(src, dst):
                ta, ha = divmod(a, p_local)
                tb, hb = divmod(b, d_local)
                assert ta == tb
                assert _placed(p_tp, heads, s.rank)[ha] == _placed(d_tp, heads, d)[hb]
                assert got.setdefault(hb, s.rank) == s.rank
        assert sorted(got) == list(range(len(_placed(d_tp, heads, d)))), (d, got)
        notified += unread_notified_by(pre, dec, d)
    # every prefill rank is read or told it is not, exactly once
    unread = [p for p in range(p_tp) if not readers(pre, dec, p)]
    assert sorted(notified) == unread


def test_heads_neither_split_nor_replicated_refused_by_name(need_sglang: None) -> None:
    from kvferry.integrations.sglang._plan import Layout, PairingError, check_pairing

    pre = Layout(4, "bf16", False, 3, 0, 1, 2, (64,), ())
    dec = Layout(4, "bf16", False, 1, 0, 2, 2, (128,), ())
    with pytest.raises(PairingError, match="the prefill's TP 3 is not a multiple of its 2 KV heads"):
        check_pairing(pre, dec)
