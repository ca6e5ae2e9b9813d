"""vLLM 0.33's connector hooks beyond the transfer itself (issue 45), on the real
``Scheduler`` with real kvferry transfers (the harness of ``vllm_harness.py``: a
prefill and a decode instance, each a real scheduler plus the worker half called the
way vLLM's model runner calls it — ``handle_preemptions`` before the forward
included):

- preemption: vLLM names a request preempted (``SchedulerOutput.preempted_req_ids`` →
  the connector's metadata → ``handle_preemptions``) while its pull is writing, or
  its publication being read: when the hook returns nothing of kvferry's touches
  the blocks (a sentinel written then, as vLLM's next forward would, survives), the
  decode lands no byte of it, and both instances end empty; and a real preemption
  by vLLM's scheduler (memory pressure) reaches the worker and costs no byte;
- a request rejected before admission (``AsyncLLM.notify_kv_transfer_request_rejected``:
  added pre-aborted) frees the prefill's blocks within a round trip, kvferry's params
  and NIXL-style ones;
- hit source and KV events, read through vLLM's own ``PrefixCacheStats`` and
  ``KVEventBatch``/``BlockStored`` (a publisher registered with vLLM's
  ``EventPublisherFactory``);
- sleep mode: ``unregister_kv_caches`` with a pull in flight (decode) and a
  publication being read (prefill) drains, withdraws and deregisters; after
  ``restore_kv_caches`` both instances transfer again, every byte compared.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from vllm_harness import BLOCK_SIZE, Instance, check_landed, one_rank, scheduler_leaks

LEASE_TTL = 20.0  # long: every release below must come far sooner
TIMEOUT = 10.0
RELEASE_BOUND = 2.0  # "within a round trip", with slack for a loaded 2-core host
SENTINEL = 0xEE
DELAY_US = 400_000  # the prefill's sends, slowed: a transfer is caught in flight


@pytest.fixture(params=["host", "sim"])
def pair(request, made):
    """Makes prefill and decode instances (in this process), KV in host memory or on
    kvferry's sim device."""
    dev = {"device": "sim"} if request.param == "sim" else {}

    def make(role: str, **kw: Any) -> Instance:
        extra = {"timeout": TIMEOUT, "lease_ttl": LEASE_TTL, **dev, **kw.pop("extra", {})}
        inst = one_rank(role, extra, **kw)
        made.append(inst)
        return inst

    return make


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _prefill(p: Instance, rid: str, prompt: list[int]) -> dict[str, Any]:
    p.add(rid, prompt, 1, {"do_remote_decode": True})
    p.run_until(lambda: rid in p.final, 30, "the prefill")
    p.step()  # the step after: the worker publishes
    assert rid in p.worker._sending
    return dict(p.final[rid].kv_transfer_params)


def _blocks(inst: Instance, rid: str) -> list[int]:
    (ids,) = inst.scheduler.kv_cache_manager.get_block_ids(rid)
    return list(ids)


def _fill(inst: Instance, blocks: list[int]) -> None:
    """Writes the sentinel into these blocks of every layer, as vLLM's next use would."""
    import torch

    for t in inst.kv[0].values():
        for b in blocks:
            t[b].view(torch.uint8).fill_(SENTINEL)


def _intact(inst: Instance, blocks: list[int]) -> bool:
    import torch

    return all(bool((t[b].view(torch.uint8) == SENTINEL).all()) for t in inst.kv[0].values() for b in blocks)


def _delay(inst: Instance, us: int) -> None:
    inst.worker.engine._e._inject_faults(send_delay_us=us)


def _sent(inst: Instance) -> int:
    """Bytes the instance's engine has sent (its producer's counter)."""
    return int(inst.worker.engine.stats()["producer"]["bytes_sent"])


def _preempt(inst: Instance, rids: set[str]) -> float:
    """What the worker receives when vLLM preempts ``rids``: the scheduler half's
    metadata carries ``SchedulerOutput.preempted_req_ids`` (checked on a real
    preemption below); vLLM 0.33's scheduler itself never preempts a request that
    waits for remote KV or has finished, the only ones kvferry transfers. Returns how
    long the hook took."""
    from kvferry.integrations.vllm.metadata import KvferryConnectorMetadata

    t0 = time.monotonic()
    inst.connector.handle_preemptions(KvferryConnectorMetadata(preempted=set(rids)))
    return time.monotonic() - t0


