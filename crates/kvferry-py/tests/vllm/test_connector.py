"""KvferryConnector against vLLM 0.33.0's real scheduler, on CPU.

Each instance is a real ``vllm.v1.core.sched.scheduler.Scheduler`` driving a worker-side
connector (created by vLLM's ``KVConnectorFactory`` from the module path, called through
vLLM's own model-runner connector lifecycle) over torch CPU KV tensors. The "forward"
writes known bytes for every computed token; the model is a tiny config.json only (no
weights: nothing runs a model). The prefill instance runs in a spawned process (its own
vLLM engine loop, killable); the decode instance runs in the test process.

Needs vLLM: ``scripts/install-vllm.sh`` (or ``pip install vllm==0.33.0``), then
``$KVFERRY_VLLM_VENV/bin/python -m pytest crates/kvferry-py/tests/vllm``. Without vLLM
the module is skipped, unless ``KVFERRY_REQUIRE_VLLM=1`` (then it fails).
"""

from __future__ import annotations

import random
import time

import pytest

from kvferry.integrations.vllm.prompt import prompt_digest, publication_key
from vllm_harness import check_landed, one_rank, prefill_process, prompts

LEASE_TTL = 8.0  # the conftest ``prefill``'s lease: short, as the expiry tests need
TIMEOUT = 10.0


# -- tests ------------------------------------------------------------------------------


def test_lifecycle_prefill_to_decode(prefill, decode, kv_device):
    d = decode()  # made first: building a vLLM config takes seconds on a busy machine
    (rid, prompt), = prompts(1, seed=1, lo=50, hi=51)
    params = prefill.prefill([(rid, prompt)])[rid]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    # The key is bound to the prompt (prompt.py): the request id and the prompt's digest.
    assert params["remote_request_id"] == publication_key(rid, prompt_digest(prompt))
    assert len(params["remote_block_ids"]) == 4  # 50 tokens, 16 per block
    host, port = prefill.address.rsplit(":", 1)
    assert params["remote_host"] == host and params["remote_port"] == int(port)
    assert params["kvferry_incarnation"] == prefill.incarnation and params["kvferry_peer_id"]
    assert params["remote_engine_id"]
    assert rid in prefill.state()["held"], "prefill frees blocks before the decode pulled"

    d.add(rid, prompt, max_tokens=3, params=params)
    d.step()
    from vllm.v1.request import RequestStatus

    assert d.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.run_until(lambda: rid in d.finished_recving, 10, "the pull")
    assert not d.failed_recving and not d.invalid_blocks
    check_landed(d, rid, prompt)
    d.run_until(lambda: rid in d.final, 10, "decode to finish")
    assert len(d.tokens[rid]) == 3
    st = prefill.wait_freed({rid}, timeout=5)
    assert rid in st["finished_sending"]
    assert st["free"] == st["free_at_start"], "prefill leaked blocks"
    assert d.free_blocks() == d.free_at_start
    if kv_device == "sim":  # the bytes went through device copies on both sides
        assert d.worker.engine.stats()["device"]["operations"] >= 1
        assert prefill.device_stats()["operations"] >= 1


