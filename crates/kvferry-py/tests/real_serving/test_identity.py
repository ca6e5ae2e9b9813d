"""P/D through ``vllm-router`` gives the tokens one instance gives, and every prompt
token of the decode came through kvferry.

Greedy completions of the tiny Llama (float32), compared token id for token id with the
``single`` instance's answers to the same prompts, sent the same way (one at a time, or
32 at once). After the load, both instances' ``vllm:kv_cache_usage_perc`` is back to 0:
no block left pinned by a publication or a pull.
"""

from __future__ import annotations

import pytest
import serving_harness as h

CONCURRENT = 32


def external_counts(d: h.Server) -> tuple[float, float, float]:
    """The decode's prompt tokens in total, through the connector, computed locally."""
    m = d.metrics()
    return (
        h.metric(m, "vllm:prompt_tokens_total"),
        h.metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        h.metric(m, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    )


def check_through_kvferry(pd: h.PD, before: tuple[float, float, float], outcomes: list[h.Outcome]) -> None:
    """Every prompt token the decode admitted for ``outcomes`` came from the prefill: the
    decode's ``prompt_tokens_by_source{source="external_kv_transfer"}`` grew by exactly
    the prompts' tokens (the usage the answers report) and ``local_compute`` not at all."""
    after = external_counts(pd.decode)
    total, external, local = (a - b for a, b in zip(after, before))
    n = len(outcomes)
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    assert total == prompt_tokens, (total, prompt_tokens)
    assert external == prompt_tokens, f"{external} of {prompt_tokens} prompt tokens came through kvferry"
    assert local == 0, f"the decode computed {local} prompt tokens itself for {n} requests"
    print(f"decode: {external:.0f} of {prompt_tokens} prompt tokens through kvferry, {local:.0f} computed")


@pytest.mark.parametrize("config", ["default", "tcp-staged"])
def test_one_at_a_time(config: str, single: h.Server, cluster: h.Cluster) -> None:
    """8 prompts of 40–160 words, one after another: P/D tokens == single's."""
    pd = cluster.get(config)
    ps = h.prompts(8, seed=100 + len(config))
    ref = [h.complete(single.port, p) for p in ps]
    before = external_counts(pd.decode)
    got = [h.complete(pd.router.port, p) for p in ps]
    h.assert_identical(ref, got, ps)
    check_through_kvferry(pd, before, got)
    h.assert_no_blocks_held(pd)


@pytest.mark.parametrize("config", ["default", "tcp-staged"])
def test_concurrent(config: str, single: h.Server, cluster: h.Cluster) -> None:
    """32 prompts at once: P/D tokens == single's (the reference also taken 32 at once)."""
    pd = cluster.get(config)
    ps = h.prompts(CONCURRENT, seed=200 + len(config))
    ref = h.complete_many(single.port, ps, CONCURRENT)
    before = external_counts(pd.decode)
    got = h.complete_many(pd.router.port, ps, CONCURRENT)
    h.assert_identical(ref, got, ps)
    check_through_kvferry(pd, before, got)
    h.assert_no_blocks_held(pd, single)