def _end_empty(p: Instance, d: Instance, rids: set[str]) -> None:
    d.run_until(lambda: rids <= set(d.final), 30, "the decode requests to finish")
    d.step()
    p.run_until(lambda: rids <= set(p.finished_sending), RELEASE_BOUND, "the prefill to free the blocks")
    p.step()
    assert scheduler_leaks(d.scheduler) == []
    assert scheduler_leaks(p.scheduler) == []
    d.run_until(lambda: not d.worker._releases, 5, "the releases to finish")
    assert d.worker.ledger.holds() == {"pulls": 0, "publications": 0, "slots": 0, "releases_queued": 0}
    assert p.worker.ledger.holds() == {"pulls": 0, "publications": 0, "slots": 0, "releases_queued": 0}


# -- preemption ---------------------------------------------------------------------------


def test_preempted_mid_pull_drains_before_the_hook_returns(pair):
    p, d = pair("kv_producer"), pair("kv_consumer")
    rid, prompt = "pre-pull", _prompt(int(BLOCK_SIZE * 2.5), 1)
    params = _prefill(p, rid, prompt)
    _delay(p, DELAY_US)
    d.add(rid, prompt, max_tokens=2, params=params)
    d.step()  # the pull starts
    rec = d.worker.ledger.pulls[rid]
    assert rec.transfer is not None and not rec.transfer.done(), "the pull must be in flight"
    blocks = _blocks(d, rid)
    took = _preempt(d, {rid})
    assert rec.transfer.drained(), "handle_preemptions returned while the pull could still write"
    assert took < TIMEOUT
    _fill(d, blocks)  # vLLM reuses the blocks
    _delay(p, 0)
    time.sleep(1.0)  # a pull still alive would land its bytes by now
    assert _intact(d, blocks), "a preempted request's blocks were written after handle_preemptions"
    # The prefill is told at once (its slot released) and frees within a round trip.
    t0 = time.monotonic()
    p.run_until(lambda: rid in p.finished_sending, RELEASE_BOUND, "the prefill to free the blocks")
    assert time.monotonic() - t0 < RELEASE_BOUND
    # vLLM hears a failed load and recomputes (kv_load_failure_policy "recompute").
    d.run_until(lambda: rid in d.finished_recving, 5, "the preempted pull to be reported")
    assert rid in d.failed_recving
    _end_empty(p, d, {rid})


def test_preempted_mid_publication_stops_its_sends_before_the_hook_returns(pair):
    p, d = pair("kv_producer"), pair("kv_consumer")
    rid, prompt = "pre-pub", _prompt(int(BLOCK_SIZE * 2.5), 2)
    params = _prefill(p, rid, prompt)
    blocks = _blocks(p, rid)
    _delay(p, DELAY_US)
    d.add(rid, prompt, max_tokens=2, params=params)
    d.step()  # the pull starts; the prefill's send waits out its delay
    time.sleep(0.05)
    assert not d.worker.ledger.pulls[rid].transfer.done(), "the read must be in flight"
    took = _preempt(p, {rid})
    sent = _sent(p)
    assert rid not in p.worker._sending and took < TIMEOUT
    _fill(p, blocks)  # vLLM reuses the blocks: no peer may read them now
    _delay(p, 0)
    time.sleep(1.0)  # a send still alive would go out by now
    assert _sent(p) == sent, "the prefill sent from a preempted request's blocks after handle_preemptions"
    d.run_until(lambda: rid in d.finished_recving, TIMEOUT + 2, "the decode's pull to end")
    # Either the read was cut (a load error: recomputed) or it finished before the
    # hook returned — then with the prefill's bytes, never the sentinel.
    if rid not in d.failed_recving:
        check_landed(d, rid, prompt)
    print(f"\npreempted mid-publication: hook {took * 1e3:.0f} ms, read {'cut' if rid in d.failed_recving else 'landed first'}")
    d.run_until(lambda: rid in d.final, 30, "the request")
    _end_empty(p, d, {rid})