@pytest.mark.parametrize("kv_device", ["sim"], indirect=True)  # faults need the sim device
def test_device_faults_fail_only_their_requests(prefill, decode, kv_device):
    """Sim device on both sides. Decode side: of 48 pulls in flight, the one whose
    host-to-device copy never completes fails within ``device_timeout`` (+ slack), its
    staging pages quarantined; the 47 others land. Its blocks go back to vLLM (the load
    error) only once the device confirmed the copy (here: the sim device released).
    Prefill side: a device-to-host gather that fails becomes a load error for its
    request only, and the prefill's blocks are freed within a round trip (the decode
    releases them)."""
    bound = 2.0
    d = decode(extra={"timeout": TIMEOUT, "device_timeout": bound})
    reqs = prompts(48, seed=30, lo=20, hi=100)
    params = prefill.prefill(reqs)
    d.worker.engine._e._inject_device_fault("never_complete", "5")  # the 5th device op
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    t0 = time.monotonic()
    d.run_until(lambda: sum(r in d.finished_recving for r, _ in reqs) == 47, TIMEOUT, "47 pulls")
    (stuck,) = [r for r, _ in reqs if r not in d.finished_recving]
    t = d.worker._pulls[stuck].transfer
    d.run_until(t.done, bound + 2.0 - (time.monotonic() - t0), "the stuck pull to fail")
    assert isinstance(t.error, Exception) and not t.drained()
    for rid, prompt in reqs:
        if rid != stuck:
            check_landed(d, rid, prompt)
    assert d.worker.engine.stats()["arena"]["quarantined_pages"] > 0, "the stuck copy's pages stay out of use"
    for _ in range(10):
        d.step()
    assert not d.failed_recving and stuck not in d.finished_recving, "blocks handed back before the device confirmed"
    d.worker.engine._e._release_device()
    d.run_until(lambda: stuck in d.finished_recving, 5, "the stuck pull, drained")
    assert d.failed_recving == {stuck}
    assert d.kv_stats.data["failed"]["device"] == 1
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 30, "the decodes (the stuck one recomputed)")
    prefill.wait_freed({r for r, _ in reqs}, timeout=5)
    assert d.free_blocks() == d.free_at_start

    # The prefill's gather fails for one request.
    (rid, prompt), = prompts(1, seed=31, lo=40, hi=41)
    params = prefill.prefill([(rid, prompt)])
    prefill.device_fault("fail_copy", "next")
    d2 = decode(extra={"timeout": TIMEOUT})
    d2.add(rid, prompt, max_tokens=2, params=params[rid])
    d2.run_until(lambda: rid in d2.finished_recving, TIMEOUT, "the failed pull")
    assert d2.failed_recving == {rid}
    prefill.wait_freed({rid}, timeout=3.0)
    d2.run_until(lambda: rid in d2.final, 10, "the request, recomputed")
    assert d2.free_blocks() == d2.free_at_start


def test_concurrent_requests(prefill, decode):
    d = decode()
    reqs = prompts(48, seed=2, lo=1, hi=200)
    params = prefill.prefill(reqs)
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.step()
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 30, "48 pulls")
    assert not d.failed_recving and not d.invalid_blocks
    for rid, prompt in reqs:
        check_landed(d, rid, prompt)
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 30, "48 decodes")
    st = prefill.wait_freed({r for r, _ in reqs}, timeout=10)
    assert st["free"] == st["free_at_start"]
    assert d.free_blocks() == d.free_at_start


def test_local_prefix_hit_pulls_only_the_rest(prefill, decode):
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]  # 2 full blocks shared
    a = ("prefix-a", shared + [rng.randrange(3, 1000) for _ in range(30)])
    b = ("prefix-b", shared + [rng.randrange(3, 1000) for _ in range(25)])
    d = decode()
    params = prefill.prefill([a, b])
    d.add(a[0], a[1], max_tokens=1, params=params[a[0]])
    d.run_until(lambda: a[0] in d.final, 10, "first request")
    started = []
    real = d.worker._start_pull
    d.worker._start_pull = lambda rid, spec, exp: (started.append((rid, spec)), real(rid, spec, exp))
    d.add(b[0], b[1], max_tokens=1, params=params[b[0]])
    d.run_until(lambda: b[0] in d.finished_recving, 10, "second pull")
    (rid, spec), = started
    assert rid == b[0] and spec.skip_blocks == 2 and len(spec.remote_block_ids) == 5
    assert len(spec.load_block_ids) == 3  # only the blocks the local cache lacks
    assert not d.failed_recving
    check_landed(d, b[0], b[1])
    d.run_until(lambda: b[0] in d.final, 10, "second request")
    prefill.wait_freed({a[0], b[0]}, timeout=5)


def test_decode_abort_mid_pull(prefill, decode):
    d = decode()
    reqs = prompts(2, seed=3, lo=64, hi=65)
    params = prefill.prefill(reqs)
    prefill.faults(send_delay_us=300_000)  # 300 ms per chunk sent
    try:
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        d.step()
        time.sleep(0.1)
        (gone, _), (kept, kept_prompt) = reqs
        d.abort(gone)
        t = d.run_until(lambda: gone in d.finished_recving, 5, "the aborted pull to drain")
        assert t < 2.0
        assert gone not in d.scheduler.requests  # blocks back in decode's pool
        assert gone not in d.failed_recving
        d.run_until(lambda: kept in d.finished_recving, 15, "the other pull")
        assert not d.failed_recving
        check_landed(d, kept, kept_prompt)
        d.run_until(lambda: kept in d.final, 5, "the other request")
        prefill.wait_freed({kept}, timeout=2.0)  # the decode's Done released it
        # The abort told the prefill instance (release through kvferry): it frees the
        # aborted request's blocks at once, long before the lease would expire.
        st = prefill.wait_freed({gone}, timeout=3.0)
        assert gone in st["finished_sending"]
        assert not prefill.state()["publishing"]
        assert d.free_blocks() == d.free_at_start
        assert not d.worker._releases, "every release finished"
    finally:
        prefill.faults(send_delay_us=0)


