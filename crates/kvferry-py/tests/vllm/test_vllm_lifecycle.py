"""vLLM 0.33's own connector lifecycle tests, ported to ``KvferryConnector``.

The originals (``tests/v1/kv_connector/unit/`` in vLLM's repository:
``test_remote_prefill_lifecycle.py``, ``test_remote_decode_lifecycle.py``,
``test_kv_load_failure_recovery.py``, and the NIXL connector's handling of requests
given 0 external tokens) drive a bare scheduler and hand it made-up ``finished_recving``
/ ``finished_sending`` sets. Here the same scheduler assertions are kept — request
states, blocks allocated but not cached while waiting, hashed blocks and ref counts
after the load, the scheduled token counts, and vLLM's ``assert_scheduler_empty``
(:func:`vllm_harness.scheduler_leaks`) on both instances at the end — while every
finished set comes from real kvferry transfers between a prefill instance in its own
process and a decode instance in this one (the harness of ``vllm_harness.py``).

Beyond the originals, each give-up case asserts the bound the connector promises: a
prefill instance's blocks are freed within about one round trip of the decode giving up
(far below ``lease_ttl``), never at lease expiry.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time

import pytest

from vllm_harness import BLOCK_SIZE, Instance, RemoteInstance, check_landed, scheduler_leaks

# The conftest fixtures ``prefill`` and ``decode`` read these.
LEASE_TTL = 20.0  # long: every release below must come far sooner
TIMEOUT = 10.0
DECODE_BLOCKS = 256
RELEASE_BOUND = 2.0  # seconds: "within a round trip", with slack for a loaded 2-core host


def _prompt(rid: str, n: int, seed: int, ones: bool = False) -> tuple[str, list[int]]:
    rng = random.Random(seed)
    return rid, [1] * n if ones else [rng.randrange(3, 1000) for _ in range(n)]


def _waiting(d: Instance) -> list:
    """Requests waiting: vLLM 0.33 keeps those that hold blocks while their KV arrives
    (WAITING_FOR_REMOTE_KVS) in ``kv_holding_waiting``, beside ``waiting``, where the
    originals' vLLM had one queue."""
    return list(d.scheduler.waiting) + list(d.scheduler.kv_holding_waiting)


def _req_blocks(d: Instance, rid: str):
    return d.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[rid]


def _finish_and_check_empty(d: Instance, prefill: RemoteInstance, rids: set[str]) -> None:
    d.run_until(lambda: rids <= set(d.final), 20, "the requests to finish")
    d.step()  # vLLM's tests end with one more schedule(): finished ids are cleared
    assert scheduler_leaks(d.scheduler) == []
    prefill.wait_freed(rids, timeout=RELEASE_BOUND)
    assert prefill.leaks() == []


# -- test_remote_prefill_lifecycle.py (the decode instance's side) ----------------------


def test_basic_lifecycle(prefill, decode):
    from vllm.v1.request import RequestStatus

    d = decode()
    full = 2
    rid, prompt = _prompt("basic", int(BLOCK_SIZE * (full + 0.5)), seed=11)
    params = prefill.prefill([(rid, prompt)])[rid]
    free0 = d.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
    d.add(rid, prompt, max_tokens=3, params=params)
    d.step()
    so = d.last_output
    # Nothing scheduled; the request waits for its KV with blocks allocated, uncached.
    assert len(d.scheduler.running) == 0 and len(so.scheduled_new_reqs) == 0
    assert so.total_num_scheduled_tokens == 0
    req = d.scheduler.requests[rid]
    assert req in _waiting(d) and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # vLLM 0.33 counts the tokens being loaded as computed while they arrive (the
    # originals' vLLM said 0); nothing was scheduled for them.
    assert req.num_computed_tokens == len(prompt)
    assert d.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks < free0
    assert all(b.block_hash is None for b in _req_blocks(d, rid))
    # The real pull lands; the step after reports it, the next schedules the rest.
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    assert not d.failed_recving
    d.run_until(lambda: rid in d.last_output.num_scheduled_tokens, 5, "the request to be scheduled")
    so = d.last_output
    assert len(d.scheduler.running) == 1
    blocks = _req_blocks(d, rid)
    assert all(b.ref_cnt == 1 for b in blocks)
    assert sum(b.block_hash is not None for b in blocks) == full
    new = so.scheduled_new_reqs[0]
    assert so.num_scheduled_tokens[rid] == len(new.prompt_token_ids) - new.num_computed_tokens
    check_landed(d, rid, prompt)
    _finish_and_check_empty(d, prefill, {rid})