def test_a_real_preemption_reaches_the_worker_and_costs_no_byte(pair):
    """vLLM's scheduler preempts a running decode request under memory pressure: the
    step's metadata names it (``preempted``), the hook leaves the other requests'
    pulls alone, the preempted request is recomputed (its params were spent: no
    second pull), and every pulled byte is the prefill's."""
    p, d = pair("kv_producer"), pair("kv_consumer", num_blocks=66)  # 65 hold one 1,024-token request
    reqs = {f"pre-real-{i}": _prompt(40, 10 + i) for i in range(2)}
    params = {r: _prefill(p, r, pr) for r, pr in reqs.items()}
    seen: list[set[str]] = []
    hook = d.connector.handle_preemptions

    def watch(meta: Any) -> None:
        seen.append(set(meta.preempted))
        hook(meta)

    d.connector.handle_preemptions = watch  # type: ignore[method-assign]
    for r, pr in reqs.items():
        d.add(r, pr, max_tokens=520, params=params[r])  # 35 blocks each: both cannot fit
    preempted: set[str] = set()
    t0 = time.monotonic()
    while not set(reqs) <= set(d.final):
        assert time.monotonic() - t0 < 120, "the requests did not finish"
        d.step()
        so = d.last_output
        if so.preempted_req_ids:
            preempted |= so.preempted_req_ids
            assert seen[-1] == so.preempted_req_ids, (seen[-1], so.preempted_req_ids)
    assert preempted, "no preemption happened: the test needs a smaller cache"
    for r, pr in reqs.items():
        check_landed(d, r, pr)
    assert not d.failed_recving
    _end_empty(p, d, set(reqs))


