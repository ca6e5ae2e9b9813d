"""KvferryConnector with tensor parallelism (TP=2) under vLLM 0.33.0's real scheduler.

Each instance is one real ``Scheduler`` (``tensor_parallel_size=2``) and two
worker-side connectors — ranks 0 and 1, each with its own KV shard (one KV head of
two), its own kvferry engine and address — driven by the scheduler's metadata the way
vLLM's executor drives its workers; their outputs are combined by vLLM's own
``KVOutputAggregator`` (a request is finished only once every rank reports it). The
harness is ``vllm_harness.Instance``: each rank's "forward" writes bytes of its own
global head, so a rank that pulled from the wrong prefill rank cannot pass. Both
instances run in the test process (separate engines, real loopback sockets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from vllm_harness import MODEL_DIR, Instance, prefill, prompts

TP = 2


@pytest.fixture
def pair(need_vllm: None) -> Iterator[tuple[Instance, Instance]]:
    made: list[Instance] = []
    kw = {"tp": TP, "model": MODEL_DIR, "kv_heads": 2, "num_blocks": 256}
    p = Instance("kv_producer", extra={"lease_ttl": 30.0, "timeout": 10.0}, tag="tp-p", **kw)  # type: ignore[arg-type]
    made.append(p)
    d = Instance("kv_consumer", extra={"timeout": 10.0}, tag="tp-d", **kw)  # type: ignore[arg-type]
    made.append(d)
    yield p, d
    for i in made:
        i.close()


def test_tp2_each_rank_pulls_its_own_shard(pair):
    p, d = pair
    reqs = prompts(6, seed=21, lo=20, hi=90)
    params = prefill(p, reqs)
    for rid, _ in reqs:
        peers = params[rid]["kvferry_peers"]
        assert params[rid]["tp_size"] == TP and len(peers) == TP
        assert peers[0]["address"] != peers[1]["address"], "one engine per rank"
        assert [x["address"] for x in peers] == [w.engine.address for w in p.workers()]
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 15, "the pulls on both ranks")
    assert not d.failed_recving
    for rid, prompt in reqs:
        for pos in range(len(prompt)):
            for rank in range(TP):
                assert d.landed[rid][rank][pos] == d.expected(prompt, rank, pos), (rid, pos, rank)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    # Every rank's Done arrived: each prefill rank reports finished sending, and only
    # then (the aggregator waits for both) the scheduler frees the blocks.
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "prefill to free the blocks")
    assert {r for r, _ in reqs} <= p.finished_sending.keys()
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    assert p.leaks() == [] and d.leaks() == []
    for w in p.workers() + d.workers():
        assert w.engine.stats()["consumer"]["draining"] == 0


def test_tp2_abort_releases_every_rank(pair):
    p, d = pair
    reqs = prompts(2, seed=22, lo=40, hi=60)
    params = prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    for rid, _ in reqs:
        d.abort(rid)  # before any pull: each decode rank releases on its prefill rank
    t0 = time.monotonic()
    d.step()  # the next step's metadata carries the releases to both decode ranks
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "prefill to free the aborted requests")
    assert time.monotonic() - t0 < 5.0  # far below the 30 s lease
    d.run_until(lambda: not any(w._releases for w in d.workers()), 5, "the releases")
    assert not d.finished_recving and p.free_blocks() == p.free_at_start


def test_tp2_connector_metrics_through_vllms_stats_classes(pair):
    """Both ranks' connector stats, combined by vLLM's ``KVOutputAggregator`` every
    step, logged by ``KVConnectorLogging`` and recorded by ``KVConnectorProm`` (both
    resolve the connector class from the config, as vLLM's front end does)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    p, d = pair
    d.stats.clear()
    p.stats.clear()
    reqs = prompts(4, seed=23, lo=40, hi=80)
    params = prefill(p, reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 15, "the pulls")
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "prefill to free the blocks")
    # What moved: every request's blocks, once per rank, each rank's shard of a block.
    nblocks = sum(len(params[r]["remote_block_ids"]) for r, _ in reqs)
    block_bytes = d.ranks[0].connector_worker.region.block_bytes
    got = d.ranks[0].build_kv_connector_stats()
    for data in d.stats:
        got = got.aggregate(type(got)(data=data))
    assert len(got.data["pull_seconds"]) == TP * len(reqs)
    assert sum(got.data["pull_blocks"]) == TP * nblocks
    assert sum(got.data["pull_bytes"]) == TP * nblocks * block_bytes
    assert not any(got.data["failed"].values())
    sent = d.ranks[0].build_kv_connector_stats()
    for data in p.stats:
        sent = sent.aggregate(type(sent)(data=data))
    assert sent.data["published_released"]["done"] == TP * len(reqs)

    logging_ = KVConnectorLogging(d.vllm_config.kv_transfer_config)
    for data in d.stats:
        logging_.observe(data)
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1 and f"pulls={TP * len(reqs)}" in lines[0] and f"blocks={TP * nblocks}" in lines[0], lines

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    prom = Prom(d.vllm_config, labelnames=["model_name", "engine"], per_engine_labelvalues={0: ["tiny", "0"]})
    for data in d.stats:
        prom.observe(data, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvferry_bytes_total", labels) == TP * nblocks * block_bytes
    assert registry.get_sample_value("vllm:kvferry_blocks_total", labels) == TP * nblocks
    assert registry.get_sample_value("vllm:kvferry_pull_seconds_count", labels) == TP * len(reqs)
    assert registry.get_sample_value("vllm:kvferry_failed_pulls_total", {**labels, "kind": "miss"}) == 0
