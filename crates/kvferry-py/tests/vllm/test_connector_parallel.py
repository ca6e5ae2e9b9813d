"""KvferryConnector in data-parallel and pipeline-parallel vLLM 0.33.0 deployments.

Every instance is the harness's (``vllm_harness.Instance``): one real ``Scheduler`` and
its workers' connectors, KV allocated by vLLM's own code, a "forward" that writes bytes
depending on (token, position, layer, K/V, head, salt).

- **Data parallel.** A DP rank is an engine core of its own (its own scheduler and
  workers); ``Instance(dp_rank=d, dp_size=n)`` is DP rank ``d``'s engine core, its
  config set as vLLM's ``run_engine_core`` sets it (``data_parallel_index``, a dense
  model's independent DP-1 reconfiguration or a MoE model's DP group, ``engine_id``
  suffixed ``_dp<d>``). Each prefill DP rank writes its own salt, so a byte read from
  the wrong DP rank cannot pass. With a fixed ``port`` base, every worker of every DP
  rank listens on ``port + (dp × PP + pp) × TP + tp`` (the old ``port + tp`` bound DP
  rank 1 onto DP rank 0's ports: its engine could not start).
- **Across network namespaces.** The prefill DP ranks run in processes of their own
  inside another network namespace (a veth pair), listening on its address with the
  same fixed port base; the decode pulls from the root namespace.
- **Pipeline parallel.** ``Instance(pp=2)``: one scheduler, each stage's workers
  holding only that stage's layers (vLLM's ``get_pp_indices``, allocated by vLLM from
  the stage's own specs); each decode stage pulls only its layers from the prefill
  stage holding them, and the bytes on each stage's wire are exactly its layers'
  bytes. A PP mismatch is refused at the compatibility handshake naming both sizes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import random
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm_harness import KV2, LAYERS, PREFILL_SALT, Instance, RemoteInstance, prefill, prompts, stage_wire

TP = 2
SALTS = (11, 12)  # what prefill DP rank 0 and 1 write (the decode writes 2)
BS = 16


# -- helpers -------------------------------------------------------------------------------


def _free_port_base(host: str, n: int) -> int:
    """A base port ``p`` with ``p .. p+n-1`` free on ``host``."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def _run(insts: list[Instance], pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Steps every instance (each its own engine core) until ``pred``."""
    import time

    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        for i in insts:
            i.step()
        time.sleep(0.002)


