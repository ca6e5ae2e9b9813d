"""KV that belongs to the request: a decode loads only KV computed from its own prompt.

A router that hands a decode instance another request's ``kv_transfer_params`` (two
requests' params swapped, or params rebuilt from another request's fields) used to
make the decode load the other prompt's KV and answer with wrong tokens. The prefill
now publishes each request under a key bound to its prompt's digest
(``kvferry.integrations.vllm.prompt``), and the decode refuses, before any read, a key
not bound to its own prompt — a load error of kind ``wrong_prompt`` that vLLM's
``kv_load_failure_policy`` turns into a local recompute or a failed request — while the
prefill is told to free the named publication at once.

What the harness writes makes a wrong load visible: the prefill's "forward" writes
bytes of (token, position, ..., salt 1) and the decode's salt 2, so a decode whose
prompt KV is its own computation holds salt 2 of *its* tokens at every position, and
one that loaded the other prompt's KV would hold salt 1 of the other prompt's tokens.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from kvferry.integrations.vllm.prompt import prompt_digest, publication_key
from vllm_harness import (
    BLOCK_SIZE,
    DECODE_SALT,
    Instance,
    check_landed,
    needed,
    prefill,
    prompts,
    scheduler_leaks,
    wire,
)

# The conftest fixtures ``prefill`` and ``decode`` read these.
LEASE_TTL = 20.0  # long: every release below must come far sooner
TIMEOUT = 10.0
DECODE_BLOCKS = 256
RELEASE_BOUND = 2.0  # seconds: "within a round trip", with slack for a loaded 2-core host


class _Log(logging.Handler):
    """The connector's log records, as vLLM's logger does not reach pytest's caplog."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())

    def __enter__(self) -> _Log:
        logging.getLogger("kvferry.integrations.vllm").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("kvferry.integrations.vllm").removeHandler(self)


def _failed(d: Instance) -> dict[str, int]:
    """Failed pulls by kind, every rank, every step."""
    out: dict[str, int] = {}
    for per_rank in d.rank_stats:
        for st in per_rank:
            for kind, n in st.get("failed", {}).items():
                out[kind] = out.get(kind, 0) + int(n)
    return {k: n for k, n in out.items() if n}


def _check_computed_here(d: Instance, rid: str, prompt: list[int]) -> None:
    """Once the request sampled its first token (its prompt went through the decode's
    own forward), every rank holds, at every prompt position, the decode's own bytes
    of *this* prompt (salt 2): not another prompt's KV, not the prefill's."""
    d.run_until(lambda: bool(d.tokens.get(rid)), 10, f"{rid}'s prompt to be computed")
    assert rid not in d.final, "max_tokens leaves the request running while its KV is read"
    (blocks,) = d.scheduler.kv_cache_manager.get_block_ids(rid)
    for rank in range(len(d.ranks)):
        for pos in range(len(prompt)):
            got = d.slot(rank, blocks, pos)
            assert got == d.expected(prompt, rank, pos, salt=DECODE_SALT), f"{rid}: rank {rank}, position {pos}"


def _same_length_prompts(n: int, seed: int) -> list[tuple[str, list[int]]]:
    """``n`` prompts of one length (the same block count and ``remote_num_tokens``:
    nothing but the tokens tells their KV apart)."""
    ntok = int(BLOCK_SIZE * 2.5)
    return prompts(n, seed=seed, lo=ntok, hi=ntok + 1)