def test_decode_abort_before_pull_releases_at_once(prefill, decode):
    d = decode()
    reqs = prompts(3, seed=10, lo=30, hi=90)
    params = prefill.prefill(reqs)
    t0 = time.monotonic()
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    # Aborted while still waiting: the decode scheduler never allocated or pulled.
    for rid, _ in reqs:
        d.abort(rid)
    d.step()  # the next step's metadata carries the releases to the worker
    st = prefill.wait_freed({r for r, _ in reqs}, timeout=3.0)
    assert time.monotonic() - t0 < LEASE_TTL / 2, "freed by the release, not the lease"
    assert {r for r, _ in reqs} <= set(st["finished_sending"])
    assert not d.finished_recving and not d.failed_recving, "nothing was pulled"
    d.run_until(lambda: not d.worker._releases, 5, "the releases to finish")
    assert d.free_blocks() == d.free_at_start
    assert d.worker.engine.stats()["consumer"]["draining"] == 0


def test_never_pulled_frees_at_lease_expiry(prefill):
    (rid, prompt), = prompts(1, seed=4)
    t0 = time.monotonic()
    prefill.prefill([(rid, prompt)])
    time.sleep(LEASE_TTL / 2)
    assert rid in prefill.state()["held"]
    st = prefill.wait_freed({rid}, timeout=LEASE_TTL + 5)
    assert time.monotonic() - t0 >= LEASE_TTL * 0.9
    assert rid in st["finished_sending"]
    assert st["free"] == st["free_at_start"] or st["held"], "prefill leaked blocks"


def test_pull_after_lease_expiry_is_a_load_error(prefill, decode):
    recompute = decode(policy="recompute")
    fail = decode(policy="fail")  # vLLM's default kv_load_failure_policy
    (r1, p1), (r2, p2) = prompts(2, seed=6)
    params = prefill.prefill([(r1, p1), (r2, p2)])
    prefill.wait_freed({r1, r2}, timeout=LEASE_TTL + 5)
    recompute.add(r1, p1, max_tokens=2, params=params[r1])
    fail.add(r2, p2, max_tokens=2, params=params[r2])
    for d, rid in ((recompute, r1), (fail, r2)):
        d.run_until(lambda: rid in d.finished_recving, 10, "the failed pull")
        assert d.failed_recving == {rid} and d.invalid_blocks
        d.run_until(lambda: rid in d.final, 10, "the request to finish")
        assert d.free_blocks() == d.free_at_start
    assert len(recompute.tokens[r1]) == 2  # computed locally
    assert str(fail.final[r2].finish_reason) == "error" and not fail.tokens.get(r2)