def _by_dp(d: Instance, field: str) -> dict[str, int]:
    """The decode's connector stats ``field`` (per prefill DP rank), over every step."""
    out: dict[str, int] = {}
    for s in d.stats:
        for k, v in (s.get(field) or {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _check_bytes(d: Instance, reqs: list[tuple[str, list[int]]], salt: int) -> None:
    """Every worker of ``d`` holds, at every prompt position of every request, what the
    prefill that wrote ``salt`` computed (its heads, its stage's layers)."""
    for rid, prompt in reqs:
        assert len(d.landed[rid]) == len(d.ranks)
        for w, slots in enumerate(d.landed[rid]):
            assert len(slots) == len(prompt)
            for pos in range(len(prompt)):
                assert slots[pos] == d.expected(prompt, w, pos, salt=salt), f"{rid}: worker {w}, position {pos}"


def _blocks(params: dict[str, Any]) -> int:
    return len(params["remote_block_ids"])


def _worker_block_bytes(d: Instance) -> int:
    return sum(int(w.region.block_bytes) for w in d.workers())


@contextlib.contextmanager
def _logged(name: str = "kvferry.integrations.vllm") -> Iterator[list[str]]:
    records: list[str] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    lg = logging.getLogger(name)
    h = H()
    lg.addHandler(h)
    try:
        yield records
    finally:
        lg.removeHandler(h)


# -- data parallel, one host ----------------------------------------------------------------


def test_dp2_to_dp2_on_one_host_with_a_fixed_port_base(made):
    """Two prefill DP ranks of one deployment (one engine id, one port base) and two
    decode DP ranks; each decode pulls requests prefilled on both DP ranks, each from
    the DP rank that holds its blocks, every byte compared. On the old port formula
    (``port + tp``) DP rank 1's engines could not bind: the test fails there."""
    base = _free_port_base("127.0.0.1", 2 * TP)
    eid = f"pdp-{os.getpid()}"
    kw: dict[str, Any] = {"tp": TP, "model": KV2, "kv_heads": 2, "num_blocks": 256, "dp_size": 2}
    p = [
        Instance("kv_producer", dp_rank=r, engine_id=eid, salt=SALTS[r], extra={"port": base, "peer_id": "prefill"}, **kw)
        for r in range(2)
    ]
    made += p
    d = [Instance("kv_consumer", dp_rank=r, engine_id=f"ddp-{os.getpid()}", **kw) for r in range(2)]
    made += d
    # Ports and peer ids: every worker of both DP ranks its own.
    for r, inst in enumerate(p):
        assert inst.vllm_config.parallel_config.data_parallel_index == r
        ports = [int(w.engine.address.rpartition(":")[2]) for w in inst.workers()]
        assert ports == [base + r * TP + t for t in range(TP)], ports
    assert [w.engine.peer_id for inst in p for w in inst.workers()] == [
        "prefill-dp0-tp0",
        "prefill-dp0-tp1",
        "prefill-dp1-tp0",
        "prefill-dp1-tp1",
    ]
    reqs = [prompts(4, seed=61 + r, lo=20, hi=90) for r in range(2)]
    params: dict[str, dict[str, Any]] = {}
    for r in range(2):
        got = prefill(p[r], reqs[r])
        for rid, _ in reqs[r]:
            assert got[rid]["remote_dp_rank"] == r
            assert got[rid]["remote_engine_id"] == f"{eid}_dp{r}"
            assert [x["address"] for x in got[rid]["kvferry_peers"]] == [w.engine.address for w in p[r].workers()]
        params.update(got)
    # A proxy routes each request to a decode DP rank of its own choosing: each decode
    # gets requests of both prefill DP ranks.
    routed = [reqs[0][:2] + reqs[1][:2], reqs[0][2:] + reqs[1][2:]]
    for i, dec in enumerate(d):
        for rid, prompt in routed[i]:
            dec.add(rid, prompt, max_tokens=2, params=params[rid])
    _run(d, lambda: all(r in dec.finished_recving for i, dec in enumerate(d) for r, _ in routed[i]), 20, "the pulls")
    for dec in d:
        assert not dec.failed_recving
    for i, dec in enumerate(d):
        for r in range(2):
            mine = [x for x in routed[i] if x in reqs[r]]
            _check_bytes(dec, mine, SALTS[r])
        # The decode's stats name the DP rank each pull came from.
        want = {str(r): sum(_blocks(params[x[0]]) for x in routed[i] if x in reqs[r]) * _worker_block_bytes(dec) for r in range(2)}
        assert _by_dp(dec, "pulled_by_dp") == want
    _run(d, lambda: all(r in dec.final for i, dec in enumerate(d) for r, _ in routed[i]), 10, "the decodes")
    all_ids = {rid for rs in reqs for rid, _ in rs}
    _run(p, lambda: not (p[0].held() | p[1].held()) & all_ids, 5, "both prefill DP ranks to free the blocks")
    for inst in p + d:
        assert inst.free_blocks() == inst.free_at_start
        assert inst.leaks() == []


def test_dp2_to_dp1_one_decode_pulls_from_both_prefill_dp_ranks(made):
    """A decode of DP size 1 pulls from a prefill of DP size 2 (a MoE deployment's DP
    group: ``data_parallel_size`` 2 in each engine core). Then: params naming a DP rank
    outside the prefill's DP size are computed locally and the prefill freed at once; a
    pull from a DP rank that went away fails, and the stats and the warning name it."""
    kw: dict[str, Any] = {"tp": TP, "model": KV2, "kv_heads": 2, "num_blocks": 256, "dp_size": 2, "dp_moe": True}
    eid = f"pdp1-{os.getpid()}"
    p = [Instance("kv_producer", dp_rank=r, engine_id=eid, salt=SALTS[r], **kw) for r in range(2)]
    made += p
    d = Instance("kv_consumer", tp=TP, model=KV2, kv_heads=2, num_blocks=256, extra={"timeout": 3.0})
    made.append(d)
    reqs = [prompts(3, seed=71 + r, lo=20, hi=90) for r in range(2)]
    params: dict[str, dict[str, Any]] = {}
    for r in range(2):
        assert p[r].vllm_config.parallel_config.data_parallel_size == 2
        got = prefill(p[r], reqs[r])
        assert all(got[rid]["remote_dp_rank"] == r and got[rid]["dp_size"] == 2 for rid, _ in reqs[r])
        params.update(got)
    for rs in reqs:
        for rid, prompt in rs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(rid in d.finished_recving for rs in reqs for rid, _ in rs), 20, "the pulls from both DP ranks")
    assert not d.failed_recving
    for r in range(2):
        _check_bytes(d, reqs[r], SALTS[r])
    assert _by_dp(d, "pulled_by_dp") == {
        str(r): sum(_blocks(params[rid]) for rid, _ in reqs[r]) * _worker_block_bytes(d) for r in range(2)
    }
    d.run_until(lambda: all(rid in d.final for rs in reqs for rid, _ in rs), 10, "the decodes")
    ids = {rid for rs in reqs for rid, _ in rs}
    _run(p, lambda: not (p[0].held() | p[1].held()) & ids, 5, "the prefill DP ranks to free the blocks")

    # Params that name a DP rank the prefill does not have: refused, computed locally,
    # the publication released at once (not held until its 30 s lease).
    (bad,) = prompts(1, seed=79, lo=40, hi=60)
    bp = dict(prefill(p[1], [bad])[bad[0]])
    bp["remote_dp_rank"] = 5
    with _logged() as records:
        d.add(bad[0], bad[1], max_tokens=2, params=bp)
        d.run_until(lambda: bad[0] in d.final, 10, "the local prefill")
    assert bad[0] not in d.finished_recving and bad[0] not in d.failed_recving
    assert any("remote_dp_rank 5 is not a rank of dp_size 2" in m for m in records), records
    p[1].run_until(lambda: bad[0] not in p[1].held(), 5, "prefill DP rank 1 to free the refused request")

    # A pull from DP rank 1 after its workers went away: a load error that the stats
    # and the warning attribute to DP rank 1.
    (gone,) = prompts(1, seed=80, lo=40, hi=60)
    gp = prefill(p[1], [gone])[gone[0]]
    p[1].close()
    made.remove(p[1])
    with _logged() as records:
        d.add(gone[0], gone[1], max_tokens=2, params=gp)
        d.run_until(lambda: gone[0] in d.failed_recving, 10, "the failed pull")
    assert _by_dp(d, "failed_by_dp") == {"1": TP}
    assert any(f"(DP rank 1)" in m and gone[0] in m for m in records), records
    d.run_until(lambda: gone[0] in d.final, 10, "the local recompute")
    assert d.free_blocks() == d.free_at_start


# -- data parallel across network namespaces ------------------------------------------------

_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


@contextlib.contextmanager
def _inside(ns: str) -> Iterator[None]:
    """The calling thread in network namespace ``ns`` (processes it starts are born
    there); back in its own on exit."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@pytest.fixture
def netns() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: ``(name, its address,
    ours)``. Removed after the test (processes this test started in it are stopped
    first by ``made``; any left are killed by pid)."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"kvf-dp-{tag}", f"kvfa{tag}", f"kvfb{tag}"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    ours, theirs = f"{net}.1", f"{net}.2"
    try:
        _ip("netns", "add", ns)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot create a network namespace here (needs root and iproute2): {e}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{ours}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{theirs}/30", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, theirs, ours
    finally:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()
        for pid in pids:  # only this test's prefill processes can be in it
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_dp2_to_dp2_across_network_namespaces(netns, made):
    """Prefill DP ranks 0 and 1, each in a process of its own inside another network
    namespace, on its veth address with one fixed port base; two decode DP ranks in
    this namespace pull from both, every byte compared, and both prefills free."""
    ns, theirs, _ = netns
    base = 31000
    eid = f"nsdp-{os.getpid()}"
    kw: dict[str, Any] = {"tp": TP, "model": KV2, "kv_heads": 2, "num_blocks": 256, "dp_size": 2}
    def start(r: int) -> RemoteInstance:
        # This thread joins the namespace, so the process it starts is born there.
        with _inside(ns):
            extra = {"host": theirs, "port": base, "peer_id": "prefill"}
            return RemoteInstance("kv_producer", dp_rank=r, engine_id=eid, salt=SALTS[r], extra=extra, **kw)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once (vLLM imports)
        futures = [pool.submit(start, r) for r in range(2)]
        p = [f.result() for f in futures]
    made.extend(p)
    for r in range(2):
        assert p[r].addresses == [f"{theirs}:{base + r * TP + t}" for t in range(TP)], p[r].addresses
    d = [Instance("kv_consumer", dp_rank=r, **kw) for r in range(2)]
    made += d
    reqs = [prompts(3, seed=81 + r, lo=20, hi=90) for r in range(2)]
    params: dict[str, dict[str, Any]] = {}
    for r in range(2):
        got = p[r].prefill(reqs[r])
        assert all(got[rid]["remote_dp_rank"] == r and got[rid]["remote_host"] == theirs for rid, _ in reqs[r])
        params.update(got)
        p[r].wait_published({rid for rid, _ in reqs[r]})
    routed = [reqs[0][:2] + reqs[1][2:], reqs[0][2:] + reqs[1][:2]]
    for i, dec in enumerate(d):
        for rid, prompt in routed[i]:
            dec.add(rid, prompt, max_tokens=2, params=params[rid])
    _run(d, lambda: all(r in dec.finished_recving for i, dec in enumerate(d) for r, _ in routed[i]), 30, "the pulls")
    for i, dec in enumerate(d):
        assert not dec.failed_recving
        for r in range(2):
            _check_bytes(dec, [x for x in routed[i] if x in reqs[r]], SALTS[r])
        assert set(_by_dp(dec, "pulled_by_dp")) == {"0", "1"}
    _run(d, lambda: all(r in dec.final for i, dec in enumerate(d) for r, _ in routed[i]), 10, "the decodes")
    for r in range(2):
        st = p[r].wait_freed({rid for rid, _ in reqs[r]}, 10)
        assert st["free"] == st["free_at_start"] and st["leaks"] == [], st
    for dec in d:
        assert dec.free_blocks() == dec.free_at_start and dec.leaks() == []


# -- pipeline parallel ----------------------------------------------------------------------


def test_pp2_to_pp2_each_stage_pulls_only_its_layers(made):
    """PP 2 (x TP 2) on both sides: each stage's workers hold only its layers; each
    decode stage pulls only its layers, from the prefill stage that holds them — the
    bytes on each stage's wire are exactly that stage's layers' bytes —, every byte of
    every worker compared, and both sides free everything."""
    base = _free_port_base("127.0.0.1", 2 * TP)
    kw: dict[str, Any] = {"tp": TP, "pp": 2, "model": KV2, "kv_heads": 2, "num_blocks": 256}
    p = Instance("kv_producer", extra={"port": base, "peer_id": "prefill"}, **kw)
    d = Instance("kv_consumer", **kw)
    made += [p, d]
    # Each stage's workers registered only their stage's layers; ports and peer ids by stage.
    for inst in (p, d):
        for w, c in enumerate(inst.ranks):
            stage = w // TP
            assert list(inst.kv[w]) == [LAYERS[stage]], (w, list(inst.kv[w]))
            assert c.connector_worker.pp_rank == stage
    assert [int(w.engine.address.rpartition(":")[2]) for w in p.workers()] == [base + i for i in range(2 * TP)]
    assert [w.engine.peer_id for w in p.workers()] == ["prefill-pp0-tp0", "prefill-pp0-tp1", "prefill-pp1-tp0", "prefill-pp1-tp1"]
    reqs = prompts(4, seed=91, lo=20, hi=90)
    params = prefill(p, reqs)
    for rid, _ in reqs:
        assert params[rid]["pp_size"] == 2 and params[rid]["tp_size"] == TP
        assert [x["address"] for x in params[rid]["kvferry_peers"]] == [w.engine.address for w in p.workers()]
        assert [s[1] for s in params[rid]["kvferry_stages"]] == LAYERS
    for rid, prompt in reqs:
        d.add(rid, prompt, max_tokens=2, params=params[rid])
    d.run_until(lambda: all(r in d.finished_recving for r, _ in reqs), 20, "every stage's pulls")
    assert not d.failed_recving
    _check_bytes(d, reqs, PREFILL_SALT)
    # The wire: each stage exactly its own layers' bytes (whole blocks: the same block
    # size and TP), and a stage's blocks are one layer's K and V, its heads.
    nblocks = sum(_blocks(params[rid]) for rid, _ in reqs)
    layer_block = 2 * BS * d.hpr * d.hs * 2  # K and V, one layer, one worker's heads, fp16
    for w in d.workers():
        assert w.region.block_bytes == layer_block
    assert stage_wire(d) == [nblocks * TP * layer_block] * 2
    sent = [0, 0]
    for w, c in enumerate(p.ranks):
        sent[w // TP] += int(c.connector_worker.engine.stats()["producer"]["bytes_sent"])
    assert sent == [nblocks * TP * layer_block] * 2
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the decodes")
    # Every worker of both stages reported finished sending: only then are the blocks free.
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "the prefill to free the blocks")
    assert {r for r, _ in reqs} <= set(p.finished_sending)
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    assert p.leaks() == [] and d.leaks() == []


@pytest.mark.parametrize("pp", [(2, 1), (1, 2)], ids=["pp2-to-pp1", "pp1-to-pp2"])
def test_pp_mismatch_is_refused_at_the_handshake_naming_both_sizes(made, pp):
    """A decode whose PP size differs from the prefill's: refused at the compatibility
    handshake (one verdict per prefill engine) naming both PP sizes, a load error on
    every worker, recomputed locally, the prefill's blocks freed at once."""
    p_pp, d_pp = pp
    kw: dict[str, Any] = {"tp": 1, "model": KV2, "kv_heads": 2, "num_blocks": 256}
    p = Instance("kv_producer", pp=p_pp, **kw)
    d = Instance("kv_consumer", pp=d_pp, **kw)
    made += [p, d]
    reqs = prompts(2, seed=95, lo=30, hi=60)
    params = prefill(p, reqs)
    with _logged() as records:
        for rid, prompt in reqs:
            d.add(rid, prompt, max_tokens=2, params=params[rid])
        d.run_until(lambda: all(r in d.failed_recving for r, _ in reqs), 10, "the refusals")
    refusals = [m for m in records if "refusing prefill engine" in m]
    assert len(refusals) == 1, records
    assert f"pipeline parallel sizes differ (prefill pp_size {p_pp}, decode pipeline_parallel_size {d_pp})" in refusals[0]
    d.run_until(lambda: all(r in d.final for r, _ in reqs), 10, "the local recompute")
    p.run_until(lambda: not (p.held() & {r for r, _ in reqs}), 5, "the prefill to free the refused requests")
    assert p.free_blocks() == p.free_at_start and d.free_blocks() == d.free_at_start
    assert sum(sum(s.get("pull_bytes", [])) for s in d.stats) == 0


# -- the benchmark ----------------------------------------------------------------------------


def test_connector_bench_dp2_reports_each_dp_rank(need_vllm):
    """``python -m kvferry.integrations.vllm.bench --dp 2``: two DP ranks' pairs, each in
    a process of its own, every block verified, GB/s per DP rank (``--rust-bench none``:
    no ratio)."""
    import json
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvferry.integrations.vllm.bench", "--dp", "2", "--requests", "4", "--rounds", "2", "--json", "--rust-bench", "none"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["dp"] == 2 and r["corrupted_blocks"] == 0 and r["failed"] == 0
    assert [x["dp_rank"] for x in r["dp_ranks"]] == [0, 1]
    assert all(x["gbps"] > 0 and x["bytes"] == 2 * 4 * 4 * x["block_bytes"] for x in r["dp_ranks"])
    assert r["gbps_per_dp"] == [x["gbps"] for x in r["dp_ranks"]]
    # Each pair is its DP rank's engine cores: the connector placed them so.
    assert [x["peer_ids"][0] for x in r["dp_ranks"]] == ["kvferry-bench-kv_producer_dp0-dp0-tp0", "kvferry-bench-kv_producer_dp1-dp1-tp0"]
    assert r["rust_gbps"] is None and r["ratio_to_rust"] is None and "none" in r["rust_note"]


# -- the formulas (no vLLM needed) ------------------------------------------------------------


def test_ports_peer_ids_and_params_checks():
    """Every worker of every DP rank and stage on one host gets its own port, in one
    block per DP rank; a port past 65535 is refused naming the formula; peer ids name
    what is in use; malformed DP fields and stage mismatches are named."""
    from kvferry.integrations.vllm.parallel import Placement, dp_problem, listen_port, peer_id, pp_differences, stage_view

    dp, pp, tp = 3, 2, 4
    places = [
        Placement(dp_rank=d, dp_size=dp, pp_rank=p, pp_size=pp, tp_rank=t, tp_size=tp)
        for d in range(dp)
        for p in range(pp)
        for t in range(tp)
    ]
    assert [listen_port(7000, x) for x in places] == list(range(7000, 7000 + dp * pp * tp))
    assert listen_port(0, places[-1]) == 0
    assert listen_port(7000, Placement(tp_rank=1, tp_size=2)) == 7001  # DP 1, PP 1: port + tp, as before
    with pytest.raises(ValueError, match=r"port 65530 \+ \(data_parallel_index 2 × pipeline_parallel_size 2"):
        listen_port(65530, places[-1])
    assert peer_id("p", Placement(tp_rank=1, tp_size=2)) == "p-tp1"
    assert peer_id("p", Placement(dp_rank=0, in_dp=True, tp_rank=1, tp_size=2)) == "p-dp0-tp1"
    assert peer_id("p", places[-1]) == "p-dp2-pp1-tp3"
    assert dp_problem({}) is None and dp_problem({"remote_dp_rank": 1, "dp_size": 1}) is None  # a dense model's rank
    assert dp_problem({"remote_dp_rank": 2, "dp_size": 2}) == "remote_dp_rank 2 is not a rank of dp_size 2"
    assert "is not a data-parallel rank" in str(dp_problem({"remote_dp_rank": "0"}))
    sig = [[1, "a", "a", "x"], [1, "b", "b", "y"]]
    assert pp_differences({"pp_size": 2, "kvferry_stages": sig}, 2, dict(enumerate(sig))) == []
    assert "prefill pp_size 2, decode pipeline_parallel_size 1" in pp_differences({"pp_size": 2}, 1, {})[0]
    assert "stage 1 holds other layers" in pp_differences({"pp_size": 2, "kvferry_stages": sig}, 2, {0: sig[0], 1: sig[0]})[0]
    peers = ["p0t0", "p0t1", "p1t0", "p1t1"]
    assert stage_view(peers, 2, Placement(pp_rank=1, pp_size=2, tp_size=2)) == ["p1t0", "p1t1"]
    assert stage_view(peers, 1, Placement(pp_rank=0, pp_size=2, tp_size=2)) == peers  # unsplit: stage 0 alone
    assert stage_view(peers, 1, Placement(pp_rank=1, pp_size=2, tp_size=2)) is None