def _mixed_up(how: str, mine: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """What a faulty router hands the decode of ``mine``'s request."""
    if how == "swapped":  # the other request's params, whole
        return dict(other)
    if how == "nixl-fields":  # a proxy written for NIXL: only NIXL's fields, the other's
        return {k: v for k, v in other.items() if not k.startswith("kvferry_")}
    if how == "key-only":  # this request's params, but the other's publication key
        return dict(mine, remote_request_id=other["remote_request_id"])
    raise AssertionError(how)


# -- swapped params: refused before any read, recomputed or failed per the policy -------


def test_swapped_params_are_recomputed_never_loaded(prefill, decode, kv_device):
    """Two requests' params swapped by the router, a third request with its own params
    in the same step. The two are refused at once — no byte read, kind
    ``wrong_prompt``, one warning each naming the request — and recomputed here
    (``kv_load_failure_policy`` recompute): each holds its own prompt's KV, computed by
    the decode. The third lands the prefill's bytes as before. The prefill frees both
    refused publications within a round trip, and neither side leaks a block."""
    _mixed_up_pair_is_recomputed(prefill, decode, "swapped")


@pytest.mark.parametrize("kv_device", ["host"], indirect=True)
@pytest.mark.parametrize("how", ["nixl-fields", "key-only"])
def test_params_mixed_up_otherwise_are_refused_the_same_way(prefill, decode, kv_device, how):
    """As above, with the swapped params cut to NIXL's fields (a proxy written for
    NIXL: the key still carries the digest), or with each request's own params but the
    other's publication key (params rebuilt from two requests' fields): the key is what
    is checked, so both are refused alike."""
    _mixed_up_pair_is_recomputed(prefill, decode, how)


def _mixed_up_pair_is_recomputed(prefill: Any, decode: Any, how: str) -> None:
    d = decode(policy="recompute")
    (r1, p1), (r2, p2), (r3, p3) = _same_length_prompts(3, seed=501 + len(how))
    params = prefill.prefill([(r1, p1), (r2, p2), (r3, p3)])
    prefill.wait_published({r1, r2, r3})
    wire0 = wire(d)
    with _Log() as log:
        d.add(r1, p1, max_tokens=4, params=_mixed_up(how, params[r1], params[r2]))
        d.add(r2, p2, max_tokens=4, params=_mixed_up(how, params[r2], params[r1]))
        d.add(r3, p3, max_tokens=4, params=params[r3])
        t = d.run_until(lambda: {r1, r2} <= d.failed_recving and r3 in d.finished_recving, 10, "the refusals and the pull")
    assert t < TIMEOUT / 2, f"refused at once, not after a pull timed out ({t:.1f} s)"
    assert d.failed_recving == {r1, r2} and d.invalid_blocks
    assert _failed(d) == {"wrong_prompt": 2}, _failed(d)
    refusals = [m for m in log.records if "refusing the KV named for" in m]
    assert len(refusals) == 2 and any(r1 in m for m in refusals) and any(r2 in m for m in refusals), log.records
    assert all("another prompt" in m and "kv_load_failure_policy=recompute" in m for m in refusals), refusals
    check_landed(d, r3, p3)
    assert wire(d) - wire0 == needed(BLOCK_SIZE, d, len(p3)), "only the third request's bytes were read"
    assert not any(r in d.landed for r in (r1, r2))
    for rid, prompt in ((r1, p1), (r2, p2)):
        _check_computed_here(d, rid, prompt)
    d.run_until(lambda: {r1, r2, r3} <= set(d.final), 10, "the decodes")
    assert all(len(d.tokens[r]) == 4 for r in (r1, r2, r3))
    # The refused publications were released by the decode, not left to the lease.
    st = prefill.wait_freed({r1, r2, r3}, timeout=RELEASE_BOUND)
    assert {r1, r2, r3} <= set(st["finished_sending"])
    assert st["free"] == st["free_at_start"] and prefill.leaks() == []
    d.run_until(lambda: not d.worker._releases, 5, "the releases to finish")
    assert d.leaks() == [] and d.free_blocks() == d.free_at_start


@pytest.mark.parametrize("kv_device", ["host"], indirect=True)
def test_swapped_params_fail_the_requests_with_the_fail_policy(prefill, decode, kv_device):
    """``kv_load_failure_policy`` fail (vLLM's default): both requests of a swapped
    pair end with an error and no token; nothing was read, both publications are
    freed at once, and neither side leaks."""
    d = decode(policy="fail")
    (r1, p1), (r2, p2) = _same_length_prompts(2, seed=511)
    params = prefill.prefill([(r1, p1), (r2, p2)])
    wire0 = wire(d)
    d.add(r1, p1, max_tokens=4, params=params[r2])
    d.add(r2, p2, max_tokens=4, params=params[r1])
    d.run_until(lambda: {r1, r2} <= set(d.final), 10, "the failed requests")
    assert d.failed_recving == {r1, r2} and _failed(d) == {"wrong_prompt": 2}
    for rid in (r1, r2):
        assert str(d.final[rid].finish_reason) == "error" and not d.tokens.get(rid), (rid, d.tokens.get(rid))
    assert wire(d) == wire0, "nothing was read"
    prefill.wait_freed({r1, r2}, timeout=RELEASE_BOUND)
    assert prefill.leaks() == []
    d.run_until(lambda: not d.worker._releases, 5, "the releases to finish")
    d.step()
    assert scheduler_leaks(d.scheduler) == [] and d.free_blocks() == d.free_at_start


@pytest.mark.parametrize("kv_device", ["host"], indirect=True)
def test_a_key_without_a_prompt_digest_is_refused(prefill, decode, kv_device):
    """Params whose key carries no prompt digest — what a prefill of a kvferry before
    the prompt check returned (the plain request id) — are refused, not loaded
    unverified: a load error of kind ``wrong_prompt`` at once, whose warning says to
    upgrade the prefill instances first, and the request is recomputed here. The same
    prompt with the prefill's own params then lands as before on another decode (so
    the prefill is freed by its reader, not the lease)."""
    d = decode(policy="recompute")
    (rid, prompt), = _same_length_prompts(1, seed=521)
    params = prefill.prefill([(rid, prompt)])[rid]
    assert params["remote_request_id"] == publication_key(rid, prompt_digest(prompt))
    # As a prefill without the check named it; its lease advertised to end in 2 s, so
    # the decode's release of that key (published by no one here) retries no longer.
    old = dict(params, remote_request_id=rid, kvferry_expires_at=time.time() + 2.0)
    with _Log() as log:
        d.add("old-params", prompt, max_tokens=4, params=old)
        t = d.run_until(lambda: "old-params" in d.failed_recving, 10, "the refusal")
    assert t < TIMEOUT / 2, f"refused at once, not after misses until the timeout ({t:.1f} s)"
    assert _failed(d) == {"wrong_prompt": 1}, _failed(d)
    assert any("carries no prompt digest" in m and "upgrade prefill instances first" in m for m in log.records), log.records
    _check_computed_here(d, "old-params", prompt)
    d.run_until(lambda: "old-params" in d.final, 10, "the decode")
    d.run_until(lambda: not d.worker._releases, 5, "the release to finish")
    assert d.leaks() == [] and d.free_blocks() == d.free_at_start
    # The prefill's own params for the same prompt, on a decode whose prefix cache
    # does not hold it yet: bound to it, pulled as ever.
    d2 = decode(policy="recompute")
    d2.add(rid, prompt, max_tokens=4, params=params)
    d2.run_until(lambda: rid in d2.finished_recving, 10, "the pull")
    assert not d2.failed_recving
    check_landed(d2, rid, prompt)
    d2.run_until(lambda: rid in d2.final, 10, "the decode")
    prefill.wait_freed({rid}, timeout=RELEASE_BOUND)
    assert prefill.leaks() == [] and d2.leaks() == []


def test_swapped_params_tp1_to_tp2_every_decode_rank_refuses(made):
    """A planned pull (TP 1 → 2: each decode rank reads its heads from its own slot of
    the publication). A swapped pair is refused on both decode ranks (each reports the
    load error, kind ``wrong_prompt``), every slot of both publications is released,
    and the decode computes both prompts itself on every rank."""
    p = Instance("kv_producer", tp=1, tag="p")
    d = Instance("kv_consumer", tp=2, tag="d")
    made += [p, d]
    (r1, p1), (r2, p2) = _same_length_prompts(2, seed=531)
    params = prefill(p, [(r1, p1), (r2, p2)])
    assert params[r1]["kvferry_desc"]["slots"] > 1, "several reader slots to release"
    d.add(r1, p1, max_tokens=4, params=params[r2])
    d.add(r2, p2, max_tokens=4, params=params[r1])
    t = d.run_until(lambda: {r1, r2} <= d.failed_recving, 10, "the refusals")
    assert t < 5.0
    assert _failed(d) == {"wrong_prompt": 2 * d.tp}, _failed(d)
    assert all(set(rf) == {r1, r2} for rf in d.rank_failed), d.rank_failed
    assert wire(d) == 0
    for rid, prompt in ((r1, p1), (r2, p2)):
        _check_computed_here(d, rid, prompt)
    d.run_until(lambda: {r1, r2} <= set(d.final), 10, "the decodes")
    p.run_until(lambda: not (p.held() & {r1, r2}), RELEASE_BOUND * 2, "the prefill to free both publications")
    assert p.leaks() == [] and d.leaks() == []
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start


def test_the_digest_covers_the_whole_prompt_and_is_stable() -> None:
    """The digest is the same in every process (a fixed value, no ``hash()``) and
    changes with any token, the order, or the length (a prefix is another prompt)."""
    base = list(range(3, 203))
    assert prompt_digest(base) == prompt_digest(list(base))
    assert prompt_digest([1, 2, 3]) == "68db65702b4699a284346b392c45e56c"  # pinned: the same everywhere
    others = [base[:-1], base + [0], [base[1], base[0], *base[2:]], base[:100] + [base[100] + 1] + base[101:]]
    assert len({prompt_digest(base), *(prompt_digest(o) for o in others)}) == 1 + len(others)
    key = publication_key("cmpl-1@x", prompt_digest(base))
    assert key.startswith("cmpl-1@x@prompt-") and key.endswith(prompt_digest(base))
