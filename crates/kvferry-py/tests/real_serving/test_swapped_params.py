"""A router bug: the decode is handed another request's ``kv_transfer_params``.

The test is the router here, doing what ``vllm-router`` does for P/D — the prompt to the
prefill with ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``,
then the prompt to the decode with the params the prefill answered — except that it
swaps the params of two requests whose prompts have the same number of tokens (so
nothing about the blocks' count gives the swap away). The decode must never answer
with tokens other than the single instance's for its own prompt: it refuses the KV (a
load error, failed or recomputed per ``kv_load_failure_policy``) or computes it again.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import serving_harness as h


def prefill(pd: h.PD, prompt: str) -> dict[str, Any]:
    """The prefill step a P/D router makes; the ``kv_transfer_params`` it returns."""
    r = h.request(
        pd.prefill.port, "POST", "/v1/completions",
        h.body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}),
    )  # fmt: skip
    params = r.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), f"the prefill returned no usable kv_transfer_params: {r}"
    return dict(params)


def same_length_pair(pd: h.PD, seed: int) -> tuple[str, str]:
    """Two different prompts of the same token count."""
    by_len: dict[int, str] = {}
    for i, p in enumerate(h.prompts(200, seed=seed, min_words=60, max_words=70)):
        n = len(h.request(pd.decode.port, "POST", "/tokenize", {"model": "tiny", "prompt": p})["tokens"])
        if n in by_len and by_len[n] != p:
            return by_len[n], p
        by_len[n] = p
    raise AssertionError("no two prompts of the same token count among 200")


def test_swapped_params_never_give_wrong_tokens(pd: h.PD, single: h.Server) -> None:
    a, b = same_length_pair(pd, seed=700)
    ref_a, ref_b = h.complete(single.port, a), h.complete(single.port, b)
    assert ref_a.tokens and ref_b.tokens and ref_a.tokens != ref_b.tokens
    with cf.ThreadPoolExecutor(2) as ex:
        params_a, params_b = ex.map(lambda p: prefill(pd, p), [a, b])
    # Swapped on purpose: a's prompt with b's KV, b's prompt with a's.
    got_a = h.complete(pd.decode.port, a, timeout=30, kv_transfer_params=params_b)
    got_b = h.complete(pd.decode.port, b, timeout=30, kv_transfer_params=params_a)
    print(f"swapped: a -> {got_a.error or 'tokens'}, b -> {got_b.error or 'tokens'}")
    for name, got, ref in [("a", got_a, ref_a), ("b", got_b, ref_b)]:
        assert got.tokens is None or got.tokens == ref.tokens, (
            f"prompt {name} decoded with the other prompt's KV returned other tokens (HTTP 200): "
            f"{got.tokens} != {ref.tokens}"
        )
    h.assert_no_blocks_held(pd, within=30)