def test_prefill_killed_mid_pull_then_restarted(need_vllm):
    timeout = 5.0
    p = prefill_process({"lease_ttl": 30.0, "timeout": timeout})
    d = again = None
    try:
        d = one_rank("kv_consumer", {"timeout": timeout}, num_blocks=1024, policy="recompute")
        reqs = prompts(8, seed=7, lo=40, hi=100)
        params = p.prefill(reqs)
        p.faults(send_delay_us=500_000)
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        # Requests that do not involve the dead instance: plain prompts.
        local = prompts(2, seed=8)
        for rid, prompt in local:
            d.add(rid, prompt, max_tokens=2, params=None)
        d.step()
        time.sleep(0.2)
        assert all(r in d.worker._pulls for r, _ in reqs), "every pull is in flight"
        loading = {b for r, _ in reqs for b in d.worker._pulls[r].spec.load_block_ids}
        killed = time.monotonic()
        p.kill()
        d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), timeout, "load errors")
        took = time.monotonic() - killed
        assert took < timeout, took
        assert d.failed_recving == {r for r, _ in reqs}, "exactly the dead instance's requests fail"
        assert d.invalid_blocks == loading, "exactly the blocks they were loading"
        # Recompute policy: every request still completes, computed locally.
        d.run_until(lambda: all(r in d.final for r, _ in reqs + local), 30, "recompute")
        assert d.worker.engine.stats()["consumer"]["draining"] == 0
        assert d.free_blocks() == d.free_at_start

        # Restarted on the same port: a new incarnation that holds none of the dead
        # one's blocks. A request still carrying the dead instance's params becomes a
        # load error within the timeout; the new instance's params work.
        port = int(p.address.rsplit(":", 1)[1])
        again = prefill_process({"lease_ttl": 30.0, "timeout": timeout, "port": port})
        assert again.address == p.address and again.incarnation != p.incarnation
        (late, late_prompt), (fresh, fresh_prompt) = prompts(2, seed=9, lo=30, hi=60)
        stale = dict(params[reqs[0][0]], do_remote_prefill=True, kvferry_expires_at=time.time() + 30.0)
        d.failed_recving.clear()
        d.invalid_blocks.clear()
        fresh_params = again.prefill([(fresh, fresh_prompt)])[fresh]
        assert fresh_params["kvferry_incarnation"] == again.incarnation
        d.add(late, late_prompt, max_tokens=1, params=stale)
        d.add(fresh, fresh_prompt, max_tokens=1, params=fresh_params)
        t = d.run_until(lambda: {late, fresh} <= set(d.finished_recving), timeout + 2, "both pulls")
        assert t < timeout + 2
        assert d.failed_recving == {late}
        d.run_until(lambda: {late, fresh} <= set(d.final), 10, "both requests")
        again.wait_freed({fresh}, timeout=5)
    finally:
        if d is not None:
            d.close()
        p.stop()
        if again is not None:
            again.stop()


def test_import_kvferry_without_vllm():
    """``import kvferry`` never needs vLLM, nor do the connector package's pure modules;
    the connector itself says how to get vLLM."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvferry, kvferry.integrations\n"
        "import kvferry.integrations.vllm.mapping, kvferry.integrations.vllm.layout\n"
        "try:\n"
        "    from kvferry.integrations.vllm import KvferryConnector\n"
        "except ImportError as e:\n"
        "    assert 'vllm==0.33.0' in str(e), e\n"
        "    print('clear')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clear"


def test_the_package_keeps_its_public_names_and_former_module_names(need_vllm):
    """``kvferry.integrations.vllm`` became a package: the names vLLM and users import
    from it are the modules' own, and the two former module names that configurations
    and commands use (the plugin, the bench) still work."""
    import subprocess
    import sys

    import kvferry.integrations.vllm as pkg
    import kvferry.integrations.vllm_bounded_output as former_plugin
    from kvferry.integrations.vllm import bounded_output, connector, metadata, worker

    assert pkg.KvferryConnector is connector.KvferryConnector
    assert pkg.RecvSpec is metadata.RecvSpec and pkg.KvferryConnectorWorker is worker.KvferryConnectorWorker
    assert {"KvferryConnector", "KvferryConfig", "KvferryConnectorMetadata", "VLLM_VERSION"} <= set(pkg.__all__)
    with pytest.raises(AttributeError):
        pkg.NoSuchName  # noqa: B018
    assert former_plugin is bounded_output
    out = subprocess.run([sys.executable, "-m", "kvferry.integrations.vllm_bench", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "python -m kvferry.integrations.vllm.bench" in out.stdout


@pytest.mark.parametrize("bench_device", ["host", "sim"])
def test_connector_bench_runs(need_vllm, bench_device):
    """``python -m kvferry.integrations.vllm.bench``: a short run, every block verified
    (``--device sim``: every block through the sim device path)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvferry.integrations.vllm.bench", "--requests", "8", "--rounds", "2", "--json", "--rust-bench", "none", "--device", bench_device],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["corrupted_blocks"] == 0 and r["failed"] == 0
    assert r["bytes"] == 2 * 8 * 4 * r["block_bytes"] and r["block_bytes"] == 640 << 10
    assert r["gbps"] > 0 and r["blocks_per_s"] > 0
    assert r["ratio_to_rust"] is None and "none" in r["rust_note"]
    assert r["device"] == bench_device