def test_interleaved_lifecycle(prefill, decode):
    d = decode()
    n = int(BLOCK_SIZE * 2.5)
    remote = _prompt("interleaved-remote", n, seed=12)
    local_a, local_b = _prompt("interleaved-a", n, seed=13), _prompt("interleaved-b", n, seed=14)
    params = prefill.prefill([remote])[remote[0]]
    prefill.faults(send_delay_us=300_000)  # the KV arrives a few steps later
    try:
        d.add(*local_a, max_tokens=300, params=None)  # still running when the KV arrives
        d.step()
        assert len(d.scheduler.running) == 1
        d.add(*local_b, max_tokens=300, params=None)
        d.add(remote[0], remote[1], max_tokens=3, params=params)
        d.step()
        assert len(d.scheduler.running) == 2 and len(_waiting(d)) == 1
        assert len(d.last_output.scheduled_new_reqs) == 1
        assert d.last_output.scheduled_cached_reqs.num_reqs == 1
        d.step()  # KV not here yet: the two local requests keep running
        assert len(d.scheduler.running) == 2 and len(_waiting(d)) == 1
        assert len(d.last_output.scheduled_new_reqs) == 0
        d.run_until(lambda: remote[0] in d.finished_recving, 10, "the pull")
        d.run_until(lambda: len(d.scheduler.running) == 3, 5, "the remote request to run")
        assert len(_waiting(d)) == 0
    finally:
        prefill.faults(send_delay_us=0)
    check_landed(d, *remote)
    _finish_and_check_empty(d, prefill, {remote[0], local_a[0], local_b[0]})


def test_no_spurious_prefix_caching(prefill, decode):
    d = decode()
    n = int(BLOCK_SIZE * 2.5)
    remote = _prompt("spurious-remote", n, seed=0, ones=True)
    local = _prompt("spurious-local", n, seed=0, ones=True)
    params = prefill.prefill([remote])[remote[0]]
    prefill.faults(send_delay_us=1_000_000)  # the pull stays in flight over two steps, even on a loaded host
    try:
        d.add(remote[0], remote[1], max_tokens=2, params=params)
        d.step()
        assert len(_waiting(d)) == 1
        d.add(*local, max_tokens=2, params=None)
        d.step()
        assert len(d.scheduler.running) == 1 and len(_waiting(d)) == 1
        local_blocks, remote_blocks = _req_blocks(d, local[0]), _req_blocks(d, remote[0])
        assert all(b.ref_cnt == 1 for b in local_blocks)
        assert sum(b.block_hash is not None for b in local_blocks) > 0
        # The waiting request's blocks are allocated but not computed: never a cache hit.
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in remote_blocks)
        assert not set(b.block_id for b in local_blocks) & set(b.block_id for b in remote_blocks)
    finally:
        prefill.faults(send_delay_us=0)
    d.run_until(lambda: remote[0] in d.finished_recving, 10, "the pull")
    check_landed(d, *remote)
    _finish_and_check_empty(d, prefill, {remote[0], local[0]})


def test_full_block_prompt(prefill, decode):
    d = decode()
    full = 2
    rid, prompt = _prompt("full-block", BLOCK_SIZE * full, seed=15)
    params = prefill.prefill([(rid, prompt)])[rid]
    d.add(rid, prompt, max_tokens=2, params=params)
    d.step()
    assert len(_req_blocks(d, rid)) == full
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    d.run_until(lambda: rid in d.last_output.num_scheduled_tokens, 5, "the request to be scheduled")
    so = d.last_output
    # The prompt's last token is recomputed to sample the first new one: no new block.
    assert len(_req_blocks(d, rid)) == full
    assert so.scheduled_new_reqs[0].num_computed_tokens == len(prompt) - 1
    assert so.num_scheduled_tokens[rid] == 1
    check_landed(d, rid, prompt)
    _finish_and_check_empty(d, prefill, {rid})