# -- rejected before admission -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["kvferry", "nixl-style"])
def test_a_request_rejected_before_admission_frees_the_prefill(pair, kind):
    """``AsyncLLM.notify_kv_transfer_request_rejected`` sends the decode engine a
    pre-aborted request carrying the prefill's params (``abort_immediately``);
    ``EngineCore.add_request`` adds it, then aborts it: the connector's
    ``request_finished`` must release the prefill's blocks."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request, RequestStatus

    p, d = pair("kv_producer"), pair("kv_consumer")
    rid = f"rejected-{kind}"
    params = _prefill(p, rid, _prompt(int(BLOCK_SIZE * 2.5), 3))
    if kind == "nixl-style":
        params = {k: v for k, v in params.items() if not k.startswith("kvferry_")}
    # As AsyncLLM.notify_kv_transfer_request_rejected builds it.
    ecr = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[0],
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)}, watermarking=False),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        abort_immediately=True,
    )
    req = Request.from_engine_core_request(ecr, block_hasher=d.hasher)
    t0 = time.monotonic()
    d.scheduler.add_request(req)  # EngineCore.add_request, then its abort_immediately branch
    assert req.abort_immediately
    d.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    d.step()  # the engine steps once for the finished id: the release goes out
    p.run_until(lambda: rid in p.finished_sending, RELEASE_BOUND, "the prefill to free the rejected request's blocks")
    assert time.monotonic() - t0 < RELEASE_BOUND
    assert rid not in d.finished_recving
    p.step()
    d.step()
    assert scheduler_leaks(p.scheduler) == [] and scheduler_leaks(d.scheduler) == []


# -- hit source and KV events ------------------------------------------------------------


_BATCHES: list[Any] = []


def _collector() -> Any:
    """A KV event publisher (vLLM's ``EventPublisher`` interface) keeping every
    ``KVEventBatch`` the scheduler publishes; it stands in for the ``zmq`` one."""
    from vllm.distributed.kv_events import EventPublisher

    class Collect(EventPublisher):
        def __init__(self) -> None:
            pass

        def publish(self, events: Any) -> None:
            _BATCHES.append(events)

        def shutdown(self) -> None:
            pass

    return Collect()


def test_remote_hits_are_p2p_and_pulled_blocks_announced_by_vllm_events(pair):
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import PrefixCacheStats

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    p, d = pair("kv_producer"), pair("kv_consumer", log_stats=True, kv_events=events)
    d.scheduler.kv_event_publisher = _collector()  # where vLLM's zmq publisher would be
    rid, prompt = "hits", _prompt(BLOCK_SIZE * 3 + 5, 4)
    params = _prefill(p, rid, prompt)
    _BATCHES.clear()
    d.add(rid, prompt, max_tokens=2, params=params)
    d.step()
    # Nothing announced while the blocks are being written: they enter vLLM's prefix
    # cache (and its events) only once the pull landed.
    assert not [e for b in _BATCHES for e in b.events if isinstance(e, BlockStored)]
    assert list(d.scheduler.get_kv_connector().take_events()) == []
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    d.run_until(lambda: rid in d.last_output.num_scheduled_tokens, 5, "the request to run")
    # vLLM's SchedulerStats, as its stat loggers receive them with each step's outputs.
    per_step = [s.connector_prefix_cache_stats for s in d.scheduler_stats if s.connector_prefix_cache_stats is not None]
    assert per_step and all(isinstance(s, PrefixCacheStats) for s in per_step)
    hits = sum(s.hits for s in per_step)
    by_source: dict[Any, int] = {}
    for s in per_step:
        for src, n in s.hits_by_source.items():
            by_source[src] = by_source.get(src, 0) + n
    assert hits == len(prompt) and by_source == {CacheHitSource.P2P: len(prompt)}, per_step
    stored = [e for b in _BATCHES for e in b.events if isinstance(e, BlockStored)]
    full = len(prompt) // BLOCK_SIZE
    hashes = [bytes(h) if isinstance(h, bytes) else h for e in stored for h in e.block_hashes]
    assert len(hashes) >= full, stored
    check_landed(d, rid, prompt)
    _end_empty(p, d, {rid})


# -- sleep mode ----------------------------------------------------------------------------


def test_sleep_then_wake_with_transfers_in_flight_on_both_sides(pair):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    p, d = pair("kv_producer"), pair("kv_consumer")
    assert KVConnectorFactory.get_connector_class(d.vllm_config.kv_transfer_config).supports_sleep_mode(
        d.vllm_config.kv_transfer_config
    )
    # The decode goes to sleep mid-pull.
    r1, pr1 = "sleep-d", _prompt(int(BLOCK_SIZE * 2.5), 5)
    params = _prefill(p, r1, pr1)
    _delay(p, DELAY_US)
    d.add(r1, pr1, max_tokens=2, params=params)
    d.step()
    rec = d.worker.ledger.pulls[r1]
    assert not rec.transfer.done(), "the pull must be in flight"
    blocks = _blocks(d, r1)
    d.connector.unregister_kv_caches()
    d.connector.unregister_kv_caches()  # idempotent
    assert rec.transfer.drained() and d.worker.region is None
    _fill(d, blocks)  # the sleep backend drops the memory's contents
    _delay(p, 0)
    time.sleep(1.0)
    assert _intact(d, blocks), "the KV cache was written while asleep"
    p.run_until(lambda: r1 in p.finished_sending, RELEASE_BOUND, "the prefill to free the slept decode's request")
    d.connector.restore_kv_caches()
    d.connector.restore_kv_caches()  # idempotent
    assert d.worker.region is not None
    d.run_until(lambda: r1 in d.final, 30, "the slept request, recomputed")
    assert r1 in d.failed_recving

    # The prefill goes to sleep mid-publication (a decode reading it).
    r2, pr2 = "sleep-p", _prompt(int(BLOCK_SIZE * 2.5), 6)
    params = _prefill(p, r2, pr2)
    pblocks = _blocks(p, r2)
    _delay(p, DELAY_US)
    d.add(r2, pr2, max_tokens=2, params=params)
    d.step()
    time.sleep(0.05)
    assert not d.worker.ledger.pulls[r2].transfer.done(), "the read must be in flight"
    p.connector.unregister_kv_caches()
    sent = _sent(p)
    assert p.worker.region is None and not p.worker._sending
    _fill(p, pblocks)
    _delay(p, 0)
    time.sleep(1.0)
    assert _sent(p) == sent, "the prefill sent from its KV cache while asleep"
    d.run_until(lambda: r2 in d.finished_recving, TIMEOUT + 2, "the decode's read of a slept prefill to end")
    if r2 not in d.failed_recving:  # it finished before the sleep: the prefill's bytes
        check_landed(d, r2, pr2)
    p.connector.restore_kv_caches()
    p.run_until(lambda: r2 in p.finished_sending, RELEASE_BOUND, "the woken prefill to report the blocks")

    # Both awake: a transfer as before, every byte compared.
    r3, pr3 = "after-wake", _prompt(int(BLOCK_SIZE * 3.5), 7)
    d.add(r3, pr3, max_tokens=2, params=_prefill(p, r3, pr3))
    d.run_until(lambda: r3 in d.finished_recving, 10, "the pull after wake-up")
    assert r3 not in d.failed_recving
    check_landed(d, r3, pr3)
    _end_empty(p, d, {r1, r2, r3})


def test_hooks_answer_as_documented(need_vllm):
    """The hooks kvferry answers with a value (docs/vllm.md's table says why)."""
    from kvferry.integrations.vllm import KvferryConnector

    assert KvferryConnector.requires_piecewise_for_cudagraph({}) is False
    d = one_rank("kv_consumer", {"timeout": TIMEOUT}, num_blocks=66)
    try:
        sc = d.scheduler.get_kv_connector()
        assert sc.has_pending_block_frees() is False
        assert list(sc.take_events()) == []
        assert d.connector.build_connector_worker_meta() is None
        assert d.connector.get_kv_connector_kv_cache_events() is None
        assert sc.requires_kv_delivery is False and d.connector.requires_kv_delivery is False  # a consumer
        d.connector.set_host_xfer_buffer_ops(lambda *a: None)  # accepted, unused
    finally:
        d.close()