# -- test_remote_decode_lifecycle.py (the prefill instance's side) ----------------------


def test_remote_decode_basic_lifecycle(prefill, decode):
    """The prefill request finishes after one token, length-capped; its blocks stay
    held (ref_cnt 1) until the real pull's ``Done`` makes it finished_sending, then
    the prefill scheduler is empty."""
    d = decode()
    rid, prompt = _prompt("decode-basic", int(BLOCK_SIZE * 2.5), seed=16)
    params = prefill.prefill([(rid, prompt)])[rid]
    assert prefill.finished[rid][0] == "length"
    assert params["remote_block_ids"] and len(params["remote_block_ids"]) == 3
    refs = prefill.block_refs()
    assert refs.get(rid) and all(r == 1 for r in refs[rid]), refs
    d.add(rid, prompt, max_tokens=1, params=params)
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    st = prefill.wait_freed({rid}, timeout=RELEASE_BOUND)
    assert rid in st["finished_sending"]
    _finish_and_check_empty(d, prefill, {rid})


def test_short_prompt_lifecycle(prefill, decode):
    d = decode()
    rid, prompt = _prompt("decode-short", BLOCK_SIZE // 2, seed=17)
    params = prefill.prefill([(rid, prompt)])[rid]
    assert len(params["remote_block_ids"]) == 1  # a partial block moves too
    d.add(rid, prompt, max_tokens=1, params=params)
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    check_landed(d, rid, prompt)
    _finish_and_check_empty(d, prefill, {rid})


def test_prefix_cache_lifecycle(prefill, decode):
    """A prefill with a local prefix hit still sends every block of the prompt."""
    d = decode()
    rng = random.Random(18)
    shared = [rng.randrange(3, 1000) for _ in range(int(BLOCK_SIZE * 3.5))]
    first = ("decode-prefix-1", shared)
    second = ("decode-prefix-2", shared[: int(BLOCK_SIZE * 2.5)])
    p1 = prefill.prefill([first])[first[0]]
    d.add(first[0], first[1], max_tokens=1, params=p1)
    d.run_until(lambda: first[0] in d.finished_recving, 10, "the first pull")
    p2 = prefill.prefill([second])[second[0]]
    assert len(p2["remote_block_ids"]) == 3
    d.add(second[0], second[1], max_tokens=1, params=p2)
    d.run_until(lambda: second[0] in d.final, 10, "the second request")
    _finish_and_check_empty(d, prefill, {first[0], second[0]})


# -- load failures and give-ups: the prefill's blocks are freed within a round trip ----


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_decode_gives_up_before_a_slow_prefill_publishes(prefill, decode, policy):
    """The decode's pull times out because the prefill had not published yet (a slow
    prefill step, here a 3 s pause). When the prefill does publish, the decode's
    release (retried on a miss until the lease's end) frees the blocks at once."""
    d = decode(extra={"timeout": 1.0}, policy=policy)
    rid, prompt = _prompt(f"slow-prefill-{policy}", int(BLOCK_SIZE * 2.5), seed=19)
    prefill.hold_after_finish(3.0)
    params = prefill.prefill([(rid, prompt)])[rid]
    d.add(rid, prompt, max_tokens=2, params=params)
    d.run_until(lambda: rid in d.finished_recving, 5, "the pull to give up")
    assert d.failed_recving == {rid} and d.invalid_blocks
    assert rid in prefill.state()["held"], "the prefill has not published yet"
    failed = d.kv_stats.data["failed"]
    assert failed["miss"] + failed["timeout"] == 1 and sum(failed.values()) == 1, failed
    # One Release of the slots the plan does not read (reader_slots "auto" publishes
    # several; sent as the pull starts), one when the decode gives up.
    assert d.kv_stats.data["releases"] == 2
    t0 = time.monotonic()
    st = prefill.wait_freed({rid}, timeout=3.0 + RELEASE_BOUND)
    assert time.monotonic() - t0 < LEASE_TTL / 4, "freed by the release, not the lease"
    assert rid in st["finished_sending"]
    d.run_until(lambda: rid in d.final, 10, "the request to finish")
    if policy == "fail":
        assert str(d.final[rid].finish_reason) == "error"
    else:
        assert len(d.tokens[rid]) == 2  # recomputed locally
    d.run_until(lambda: not d.worker._releases, 5, "the release to finish")
    d.step()
    assert scheduler_leaks(d.scheduler) == []
    assert prefill.leaks() == []


def test_prompt_logprobs_zero_external_tokens_releases_the_prefill(prefill, decode):
    """vLLM gives a request with ``prompt_logprobs`` 0 external tokens
    (0.33: ``skip_reading_prefix_cache``; 0.34: ``skip_reading_external_kv``): nothing is pulled, the prompt is computed here,
    and the prefill is told at once (as vLLM's NIXL connector does)."""
    d = decode()
    rid, prompt = _prompt("logprobs", int(BLOCK_SIZE * 2.5), seed=20)
    params = prefill.prefill([(rid, prompt)])[rid]
    t0 = time.monotonic()
    d.add(rid, prompt, max_tokens=2, params=params, prompt_logprobs=1)
    req = d.scheduler.requests[rid]
    import vllm

    if vllm.__version__ == "0.33.0":
        assert req.skip_reading_prefix_cache
    else:  # vLLM 0.34 replaced the flag with a bound: skip_reading_external_kv
        assert req.skip_reading_external_kv
    d.step()
    d.step()  # the release travels in the next step's metadata
    st = prefill.wait_freed({rid}, timeout=RELEASE_BOUND)
    assert time.monotonic() - t0 < RELEASE_BOUND + 1
    assert rid in st["finished_sending"]
    assert rid not in d.finished_recving and not d.failed_recving, "nothing was pulled"
    _finish_and_check_empty(d, prefill, {rid})


def test_nixl_style_params_pull_from_remote_host_and_port(prefill, decode):
    """A proxy written for NIXL forwards only ``remote_host``/``remote_port``/
    ``remote_block_ids``/``remote_engine_id``/``remote_request_id``: with a one-rank
    prefill, the connector pulls from that address instead of computing silently."""
    d = decode()
    rid, prompt = _prompt("nixl-style", int(BLOCK_SIZE * 2.5), seed=21)
    params = prefill.prefill([(rid, prompt)])[rid]
    nixl = {k: v for k, v in params.items() if not k.startswith("kvferry_")}
    d.add(rid, prompt, max_tokens=2, params=nixl)
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    assert not d.failed_recving
    check_landed(d, rid, prompt)
    _finish_and_check_empty(d, prefill, {rid})


def test_unusable_params_are_computed_locally_with_a_warning(prefill, decode, caplog):
    d = decode()
    rid, prompt = _prompt("unusable", int(BLOCK_SIZE * 2.5), seed=22)
    params = prefill.prefill([(rid, prompt)])[rid]
    nixl = {k: v for k, v in params.items() if not k.startswith("kvferry_")}
    nixl["tp_size"] = 2  # two prefill ranks, addresses unknown
    with caplog.at_level(logging.WARNING, logger="kvferry.integrations.vllm"):
        d.add(rid, prompt, max_tokens=2, params=nixl)
        d.run_until(lambda: rid in d.final, 10, "the request, computed locally")
    warned = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert len(warned) == 1 and "computing" in warned[0] and "tp_size 2" in warned[0], warned
    assert len(d.tokens[rid]) == 2 and rid not in d.finished_recving
    d.step()
    assert scheduler_leaks(d.scheduler) == []
    # The prefill could not be told (its lease is the documented backstop); release it
    # by hand so the module's prefill instance is empty for the tests after this one.
    assert rid in prefill.state()["held"]
    # Every reader slot it published (reader_slots "auto": more than one key), under
    # the key bound to the prompt.
    key = params["remote_request_id"]
    keys = [key] + [f"{key}#s{i}" for i in range(1, int(params["kvferry_desc"]["slots"]))]
    d.worker.engine.release_remote(prefill.address, keys, timeout=5.0).wait(5.0)
    prefill.wait_freed({rid}, timeout=RELEASE_BOUND)


# -- every kind of give-up: how long the prefill's blocks stay pinned ------------------


def _pinned(prefill: RemoteInstance, rid: str, since: float, kind: str, kv_device: str, extra: float = 0.0) -> float:
    """Waits until the prefill freed ``rid``; returns how long after ``since`` (the
    decode's give-up, monotonic: one clock for both processes) the prefill reported it
    ``finished_sending``. Printed, and added to ``$KVFERRY_BOUNDS_JSON`` when set."""
    st = prefill.wait_freed({rid}, timeout=RELEASE_BOUND + extra)
    pinned = st["finished_sending"][rid] - since
    print(f"\npinned after give-up ({kind}, {kv_device}): {pinned * 1e3:.0f} ms")
    path = os.environ.get("KVFERRY_BOUNDS_JSON")
    if path:
        old = json.load(open(path)) if os.path.exists(path) else {}
        old.setdefault("pinned_ms", {})[f"{kind}/{kv_device}"] = round(pinned * 1e3, 1)
        with open(path, "w") as f:
            json.dump(old, f, indent=1)
    return pinned


GIVE_UPS = ["timeout", "failed", "abort_waiting", "abort_mid_pull", "zero_tokens"]


@pytest.mark.parametrize("kind", GIVE_UPS)
def test_each_give_up_frees_the_prefill_within_a_round_trip(prefill, decode, kv_device, kind):
    """For each way a decode gives up on a pull, the prefill's blocks are pinned for at
    most about a round trip after it (asserted: ``RELEASE_BOUND``, a tenth of the
    lease), measured from the give-up to the prefill's ``finished_sending``. (The miss
    after a slow prefill is above; staging pressure, ``Busy``, in
    test_connector_drain.py.)"""
    d = decode(extra={"timeout": 1.0 if kind == "timeout" else TIMEOUT})
    rid, prompt = _prompt(f"give-up-{kind}", int(BLOCK_SIZE * 2.5), seed=40 + GIVE_UPS.index(kind))
    params = prefill.prefill([(rid, prompt)])[rid]
    slack = 0.0
    try:
        if kind == "timeout":  # the prefill sends too slowly for the decode's 1 s
            prefill.faults(send_delay_us=1_500_000)
            slack = 1.5  # the send in progress holds the blocks until it stops
        elif kind == "failed":  # a corrupted chunk: ChecksumError, a load error
            prefill.corrupt(1)
        elif kind == "abort_mid_pull":
            prefill.faults(send_delay_us=300_000)
        d.add(rid, prompt, max_tokens=2, params=params, **({"prompt_logprobs": 1} if kind == "zero_tokens" else {}))
        if kind in ("timeout", "failed"):
            d.run_until(lambda: rid in d.finished_recving, 10, "the pull to fail")
            assert d.failed_recving == {rid}
            since = d.finished_recving[rid]
        elif kind == "abort_waiting":
            since = time.monotonic()
            d.abort(rid)
            d.step()
        elif kind == "abort_mid_pull":
            d.step()
            time.sleep(0.1)
            since = time.monotonic()
            d.abort(rid)
            d.run_until(lambda: rid in d.finished_recving, 5, "the aborted pull to drain")
        else:  # zero external tokens
            since = time.monotonic()
            d.step()
            d.step()
        pinned = _pinned(prefill, rid, since, kind, kv_device, extra=slack)
        assert pinned < RELEASE_BOUND + slack < LEASE_TTL / 4, pinned
    finally:
        prefill.faults(send_delay_us=0)
    if kind not in ("abort_waiting", "abort_mid_pull"):
        d.run_until(lambda: rid in d.final, 10, "the request, computed locally")
    if kind != "failed":
        d.run_until(lambda: not d.worker._releases, 5, "the release to finish")
    # (failed: the transfer's own Done freed the prefill before the connector's release
    # went out, so that release misses, and retries — it cannot tell "already released"
    # from "not published yet" — until the lease's advertised end, in the background.)
    d.step()
    assert scheduler_leaks(d.scheduler) == []
    assert prefill.leaks() == []
